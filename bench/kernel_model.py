"""An ESTIMATE of each kernel's and each MoE layer's time on every shipped profile's device, from the CPU emulation's
access model (no GPU, no timing): docs/kernels.md "Time model (an estimate)".

The emulation (tests/kernels/emulator.py ModelDevice) runs one layer of a Mixtral-8x7B-shaped model, scaled down
(SCALED: each weight row keeps whole chunks of the GEMV, so every lane's access pattern is that of the full shape),
and records per kernel: DRAM sectors of the global loads, shared-memory wavefronts per warp request against the
ideal, the active lanes of each request and the global bytes in flight per warp. Counts are then scaled linearly to
the full shape (hidden 4096, intermediate 14336, 8 experts, top-2): by the ratio of weight elements.
Per kernel and device the estimate is the largest of

    DRAM        bytes (32 x sectors touched) / bandwidth
    shared      wavefronts / (active SMs x 1 wavefront per clock x clock)
    issue       warp instructions (memory requests + FMA and dequantization, counted from the shape) /
                (active SMs x 4 schedulers x clock)
    latency     the loads in rounds of the bytes in flight per SM (Little's law); a round costs the DRAM latency plus
                the compute (shared, issue) the other resident blocks cannot hide

with the DRAM time and the latency time taken as the larger (compute is inside the latency term), plus a launch
boundary per kernel, plus the kernel's prologue (below); the layer is the sum of its kernels. The floor is the
selected experts' stored bytes / bandwidth; `est_floor_fraction` = floor / estimated layer time. Resident blocks per SM come from ptxas'
resource report of the kernels compiled for each profile (NVRTC; `--no-nvrtc`: threads and shared memory only).

The prologue (counted from the sources and the launch's arguments, not emulated): the dependent steps a block takes
before its first weight load, or, for colibri_routing, after its selection, that nothing else overlaps:

    prologue    global rounds x DRAM latency + on-chip steps x ONCHIP_STEP_CYCLES / clock

an expert kernel's blocks start together, so it is counted once per launch (later blocks' prologues overlap the
loads of the blocks resident beside them). `prologue_counts` lists them: the tiles read their expert (1 round);
the GEMV kernels copy the pair order colibri_routing built (1 round, one barrier and their share of the copy) or,
without a `pair_order` argument (before that order existed), built it per block (the valid-token count and
topk_ids: 2 rounds for gate/up, 1 for down; 4 barriers, the count, the scan and the rank loop); colibri_routing with
a `pair_order` argument builds it in its last block (3 barriers, the count, the scan, each expert's thread walking
the pairs; with more than one token group also the second counter and topk_ids through L2: 2 rounds, 2 barriers).

`est_fixed_cost_us` = the part of the layer's estimate that does not scale with the expert weights: the estimates of
colibri_routing (its launch boundary and order build included; colibri_capacity and colibri_align where the plan has
them) plus, per expert kernel, its launch boundary and its prologue.

    python bench/kernel_model.py                 # the table (an estimate)
    python bench/kernel_model.py --json          # one object
    python bench/kernel_model.py --quick         # orin and h200, fewer cases
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "bench"))

from colibri_sdk import catalog  # noqa: E402
from colibri_sdk.format import Header, HeaderV2  # noqa: E402
from colibri_sdk.format.constants import QUANT_INT4, QUANT_INT8  # noqa: E402
from colibri_sdk.profile import Profile, load_profile  # noqa: E402
from emulator import SITE_KINDS, ModelDevice  # noqa: E402
from kernel_access import make_model, selected_bytes  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
from model_estimate import resident_blocks  # noqa: E402

FULL = dict(hidden=4096, inter=14336, experts=8, top_k=2)  # Mixtral-8x7B, one layer
SCALED = dict(hidden=512, inter=1536, experts=8, top_k=2)  # whole 512-column chunks in both reductions
# int4 chunks are 1024 columns (32 lanes x 32 codes): its scaled shape keeps whole ones in both reductions, so that
# every lane of the hot loops has a vector as at the full shape (hidden 512 left half the lanes of gate/up idle,
# intermediate 1536 half of down's in its second chunk); 3072 rows are also a grid the 24 sampled blocks divide
SCALED_INT4 = dict(hidden=1024, inter=3072, experts=8, top_k=2)
QUICK = dict(hidden=512, inter=1024, experts=8, top_k=2)
STORAGES = {"fp16": None, "int8": (QUANT_INT8, 0), "int4_g128": (QUANT_INT4, 128)}
KIT_STORAGE = {"fp16": "fp16", "int8": "int8", "int4_g128": "int4-g128"}  # kernel_access.make_model names
TOKENS = (1, 16, 64)

# Device constants (public specs; docs/kernels.md "Time model" cites each). bandwidth and SMs from the profile.
#   clock_ghz: the boost clock; latency_ns: a loaded DRAM latency (microbenchmarks put idle latency at ~400-600 ns;
#   under a streaming load it grows: 700 ns is the model's choice); launch_us: a kernel boundary inside a CUDA Graph.
DEVICES = {
    "orin": dict(profile="orin", clock_ghz=1.3, latency_ns=700.0, launch_us=3.0),
    "a100": dict(profile="a100", clock_ghz=1.41, latency_ns=700.0, launch_us=2.0),
    "rtx4090": dict(profile="rtx4090", clock_ghz=2.52, latency_ns=700.0, launch_us=2.0),
    "h200": dict(profile="h200", clock_ghz=1.98, latency_ns=700.0, launch_us=2.0),
}
SCHEDULERS = 4  # warp schedulers per SM, one instruction per clock each
# Warp instructions per weight element besides the FMAs (per element, once per block that streams it): fp16
# unpack (1 conversion), int8 (byte extract, convert, scale), int4 (shift/mask, offset, convert, scale).
DEQUANT_INSTR = {"fp16": 1.0, "int8": 3.0, "int4_g128": 4.0}
TC_SYMBOLS = ("colibri_gate_up_tc", "colibri_down_tc", "colibri_gate_up_qtc", "colibri_down_qtc")
SAMPLE_BLOCKS = 24  # blocks emulated per expert-kernel launch (every k-th, k coprime to grid.x; counts scaled by k)
HOT_SHARE = 0.5  # a site is part of a hot loop when it has at least half the requests of its kernel's busiest site
# One dependent on-chip step of a prologue (a shared-memory access, a warp shuffle, a barrier): clocks. Shared-memory
# load latency is about 20-33 clocks on Volta to Hopper (Jia et al. 2018; Luo et al. 2024); shuffles and barriers
# are taken at the same cost (a model choice).
ONCHIP_STEP_CYCLES = 30
# Kernels whose whole estimate is fixed cost (they read no expert weight).
ORDER_SYMBOLS = ("colibri_routing", "colibri_capacity", "colibri_align")


PATHS = ("profile", "gemv", "tc")  # the shipped profile's max_pairs, or the GEMV / tensor-core tile path forced


def profile_path(device: str, tokens: int, storage: str) -> str:
    """"gemv" or "tc": the path the shipped profile's crossover takes for `tokens` valid tokens: the pairs of the
    smallest shape that holds them (profile_for: the path is fixed per compiled shape; FULL's top-k pairs per token)
    against max_pairs, or max_pairs_quantized for int8/int4 where the profile sets it. Orin's one token runs in its
    16-token shape."""
    data = profile_for(device, tokens)
    small_batch = data["kernels"]["small_batch"]
    limit = small_batch.get("max_pairs_quantized", small_batch["max_pairs"]) if STORAGES[storage] else \
        small_batch["max_pairs"]
    return "gemv" if data["shape"]["batch"] * data["shape"]["tokens"] * FULL["top_k"] <= limit else "tc"


def profile_for(device: str, tokens: int, route: str = "profile") -> dict:
    """The device's shipped profile with the smallest (batch, tokens) shape that holds `tokens` (batch 1 first);
    route "gemv" / "tc" sets kernels.small_batch.max_pairs so that the layer takes that path (the crossover study),
    "profile" keeps the shipped value."""
    data = copy.deepcopy(load_profile(DEVICES[device]["profile"], toolchain=False).data)
    if route not in PATHS:
        raise SystemExit(f"path {route!r}: expected one of {', '.join(PATHS)}")
    shape = data["shape"]
    batches = shape["batch"] if isinstance(shape["batch"], list) else [shape["batch"]]
    lengths = shape["tokens"] if isinstance(shape["tokens"], list) else [shape["tokens"]]
    fits = sorted((b * t, b, t) for b in batches for t in lengths if b * t >= tokens)
    if not fits:
        raise SystemExit(f"{device}: no profile shape holds {tokens} tokens (batch {batches}, tokens {lengths})")
    _, b, t = fits[0]
    data["shape"] = {"batch": b, "tokens": t}
    if route != "profile":  # one forced value for every storage
        data["kernels"]["small_batch"].pop("max_pairs_quantized", None)
    if route == "gemv":
        data["kernels"]["small_batch"]["max_pairs"] = max(data["kernels"]["small_batch"]["max_pairs"],
                                                          b * t * FULL["top_k"])
    elif route == "tc":
        data["kernels"]["small_batch"]["max_pairs"] = 1
    return Profile.from_dict(data, toolchain=False).data


def header_for(dims: dict, storage: str):
    spec = STORAGES[storage]
    if spec is None:
        return Header(1, dims["experts"], dims["top_k"], dims["hidden"], dims["inter"], dtype=1)
    return HeaderV2(1, dims["experts"], dims["top_k"], dims["hidden"], dims["inter"], dtype=1, quant=spec[0],
                    group_size=spec[1])


def expert_bytes(dims: dict, storage: str) -> int:
    """Stored bytes of one expert (gate, up, down with scales and zero points)."""
    h = header_for(dims, storage)
    if isinstance(h, HeaderV2):
        return sum(b.tensor_bytes for b in h.blocks() if b.tensor in ("gate_proj", "up_proj", "down_proj"))
    return 2 * 3 * h.hidden_size * h.intermediate_size


def resources(device: str, tokens: int, storage: str, use_nvrtc: bool, route: str = "profile") -> dict:
    """{symbol: {"registers", "shared_bytes"}} from ptxas for the full shape, or {} without NVRTC."""
    if not use_nvrtc:
        return {}
    from colibri_sdk.aot.cache import NvrtcCache
    from colibri_sdk.aot.kernels import compile_catalog

    profile = Profile.from_dict(profile_for(device, tokens, route), toolchain=False)
    out = {}
    for k in compile_catalog(profile, header_for(FULL, storage), workers=1, cache=NvrtcCache()):
        out.update(k.resources)
    return out


_EMULATED: dict = {}  # (path, compile defines, launch plan): emulate()'s result; profiles that compile alike share it


def emulate(path: Path, profile: dict, valid: int) -> tuple[list[dict], int, int]:
    """(per-launch records of ModelDevice.run_modelled, selected bytes, selected experts' bytes) for `valid`
    random tokens; one emulation per distinct compiled layer (a100, rtx4090 and h200 compile alike)."""
    from colibri_sdk.format import ColibriFile

    with ColibriFile(path) as f:
        header = f.header
    key = (str(path), valid, json.dumps(catalog.compile_defines(profile, header), sort_keys=True),
           json.dumps(catalog.launch_plan(profile, header), sort_keys=True, default=str))
    if key not in _EMULATED:
        _EMULATED[key] = _emulate(path, profile, valid)
    return _EMULATED[key]


def _emulate(path: Path, profile: dict, valid: int) -> tuple[list[dict], int, int]:
    device = ModelDevice(profile, path)
    tokens = device.sizes.tokens
    hidden = device.header.hidden_size
    x = np.zeros((tokens, hidden), dtype=np.float32)
    x[:valid] = np.random.default_rng(valid).standard_normal((valid, hidden))
    batch, seq = profile["shape"]["batch"], profile["shape"]["tokens"]
    counts = [min(max(valid - b * seq, 0), seq) for b in range(batch)]
    device.poison()
    expert_kernels = tuple(spec.name for spec in catalog.KERNELS if spec.name not in ("routing", "capacity"))
    records = device.run_modelled(x, valid_tokens=counts, sample_blocks=SAMPLE_BLOCKS, sampled=expert_kernels)
    for r in records:
        r["site_names"] = [device.lib.site_name(int(s[0])) for s in r["sites"]]
    selected, experts_selected = selected_bytes(path, x[:valid])
    return records, selected, experts_selected


def kernel_counts(record: dict) -> dict:
    """Totals of one launch: DRAM sectors, shared requests/wavefronts/ideal, hot-site lane fractions, in flight."""
    loads, sites, flight = record["loads"].astype(np.int64), record["sites"].astype(np.int64), record["in_flight"]
    sectors = int(loads[:3, 1].sum())  # registered buffers (weights, activations, other scratch)
    shared = sites[sites[:, 1] <= 1] if len(sites) else sites
    out = {"sectors": sectors, "weight_sectors": int(loads[0, 1]), "requests": int(sites[:, 2].sum()) if len(sites) else 0,
           "smem_requests": int(shared[:, 2].sum()) if len(shared) else 0,
           "smem_wavefronts": int(shared[:, 3].sum()) if len(shared) else 0,
           "smem_ideal": int(shared[:, 4].sum()) if len(shared) else 0, "sites": []}
    busiest = int(sites[:, 2].max()) if len(sites) else 0
    for row, name in zip(sites, record["site_names"]):
        hot = busiest and row[2] >= HOT_SHARE * busiest
        out["sites"].append({"site": name, "kind": SITE_KINDS[int(row[1])], "requests": int(row[2]),
                             "wavefronts": int(row[3]), "ideal": int(row[4]), "lanes": int(row[5]) / 32 / max(int(row[2]), 1),
                             "hot": bool(hot)})
    b, bsq = int(flight[1]) + int(flight[4]), int(flight[2]) + int(flight[5])
    out["lane_bytes_in_flight"] = bsq / b if b else 0.0  # the outstanding bytes a loaded byte waits with (per lane)
    loads_sites = sites[sites[:, 1] == 2] if len(sites) else sites
    requests = int(loads_sites[:, 2].sum()) if len(loads_sites) else 0
    out["load_lane_fraction"] = int(loads_sites[:, 5].sum()) / (32 * requests) if requests else 1.0
    return out


def _rank_steps(pairs: int, threads: int) -> int:
    """Shared reads of the slowest thread of the order build's rank loop (thread i takes pairs i, i + threads, ...;
    pair p reads the p pairs before it)."""
    return max((sum(range(t, pairs, threads)) for t in range(min(pairs, threads))), default=0)


def _build_steps(pairs: int, experts: int, threads: int, barriers: int, walk: bool = True) -> int:
    """On-chip steps of one block building the pair order: the barriers, the ids' stores and the count's atomics
    (ceil(pairs / threads) each), the warp scan over the experts (EPL reads, 5 shuffle rounds, EPL stores), then
    walk (common.cuh build_pair_order): each expert's thread reads all pairs, ceil(experts / threads) times; else
    the rank loop of the per-block build before it (its slowest thread); the last store."""
    epl = -(-experts // 32)
    place = pairs * -(-experts // threads) if walk else _rank_steps(pairs, threads)
    return barriers + 2 * -(-pairs // threads) + 2 * epl + 5 + place + 1


def prologue_counts(launch: dict, pairs: int, experts: int, groups: int) -> tuple[int, int]:
    """(global rounds, on-chip steps) of a launch's prologue (module docstring), from its symbol and arguments at the
    full shape: `pairs` tokens x top-k of the compiled shape, `groups` colibri_routing's token groups."""
    symbol, threads = launch["symbol"], int(np.prod(launch["block"]))
    names = {a.get("name") for a in launch["args"] if a["kind"] == "buffer"}
    if symbol == "colibri_routing":
        if catalog.PAIR_ORDER not in names:
            return 0, 0
        rounds, barriers = (2, 5) if groups > 1 else (0, 3)
        return rounds, _build_steps(pairs, experts, threads, barriers)
    if symbol in ORDER_SYMBOLS:
        return 0, 0  # counted in their estimate as a whole
    if symbol in ("colibri_gate_up_gemv", "colibri_down_gemv"):
        if catalog.PAIR_ORDER in names:  # the copy of the order: one coalesced loop, one barrier
            return 1, 1 + -(-catalog.pair_order_ints(experts, pairs) // threads)
        rounds = 2 if symbol == "colibri_gate_up_gemv" else 1  # the per-block build: valid_tokens, topk_ids
        return rounds, _build_steps(pairs, experts, threads, 4, walk=False)
    if symbol in ("colibri_shared_gate_up", "colibri_shared_down"):
        return 1, 2  # the valid-token list: one round, a barrier
    return 1, 0  # the tiles: their expert (block_experts or expert_offsets)


def estimate(dev: dict, dram_bytes: float, wavefronts: float, instr: float, blocks: int, resident: int,
             flight_warp: float, warps: int, prologue: tuple[int, int] = (0, 0)) -> dict:
    """Microseconds of each limit of one kernel and the estimate: max(DRAM, latency) plus the launch boundary.

    dram: bytes / bandwidth. shared: wavefronts / (active SMs x clock). issue: warp instructions / (active SMs x 4 x
    clock). latency: the loads of an SM come in rounds of `bytes in flight per SM` (Little's law); each round costs
    the DRAM latency plus the compute of the round that the other resident blocks cannot hide
    (max(latency + compute / blocks, compute)), since a warp computes on a batch only after it has arrived and
    loads the next one after (the emulation's batches). prologue: (global rounds, on-chip steps) before the loads
    (prologue_counts). An estimate: no caches, no clock changes, no tail effects.
    """
    sms = dev["sms"]
    active = max(min(sms, blocks), 1)
    clock = dev["clock_ghz"] * 1e9
    latency = dev["latency_ns"] * 1e-9
    t_dram = dram_bytes / (dev["bandwidth_gbs"] * 1e9)
    t_smem = wavefronts / (active * clock)
    t_issue = instr / (active * SCHEDULERS * clock)
    t_compute = max(t_smem, t_issue)
    per_sm_blocks = max(min(resident, -(-blocks // sms)), 1)
    flight_sm = flight_warp * warps * per_sm_blocks
    if flight_sm > 0 and dram_bytes > 0:
        rounds = dram_bytes / active / flight_sm
        c_round = t_compute / rounds
        t_latency = rounds * max(latency + c_round / per_sm_blocks, c_round)
    else:
        t_latency = t_compute
    t_prologue = prologue[0] * latency + prologue[1] * ONCHIP_STEP_CYCLES / clock
    limits = {"dram": t_dram, "shared": t_smem, "issue": t_issue, "latency": t_latency, "prologue": t_prologue}
    bound = "dram" if t_dram >= t_latency else ("latency" if t_latency > t_compute * 1.0001 else
                                                 ("shared" if t_smem >= t_issue else "issue"))
    return {**{f"t_{k}_us": v * 1e6 for k, v in limits.items()}, "bound": bound,
            "bytes_in_flight_sm": flight_sm, "resident_blocks": resident,
            "prologue_rounds": prologue[0], "prologue_steps": prologue[1],
            "time_us": max(t_dram, t_latency) * 1e6 + t_prologue * 1e6 + dev["launch_us"]}


def fma_instr(symbol: str, storage: str, pairs_per_expert: dict, dims: dict) -> float:
    """Warp instructions of the arithmetic of one expert kernel at the full shape (not emulated: counted)."""
    h, i = FULL["hidden"], FULL["inter"]
    mats = 2 if "gate_up" in symbol else 1
    elements = mats * h * i
    used = len(pairs_per_expert)
    pairs = sum(pairs_per_expert.values())
    if symbol in TC_SYMBOLS:  # mma.m16n8k16: 4096 FMAs, tiles of 16 rows (padded)
        tiles = sum(-(-p // 16) * 16 for p in pairs_per_expert.values())
        return elements * tiles / 4096 + elements * used * DEQUANT_INSTR[storage] / 32 / 4
    return (elements * pairs + elements * used * DEQUANT_INSTR[storage]) / 32


def run_case(device: str, storage: str, valid: int, dims: dict, tmp: Path, use_nvrtc: bool,
             route: str = "profile") -> dict:
    """One layer's estimate on `device`; route: PATHS ("profile": the shipped max_pairs, "gemv"/"tc": forced)."""
    profile = profile_for(device, valid, route)
    path = tmp / f"{storage}-{dims['hidden']}x{dims['inter']}.colibri"
    if not path.exists():
        make_model(path, **dims, storage=KIT_STORAGE[storage])
    records, selected, experts_selected = emulate(path, profile, valid)
    scale = FULL["hidden"] * FULL["inter"] / (dims["hidden"] * dims["inter"])
    dev = dict(DEVICES[device])
    hw = profile["hardware"]
    dev.update(sms=hw["sm_count"], bandwidth_gbs=hw["memory_bandwidth_gbs"])
    res = resources(device, valid, storage, use_nvrtc, route)
    full_header = header_for(FULL, storage)
    full_plan = {(l["symbol"]): l for l in catalog.launch_plan(profile, full_header)}
    full_pairs = catalog.sizes(profile, full_header).pairs
    groups = catalog.router_grid(profile, full_header).groups
    floor_s = experts_selected / expert_bytes(dims, storage) * expert_bytes(FULL, storage) / (dev["bandwidth_gbs"] * 1e9)
    experts_used = round(experts_selected / expert_bytes(dims, storage))
    pairs_per_expert = {e: valid * FULL["top_k"] / experts_used for e in range(experts_used)}
    kernels = []
    for r in records:
        launch = r["launch"]
        symbol = launch["symbol"]
        c = kernel_counts(r)
        expert = symbol not in ("colibri_routing", "colibri_align")
        s = (scale if expert else FULL["hidden"] / dims["hidden"]) * r["block_scale"]  # routing: the router
        full = full_plan.get(symbol, launch)
        blocks = int(np.prod(full["grid"]))
        threads = int(np.prod(full["block"]))
        ptxas = res.get(symbol) or {}
        resident = resident_blocks(profile["target"]["arch"], threads, ptxas.get("registers"),
                                   ptxas.get("shared_bytes"), hw["shared_memory_per_sm"])
        instr = c["requests"] * s + (fma_instr(symbol, storage, pairs_per_expert, dims) if expert else 0.0)
        # DRAM: the weights' sectors (streamed once); activations and scratch are small and stay in L2
        est = estimate(dev, 32.0 * c["weight_sectors"] * s, c["smem_wavefronts"] * s, instr, blocks, resident,
                       32 * c["load_lane_fraction"] * c["lane_bytes_in_flight"], threads // 32,
                       prologue_counts(full, full_pairs, FULL["experts"], groups))
        kernels.append({"symbol": symbol, "blocks": blocks, "threads": threads,
                        "registers": ptxas.get("registers"), "shared_bytes": ptxas.get("shared_bytes"),
                        "smem_wavefront_ratio": c["smem_wavefronts"] / c["smem_ideal"] if c["smem_ideal"] else None,
                        "sites": c["sites"], **est})
    layer_us = sum(k["time_us"] for k in kernels)
    taken = "tc" if any(k["symbol"] in TC_SYMBOLS for k in kernels) else "gemv"
    return {"device": device, "storage": storage, "tokens": valid, "path": taken,
            "profile_path": profile_path(device, valid, storage), "kernels": kernels, "est_layer_us": layer_us,
            "est_fixed_cost_us": fixed_cost_us(kernels, dev["launch_us"]),
            "floor_us": floor_s * 1e6, "est_floor_fraction": floor_s * 1e6 / layer_us, "scale": scale}


def fixed_cost_us(kernels: list[dict], launch_us: float) -> float:
    """The part of a layer's estimate that does not scale with the expert weights (module docstring): the order
    kernels' whole estimates (colibri_routing, colibri_capacity, colibri_align), the other kernels' launch boundary
    and prologue."""
    return sum(k["time_us"] if k["symbol"] in ORDER_SYMBOLS else launch_us + k["t_prologue_us"] for k in kernels)


def add_prologue(case: dict) -> dict:
    """A case of a run from before the prologue was counted (no `est_fixed_cost_us`), with it: each kernel's prologue
    from the current launch plan of the case's profile and path, added to its estimate, and the layer's figures
    redone. Right where the kernels the case ran have not changed since that run (--merge)."""
    if "est_fixed_cost_us" in case:
        return case
    route = "profile" if case["path"] == case["profile_path"] else case["path"]
    profile = profile_for(case["device"], case["tokens"], route)
    header = header_for(FULL, case["storage"])
    plan = {l["symbol"]: l for l in catalog.launch_plan(profile, header)}
    pairs, groups = catalog.sizes(profile, header).pairs, catalog.router_grid(profile, header).groups
    dev = DEVICES[case["device"]]
    for k in case["kernels"]:
        rounds, steps = prologue_counts(plan[k["symbol"]], pairs, FULL["experts"], groups)
        t = rounds * dev["latency_ns"] * 1e-3 + steps * ONCHIP_STEP_CYCLES / (dev["clock_ghz"] * 1e3)
        k.update(t_prologue_us=t, prologue_rounds=rounds, prologue_steps=steps, time_us=k["time_us"] + t)
    case["est_layer_us"] = sum(k["time_us"] for k in case["kernels"])
    case["est_floor_fraction"] = case["floor_us"] / case["est_layer_us"]
    case["est_fixed_cost_us"] = fixed_cost_us(case["kernels"], dev["launch_us"])
    case["prologue_added_at_merge"] = True
    return case


def hot_summary(cases: list[dict]) -> dict:
    """Worst shared-memory site ratio and lowest active-lane fraction over the hot sites of every kernel."""
    worst = {"ratio": 0.0, "site": None}
    lanes = {"fraction": 1.01, "site": None}
    weighted = [0.0, 0.0]
    for case in cases:
        for k in case["kernels"]:
            for s in k["sites"]:
                if not s["hot"]:
                    continue
                weighted[0] += s["lanes"] * s["requests"]
                weighted[1] += s["requests"]
                if s["kind"] != "global load" and s["ideal"]:
                    r = s["wavefronts"] / s["ideal"]
                    if r > worst["ratio"]:
                        worst = {"ratio": r, "site": f"{k['symbol']} {s['site']} ({case['storage']}, T={case['tokens']})"}
                if s["lanes"] < lanes["fraction"] - 1e-9:
                    lanes = {"fraction": s["lanes"],
                             "site": f"{k['symbol']} {s['site']} ({case['storage']}, T={case['tokens']})"}
    lanes["fraction"] = min(lanes["fraction"], 1.0)
    return {"worst": worst, "lanes": lanes, "lanes_weighted": weighted[0] / weighted[1] if weighted[1] else None}


def summary(cases: list[dict], dims: dict, sites: str = "all") -> dict:
    """The --json object of `cases` (every value an estimate); sites "hot": each kernel's access sites of its hot
    loops only (what the hot-loop figures read; a --merge of such a file gives the same summary)."""
    shipped = [c for c in cases if c.get("path", "gemv") == c.get("profile_path", c.get("path", "gemv"))]
    hot = hot_summary(shipped)
    fraction: dict = {}
    fixed: dict = {}
    by_path: dict = {}
    for c in cases:
        if c in shipped:
            fraction.setdefault(c["device"], {}).setdefault(c["storage"], {})[str(c["tokens"])] = \
                c["est_floor_fraction"]
            fixed.setdefault(c["device"], {}).setdefault(c["storage"], {})[str(c["tokens"])] = c["est_fixed_cost_us"]
        by_path.setdefault(c["device"], {}).setdefault(c["storage"], {}).setdefault(str(c["tokens"]), {})[
            c.get("path", "gemv")] = c["est_floor_fraction"]
    layer = {(c["device"], c["storage"], c["tokens"]): c["est_layer_us"] for c in shipped}
    ratio = layer.get(("orin", "int4_g128", 1), 0) / layer[("orin", "fp16", 1)] \
        if ("orin", "fp16", 1) in layer and ("orin", "int4_g128", 1) in layer else None
    result = {
        "note": "an ESTIMATE from the CPU emulation's access model (bench/kernel_model.py, docs/kernels.md), not a "
                "measurement",
        "shape": {"full": FULL, "emulated": dims, "counts_scaled_by": FULL["hidden"] * FULL["inter"] /
                  (dims["hidden"] * dims["inter"]),
                  **({"emulated_int4": SCALED_INT4} if dims is SCALED else {})},
        "smem_wavefront_ratio_worst": hot["worst"]["ratio"], "smem_worst_site": hot["worst"]["site"],
        "active_lane_fraction_min": hot["lanes"]["fraction"], "active_lane_min_site": hot["lanes"]["site"],
        "active_lane_fraction_weighted": hot["lanes_weighted"],
        "est_floor_fraction": fraction, "est_int4_over_fp16_time": ratio,
        "est_fixed_cost_us": fixed,
        "note_fixed_cost": "est_fixed_cost_us: the part of the layer estimate that does not scale with the expert "
                           "weights: colibri_routing's estimate (launch boundary and order build included), and per "
                           "expert kernel its launch boundary and prologue (counted, not emulated; docs/kernels.md)",
        "est_floor_fraction_by_path": by_path,  # the GEMV and the tensor-core tile path at the same shape
        "note_paths": "est_floor_fraction and the hot-loop figures: the path each shipped profile's max_pairs takes; "
                      "est_floor_fraction_by_path: both paths where --paths ran both",
        "cases": [{**c, "kernels": [{**k, "sites": [s for s in k["sites"] if sites == "all" or s["hot"]]}
                                     for k in c["kernels"]]} for c in cases],
    }
    return result


def print_case(case: dict) -> None:
    """The text lines of one case: the layer, then each kernel's limits (every figure an estimate)."""
    print(f"{case['device']:<8} {case['storage']:<10} T={case['tokens']:<3} {case['path']:<4} est layer "
          f"{case['est_layer_us']:9.1f} us  floor {case['floor_us']:8.1f} us  est fraction of floor "
          f"{case['est_floor_fraction']:.3f}  est fixed cost {case['est_fixed_cost_us']:6.1f} us", flush=True)
    for k in case["kernels"]:
        ratio = k["smem_wavefront_ratio"]
        print(f"    {k['symbol']:<22} est {k['time_us']:8.1f} us ({k['bound']:<9}) dram {k['t_dram_us']:8.1f} shared "
              f"{k['t_shared_us']:8.1f} issue {k['t_issue_us']:8.1f} latency {k['t_latency_us']:8.1f} prologue "
              f"{k['t_prologue_us']:5.2f}  wavefronts/ideal {'-' if ratio is None else f'{ratio:.2f}'}  blocks/SM "
              f"{k['resident_blocks']} regs {k['registers']} smem {k['shared_bytes']} in flight/SM "
              f"{k['bytes_in_flight_sm'] / 1024:.1f} KiB", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", type=Path, metavar="FILE", help="also write the JSON object to FILE")
    parser.add_argument("--quick", action="store_true", help="orin and h200 only, a smaller scaled shape")
    parser.add_argument("--devices", nargs="*", choices=list(DEVICES))
    parser.add_argument("--storages", nargs="*", default=list(STORAGES), choices=list(STORAGES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS), choices=list(TOKENS))
    parser.add_argument("--paths", nargs="*", default=["profile"], choices=list(PATHS),
                        help="profile: the shipped max_pairs; gemv / tc: that path forced (the crossover study; "
                             "at T=1 only the GEMV path is run)")
    parser.add_argument("--no-nvrtc", action="store_true", help="resident blocks from threads only (no ptxas)")
    parser.add_argument("--merge", nargs="*", type=Path, metavar="JSON",
                        help="no emulation: the summary of the cases of these --json-out files (runs split by storage; "
                             "a case of a later file replaces the same case of an earlier one)")
    parser.add_argument("--sites", choices=("all", "hot"), default="all",
                        help="access sites in the JSON's cases: all, or the hot loops' only (bench/results)")
    args = parser.parse_args(argv)
    devices = args.devices or (["orin", "h200"] if args.quick else list(DEVICES))
    dims = QUICK if args.quick else SCALED
    cases = []
    if args.merge:
        merged: dict = {}  # a case of a later file replaces the same (device, storage, tokens, path) of an earlier one
        for f in args.merge:
            for c in json.loads(f.read_text())["cases"]:
                c.setdefault("path", "tc" if any(k["symbol"] in TC_SYMBOLS for k in c["kernels"]) else "gemv")
                merged[(c["device"], c["storage"], c["tokens"], c["path"])] = c
        cases = list(merged.values())
        for c in cases:  # the profiles' max_pairs as they are now (a profile may have changed since the run)
            c.setdefault("path", "tc" if any(k["symbol"] in TC_SYMBOLS for k in c["kernels"]) else "gemv")
            c["profile_path"] = profile_path(c["device"], c["tokens"], c["storage"])
            add_prologue(c)
        devices, args.storages, args.tokens = [], [], []  # nothing to emulate
        if not args.json:
            for c in cases:
                print_case(c)
    if args.quick and not args.json:
        print("--quick: a smaller scaled shape than the committed results (bench/results/kernel_model.txt): its "
              "estimates differ from theirs; run without --quick for those", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for storage in args.storages:
            for t in args.tokens:
                for device, route in [(d, p) for d in devices for p in args.paths]:
                    if t == 1 and route == "tc" and "gemv" in args.paths:
                        continue
                    shape = SCALED_INT4 if storage.startswith("int4") and dims is SCALED else dims
                    case = run_case(device, storage, t, shape, Path(tmp), not args.no_nvrtc, route)
                    if any((c["device"], c["storage"], c["tokens"], c["path"]) ==
                           (device, storage, t, case["path"]) for c in cases):
                        continue  # "profile" took the same path as a forced one
                    cases.append(case)
                    if args.json_out is not None:  # after every case: a run cut short keeps what it measured
                        args.json_out.write_text(json.dumps(summary(cases, dims, args.sites), indent=1) + "\n")
                    if not args.json:
                        print_case(case)
    result = summary(cases, dims, args.sites)
    hot = hot_summary(cases)
    ratio = result["est_int4_over_fp16_time"]
    text = json.dumps(result, indent=1)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"hot loops: worst shared wavefronts / ideal {hot['worst']['ratio']:.2f} at {hot['worst']['site']}; "
              f"lowest active-lane fraction {hot['lanes']['fraction']:.3f} at {hot['lanes']['site']}")
        if ratio is not None:
            print(f"estimated int4 g128 / fp16 layer time, orin, T=1: {ratio:.2f}")
        print("all times are estimates of a model (docs/kernels.md \"Time model\"), not measurements")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
