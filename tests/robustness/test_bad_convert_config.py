"""config.json values at the edge of their allowed ranges must be answered at once, not after minutes."""

from __future__ import annotations


import pytest
from colibri_sdk.convert import convert
from colibri_sdk.convert.families import model_spec
from colibri_sdk.errors import ConvertError
from robustness_helpers import write_checkpoint


ALARM_S = 120  # the `alarm` fixture (conftest.py): a hang fails the test after this many seconds


def test_65535_layers_and_experts_are_refused_at_once(tmp_path, alarm):
    folder = write_checkpoint(tmp_path / "ckpt", num_hidden_layers=65535, num_local_experts=65535)
    with pytest.raises(ConvertError, match=r"gate\.weight' has shape \(2, 4\); expected \(65535, 4\)"):
        convert(folder, tmp_path / "m.colibri")


def test_a_long_mlp_only_layers_list_is_read_in_linear_time(alarm):
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 65535, "num_experts": 4, "num_experts_per_tok": 2,
              "hidden_size": 8, "moe_intermediate_size": 8, "mlp_only_layers": list(range(0, 65535, 2))}
    spec = model_spec(config)
    assert spec.moe_layers[:3] == (1, 3, 5) and len(spec.moe_layers) == 32767
    assert len(spec.dense_layers) == 32768


def test_int4_of_weights_beyond_float16_scales_says_what_the_command_line_can_do(tmp_path):
    from safetensors.numpy import load_file, save_file
    from robustness_helpers import PREFIX

    folder = write_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[PREFIX + "experts.0.w1.weight"][0, 0] = 1e30
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"experts\.0\.w1\.weight: 1 group scales exceed float16 .*\(convert with "
                                           r"--dtype fp32, which keeps these weights as floats\)$"):
        convert(folder, tmp_path / "m.colibri", dtype="int4", group_size=32)
