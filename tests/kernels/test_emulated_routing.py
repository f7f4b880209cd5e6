"""colibri_routing alone (kernels/routing.cu), emulated on the CPU: the router read once per token group by a grid of
hidden slices x token groups, the last block of each group selecting (and, on the tiled path, building the padded
expert order), against the float64 reference routing (sdk/reference.py, itself checked against transformers).

Every routing variant (v1 topk_softmax / softmax_topk, Qwen2-MoE's shared gate, Qwen3's renormalised softmax,
DeepSeek-V2/V3 group limits with scaling, sigmoid and correction bias, gpt-oss's router bias) at 1, 3, 16 and 64
tokens, padded tokens, several calls in a row on the same buffers (the counters back at zero, the same bits),
experts 8 to 256 (more experts than threads: several passes; experts not a multiple of a warp), hidden sizes that
are not a multiple of the slice. A CPU emulation of the kernel's logic (blocks run one after another, in
increasing, decreasing or pseudo-random order), not a GPU run: it cannot show a missing fence.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.format import ColibriFile
from colibri_sdk.reference import ReferenceEngine, selection_margin
from colibri_sdk.runtime.cuda_backend import POISON_WORD

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import expected_order, make_model, make_profile  # noqa: E402
from test_emulated_families import DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, QWEN2, make_v2_model  # noqa: E402

MARGIN = 1e-4  # selection-score gap below which fp32 may legitimately select otherwise than float64
QWEN3 = dict(routing=1, norm_topk=1)  # softmax, top-k, renormalised: the kernels' routing-0 shortcut
# DeepSeek-V3 with 256 experts in 8 groups, top-4 groups (its real grouping)
DEEPSEEK_V3_256 = dict(DEEPSEEK_V3, n_group=8, topk_group=4)

# (id, v1 routing code or v2 fields, model kwargs, profile kwargs, valid-token runs). make_profile sets
# small_batch.max_pairs 32: tokens * top_k above it takes the tiled path (the align fused into colibri_routing).
# Slice rows: 32 at 1 token, 48 at 3, 256 at 16 or more (catalog.router_grid).
CASES = [
    ("topk_softmax-v1-fp16-1token-e8-h100", 0, dict(experts=8, top_k=2, hidden=100), dict(tokens=1), [[1], [0]]),
    ("softmax_topk-v1-fp32-3tokens-e64-h100-32threads", 1,
     dict(experts=64, top_k=4, hidden=100, dtype="fp32"),
     dict(tokens=3, dtype="fp32", kernels={"routing": {"threads": 32}}), [[3], [2]]),
    ("qwen2-shared-gate-16tokens-e128-h300", QWEN2, dict(experts=128, top_k=2, hidden=300),
     dict(tokens=16), [[16], [1], [3], [11]]),
    ("qwen3-norm-64tokens-e128-k8-tiled", QWEN3, dict(experts=128, top_k=8, hidden=64),
     dict(batch=2, tokens=32), [[32, 32], [32, 7], [0, 1]]),
    ("deepseek_v3-3tokens-e256-k8", DEEPSEEK_V3_256, dict(experts=256, top_k=8, hidden=72),
     dict(tokens=3), [[3], [1]]),
    ("deepseek_v2-16tokens-e64-tiled-1024threads", DEEPSEEK_V2, dict(experts=64, top_k=3, hidden=100),
     dict(tokens=16, kernels={"routing": {"threads": 1024}}), [[16], [5]]),
    ("gpt_oss-64tokens-e200-tiled-atomic-h300", GPT_OSS, dict(experts=200, top_k=4, hidden=300),
     dict(tokens=64, aggregation="atomic"), [[64], [50], [1]]),
]

ROUTING_BUFFERS = ("topk_ids", "topk_weights", "routing_partials", "shared_scale", "expert_counts", "expert_offsets",
                   "sorted_pairs", "block_experts")


def reference_routes(path, x: np.ndarray):
    """float64 routes of layer 0: ids (tokens, k), weights (tokens, k), the shared gate sigmoid(x . g) or None, and
    the (tokens,) mask of tokens whose selection gaps are >= MARGIN."""
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    h = engine.header
    flat = x.astype(np.float64)
    ids, weights = engine.route(0, flat)
    logits = flat @ engine.file.router(0).astype(np.float64)
    gate = None
    if engine.v2:
        if h.router_bias:
            logits = logits + engine.file.vector("router_bias", 0)
        correction = engine.file.vector("correction_bias", 0) if h.correction_bias else None
        stable = selection_margin(logits, h, correction) >= MARGIN
        if getattr(h, "shared_gate", 0):
            gate = 1.0 / (1.0 + np.exp(-(flat @ engine.file.vector("shared_expert_gate", 0).astype(np.float64))))
    else:
        top = -np.sort(-logits, axis=-1)[:, : h.top_k + 1]
        stable = (np.diff(-top, axis=-1) >= MARGIN).all(axis=-1) if top.shape[1] > 1 else np.ones(len(flat), bool)
    engine.close()
    return ids, weights, gate, stable


@pytest.fixture(scope="module")
def built(request, orin_profile, tmp_path_factory):
    """(case, profile, path, device): the routing launch of layer 0 only."""
    name, fields, model_kwargs, profile_kwargs, runs = request.param
    folder = tmp_path_factory.mktemp(name)
    if isinstance(fields, int):
        path = make_model(folder / "m.colibri", routing=fields, seed=len(name), **model_kwargs)
    else:
        path = make_v2_model(folder / "m.colibri", fields, seed=len(name), **model_kwargs)
    profile = make_profile(orin_profile, **profile_kwargs)
    device = EmulatedDevice(profile, path, kernels=("routing",))
    return request.param, profile, path, device


def routing_state(device: EmulatedDevice) -> dict[str, np.ndarray]:
    """The routing kernel's outputs and scratch (uint32 words), the counters included."""
    names = [*ROUTING_BUFFERS, "routing_counters", device.io["output"]]
    return {name: device.buffer(name, np.uint32) for name in names if name in device.buffers}


@pytest.mark.parametrize("built", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_routing_matches_the_reference_and_repeats_bit_for_bit(built):
    (name, _fields, _model, _pk, runs), profile, path, device = built
    s, h = device.sizes, device.header
    grid = catalog.router_grid(profile, h)
    assert [launch["grid"] for launch in device.plan] == [[grid.slices, grid.groups, 1]]
    assert grid.fused_align == (not s.small_batch)
    shape = profile["shape"]
    x = np.random.default_rng(11).standard_normal((s.tokens, h.hidden_size)).astype(np.float32)
    ref_ids, ref_weights, ref_gate, stable = reference_routes(path, x)
    for valid_counts in runs:
        valid = (np.arange(shape["tokens"])[None, :] < np.asarray(valid_counts)[:, None]).reshape(-1)
        device.poison()  # every scratch entry NaN, the counters 0 (as after allocation)
        states = []
        for schedule, seed in (("increasing", 0), ("decreasing", 0), ("random", 5)):  # same buffers, no reset
            device.run(x, schedule=schedule, seed=seed, valid_tokens=valid_counts)
            state = routing_state(device)
            assert (state["routing_counters"] == 0).all(), f"{name}: counters left {state['routing_counters']}"
            states.append(state)
        for other in states[1:]:
            for buffer, words in states[0].items():
                np.testing.assert_array_equal(other[buffer], words, err_msg=f"{buffer} differs between calls")
        for buffer in ROUTING_BUFFERS:
            if buffer in device.buffers:
                left = int((device.buffer(buffer, np.uint32) == POISON_WORD).sum())
                assert left == 0, f"{buffer}: {left} entries not written"
        ids = device.buffer("topk_ids", np.int32).reshape(s.tokens, h.top_k)
        weights = device.buffer("topk_weights", np.float32).reshape(s.tokens, h.top_k)
        assert (ids[~valid] == h.num_experts).all() and (weights[~valid] == 0).all()
        check = valid & stable
        assert check.sum() >= 0.5 * valid.sum(), f"only {check.sum()} of {valid.sum()} tokens select stably"
        np.testing.assert_array_equal(ids[check], ref_ids[check])
        np.testing.assert_allclose(weights[check], ref_weights[check], rtol=1e-5, atol=1e-6)
        if ref_gate is not None:
            scale = device.buffer("shared_scale", np.float32)
            np.testing.assert_allclose(scale[valid], ref_gate[valid], rtol=1e-5, atol=1e-6)
            assert (scale[~valid] == 0).all()
        if profile["aggregation"] == "atomic" and not s.small_batch:  # the output rows the down kernels add into
            out = device.buffer(device.io["output"], np.float32).reshape(s.tokens, h.hidden_size)
            np.testing.assert_array_equal(out, x if h.composition == 1 else np.zeros_like(x))
        if not s.small_batch:  # the padded expert order of the old colibri_align (docs/kernels.md)
            counts, offsets, sorted_pairs, block_experts = expected_order(ids, h.num_experts, s.block_m, s.padded,
                                                                          s.blocks)
            counts, offsets = counts[: h.num_experts], offsets[: h.num_experts + 1]  # NO_EXPERT pairs: no expert's
            np.testing.assert_array_equal(device.buffer("expert_counts", np.int32), counts)
            np.testing.assert_array_equal(device.buffer("expert_offsets", np.int32), offsets)
            np.testing.assert_array_equal(device.buffer("sorted_pairs", np.int32), sorted_pairs)
            np.testing.assert_array_equal(device.buffer("block_experts", np.int32), block_experts)


def test_router_is_read_once_per_group_by_many_blocks(orin_profile, tmp_path):
    """Access model: at 16 tokens the router's sectors are read once in all (not once per token), by
    ceil(hidden / 256) blocks; one valid token of a 64-token bundle reads it once too (groups without a valid token
    read none of it)."""
    hidden, experts = 512, 64
    path = make_v2_model(tmp_path / "m.colibri", QWEN3, experts=experts, top_k=4, hidden=hidden)
    router_bytes = hidden * experts * 4  # float32 in a v2 file
    for tokens, valid in ((16, [16]), (64, [1])):
        device = EmulatedDevice(make_profile(orin_profile, tokens=tokens), path, kernels=("routing",))
        x = np.random.default_rng(2).standard_normal((tokens, hidden)).astype(np.float32)
        [(launch, stats)] = device.run_recorded(x, valid_tokens=valid)
        assert launch["grid"][0] == hidden // 256
        assert 32 * int(stats[0][1]) == router_bytes, (tokens, 32 * int(stats[0][1]), router_bytes)
        assert int(stats[0][2]) == int(stats[0][1])  # every sector fully used by the load that fetched it
