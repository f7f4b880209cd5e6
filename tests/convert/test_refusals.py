"""What .colibri v1 cannot hold is refused with an error naming the config key or the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri_sdk.convert import convert
from colibri_sdk.errors import ConvertError
from hf_models import convert_cli, edit_config, make_model, transformers

PREFIX = "model.layers.0.block_sparse_moe."


def rewrite(folder, change) -> None:
    """Load the single-file checkpoint as NumPy arrays, apply change(dict), save it back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def refused(folder, tmp_path, match: str, **kwargs) -> None:
    out = tmp_path / "out.colibri"
    with pytest.raises(ConvertError, match=match):
        convert(folder, out, progress=False, **kwargs)
    assert not out.exists()
    assert not (tmp_path / "out.colibri.partial").exists()


# ---- config keys ---------------------------------------------------------------------------------------------
CONFIG_CASES = [
    ({"scoring_func": "sigmoid"}, r"scoring_func = 'sigmoid': only softmax routing"),
    ({"topk_method": "noaux_tc"}, r"topk_method = 'noaux_tc': grouped top-k routing"),
    ({"n_group": 8}, r"n_group = 8: grouped routing"),
    ({"topk_group": 4}, r"topk_group = 4: grouped routing"),
    ({"routed_scaling_factor": 2.5}, r"routed_scaling_factor = 2.5: scaled routing"),
    ({"n_shared_experts": 2}, r"n_shared_experts = 2: shared experts"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2: dense MLP layers between MoE layers"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\]: dense MLP layers"),
    ({"first_k_dense_replace": 1}, r"first_k_dense_replace = 1: dense MLP layers"),
    ({"hidden_act": "gelu"}, r"hidden_act = 'gelu': experts must be SwiGLU with SiLU; allowed: silu, swish"),
    ({"mlp_bias": True}, r"mlp_bias = True: biases are not representable"),
    ({"model_type": "llama"}, r"model_type = 'llama' is not supported; allowed: mixtral, qwen3_moe, olmoe"),
    ({"num_experts_per_tok": 17}, r"num_experts_per_tok = 17 exceeds num_local_experts = 16"),
    ({"num_local_experts": 70000}, r"num_local_experts = 70000; the format allows an integer in 1\.\.65535"),
    ({"hidden_size": 0}, r"hidden_size = 0; the format allows"),
    ({"num_experts_per_tok": None}, r"no top-k \(looked for num_experts_per_tok\)"),
    ({"norm_topk_prob": "yes", "model_type": "olmoe", "num_experts": 16}, r"norm_topk_prob = 'yes'; allowed: true, false"),
]


@pytest.mark.parametrize("changes,match", CONFIG_CASES, ids=[next(iter(c)) for c, _ in CONFIG_CASES])
def test_config_refusals(mixtral_copy, tmp_path, changes, match):
    edit_config(mixtral_copy, **changes)
    refused(mixtral_copy, tmp_path, match)


def test_qwen2_moe_shared_expert_is_refused(tmp_path):
    model = make_model("qwen2", 2)
    model.save_pretrained(tmp_path / "qwen2")
    refused(tmp_path / "qwen2", tmp_path, r"shared_expert_intermediate_size = 48: shared experts")
    # Without the config key, the shared expert's tensors still give it away.
    edit_config(tmp_path / "qwen2", shared_expert_intermediate_size=None)
    refused(tmp_path / "qwen2", tmp_path, r"tensor 'model\.layers\.0\.mlp\.shared_expert\.down_proj\.weight': shared experts")


def test_deepseek_v3_config_is_refused(tmp_path):
    """A real DeepSeek-V3 config: a shared expert, sigmoid scoring, grouped top-k — each is named in turn."""
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=48, n_routed_experts=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
    )
    folder = tmp_path / "deepseek"
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    save_file({"model.layers.0.mlp.gate.weight": np.zeros((16, 32), np.float32)}, str(folder / "model.safetensors"))
    refused(folder, tmp_path, r"n_shared_experts = 1: shared experts")
    edit_config(folder, n_shared_experts=None)
    refused(folder, tmp_path, r"model_type = 'deepseek_v3' routes with sigmoid scores")
    edit_config(folder, model_type="mixtral")
    refused(folder, tmp_path, r"n_group = 8: grouped routing")


# ---- tensors -------------------------------------------------------------------------------------------------
def test_expert_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.3.w1.bias": np.zeros(48, np.float32)}))
    refused(mixtral_copy, tmp_path, r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.3\.w1\.bias': biases")


def test_router_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "gate.bias": np.zeros(16, np.float32)}))
    refused(mixtral_copy, tmp_path, r"'model\.layers\.0\.block_sparse_moe\.gate\.bias': biases")


def test_deepseek_score_correction_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "gate.e_score_correction_bias": np.zeros(16, np.float32)}))
    refused(mixtral_copy, tmp_path, r"e_score_correction_bias': biased / grouped routing")


def test_missing_expert_tensor(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.pop(PREFIX + "experts.12.w2.weight"))
    refused(mixtral_copy, tmp_path, r"missing expert tensor model\.layers\.0\.block_sparse_moe\.experts\.12\.w2\.weight")


def test_extra_expert_tensor(mixtral_copy, tmp_path):
    extra = np.zeros((48, 32), np.float32)
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.16.w1.weight": extra}))
    refused(mixtral_copy, tmp_path, r"extra expert tensor '.*experts\.16\.w1\.weight': expert 16 >= config\.json num_local_experts = 16")


def test_unknown_tensor_in_moe_block(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.3.w4.weight": np.zeros((48, 32), np.float32)}))
    refused(mixtral_copy, tmp_path, r"unexpected tensor '.*experts\.3\.w4\.weight' in a MoE block")


def test_wrong_shape_names_tensor_and_config(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.5.w3.weight": np.zeros((40, 32), np.float32)}))
    refused(mixtral_copy, tmp_path, r"'.*experts\.5\.w3\.weight' has shape \(40, 32\); expected \(48, 32\) .*intermediate_size=48")


def test_dense_layer_without_router(mixtral_copy, tmp_path):
    def drop_layer1(t):
        for name in [n for n in t if n.startswith("model.layers.1.block_sparse_moe.")]:
            del t[name]
        t["model.layers.1.mlp.gate_proj.weight"] = np.zeros((48, 32), np.float32)

    rewrite(mixtral_copy, drop_layer1)
    refused(mixtral_copy, tmp_path, r"layer 1 has no MoE router .*dense layers between MoE layers")


def test_integer_dtype_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.0.w1.weight": np.zeros((48, 32), np.int8)}))
    refused(mixtral_copy, tmp_path, r"'.*experts\.0\.w1\.weight' has dtype I8; allowed: BF16, F16, F32")


def test_fp16_overflow_names_tensor_and_count(mixtral_copy, tmp_path):
    def big(t):
        t[PREFIX + "experts.7.w2.weight"][:3, 0] = [7e4, -1e5, 65504.0]

    rewrite(mixtral_copy, big)
    refused(mixtral_copy, tmp_path, r"experts\.7\.w2\.weight: 2 values overflow float16 .*--clamp-fp16")
    # fp32 holds them; clamping is explicit.
    assert convert_cli(mixtral_copy, tmp_path / "f32.colibri", "--dtype", "fp32") == 0
    assert convert_cli(mixtral_copy, tmp_path / "c.colibri", "--clamp-fp16") == 0
    from colibri_sdk.format import ColibriFile

    w = ColibriFile(tmp_path / "c.colibri").tensor("down_proj", 0, 7)
    assert w[:3, 0].tolist() == [65504.0, -65504.0, 65504.0]


def test_non_finite_weight(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t[PREFIX + "gate.weight"].__setitem__((0, 0), np.nan))
    refused(mixtral_copy, tmp_path, r"block_sparse_moe\.gate\.weight: 1 non-finite values")


# ---- folders -------------------------------------------------------------------------------------------------
def test_missing_config(mixtral_copy, tmp_path):
    (mixtral_copy / "config.json").unlink()
    refused(mixtral_copy, tmp_path, r"no config\.json")


def test_malformed_config(mixtral_copy, tmp_path):
    (mixtral_copy / "config.json").write_text("{not json")
    refused(mixtral_copy, tmp_path, r"config\.json: not valid JSON")


def test_pytorch_bin_only(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / "pytorch_model.bin")
    refused(mixtral_copy, tmp_path, r"only PyTorch \.bin/\.pt weights found")


def test_index_names_missing_shard(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / "model-00001-of-00002.safetensors")
    index = {"weight_map": {PREFIX + "gate.weight": "model-00002-of-00002.safetensors"}}
    (mixtral_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(mixtral_copy, tmp_path, r"names shard 'model-00002-of-00002\.safetensors', which is not in")


def test_index_places_tensor_in_wrong_shard(mixtral_copy, tmp_path):
    shard = "model-00001-of-00001.safetensors"
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / shard)
    index = {"weight_map": {PREFIX + "gate.weight": shard, "lm_head.bias": shard}}
    (mixtral_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(mixtral_copy, tmp_path, r"places 'lm_head\.bias' in model-00001-of-00001\.safetensors, which does not")


def test_corrupt_safetensors(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(mixtral_copy, tmp_path, r"model\.safetensors: not a readable safetensors file")


def test_missing_output_folder(saved_mixtral, tmp_path):
    with pytest.raises(ConvertError, match=r"output folder .*nowhere does not exist"):
        convert(saved_mixtral[0], tmp_path / "nowhere" / "m.colibri", progress=False)


def test_cli_error_exit_code(mixtral_copy, tmp_path, capsys):
    edit_config(mixtral_copy, hidden_act="relu")
    assert convert_cli(mixtral_copy, tmp_path / "m.colibri") == 1
    err = capsys.readouterr().err
    assert err.startswith("colibri-sdk convert: error: config.json hidden_act = 'relu'")
