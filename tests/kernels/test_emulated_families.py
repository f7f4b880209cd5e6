"""The v2 model features in the kernels, emulated on the CPU (kernels/*.cu unmodified, compiled by g++ through
tests/kernels/emu/cuda_shim.h), against the float64 ReferenceEngine (sdk/reference.py, the oracle, itself checked
against transformers in tests/convert/test_families.py).

One case per family and path: Qwen2-MoE (softmax, shared expert with its sigmoid gate), DeepSeek-V2 (group score
max, routed scaling, ungated shared experts), DeepSeek-V3 (sigmoid scores, a correction bias that changes the
selection, group score = top-two sum with n_group > 1 and topk_group < n_group, renormalisation, routed scaling,
two ungated shared experts), gpt-oss (router bias, top-k then softmax, expert biases, the clamped SwiGLU reached),
in fp16 and fp32, on the GEMV path and the tiled path (tensor-core and scalar tiles, ordered and atomic
aggregation), and int8 with every feature at once. A CPU emulation of the kernels' logic, not a GPU run.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from colibri_sdk.format import HeaderV2, write_arrays
from colibri_sdk.reference import ReferenceEngine, route_v2, selection_margin

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import RTOL, make_profile, run_checked  # noqa: E402

MARGIN = 1e-4  # selection-score gap below which fp32 may legitimately select otherwise than float64

QWEN2 = dict(routing=1, num_shared_experts=1, shared_intermediate_size=28, shared_gate=1)
DEEPSEEK_V2 = dict(routing=1, n_group=4, topk_group=2, group_score=1, routed_scaling_factor=1.5,
                   num_shared_experts=1, shared_intermediate_size=48)
DEEPSEEK_V3 = dict(routing=2, norm_topk=1, n_group=4, topk_group=2, group_score=2, correction_bias=1,
                   routed_scaling_factor=2.5, num_shared_experts=2, shared_intermediate_size=20)
GPT_OSS = dict(routing=0, router_bias=1, expert_bias=1, activation=1, swiglu_limit=0.7, swiglu_alpha=1.702)


def make_v2_model(path, fields: dict, *, layers=1, experts=8, top_k=2, hidden=40, inter=24, dtype="fp16", seed=0):
    """A random v2 file: N(0, 1/fan_in) matrices, biases N(0, 0.3), the correction bias N(0, 0.3) (sigmoid scores
    spread about as much, so it changes the selection)."""
    h = HeaderV2(num_layers=layers, num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                 dtype=1 if dtype == "fp16" else 0, composition=1, **fields)
    rng = np.random.default_rng(seed)
    arrays = {}
    for kind in h.kinds:
        shape = h.shape(kind)
        if h.is_matrix(kind):
            arrays[kind] = rng.standard_normal((layers, h.count(kind), *shape)) / np.sqrt(shape[1])
        elif kind == "router":
            arrays[kind] = rng.standard_normal((layers, *shape)) / np.sqrt(shape[0])
        elif kind == "shared_expert_gate":
            arrays[kind] = rng.standard_normal((layers, *shape)) / np.sqrt(shape[0])
        else:
            arrays[kind] = 0.3 * rng.standard_normal((layers, *shape))
    return write_arrays(path, h, arrays)


def reference_v2(path, x: np.ndarray):
    """float64 reference: output (tokens, hidden), per-layer routes [(ids, weights)], per-layer correction biases,
    and the (tokens,) mask of tokens whose selection gaps (reference.selection_margin) are >= MARGIN everywhere."""
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    h = engine.header
    flat = x.astype(np.float64)
    stable = np.ones(len(flat), dtype=bool)
    routes, logits_per_layer = [], []
    for layer in range(h.num_layers):
        logits = flat @ engine.file.router(layer).astype(np.float64)
        if h.router_bias:
            logits = logits + engine.file.vector("router_bias", layer)
        correction = engine.file.vector("correction_bias", layer) if h.correction_bias else None
        stable &= selection_margin(logits, h, correction) >= MARGIN
        logits_per_layer.append((logits, correction))
        routes.append(engine.route(layer, flat))
        y = engine.layer(layer, flat)
        flat = flat + y if h.composition == 1 else y
    engine.close()
    return flat, routes, stable, logits_per_layer


def assert_close(y, ref, mask, rtol=RTOL):
    assert mask.mean() >= 0.5, f"only {mask.sum()} of {mask.size} tokens select stably: another seed"
    assert np.isfinite(y).all()
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    err = (np.abs(y - ref) / scale)[mask]
    assert err.max() <= rtol, f"max relative error {err.max():.3g} > {rtol} (token {np.argmax(err.max(axis=-1))})"


# (id, profile kwargs, model kwargs, valid tokens per sequence or None). make_profile sets small_batch.max_pairs
# 32: tokens*k <= 32 takes the GEMV path, else the tiled one (tensor cores with fp16, scalar tiles with fp32).
CASES = [
    ("qwen2moe-gemv-fp16-padded", dict(batch=2, tokens=3), dict(fields=QWEN2), [3, 1]),
    ("qwen2moe-tiled-tc-fp16-padded", dict(batch=2, tokens=16), dict(fields=QWEN2, hidden=48, inter=32, seed=1),
     [16, 9]),
    # top_k 3 > topk_group 2: the group limit changes the selection (with k <= topk_group a group max never does)
    ("deepseek_v2-gemv-fp16-group-max", dict(tokens=8),
     dict(fields=DEEPSEEK_V2, experts=16, top_k=3, seed=2), None),
    ("deepseek_v2-tiled-scalar-fp32-atomic", dict(tokens=16, aggregation="atomic", dtype="fp32"),
     dict(fields=DEEPSEEK_V2, experts=16, top_k=3, hidden=44, inter=30, dtype="fp32", seed=3), None),
    ("deepseek_v2-tiled-tc-fp16-odd-atomic-block_m32", dict(tokens=16, aggregation="atomic",
                                                           kernels={"routing": {"block_m": 32}}),
     dict(fields=DEEPSEEK_V2, experts=16, top_k=3, hidden=44, inter=30, seed=3), None),
    ("deepseek_v3-gemv-fp32", dict(tokens=8, dtype="fp32"),
     dict(fields=DEEPSEEK_V3, experts=16, top_k=4, dtype="fp32", seed=4), None),
    ("deepseek_v3-tiled-tc-fp16-2layers", dict(tokens=16),
     dict(fields=DEEPSEEK_V3, layers=2, experts=16, top_k=4, seed=5), None),
    ("gpt_oss-gemv-fp16", dict(tokens=4), dict(fields=GPT_OSS, seed=6), None),
    ("gpt_oss-tiled-tc-fp16", dict(tokens=32), dict(fields=GPT_OSS, hidden=48, seed=7), None),
    # expert biases and the clamped SwiGLU on the windowed tensor-core rows (odd sizes), block_m 16, padded tokens
    ("gpt_oss-tiled-tc-fp16-odd-block_m16-padded", dict(tokens=32, kernels={"routing": {"block_m": 16}}),
     dict(fields=GPT_OSS, hidden=77, inter=35, seed=7), [27]),
    ("int8-g32-every-feature-gemv", dict(tokens=4),
     dict(fields=dict(DEEPSEEK_V3, quant=1, group_size=32, shared_gate=1, expert_bias=1, activation=1,
                      swiglu_limit=0.7, swiglu_alpha=1.702, router_bias=1),
          experts=16, top_k=4, hidden=64, inter=40, seed=8), [4]),
    ("int8-g32-every-feature-tiled-qtc-padded", dict(tokens=16),
     dict(fields=dict(DEEPSEEK_V3, quant=1, group_size=32, shared_gate=1, expert_bias=1, activation=1,
                      swiglu_limit=0.7, swiglu_alpha=1.702, router_bias=1),
          experts=16, top_k=4, hidden=64, inter=40, seed=9), [13]),
]


@pytest.fixture(scope="module")
def case(request, orin_profile, tmp_path_factory):
    name, profile_kwargs, model_kwargs, valid = request.param
    profile = make_profile(orin_profile, **profile_kwargs)
    path = make_v2_model(tmp_path_factory.mktemp(name) / "model.colibri", **model_kwargs)
    device = EmulatedDevice(profile, path)
    assert device.sizes.small_batch == ("gemv" in name)
    assert device.sizes.tensor_core == ("-tc-" in name)
    assert device.sizes.quant_tensor_core == ("-qtc-" in name)  # int8/int4 tensor-core kernels, same epilogue
    x = np.random.default_rng(200 + len(name)).standard_normal((device.sizes.tokens, device.header.hidden_size))
    x = x.astype(np.float32)
    ref, routes, stable, logits = reference_v2(path, x)
    shape = profile["shape"]
    counts = np.full(shape["batch"], shape["tokens"]) if valid is None else np.asarray(valid)
    is_valid = (np.arange(shape["tokens"])[None, :] < counts[:, None]).reshape(-1)
    y = run_checked(device, x, valid_tokens=valid)
    return dict(device=device, x=x, y=y, ref=ref, routes=routes, stable=stable, logits=logits, valid=is_valid,
                path=path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_matches_reference(case):
    valid = case["valid"]
    assert_close(case["y"][valid], case["ref"][valid], case["stable"][valid])
    # Padded tokens: the input row (residual), nothing of any expert, shared ones included.
    np.testing.assert_array_equal(case["y"][~valid], case["x"][~valid])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_routing_as_reference(case):
    """The last layer's top-k ids and weights (group limit, correction bias, renormalisation and scaling
    included) as the reference's, for every valid token that selects stably."""
    device = case["device"]
    s, h = device.sizes, device.header
    ids = device.buffer("topk_ids", np.int32).reshape(s.tokens, h.top_k)
    weights = device.buffer("topk_weights", np.float32).reshape(s.tokens, h.top_k)
    ref_ids, ref_weights = case["routes"][-1]
    keep = case["stable"] & case["valid"]
    np.testing.assert_array_equal(ids[keep], ref_ids[keep])
    np.testing.assert_allclose(weights[keep], ref_weights[keep], rtol=1e-5, atol=1e-6)
    assert (ids[~case["valid"]] == h.num_experts).all()  # NO_EXPERT in every slot of a padded token
    if h.shared_gate and h.num_layers == 1:  # sigmoid(x . shared_expert_gate) per valid token, 0 for padded ones
        engine = ReferenceEngine(case["path"], compute_dtype=np.float64)
        gate = engine.file.vector("shared_expert_gate", 0).astype(np.float64)
        engine.close()
        expected = 1.0 / (1.0 + np.exp(-(case["x"].astype(np.float64) @ gate)))
        scale = device.buffer("shared_scale", np.float32)
        np.testing.assert_allclose(scale[case["valid"]], expected[case["valid"]], rtol=1e-5)
        assert (scale[~case["valid"]] == 0).all()


FEATURE_CASES = [c for c in CASES if c[0].startswith(("deepseek", "int8", "gpt_oss"))]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES], indirect=True)
def test_the_features_are_exercised(case):
    """The inputs reach what the cases claim to test: the group limit and the correction bias change the selection
    of some tokens, and the SwiGLU clamp is reached, so a kernel that ignored them would fail above."""
    h = case["device"].header
    logits, correction = case["logits"][0]
    ids, _ = route_v2(logits, h, correction)
    if h.n_group > 1:
        ungrouped = dataclasses.replace(h, n_group=1, topk_group=1, group_score=0)
        assert (route_v2(logits, ungrouped, correction)[0] != ids).any(axis=-1).mean() >= 0.1
    if h.correction_bias:
        assert (route_v2(logits, h, None)[0] != ids).any(axis=-1).mean() >= 0.1
    if h.activation:
        engine = ReferenceEngine(case["path"], compute_dtype=np.float64)
        x = case["x"].astype(np.float64)
        gate = np.stack([x @ engine._matrix("gate_proj", 0, e).T for e in range(h.num_experts)])
        up = np.stack([x @ engine._matrix("up_proj", 0, e).T for e in range(h.num_experts)])
        engine.close()
        assert (gate > h.swiglu_limit).mean() >= 0.02 and (np.abs(up) > h.swiglu_limit).mean() >= 0.02


def test_repeated_runs_are_bitwise_identical(orin_profile, tmp_path):
    """Shared experts added in a fixed order: any schedule of threads and blocks gives the same bits."""
    profile = make_profile(orin_profile, batch=2, tokens=3)  # the library of the first case
    path = make_v2_model(tmp_path / "m.colibri", dict(QWEN2), seed=9)
    device = EmulatedDevice(profile, path)
    x = np.random.default_rng(3).standard_normal((6, 40)).astype(np.float32)
    first = device.run(x)
    for schedule, seed in (("decreasing", 0), ("random", 1), ("random", 2)):
        np.testing.assert_array_equal(device.run(x, schedule=schedule, seed=seed), first)
