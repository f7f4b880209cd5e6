"""The reference engine on v2 files against the transformers MoE blocks it implements: DeepSeek-V3 (sigmoid,
correction bias, group-limited top-k, renormalised, scaled, shared experts), DeepSeek-V2 (softmax, group max),
Qwen2-MoE (gated shared expert), gpt-oss (router bias, expert biases, clamped SwiGLU); float32, float16 and
int8/int4 storage (docs/format.md, "Semantics v2")."""

from __future__ import annotations

import numpy as np
import pytest

from hf_blocks import deepseek_block, gpt_oss_block, qwen2_moe_block, run_block, torch

from colibri_sdk.format import ColibriFile, HeaderV2, write_arrays
from colibri_sdk.reference import ReferenceEngine, route_v2

FAMILIES = {
    "deepseek_v3": lambda: deepseek_block(3, bias_std=0.3),
    "deepseek_v2": lambda: deepseek_block(2),
    "qwen2_moe": lambda: qwen2_moe_block(),
    "qwen2_moe_norm": lambda: qwen2_moe_block(norm_topk_prob=True),
    "gpt_oss": lambda: gpt_oss_block(std=0.6),
}


def x_tokens(n=24, hidden=32, seed=5):
    return np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32)


def write(tmp_path, name, fields, arrays, **storage):
    header = HeaderV2(num_layers=1, composition=0, **fields, **storage)
    return write_arrays(tmp_path / f"{name}.colibri", header, arrays)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_file_matches_transformers_block(tmp_path, family):
    block, fields, arrays = FAMILIES[family]()
    x = x_tokens()
    path = write(tmp_path, family, fields, arrays, dtype=0)
    expected = run_block(block, x)
    np.testing.assert_allclose(ReferenceEngine(path)(x), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ReferenceEngine(path, compute_dtype=np.float64)(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp16_file_within_2e3(tmp_path, family):
    block, fields, arrays = FAMILIES[family]()
    x = x_tokens()
    expected = run_block(block, x)
    y = ReferenceEngine(write(tmp_path, family, fields, arrays, dtype=1))(x)
    assert np.abs(y - expected).max() <= 2e-3 * np.abs(expected).max()


def load_dequantized(block, path, family):
    """Put the file's dequantized expert matrices back into the transformers block (the oracle's values)."""
    f = ColibriFile(path)
    with torch.no_grad():
        if family == "gpt_oss":
            ex = block.experts
            for e in range(f.header.num_experts):
                ex.gate_up_proj[e, :, 0::2] = torch.from_numpy(f.weight("gate_proj", 0, e).T)
                ex.gate_up_proj[e, :, 1::2] = torch.from_numpy(f.weight("up_proj", 0, e).T)
                ex.down_proj[e] = torch.from_numpy(f.weight("down_proj", 0, e).T)
            return
        ex = block.experts
        inter = f.header.intermediate_size
        for e in range(f.header.num_experts):
            ex.gate_up_proj[e, :inter] = torch.from_numpy(f.weight("gate_proj", 0, e))
            ex.gate_up_proj[e, inter:] = torch.from_numpy(f.weight("up_proj", 0, e))
            ex.down_proj[e] = torch.from_numpy(f.weight("down_proj", 0, e))
        shared = block.shared_experts if hasattr(block, "shared_experts") else block.shared_expert
        for kind, lin in (("gate", shared.gate_proj), ("up", shared.up_proj), ("down", shared.down_proj)):
            lin.weight.copy_(torch.from_numpy(f.weight(f"shared_{kind}_proj", 0, 0)))


@pytest.mark.parametrize(
    "family,quant,group",
    [("deepseek_v3", 2, 32), ("deepseek_v2", 1, 0), ("qwen2_moe", 2, 64), ("gpt_oss", 2, 128), ("gpt_oss", 1, 32)],
)
def test_quantized_experts_match_transformers_on_the_dequantized_weights(tmp_path, family, quant, group):
    """int8/int4 files: the engine equals the transformers block holding exactly the dequantized weights (which
    have partial groups: down_proj reduces over 16 columns, shared down over 32 or 40)."""
    block, fields, arrays = FAMILIES[family]()
    x = x_tokens()
    path = write(tmp_path, family, fields, arrays, dtype=1, quant=quant, group_size=group)
    load_dequantized(block, path, family)
    np.testing.assert_allclose(ReferenceEngine(path)(x), run_block(block, x), rtol=1e-5, atol=1e-5)


def test_gpt_oss_clamp_is_exercised():
    """The comparison above covers the clamp: some gate values exceed +7 and some up values leave ±7."""
    block, fields, arrays = gpt_oss_block(std=0.6)
    x = x_tokens()
    gate = np.einsum("th,eih->tei", x, arrays["gate_proj"][0]) + arrays["gate_bias"][0]
    up = np.einsum("th,eih->tei", x, arrays["up_proj"][0]) + arrays["up_bias"][0]
    assert (gate > 7).any() and (np.abs(up) > 7).any()


def torch_routers(version: int, seed: int, bias_std: float = 0.0, **kw):
    block, fields, arrays = deepseek_block(version, seed=seed, bias_std=bias_std, **kw)
    return block.gate, HeaderV2(num_layers=1, composition=0, **fields), arrays


def selection(indices, weights):
    order = np.argsort(indices, axis=-1)
    return np.take_along_axis(indices, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize(
    "version,n_group,topk_group,top_k",
    [(3, 4, 2, 4), (3, 8, 3, 5), (2, 4, 2, 4), (2, 8, 1, 2)],
)
def test_group_limited_routing_matches_transformers_router(version, n_group, topk_group, top_k):
    """route_v2 against DeepseekV3TopkRouter / DeepseekV2TopkRouter themselves, topk_group < n_group."""
    gate, header, arrays = torch_routers(version, seed=7, bias_std=0.3, n_group=n_group, topk_group=topk_group,
                                         num_experts_per_tok=top_k)
    x = x_tokens(n=200, seed=11)
    with torch.no_grad():
        _, tw, ti = gate(torch.from_numpy(x))
    logits = x @ arrays["router"][0]
    bias = arrays.get("correction_bias", [None])[0]
    idx, w = route_v2(logits, header, bias)
    ti, tw = selection(ti.numpy(), tw.numpy())
    idx, w = selection(idx, w)
    np.testing.assert_array_equal(idx, ti)
    np.testing.assert_allclose(w, tw, rtol=1e-5, atol=1e-6)


def test_correction_bias_changes_the_selection_and_not_the_weights():
    """With the V3 correction bias some tokens pick other experts than without it; the weights of a chosen
    expert are its sigmoid score (renormalised, scaled), never score + bias."""
    gate, header, arrays = torch_routers(3, seed=3, bias_std=0.5)
    x = x_tokens(n=200, seed=2)
    logits = (x @ arrays["router"][0]).astype(np.float64)
    bias = arrays["correction_bias"][0]
    with_bias, w = route_v2(logits, header, bias)
    without, _ = route_v2(logits, header, None)
    changed = (np.sort(with_bias, -1) != np.sort(without, -1)).any(-1)
    assert 0 < changed.sum() < len(x)
    s = 1 / (1 + np.exp(-logits))
    picked = np.take_along_axis(s, with_bias, -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True) * 2.5, rtol=1e-12)


def test_group_limit_changes_the_selection():
    """topk_group < n_group excludes experts a plain top-k would pick (so the group path is exercised)."""
    _, header, arrays = torch_routers(2, seed=4, n_group=8, topk_group=2, num_experts_per_tok=4)
    logits = x_tokens(n=200, seed=3) @ arrays["router"][0]
    grouped, _ = route_v2(logits, header)
    plain = np.argsort(-logits, -1, kind="stable")[:, :4]
    assert (np.sort(grouped, -1) != np.sort(plain, -1)).any()
    # every selected expert lies in at most topk_group groups (of 16 / 8 = 2 experts)
    assert max(len(set(row // 2)) for row in grouped) <= 2
