"""The access model's shared-memory wavefronts, active lanes, bytes in flight and the shim's alignment and cp.async
landing checks (emu/smem_model.h, emu/cuda_shim.h) on small kernels with hand-computed answers
(tests/kernels/model_kernels/smem_patterns.cu), conflicted and misaligned variants included."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from emulator import (SITE_KINDS, EmulationError, EmulationLibrary, ModelLibrary, Region, build_library,
                      build_model_library)

PATTERNS = Path(__file__).parent / "model_kernels"
SYMBOLS = ("smem_conflict_free", "smem_two_way", "smem_sixteen_way", "smem_broadcast", "smem_vec128",
           "smem_vec128_two_way", "smem_half_warp", "ldg_misaligned", "cp_async_misaligned", "cp_async_war",
           "cp_async_war_fixed")
UNITS = [("smem_patterns.cu", SYMBOLS)]


@pytest.fixture(scope="module")
def model_lib():
    return ModelLibrary(build_model_library({}, source_dir=PATTERNS, units=UNITS))


@pytest.fixture(scope="module")
def plain_lib():
    return EmulationLibrary(build_library({}, source_dir=PATTERNS, units=UNITS))


class Io:
    def __init__(self):
        self.inp, self.out = Region(4096), Region(4096)
        self.inp.view(np.float32)[:] = np.arange(1024, dtype=np.float32)


def launch(lib, io, symbol, schedule="increasing", seed=0, record=True):
    a, b = ctypes.c_void_p(io.inp.address), ctypes.c_void_p(io.out.address)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    lib.set_schedule(schedule, seed)
    lib.access_enable(record)
    try:
        lib.launch(lib.function(symbol), (1, 1, 1), (32, 1, 1), ctypes.addressof(params))
    finally:
        lib.access_enable(False)
    return io.out.view(np.float32)[:32].copy()


def shared_loads(lib, io, symbol):
    """{source line: (requests, wavefronts, ideal, mean active lanes)} of the kernel's shared loads."""
    launch(lib, io, symbol)
    sites, _ = lib.model_read()
    out = {}
    for row in sites:
        if SITE_KINDS[int(row[1])] == "shared load":
            out[lib.site_name(int(row[0]))] = (int(row[2]), int(row[3]), int(row[4]), int(row[5]) / int(row[2]))
    return out


# (kernel, wavefronts of its one shared load request, ideal, active lanes): by hand from 32 banks of 4 bytes,
# 64-bit accesses per half-warp, 128-bit per quarter-warp.
CASES = [
    ("smem_conflict_free", 1, 1, 32),  # 32 consecutive words, one per bank
    ("smem_two_way", 2, 1, 32),  # words 2l: banks 0, 2, .., 30 twice each
    ("smem_sixteen_way", 16, 1, 32),  # words 16l: banks 0 and 16, 16 distinct words each
    ("smem_broadcast", 1, 1, 32),  # one word for every lane
    ("smem_vec128", 4, 4, 32),  # 512 bytes: 4 quarter-warp phases of 128 bytes
    ("smem_vec128_two_way", 8, 4, 32),  # a phase's 8 lanes 32 bytes apart: 2 words per bank
    ("smem_half_warp", 1, 1, 16),
]


@pytest.mark.parametrize("symbol,wavefronts,ideal,lanes", CASES)
def test_wavefronts_by_hand(model_lib, symbol, wavefronts, ideal, lanes):
    loads = shared_loads(model_lib, Io(), symbol)
    assert len(loads) == 1, loads
    assert list(loads.values())[0] == (1, wavefronts, ideal, lanes)


def test_ordinary_library_records_no_shared_access(plain_lib):
    io = Io()
    launch(plain_lib, io, "smem_two_way")
    assert np.array_equal(io.out.view(np.float32)[:32], 2 * np.arange(32) % 32)
    assert not bool(plain_lib._lib.coli_emu_model_shared())


def test_misaligned_16_byte_ldg_fails(plain_lib):
    with pytest.raises(EmulationError, match=r"ldg_misaligned: .*16-byte __ldg at 0x[0-9a-f]+ is not 16-byte aligned"):
        launch(plain_lib, Io(), "ldg_misaligned", record=False)


def test_misaligned_cp_async_fails(plain_lib):
    with pytest.raises(EmulationError, match=r"cp.async 16-byte copy: shared destination at .* not 16-byte aligned"):
        launch(plain_lib, Io(), "cp_async_misaligned", record=False)


def test_random_landing_exposes_a_missing_barrier(plain_lib):
    io = Io()
    expected = (np.arange(32) + 1) % 32 * 4.0  # slot (l + 1).x before any refill
    racy = [not np.array_equal(launch(plain_lib, io, "cp_async_war", "random", seed, False), expected)
            for seed in range(8)]
    fixed = [np.array_equal(launch(plain_lib, io, "cp_async_war_fixed", "random", seed, False), expected)
             for seed in range(8)]
    assert any(racy) and all(fixed)
    # landing at the wait only (the ordered schedules) hides the race
    assert np.array_equal(launch(plain_lib, io, "cp_async_war", "increasing", 0, False), expected)


def test_in_flight_batches_of_cp_async(model_lib):
    launch(model_lib, Io(), "cp_async_war_fixed")
    _, flight = model_lib.model_read()
    # 32 threads, one 16-byte copy each in flight at its wait
    assert list(flight[3:]) == [32, 32 * 16, 32 * 16 * 16]


def worst_ratio(loads: dict) -> float:
    return max(wf / ideal for _, wf, ideal, _ in loads.values())


@pytest.mark.parametrize("symbol,passes", [("smem_conflict_free", True), ("smem_vec128", True),
                                           ("smem_broadcast", True), ("smem_two_way", False),
                                           ("smem_sixteen_way", False), ("smem_vec128_two_way", False)])
def test_goal_check_fails_on_conflicted_variants(model_lib, symbol, passes):
    """The goal bench/kernel_model.py checks (wavefronts / ideal <= 1.10 on hot loops) holds for the conflict-free
    kernels and fails for the conflicted variants of the same access."""
    assert (worst_ratio(shared_loads(model_lib, Io(), symbol)) <= 1.10) is passes


def test_time_estimate_limits_by_hand():
    """bench/kernel_model.py estimate(): 10 SMs, 100 GB/s, 1 GHz, 1 us latency, no launch cost, 1 MB of loads."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kernel_model import estimate

    dev = dict(sms=10, bandwidth_gbs=100.0, clock_ghz=1.0, latency_ns=1000.0, launch_us=0.0)
    # 8 warps x 4 KiB in flight per SM: 1e5 bytes per SM take 3.05 rounds of 1 us, under the 10 us of DRAM time
    e = estimate(dev, 1e6, 0, 0, blocks=10, resident=1, flight_warp=4096, warps=8)
    assert (e["bound"], e["time_us"]) == ("dram", pytest.approx(10.0))
    # 64 bytes per warp: 512 per SM, 195.3 rounds of 1 us
    e = estimate(dev, 1e6, 0, 0, blocks=10, resident=1, flight_warp=64, warps=8)
    assert (e["bound"], e["time_us"]) == ("latency", pytest.approx(1e5 / 512))
    # 1e6 wavefronts on 10 SMs: 100 us of shared memory, one block per SM cannot hide the latency of its 3.05 rounds
    rounds = 1e5 / 32768
    e = estimate(dev, 1e6, 1e6, 0, blocks=10, resident=1, flight_warp=4096, warps=8)
    assert (e["bound"], e["time_us"]) == ("latency", pytest.approx(rounds * (1.0 + 100.0 / rounds)))
    assert e["t_shared_us"] == pytest.approx(100.0)


def test_prologue_and_fixed_cost_by_hand(orin_profile):
    """bench/kernel_model.py prologue_counts() and fixed_cost_us(): the GEMV kernels copy the pair order colibri_routing
    builds (1 round, 1 barrier + their share of the copy); a plan whose GEMV kernels take topk_ids built it per
    block (the rank loop of the slowest thread: pairs - 1 reads); the tiles read their expert."""
    import copy
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kernel_model import estimate, fixed_cost_us, prologue_counts
    from kernel_support import make_header

    from colibri_sdk import catalog

    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 1, "tokens": 16}
    profile["kernels"]["small_batch"]["max_pairs"] = 32
    profile["kernels"]["small_batch"]["threads"] = 256
    header = make_header(hidden=256, inter=512, experts=8, top_k=2)
    plan = {l["symbol"]: l for l in catalog.launch_plan(profile, header)}
    copy_steps = 1 + -(-(1 + 3 * 8 + 32) // 256)
    assert prologue_counts(plan["colibri_gate_up_gemv"], 32, 8, 1) == (1, copy_steps)
    assert prologue_counts(plan["colibri_down_gemv"], 32, 8, 1) == (1, copy_steps)
    build = 3 + 2 + 2 + 5 + 32 + 1  # barriers, ids and count, scan (EPL 1), an expert's walk over the pairs, the store
    assert prologue_counts(plan["colibri_routing"], 32, 8, 1) == (0, build)
    assert prologue_counts(plan["colibri_routing"], 32, 8, 2) == (2, build + 2)  # the second counter, topk_ids
    old = copy.deepcopy(plan["colibri_gate_up_gemv"])  # the arguments before the pair order: topk_ids in its place
    old["args"][4] = {"kind": "buffer", "name": "topk_ids"}
    assert prologue_counts(old, 32, 8, 1) == (2, build + 1 - 32 + 31)  # 4 barriers; the rank loop: 31 reads
    profile["kernels"]["small_batch"]["max_pairs"] = 1  # the tiles
    tiles = catalog.launch_plan(profile, header)
    assert [prologue_counts(l, 32, 8, 1) for l in tiles] == [(0, 0), (1, 0), (1, 0)]
    # 1 round of 1 us and 1000 steps of 30 clocks at 1 GHz: 31 us on top of the 10 us of DRAM, plus the launch
    dev = dict(sms=10, bandwidth_gbs=100.0, clock_ghz=1.0, latency_ns=1000.0, launch_us=2.0)
    e = estimate(dev, 1e6, 0, 0, blocks=10, resident=1, flight_warp=4096, warps=8, prologue=(1, 1000))
    assert (e["t_prologue_us"], e["time_us"]) == (pytest.approx(31.0), pytest.approx(43.0))
    kernels = [{"symbol": "colibri_routing", "time_us": 5.0, "t_prologue_us": 1.0},
               {"symbol": "colibri_gate_up_gemv", "time_us": 100.0, "t_prologue_us": 0.5}]
    assert fixed_cost_us(kernels, 2.0) == pytest.approx(7.5)


def test_routing_reduction_is_conflict_free(tmp_path):
    """colibri_routing's reduction of the row groups' sums (kernels/routing.cu, part[] padded per token) reads each
    warp's lanes from 32 different banks at the shipped Orin profile (128 threads, 8 experts, fp32 router: the
    vector path; fp16 router: the scalar path): every shared-memory site within 1.10x the ideal wavefronts (4.0x
    before the pad)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kernel_access import make_model
    from kernel_model import emulate, kernel_counts, profile_for

    for storage in ("int8", "fp16"):
        path = make_model(tmp_path / f"{storage}.colibri", hidden=512, inter=512, experts=8, top_k=2, storage=storage)
        records, _, _ = emulate(path, profile_for("orin", 16), 16)
        routing = [r for r in records if r["launch"]["symbol"] == "colibri_routing"]
        sites = [s for s in kernel_counts(routing[0])["sites"] if s["kind"] != "global load" and s["ideal"]]
        worst = max(sites, key=lambda s: s["wavefronts"] / s["ideal"])
        assert worst["wavefronts"] <= 1.10 * worst["ideal"], (storage, worst)


def test_down_gemv_hot_loops_use_every_lane(tmp_path):
    """colibri_down_gemv at one token (one pass per expert) keeps the running output values in lanes: no hot site of
    the chunk loop runs on one lane (the per-chunk y update by lane 0 had 1/32 active lanes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kernel_access import make_model
    from kernel_model import emulate, kernel_counts, profile_for

    path = make_model(tmp_path / "int8.colibri", hidden=512, inter=1024, experts=8, top_k=2, storage="int8")
    records, _, _ = emulate(path, profile_for("orin", 1, "gemv"), 1)  # int8 at orin's 16-token shape: the tiles
    down = [r for r in records if r["launch"]["symbol"] == "colibri_down_gemv"]
    hot = [s for s in kernel_counts(down[0])["sites"] if s["hot"]]
    assert hot and min(s["lanes"] for s in hot) >= 0.95, [s for s in hot if s["lanes"] < 0.95]
