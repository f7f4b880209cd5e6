"""Converted checkpoints of the .colibri v2 families compute what their transformers MoE blocks compute.

Each test builds a real transformers model (3 decoder layers, random weights N(0, 0.2) including biases and
DeepSeek's score-correction bias), saves it with save_pretrained (fp32 or bf16, sharded or not), converts it with
`colibri-sdk convert`, and compares ReferenceEngine.layer(l) with the transformers block of model layer
layer_map[l] on random inputs: within 1e-5 (fp32 files) or 2e-3 (fp16), max abs error over max abs output.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.format import ColibriFile, HeaderV2
from colibri_sdk.reference import ReferenceEngine
from hf_models import HIDDEN, convert_cli, family_block, family_output, make_family, rel_err, torch

TOL = {"fp32": 1e-5, "fp16": 2e-3}
# family → (layer map, left out, header fields that must be set)
EXPECTED = {
    "qwen2_moe": ((0, 2), {1: "dense MLP layer"}, dict(routing=1, num_shared_experts=1, shared_intermediate_size=40, shared_gate=1)),
    "deepseek_v2": ((1, 2), {0: "dense MLP layer"}, dict(routing=1, num_shared_experts=1, shared_intermediate_size=96, routed_scaling_factor=1.5)),
    "deepseek_v3": ((1, 2), {0: "dense MLP layer"}, dict(routing=2, norm_topk=1, n_group=4, topk_group=2, group_score=2, correction_bias=1, routed_scaling_factor=2.5, shared_intermediate_size=48)),
    "glm4_moe": ((1, 2), {0: "dense MLP layer"}, dict(routing=2, norm_topk=1, n_group=2, topk_group=1, group_score=2, correction_bias=1)),
    "gpt_oss": ((0, 1, 2), {}, dict(routing=0, router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0)),
    "granitemoe": ((0, 1, 2), {}, dict(routing=0, version=0x0100)),
}


def inputs(seed: int = 7, tokens: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, tokens, HIDDEN)).astype(np.float32)


def compare(model, path, tol: float) -> list[float]:
    engine = ReferenceEngine(path)
    layer_map = ColibriFile(path).layer_map
    x = inputs()
    errors = []
    for file_layer, layer in enumerate(layer_map):
        expected = family_output(model, layer, x)
        actual = engine.layer(file_layer, x.reshape(-1, HIDDEN)).reshape(x.shape)
        errors.append(rel_err(actual, expected))
    engine.close()
    assert max(errors) <= tol, errors
    return errors


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_matches_transformers(tmp_path, family, dtype, capsys):
    model = make_family(family, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "m.colibri"
    assert convert_cli(tmp_path / "ckpt", out, "--dtype", dtype) == 0
    printed = capsys.readouterr().out
    layer_map, left_out, fields = EXPECTED[family]
    h = ColibriFile(out).header
    # GraniteMoE needs nothing of v2 (every layer MoE, top-k then softmax = routing 0): it is written as v1.
    assert isinstance(h, HeaderV2) == (family != "granitemoe")
    assert ColibriFile(out).layer_map == layer_map
    if family != "granitemoe":
        assert h.num_model_layers == 3
    for key, value in fields.items():
        assert getattr(h, key) == pytest.approx(value), key
    for layer, why in left_out.items():
        assert f"left out: model layers [{layer}] ({why})" in printed
    compare(model, out, TOL[dtype])


def test_deepseek_v3_correction_bias_changes_the_selection(tmp_path):
    """The converted correction bias is used: with it zeroed in the file's source, the selection differs."""
    model = make_family("deepseek_v3", seed=4)
    model.save_pretrained(tmp_path / "ckpt")
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    engine = ReferenceEngine(tmp_path / "m.colibri")
    x = inputs(seed=3).reshape(-1, HIDDEN)
    gate = family_block(model, 1).gate
    with torch.no_grad():
        _, _, expected = gate(torch.from_numpy(x))
        gate.e_score_correction_bias.zero_()
        _, _, unbiased = gate(torch.from_numpy(x))
    selected, _ = engine.route(0, x)
    as_sets = lambda a: [set(r) for r in np.asarray(a).tolist()]
    assert as_sets(selected) == as_sets(expected.numpy())
    assert as_sets(selected) != as_sets(unbiased.numpy())


def test_deepseek_v2_group_limited(tmp_path):
    model = make_family("deepseek_v2", seed=2, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    model.save_pretrained(tmp_path / "ckpt")
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    h = ColibriFile(tmp_path / "m.colibri").header
    assert (h.n_group, h.topk_group, h.group_score) == (4, 2, 1)
    compare(model, tmp_path / "m.colibri", TOL["fp32"])


def test_gpt_oss_clamp_is_reached(tmp_path):
    """The test model's gate/up activations pass ±7, so the clamped SwiGLU is exercised, not just the linear part."""
    model = make_family("gpt_oss", seed=1)
    x = torch.from_numpy(inputs().reshape(-1, HIDDEN))
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert float(gate_up.abs().max()) > 7.0


@pytest.mark.parametrize("family", list(EXPECTED))
def test_bf16_sharded_checkpoint(tmp_path, family):
    """bf16 checkpoints in several shards convert exactly (bf16 → fp32 is lossless)."""
    model = make_family(family, seed=5).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    compare(model.float(), tmp_path / "m.colibri", TOL["fp32"])
