"""The ordered aggregation folded into the tiled down kernels (kernels/common.cuh fold_aggregate and
fold_unrouted_rows, in colibri_down, colibri_down_tc and colibri_down_qtc), emulated on the CPU.

After every down launch of the plan, the layer output must equal, bit for bit, what the former separate aggregate
kernel computed from the same pair_out rows: per token s = 0, then s += pair_out[t*k + j] for the kept slots
j = 0..k-1 in order (float32, one rounding per addition), x + s (residual) or s — re-implemented here in NumPy
(`former_aggregate`). Also: the counters are back at zero after every launch, rows of tokens without a kept pair
(padded, or every pair dropped by the expert capacity) are x + 0 or 0, repeated calls and other block orders give
the same bits, and the outputs match the float64 reference. An emulation of the logic, not a GPU run: the
fences and L2 loads of the fold (the GPU memory model) are not exercised here.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from colibri_sdk import catalog

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import assert_close, make_model, make_profile, reference  # noqa: E402
from test_emulated_capacity import capacity_profile, capacity_reference, skewed_model  # noqa: E402
from test_emulated_quant import make_quant_model  # noqa: E402

DOWN_SYMBOLS = ("colibri_down", "colibri_down_tc", "colibri_down_qtc")


def former_aggregate(x: np.ndarray, ids: np.ndarray, pair_out: np.ndarray, experts: int, residual: bool):
    """The separate aggregate kernel the fold replaces, in float32: x (tokens, hidden), ids (tokens, k) int32,
    pair_out (tokens*k, hidden) → (tokens, hidden). Slots holding NO_EXPERT (= experts) are skipped (their rows
    are never written, so never read here either)."""
    tokens, k = ids.shape
    rows = pair_out.reshape(tokens, k, -1)
    s = np.zeros((tokens, rows.shape[-1]), dtype=np.float32)
    for j in range(k):
        kept = ids[:, j] < experts
        s[kept] = s[kept] + rows[kept, j]
    return x + s if residual else s


def run_folded(device: EmulatedDevice, x: np.ndarray, valid=None, schedule="increasing", seed=0) -> np.ndarray:
    """The plan launch by launch on poisoned buffers; after each down launch, its x_next against former_aggregate
    of its pair_out, bit for bit, and down_counters all zero. Returns the output (tokens, hidden)."""
    s, h = device.sizes, device.header
    device.poison()
    device.lib.set_schedule(schedule, seed)
    device._load_input(x, valid)
    folded = 0
    for launch, (function, grid, block, _shared, params, _values) in zip(device.plan, device._launches):
        device.lib.launch(function, grid, block, params.ctypes.data)
        if launch["symbol"] not in DOWN_SYMBOLS:
            continue
        layer = launch["layer"]
        xin = device.buffer(f"x{layer % 2}", np.float32).reshape(s.tokens, h.hidden_size)
        ids = device.buffer("topk_ids", np.int32).reshape(s.tokens, h.top_k)
        want = former_aggregate(xin, ids, device.buffer("pair_out", np.float32), h.num_experts, h.composition == 1)
        got = device.buffer(f"x{(layer + 1) % 2}", np.float32).reshape(s.tokens, h.hidden_size)
        assert np.isfinite(want).all(), "the former aggregate read an unwritten pair_out row"
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"layer {layer}")
        counters = device.buffer(catalog.DOWN_COUNTERS, np.int32)
        assert not counters.any(), f"layer {layer}: {np.count_nonzero(counters)} counters left non-zero"
        folded += 1
    assert folded == h.num_layers
    assert device.damaged_guards() == [], "out-of-bounds writes next to these buffers"
    return device.buffers[device.io["output"]].view(np.float32).reshape(s.tokens, h.hidden_size).copy()


def valid_rows(device: EmulatedDevice, valid) -> np.ndarray:
    shape = device.profile["shape"]
    counts = np.full(shape["batch"], shape["tokens"]) if valid is None else np.asarray(valid)
    return (np.arange(shape["tokens"])[None, :] < counts[:, None]).reshape(-1)


def check_calls(device: EmulatedDevice, path, valid, seed: int) -> None:
    """Three calls in a row (x1, x2, x1) and x1 under a pseudo-random block order: each folded bit for bit, x1's
    output the same every time; the valid rows against the float64 reference; padded rows x (residual) or 0."""
    s, h = device.sizes, device.header
    rng = np.random.default_rng(seed)
    x1, x2 = (rng.standard_normal((s.tokens, h.hidden_size)).astype(np.float32) for _ in range(2))
    y1 = run_folded(device, x1, valid)
    y2 = run_folded(device, x2, valid)
    assert y1.tobytes() != y2.tobytes()
    assert run_folded(device, x1, valid).tobytes() == y1.tobytes(), "a second call with the same input differs"
    assert run_folded(device, x1, valid, schedule="random", seed=5).tobytes() == y1.tobytes()
    mask = valid_rows(device, valid)
    ref, _, stable = reference(path, x1[mask])
    assert_close(y1[mask], ref, stable)
    expected = x1[~mask] + np.float32(0) if h.composition == 1 else np.zeros_like(x1[~mask])
    np.testing.assert_array_equal(y1[~mask].view(np.uint32), expected.view(np.uint32))


# (id, profile kwargs, model kwargs, valid tokens, the down kernel). Every case is on the tiled path, ordered
# aggregation, two layers; those with top-3 tell the slot order apart (with two slots 0 + a + b = 0 + b + a). Several share their compile-time constants (and so their emulation library) with cases
# of test_emulated.py / test_emulated_quant_tc.py.
CASES = [
    # tensor cores (fp16, block_m 64, rows 16-byte aligned), residual, padded tokens
    ("tc-fp16-residual-padded", dict(tokens=8, kernels={"small_batch": {"max_pairs": 1}}),
     dict(layers=2, experts=8, top_k=2, hidden=264, inter=136, seed=17), [5], "colibri_down_tc"),
    # tensor cores on odd sizes (windowed rows: hidden 179 and intermediate 115 are odd, so the rows start at every
    # 2-byte offset of a sector, and 179 + 15 and 115 + 15 need one window stage more than the row), top-3,
    # block_m 16 / 32 (one 16-row tile, two per pass), 64 (two tiles of expert 0 and 1: 77 pairs each) and 128 (one
    # tile in two passes of 64 + 13 rows)
    ("tc-fp16-odd-block_m16-top3-padded", dict(batch=2, tokens=16, kernels={"routing": {"block_m": 16}}),
     dict(layers=2, experts=8, top_k=3, hidden=179, inter=115, seed=22), [16, 7], "colibri_down_tc"),
    ("tc-fp16-odd-block_m32-sequential", dict(tokens=32, kernels={"routing": {"block_m": 32}}),
     dict(layers=2, experts=8, top_k=2, hidden=179, inter=115, composition=0, seed=23), None, "colibri_down_tc"),
    ("tc-fp16-odd-block_m64-two-tiles-padded", dict(tokens=80),
     dict(layers=2, experts=2, top_k=2, hidden=179, inter=115, seed=24), [77], "colibri_down_tc"),
    ("tc-fp16-odd-block_m128-two-passes-padded", dict(tokens=80, kernels={"routing": {"block_m": 128}}),
     dict(layers=2, experts=2, top_k=2, hidden=179, inter=115, seed=24), [77], "colibri_down_tc"),
    # scalar tiles: fp32, block_m 1, 32-thread down blocks with 16 columns (7 column blocks), sequential layers
    ("scalar-fp32-sequential-block_m1", dict(tokens=16, dtype="fp32", kernels={
        "routing": {"block_m": 1}, "small_batch": {"max_pairs": 1},
        "gate_up": {"threads": 64, "block_n": 16, "block_k": 16}, "down": {"threads": 32, "block_n": 16, "block_k": 16}}),
     dict(layers=2, experts=64, top_k=2, hidden=100, inter=75, dtype="fp32", composition=0, seed=4), None,
     "colibri_down"),
    # scalar tiles: fp32 with block_m 64 rows and 32 threads (two fold steps per tile), 35 padded tokens (two
    # steps of the unrouted rows), residual
    ("scalar-fp32-block_m64-32-threads-padded", dict(tokens=48, dtype="fp32", kernels={
        "routing": {"block_m": 64}, "gate_up": {"threads": 128, "block_n": 16, "block_k": 16},
        "down": {"threads": 32, "block_n": 16, "block_k": 16}}),
     dict(layers=2, experts=4, top_k=3, hidden=40, inter=24, dtype="fp32", seed=21), [13], "colibri_down"),
]
QUANT_CASES = [
    # int8 per row on tensor cores, residual, padded tokens
    ("qtc-int8-residual-padded", dict(tokens=32), dict(quant="int8", group=0, hidden=128, inter=64, layers=2),
     [20]),
    # int4 g32, sequential layers, top-3 of 3 experts: 130 rows per expert (fold steps of 128 + 2, three passes),
    # one padded token in the second step of the unrouted rows
    ("qtc-int4-sequential-130-rows", dict(tokens=130), dict(quant="int4", group=32, experts=3, top_k=3, hidden=64,
                                                            inter=32, layers=2, composition=0, seed=3), [129]),
]


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs,valid,symbol", CASES, ids=[c[0] for c in CASES])
def test_folded_float_down_equals_the_former_aggregate(orin_profile, tmp_path, name, profile_kwargs, model_kwargs,
                                                       valid, symbol):
    path = make_model(tmp_path / "m.colibri", **model_kwargs)
    device = EmulatedDevice(make_profile(orin_profile, **profile_kwargs), path)
    assert [launch["symbol"] for launch in device.plan] == [
        "colibri_routing", symbol.replace("down", "gate_up"), symbol] * 2  # the align is in colibri_routing
    check_calls(device, path, valid, seed=len(name))


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs,valid", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
def test_folded_quantized_down_equals_the_former_aggregate(orin_profile, tmp_path, name, profile_kwargs,
                                                           model_kwargs, valid):
    path = make_quant_model(tmp_path / "m.colibri", **model_kwargs)
    device = EmulatedDevice(make_profile(orin_profile, **profile_kwargs), path)
    assert [launch["symbol"] for launch in device.plan] == [
        "colibri_routing", "colibri_gate_up_qtc", "colibri_down_qtc"] * 2
    check_calls(device, path, valid, seed=len(name))


@pytest.mark.parametrize("dtype,suffix", [("fp32", ""), ("fp16", "_tc")])
def test_folded_down_with_capacity_drops(orin_profile, tmp_path, dtype, suffix):
    """Hard capacity, position policy, the router pulled hard towards experts 0 and 1: late tokens lose one or
    both pairs. Tokens with some pairs kept sum only those (bitwise as the former aggregate), tokens with none are
    x + 0, the counters end at zero, and two layers equal the float64 reference engine with the same capacity.
    fp32: the scalar tiles; fp16: the tensor-core tiles (intermediate 24: windowed down rows)."""
    spec = {"factor": 0.8, "mode": "hard", "policy": "position"}
    profile = capacity_profile(orin_profile, spec, batch=2, tokens=16, aggregation="ordered", dtype=dtype)
    path = skewed_model(tmp_path / "m.colibri", layers=2, bias=(1.0, 0.8), seed=2, dtype=dtype)
    device = EmulatedDevice(profile, path)
    symbols = [launch["symbol"] for launch in device.plan]
    assert symbols == ["colibri_routing", "colibri_capacity", "colibri_align", "colibri_gate_up" + suffix,
                       "colibri_down" + suffix] * 2
    valid = [16, 9]
    mask = valid_rows(device, valid)
    x = np.random.default_rng(4).standard_normal((32, 48)).astype(np.float32)
    y = run_folded(device, x, valid)
    kept = (device.buffer("topk_ids", np.int32).reshape(32, 2) < 6).sum(axis=1)  # the last layer's
    assert (kept[mask] == 0).any() and (kept[mask] == 1).any() and (kept[mask] == 2).any(), kept[mask]
    assert (kept[~mask] == 0).all()
    assert run_folded(device, x, valid).tobytes() == y.tobytes()
    assert run_folded(device, x, valid, schedule="decreasing").tobytes() == y.tobytes()
    flat, dropped = capacity_reference(path, spec, x, mask)
    assert int(device.buffer("capacity_dropped", np.int32).sum()) == dropped > 0
    scale = np.abs(flat).max(axis=-1, keepdims=True)
    assert (np.abs(y - flat) / scale).max() <= 1e-4
    np.testing.assert_array_equal(y[~mask], x[~mask])
