"""The kernels' logic, emulated on the CPU: kernels/*.cu unmodified, compiled by g++ through
tests/kernels/emu/cuda_shim.h, the whole `catalog.launch_plan` run with the arguments the CUDA backend builds,
against the float64 ReferenceEngine.

An emulation on the CPU: it checks indexing, tails, the padded expert order, top-k ties, routing modes, ordered and
atomic aggregation, residual, fp16 conversion, GEMV and tiled paths, experts without tokens and that every scratch
entry is written on every call. It proves nothing about GPU timing, the GPU memory model or occupancy (tests/gpu
does, on a GPU).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.format import Header, write_model
from colibri_sdk.profile import Profile
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime.cuda_backend import POISON_WORD

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice, EmulationError, EmulationLibrary, Region, build_library  # noqa: E402
from kernel_support import expected_pair_order  # noqa: E402

MARGIN = 1e-4  # router logit gap below which fp32 may legitimately pick another expert than float64
RTOL = 1e-4  # of the largest |reference| value of the token: fp32 accumulation against float64, same weights


def make_profile(orin: dict, *, batch=1, tokens=16, dtype="fp16", aggregation="ordered", kernels=None) -> dict:
    """The Orin profile with another shape, dtype, aggregation and kernel parameters (small_batch.max_pairs 32 for
    every storage unless given: the profile's max_pairs_quantized is dropped), validated."""
    data = copy.deepcopy(orin)
    data.update(dtype=dtype, aggregation=aggregation, shape={"batch": batch, "tokens": tokens})
    data["kernels"]["small_batch"]["max_pairs"] = 32
    data["kernels"]["small_batch"].pop("max_pairs_quantized", None)
    for name, params in (kernels or {}).items():
        data["kernels"][name].update(params)
    return Profile.from_dict(data, toolchain=False).data


def make_model(path, *, layers=1, experts=8, top_k=2, hidden=40, inter=24, dtype="fp16", routing=0, composition=1,
               seed=0, router=None):
    """A random .colibri file, N(0, 1/fan_in) weights (`router` (layers, hidden, experts) replaces the router)."""
    rng = np.random.default_rng(seed)
    header = Header(layers, experts, top_k, hidden, inter, dtype=1 if dtype == "fp16" else 0, routing=routing,
                    composition=composition)
    gate = rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden)
    up = rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden)
    down = rng.standard_normal((layers, experts, hidden, inter)) / np.sqrt(inter)
    if router is None:
        router = rng.standard_normal((layers, hidden, experts)) / np.sqrt(hidden)
    return write_model(path, header, gate, up, down, router)


def reference(path, x: np.ndarray):
    """float64 reference: output (tokens, hidden), per-layer routes [(ids, weights)], and a (tokens,) mask of the
    tokens whose top-(k+1) router logits are at least MARGIN apart at every layer."""
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    h = engine.header
    flat = x.astype(np.float64)
    stable = np.ones(len(flat), dtype=bool)
    routes = []
    for layer in range(h.num_layers):
        logits = flat @ engine.file.router(layer).astype(np.float64)
        top = -np.sort(-logits, axis=-1)[:, : h.top_k + 1]
        if top.shape[1] > 1:
            stable &= (np.diff(-top, axis=-1) >= MARGIN).all(axis=-1)
        routes.append(engine.route(layer, flat))
        y = engine.layer(layer, flat)
        flat = flat + y if h.composition == 1 else y
    engine.close()
    return flat, routes, stable


def expected_order(ids: np.ndarray, experts: int, block_m: int, padded: int, blocks: int):
    """colibri_align's outputs as docs/kernels.md defines them, from the (tokens, k) selected experts."""
    flat = ids.ravel()
    counts = np.bincount(flat, minlength=experts)
    rows = -(-counts // block_m) * block_m
    offsets = np.concatenate([[0], np.cumsum(rows)])
    sorted_pairs = np.full(padded, -1, dtype=np.int32)
    block_experts = np.full(blocks, -1, dtype=np.int32)
    for e in range(experts):
        pairs = np.flatnonzero(flat == e)
        sorted_pairs[offsets[e] : offsets[e] + len(pairs)] = pairs
        block_experts[offsets[e] // block_m : offsets[e + 1] // block_m] = e
    return counts, offsets, sorted_pairs, block_experts


# Per-pair rows: those of padded tokens are never written (no expert computes them) and never read.
PAIR_ROWS = ("act", "pair_out")


def run_checked(device: EmulatedDevice, x: np.ndarray, valid_tokens=None, **schedule) -> np.ndarray:
    """Poison every scratch buffer, run, and check nothing is left unwritten (but the per-pair rows of padded
    tokens) and no guard was overwritten."""
    device.poison()
    y = device.run(x, valid_tokens=valid_tokens, **schedule)
    assert device.damaged_guards() == [], "out-of-bounds writes next to these buffers"
    s, h = device.sizes, device.header
    shape = device.profile["shape"]
    counts = np.full(shape["batch"], shape["tokens"]) if valid_tokens is None else np.asarray(valid_tokens)
    valid = (np.arange(shape["tokens"])[None, :] < counts[:, None]).reshape(-1)
    for name in device.buffers:
        words = device.buffer(name, np.uint32)
        if name in PAIR_ROWS:
            words = words.reshape(s.pairs, -1)[np.repeat(valid, h.top_k)]
        left = int((words == POISON_WORD).sum())
        assert left == 0, f"{name}: {left} entries not written by the forward pass"
    return y


def assert_close(y: np.ndarray, ref: np.ndarray, mask: np.ndarray, rtol=RTOL):
    assert mask.mean() >= 0.5 and mask.any(), f"only {mask.sum()} of {mask.size} tokens route stably: another seed"
    assert np.isfinite(y).all()
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    err = (np.abs(y - ref) / scale)[mask]
    assert err.max() <= rtol, f"max relative error {err.max():.3g} > {rtol} (token {np.argmax(err.max(axis=-1))})"


# (id, profile kwargs, model kwargs). tokens*k <= max_pairs (32 unless set) takes the GEMV path, else the tiles.
CASES = [
    ("decode-fp16-gemv", dict(tokens=1), dict(experts=8, top_k=2, hidden=40, inter=24)),
    ("few-fp32-gemv-odd-softmax-all-seq", dict(batch=3, tokens=1, dtype="fp32"),
     dict(layers=2, experts=16, top_k=4, hidden=100, inter=75, dtype="fp32", routing=1, composition=0)),
    ("gemv-fp16-odd-misaligned-rows-24experts", dict(tokens=3),
     dict(layers=2, experts=24, top_k=3, hidden=100, inter=75, seed=3)),
    ("gemv-fp16-tiny-dims-k-equals-experts", dict(tokens=5), dict(experts=2, top_k=2, hidden=5, inter=3)),
    ("gemv-fp16-256experts-k8", dict(tokens=2), dict(experts=256, top_k=8, hidden=40, inter=24, routing=1)),
    ("gemv-fp16-k8-boundary", dict(tokens=4), dict(experts=16, top_k=8, hidden=40, inter=24, routing=1)),
    ("gemv-atomic-64experts-k1-router-threads-32", dict(tokens=3, aggregation="atomic",
                                                       kernels={"routing": {"threads": 32}}),
     dict(experts=64, top_k=1, hidden=40, inter=24, composition=0)),
    ("tiled-fp16-64tokens", dict(batch=2, tokens=32),
     dict(layers=2, experts=16, top_k=2, hidden=100, inter=75, seed=1)),
    ("tiled-fp32-atomic-softmax-all", dict(tokens=16, dtype="fp32", aggregation="atomic"),
     dict(experts=8, top_k=4, hidden=40, inter=24, dtype="fp32", routing=1, seed=2)),
    ("tiled-fp32-64experts-block_m1-small-tiles", dict(tokens=16, dtype="fp32", kernels={
        "routing": {"block_m": 1}, "small_batch": {"max_pairs": 1},
        "gate_up": {"threads": 64, "block_n": 16, "block_k": 16}, "down": {"threads": 32, "block_n": 16, "block_k": 16}}),
     dict(experts=64, top_k=2, hidden=100, inter=75, dtype="fp32", composition=0, seed=4)),
    ("tiled-fp16-tiny-dims-block_m128", dict(tokens=16, kernels={"routing": {"block_m": 128}}),
     dict(experts=4, top_k=3, hidden=5, inter=3, seed=6)),
    ("tiled-fp16-256experts-k8", dict(tokens=8, kernels={"small_batch": {"max_pairs": 1}}),
     dict(experts=256, top_k=8, hidden=40, inter=24, seed=8)),
    ("tiled-fp16-atomic-block_m4-seq", dict(tokens=16, aggregation="atomic", kernels={"routing": {"block_m": 4}}),
     dict(layers=2, experts=16, top_k=4, hidden=40, inter=24, composition=0, seed=5)),
    # top-k 16 (Qwen3-Next-style routing of 10 fits under the limit), both paths
    ("gemv-fp16-k16-64experts", dict(tokens=4, kernels={"small_batch": {"max_pairs": 128}}),
     dict(experts=64, top_k=16, hidden=40, inter=24, routing=1, seed=12)),
    ("tiled-fp16-k16-32experts", dict(tokens=8), dict(experts=32, top_k=16, hidden=40, inter=24, seed=13)),
    # more pairs per expert than one pass takes (8), and 1024-thread blocks (4 pairs per pass, one down row per warp)
    ("gemv-fp32-1024-threads-passes", dict(tokens=12, dtype="fp32", kernels={"small_batch": {"threads": 1024}}),
     dict(experts=3, top_k=2, hidden=40, inter=24, dtype="fp32", seed=15)),
    # a hidden size of three staging chunks (512 + 512 + 8, 16-byte aligned rows) and an odd intermediate size
    ("gemv-fp16-three-chunks", dict(tokens=2), dict(experts=8, top_k=2, hidden=1032, inter=37, seed=16)),
    # rows that start inside a 16-byte vector (aligned windows with a margin: three chunks), two passes per expert
    ("gemv-fp16-odd-windows-passes", dict(tokens=16), dict(experts=2, top_k=1, hidden=1030, inter=45, seed=18)),
    # the tensor-core tile over 5 (hidden 264) and 3 (intermediate 136) cp.async stages: the pipeline wraps around
    ("tiled-fp16-tc-pipeline", dict(tokens=8, kernels={"small_batch": {"max_pairs": 1}}),
     dict(experts=8, top_k=2, hidden=264, inter=136, seed=17)),
    # odd sizes on the tensor-core tile (windowed rows at every offset of a sector), atomic, block_m 32
    ("tiled-fp16-tc-odd-atomic-block_m32", dict(tokens=16, aggregation="atomic", kernels={"routing": {"block_m": 32}}),
     dict(experts=8, top_k=4, hidden=179, inter=115, seed=19)),
]


@pytest.fixture(scope="module")
def case(request, orin_profile, tmp_path_factory):
    name, profile_kwargs, model_kwargs = request.param
    profile = make_profile(orin_profile, **profile_kwargs)
    path = make_model(tmp_path_factory.mktemp(name) / "model.colibri", **model_kwargs)
    device = EmulatedDevice(profile, path)
    if "-tc-" in name:
        assert device.sizes.tensor_core, f"{name} must run on the tensor-core tile"
    rng = np.random.default_rng(100 + len(name))
    x = rng.standard_normal((device.sizes.tokens, device.header.hidden_size)).astype(np.float32)
    ref, routes, stable = reference(path, x)
    y = run_checked(device, x)
    return dict(profile=profile, device=device, x=x, y=y, ref=ref, routes=routes, stable=stable, path=path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_matches_reference(case):
    assert_close(case["y"], case["ref"], case["stable"])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_routing_and_padded_order(case):
    """The last layer's scratch buffers: top-k ids and weights as the reference, colibri_align's layout (tiled path)
    or the pair order (GEMV path) exactly."""
    device, stable = case["device"], case["stable"]
    s, h = device.sizes, device.header
    ids = device.buffer("topk_ids", np.int32).reshape(s.tokens, h.top_k)
    weights = device.buffer("topk_weights", np.float32).reshape(s.tokens, h.top_k)
    ref_ids, ref_weights = case["routes"][-1]
    np.testing.assert_array_equal(ids[stable], ref_ids[stable])
    np.testing.assert_allclose(weights[stable], ref_weights[stable], rtol=1e-5, atol=1e-6)
    if s.small_batch:  # the GEMV path: no padded order; the pair order colibri_routing built for the GEMV blocks
        assert "sorted_pairs" not in device.buffers
        np.testing.assert_array_equal(device.buffer(catalog.PAIR_ORDER, np.int32),
                                      expected_pair_order(ids, h.num_experts))
        return
    counts, offsets, sorted_pairs, block_experts = expected_order(ids, h.num_experts, s.block_m, s.padded, s.blocks)
    np.testing.assert_array_equal(device.buffer("expert_counts", np.int32), counts)
    np.testing.assert_array_equal(device.buffer("expert_offsets", np.int32), offsets)
    np.testing.assert_array_equal(device.buffer("sorted_pairs", np.int32), sorted_pairs)
    np.testing.assert_array_equal(device.buffer("block_experts", np.int32), block_experts)


@pytest.mark.parametrize("case", [c for c in CASES if c[1].get("aggregation") != "atomic"],
                         ids=[c[0] for c in CASES if c[1].get("aggregation") != "atomic"], indirect=True)
def test_ordered_aggregation_is_bitwise_identical_under_any_schedule(case):
    """Threads and blocks in decreasing and in pseudo-random order give the same bits as in increasing order."""
    device, x, y = case["device"], case["x"], case["y"]
    for schedule, seed in (("decreasing", 0), ("random", 7)):
        again = run_checked(device, x, schedule=schedule, seed=seed)
        assert again.tobytes() == y.tobytes(), f"{schedule} schedule changed the output bits"


def test_atomic_aggregation_is_close_under_any_schedule(orin_profile, tmp_path):
    """atomicAdd order follows the schedule; the results stay within rounding of each other and of the reference."""
    profile = make_profile(orin_profile, tokens=16, aggregation="atomic", dtype="fp32")
    path = make_model(tmp_path / "m.colibri", experts=8, top_k=4, hidden=40, inter=24, dtype="fp32", seed=9)
    device = EmulatedDevice(profile, path)
    x = np.random.default_rng(9).standard_normal((16, 40)).astype(np.float32)
    ref, _, stable = reference(path, x)
    for schedule in ("increasing", "decreasing", "random"):
        assert_close(run_checked(device, x, schedule=schedule, seed=3), ref, stable)


@pytest.mark.parametrize("routing", [0, 1])
def test_exact_ties_go_to_the_lower_expert(orin_profile, tmp_path, routing):
    """Router columns duplicated in pairs (expert 2i+1 = expert 2i): equal logits bit for bit; the lower index wins,
    including where the tie straddles the k-th place. The output matches the reference on every token."""
    experts, top_k, hidden = 8, 3, 40
    rng = np.random.default_rng(11)
    half = rng.standard_normal((1, hidden, experts // 2)) / np.sqrt(hidden)
    router = np.repeat(half, 2, axis=-1)
    path = make_model(tmp_path / "m.colibri", experts=experts, top_k=top_k, hidden=hidden, dtype="fp32",
                      routing=routing, router=router)
    profile = make_profile(orin_profile, tokens=16, dtype="fp32")
    device = EmulatedDevice(profile, path)
    x = rng.standard_normal((16, hidden)).astype(np.float32)
    y = run_checked(device, x)
    ref, routes, _ = reference(path, x)
    logits = x.astype(np.float64) @ router[0]
    assert (logits[:, 0::2] == logits[:, 1::2]).all(), "the reference's logits of duplicated columns differ"
    distinct = -np.sort(-logits[:, 0::2], axis=-1)
    assert (np.diff(-distinct, axis=-1) >= MARGIN).all(), "pick another seed: distinct logits nearly tie"
    ids = device.buffer("topk_ids", np.int32).reshape(16, top_k)
    np.testing.assert_array_equal(ids, routes[0][0])
    assert (ids[:, 0] % 2 == 0).all() and (ids[:, 1] == ids[:, 0] + 1).all() and (ids[:, 2] % 2 == 0).all()
    assert_close(y, ref, np.ones(16, dtype=bool))


def test_all_logits_equal_select_experts_0_to_k(orin_profile, tmp_path):
    """A zero router: every logit is 0, the top-k are experts 0..k-1 with weight 1/k (routing 0)."""
    path = make_model(tmp_path / "m.colibri", experts=16, top_k=4, router=np.zeros((1, 40, 16)))
    device = EmulatedDevice(make_profile(orin_profile, tokens=3), path)
    x = np.random.default_rng(5).standard_normal((3, 40)).astype(np.float32)
    y = run_checked(device, x)
    ids = device.buffer("topk_ids", np.int32).reshape(3, 4)
    np.testing.assert_array_equal(ids, np.tile(np.arange(4), (3, 1)))
    np.testing.assert_array_equal(device.buffer("topk_weights", np.float32), np.full(12, 0.25, dtype=np.float32))
    ref, _, _ = reference(path, x)
    assert_close(y, ref, np.ones(3, dtype=bool))


def test_fp16_conversion_is_exact_for_every_bit_pattern(orin_profile):
    """The emulation's fp16 → fp32 (the kernels' wt_to_float) equals NumPy's for all 65536 halves, NaNs by bits."""
    header = Header(1, 8, 2, 40, 24, dtype=1)
    lib = EmulationLibrary(build_library(catalog.compile_defines(make_profile(orin_profile), header)))
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(lib.half_to_float(bits), want)


BROKEN = r"""
#include "common.cuh"
// thread t reads what thread t+1 wrote, without a barrier in between
extern "C" __global__ void missing_barrier(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}
// half the block returns before a __syncthreads the other half waits at
extern "C" __global__ void divergent_barrier(float* out) {
    if (threadIdx.x >= 32) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
// a full-mask shuffle in a warp whose upper lanes returned
extern "C" __global__ void partial_warp_shuffle(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = warp_sum(1.0f);
}
extern "C" __global__ void out_of_bounds(float* out) { out[threadIdx.x + (1 << 30)] = 1.0f; }
"""


@pytest.fixture(scope="module")
def broken_library(orin_profile, tmp_path_factory):
    folder = tmp_path_factory.mktemp("broken")
    for name in ("common.cuh",):
        (folder / name).write_text((catalog.kernel_dir() / name).read_text())
    (folder / "broken.cu").write_text(BROKEN)
    defines = catalog.compile_defines(make_profile(orin_profile), Header(1, 8, 2, 40, 24, dtype=1))
    symbols = ("missing_barrier", "divergent_barrier", "partial_warp_shuffle", "out_of_bounds")
    return EmulationLibrary(build_library(defines, folder, [("broken.cu", symbols)]))


def launch_one(lib: EmulationLibrary, symbol: str, threads: int, schedule: str = "increasing") -> np.ndarray:
    out = np.zeros(threads, dtype=np.float32)
    pointer = np.array([out.ctypes.data], dtype=np.uint64)
    params = np.array([pointer.ctypes.data], dtype=np.uint64)
    lib.set_schedule(schedule)
    lib.launch(lib.function(symbol), (1, 1, 1), (threads, 1, 1), params.ctypes.data)
    return out


def test_emulation_exposes_a_missing_barrier(broken_library):
    """Without a barrier, a thread reads shared memory another thread has not written yet (NaN-filled)."""
    out = launch_one(broken_library, "missing_barrier", 64)
    assert np.isnan(out[:63]).all() and out[63] == 0.0


@pytest.mark.parametrize("symbol,message", [
    ("divergent_barrier", r"divergent_barrier: block \(0, 0, 0\) thread \d+: __syncthreads not reached by every thread"),
    ("partial_warp_shuffle", r"thread \d+: warp operation with a full mask after a lane of the warp returned"),
    ("out_of_bounds", r"out_of_bounds: block \(0, 0, 0\) thread 0: memory fault at address"),
])
def test_emulation_refuses_undefined_behaviour(broken_library, symbol, message):
    with pytest.raises(EmulationError, match=message):
        launch_one(broken_library, symbol, 64)


# ---- padded tokens ------------------------------------------------------------------------------------------------
PADDED_CASES = [
    # (id, profile kwargs, model kwargs, valid tokens per sequence)
    ("gemv-sequential-layers", dict(batch=2, tokens=8), dict(layers=2, experts=16, top_k=4, composition=0), [8, 1]),
    ("tiled-ordered", dict(batch=2, tokens=16), dict(experts=8, top_k=2, seed=1), [5, 16]),
    ("tiled-atomic-sequential", dict(batch=2, tokens=16, aggregation="atomic"),
     dict(layers=2, experts=8, top_k=2, composition=0, seed=2), [0, 7]),
]


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs,valid", PADDED_CASES, ids=[c[0] for c in PADDED_CASES])
def test_padded_tokens_select_no_expert(orin_profile, tmp_path, name, profile_kwargs, model_kwargs, valid):
    """Valid rows match the reference run on the valid rows alone; padded rows are the input (residual) or zeros,
    route to NO_EXPERT (= experts) with weight 0, and their per-pair rows are never written."""
    profile = make_profile(orin_profile, **profile_kwargs)
    path = make_model(tmp_path / "m.colibri", **model_kwargs)
    device = EmulatedDevice(profile, path)
    s, h = device.sizes, device.header
    batch, tokens = profile["shape"]["batch"], profile["shape"]["tokens"]
    mask = (np.arange(tokens)[None, :] < np.asarray(valid)[:, None]).reshape(-1)
    x = np.random.default_rng(21).standard_normal((s.tokens, h.hidden_size)).astype(np.float32)
    y = run_checked(device, x, valid_tokens=valid)
    ref, _, stable = reference(path, x[mask])
    assert_close(y[mask], ref, stable)
    padded = ~mask
    expected = x[padded] if h.composition == 1 else np.zeros_like(x[padded])
    np.testing.assert_array_equal(y[padded], expected)
    ids = device.buffer("topk_ids", np.int32).reshape(s.tokens, h.top_k)
    assert (ids[padded] == h.num_experts).all() and (ids[mask] < h.num_experts).all()
    assert (device.buffer("topk_weights", np.float32).reshape(s.tokens, h.top_k)[padded] == 0).all()
    if not s.small_batch:
        counts = device.buffer("expert_counts", np.int32)
        assert counts.sum() == mask.sum() * h.top_k, "padded pairs counted in the padded expert order"


def test_padded_tokens_read_no_expert_weights(orin_profile, tmp_path):
    """Access model: one valid token in a 16-token bundle reads the router and its k experts' weights, nothing
    more (weight bytes within 5 % of the selected experts', the bench/kernel_access.py goal)."""
    from colibri_sdk.format import ColibriFile

    hidden, inter, experts, top_k = 64, 48, 8, 2
    path = make_model(tmp_path / "m.colibri", experts=experts, top_k=top_k, hidden=hidden, inter=inter)
    device = EmulatedDevice(make_profile(orin_profile, tokens=16), path)
    x = np.zeros((16, hidden), dtype=np.float32)
    x[0] = np.random.default_rng(3).standard_normal(hidden)
    records = device.run_recorded(x, valid_tokens=[1])
    weight_bytes = 32 * sum(int(stats[0][1]) for _, stats in records)  # class 0 = weights, column 1 = sectors
    with ColibriFile(path) as f:
        logits = x[0].astype(np.float64) @ f.router(0).astype(np.float64)
    chosen = len(set(np.argsort(-logits)[:top_k]))
    selected = 2 * (hidden * experts + chosen * 3 * hidden * inter)
    assert selected <= weight_bytes <= 1.05 * selected, (weight_bytes, selected)


# ---- the access model itself ----------------------------------------------------------------------------------------
ACCESS = r"""
#include "common.cuh"
// 32 lanes, consecutive floats: 128 bytes, 4 sectors
extern "C" __global__ void coalesced(const float* in, float* out) { out[threadIdx.x] = __ldg(in + threadIdx.x); }
// 32 lanes, floats 32 bytes apart: 128 bytes in 32 sectors
extern "C" __global__ void strided(const float* in, float* out) { out[threadIdx.x] = __ldg(in + 8 * threadIdx.x); }
// 32 lanes, one float: 4 bytes, 1 sector
extern "C" __global__ void broadcast(const float* in, float* out) { out[threadIdx.x] = __ldg(in); }
// 32 lanes, 16 bytes each, consecutive: 512 bytes, 16 sectors; lanes >= 16 run a second load (a divergent
// instruction of 16 lanes: 256 bytes, 8 sectors)
extern "C" __global__ void vectors(const float* in, float* out) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(in) + threadIdx.x);
    float s = v.x + v.y + v.z + v.w;
    if (threadIdx.x >= 16) s += __ldg(reinterpret_cast<const float4*>(in) + 64 + threadIdx.x).x;
    out[threadIdx.x] = s;
}
"""


@pytest.mark.parametrize("symbol,expected", [
    ("coalesced", [1, 4, 4, 128]), ("strided", [1, 32, 4, 128]), ("broadcast", [1, 1, 1, 4]),
    ("vectors", [2, 24, 24, 768]),
])
def test_access_model_counts_warp_loads_in_sectors(orin_profile, tmp_path_factory, symbol, expected):
    """(instructions, sectors touched, minimum sectors, bytes) of one warp, in address class 0."""
    folder = tmp_path_factory.mktemp("access")
    (folder / "common.cuh").write_text((catalog.kernel_dir() / "common.cuh").read_text())
    (folder / "access.cu").write_text(ACCESS)
    defines = catalog.compile_defines(make_profile(orin_profile), Header(1, 8, 2, 40, 24, dtype=1))
    lib = EmulationLibrary(build_library(defines, folder, [("access.cu", ("coalesced", "strided", "broadcast",
                                                                          "vectors"))]))
    region = Region(4096 * 4)  # 256-byte aligned, as cuMemAlloc
    region.view(np.float32)[:] = np.arange(4096, dtype=np.float32)
    out = np.zeros(32, dtype=np.float32)
    lib.access_regions([(region.address, region.size, 0)])
    pointers = np.array([region.address, out.ctypes.data], dtype=np.uint64)
    params = np.array([pointers.ctypes.data, pointers.ctypes.data + 8], dtype=np.uint64)
    lib.access_read()
    lib.access_enable(True)
    try:
        lib.launch(lib.function(symbol), (1, 1, 1), (32, 1, 1), params.ctypes.data)
    finally:
        lib.access_enable(False)
    stats = lib.access_read()
    assert stats[0].tolist() == expected
    assert stats[1:].sum() == 0


# ---- tensor-core building blocks (common.cuh mma_m16n8k16, cp_async16) ----------------------------------------------
def test_mma_fragments_and_cp_async_follow_the_documented_layout(orin_profile, tmp_path_factory):
    """tests/kernels/mma_tile.cu builds the fragments as common.cuh documents them (the PTX ISA layout) from tiles
    copied with cp_async16; D = A·B + C equals NumPy's product on fp16 values (exact products, fp32 sums)."""
    folder = tmp_path_factory.mktemp("mma")
    (folder / "common.cuh").write_text((catalog.kernel_dir() / "common.cuh").read_text())
    (folder / "mma_tile.cu").write_text((Path(__file__).parent / "mma_tile.cu").read_text())
    defines = catalog.compile_defines(make_profile(orin_profile), Header(1, 8, 2, 40, 24, dtype=1))
    lib = EmulationLibrary(build_library(defines, folder, [("mma_tile.cu", ("mma_tile",))]))
    rng = np.random.default_rng(30)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    regions = [Region(n) for n in (512, 256, 512, 512)]
    regions[0].view(np.float16)[:] = a.reshape(-1)
    regions[1].view(np.float16)[:] = b.T.reshape(-1)  # column-major B: B[k][n] at n*16 + k
    regions[2].view(np.float32)[:] = c.reshape(-1)
    pointers = np.array([r.address for r in regions], dtype=np.uint64)
    params = np.array([pointers.ctypes.data + 8 * i for i in range(4)], dtype=np.uint64)
    lib.launch(lib.function("mma_tile"), (1, 1, 1), (32, 1, 1), params.ctypes.data)
    d = regions[3].view(np.float32).reshape(16, 8)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, want, rtol=1e-6, atol=1e-5)


def test_cp_async_lands_only_when_its_group_is_waited_for(orin_profile, tmp_path_factory):
    """The emulated cp.async (emu/emu_mma_cp_async.h) writes shared memory at the cp_async_wait that retires
    its group, not at the copy: a kernel reading a stage too early sees the shared-memory poison, as it may on a GPU
    (tests/kernels/mma_tile.cu cp_async_groups: two groups, read before any wait, after wait<1>, after wait<0>)."""
    folder = tmp_path_factory.mktemp("cp_async")
    (folder / "common.cuh").write_text((catalog.kernel_dir() / "common.cuh").read_text())
    (folder / "mma_tile.cu").write_text((Path(__file__).parent / "mma_tile.cu").read_text())
    defines = catalog.compile_defines(make_profile(orin_profile), Header(1, 8, 2, 40, 24, dtype=1))
    lib = EmulationLibrary(build_library(defines, folder, [("mma_tile.cu", ("cp_async_groups",))]))
    src, out = Region(32), Region(6 * 16)
    src.view(np.uint32)[:] = np.arange(1, 9, dtype=np.uint32)
    pointers = np.array([src.address, out.address], dtype=np.uint64)
    params = np.array([pointers.ctypes.data + 8 * i for i in range(2)], dtype=np.uint64)
    lib.launch(lib.function("cp_async_groups"), (1, 1, 1), (32, 1, 1), params.ctypes.data)
    words = out.view(np.uint32).reshape(6, 4)
    poison = 0x7FC0BAD0  # emu/emu_state.h kSharedPoison
    assert (words[0:2] == poison).all()  # nothing landed before a wait
    assert words[2].tolist() == [1, 2, 3, 4] and (words[3] == poison).all()  # wait<1>: the older group only
    assert words[4].tolist() == [1, 2, 3, 4] and words[5].tolist() == [5, 6, 7, 8]  # wait<0>: both
