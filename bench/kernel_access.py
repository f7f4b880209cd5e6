"""The kernels' global-memory access model, measured on the CPU emulation (no GPU, no timing).

For each warp-level global load of one MoE layer's launch plan (one instruction across the 32 lanes of a warp,
recorded by tests/kernels/emu/cuda_shim.h) the emulator counts the 32-byte sectors it touches and the distinct
bytes its lanes asked for. Per kernel and in total this prints:

    weight sectors ÷ minimum    Σ ceil(bytes / 32) ÷ Σ sectors touched, over the loads from the weights buffer
    act sectors ÷ minimum       the same over the activation buffers (x0, x1, act, pair_out)
    weight bytes ÷ selected     32 × weight sectors touched ÷ the bytes of the weights the valid tokens need:
                                the router plus gate, up and down of every expert they select (the floor of a
                                memory-bound layer); padded tokens select nothing, so they add to the numerator only
    w-B/instr                   weight bytes per warp-level load instruction (512: 16 bytes in each of 32 lanes)
    launches per layer

Shapes (fp16, the shipped h200 profile with `shape.tokens` 16 or 64):
    mixtral/16  the Mixtral-8x7B layer scaled down 16x, ratios kept: hidden 256, intermediate 896, 8 experts, top-2
                (full size, 4096 x 14336, takes minutes per case on the emulation)
    qwen3/4     the Qwen3-30B-A3B layer scaled down 4x: hidden 512, intermediate 192, 128 experts, top-8
Cases: 1, 4 and 16 valid tokens in a 16-token bundle, 64 in a 64-token bundle; padded rows are zeros.
The sector model assumes no cache: a weight sector read by two blocks counts twice (on a GPU L2 may catch it).

    python bench/kernel_access.py            # the table
    python bench/kernel_access.py --json     # one object: the worst case over tokens 1-16 of each ratio
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

from colibri_sdk import catalog  # noqa: E402
from colibri_sdk.format import Header, write_model  # noqa: E402
from colibri_sdk.profile import Profile, load_profile  # noqa: E402
from colibri_sdk.reference import ReferenceEngine  # noqa: E402
from emulator import EmulatedDevice  # noqa: E402

SHAPES = {
    "mixtral/16": dict(hidden=256, inter=896, experts=8, top_k=2),
    "qwen3/4": dict(hidden=512, inter=192, experts=128, top_k=8),
}
CASES = ((1, 16), (4, 16), (16, 16), (64, 64))  # (valid tokens, bundle tokens)
WEIGHTS, ACTIVATIONS = 0, 1
INSTR, SECTORS, MIN_SECTORS, BYTES = range(4)


def profile_for(tokens: int) -> dict:
    data = copy.deepcopy(load_profile("h200", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": tokens}
    return Profile.from_dict(data, toolchain=False).data


def make_model(path: Path, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    header = Header(1, experts, top_k, hidden, inter, dtype=1)
    gate = rng.standard_normal((1, experts, inter, hidden)) / np.sqrt(hidden)
    up = rng.standard_normal((1, experts, inter, hidden)) / np.sqrt(hidden)
    down = rng.standard_normal((1, experts, hidden, inter)) / np.sqrt(inter)
    router = rng.standard_normal((1, hidden, experts)) / np.sqrt(hidden)
    return write_model(path, header, gate, up, down, router)


def selected_bytes(path: Path, x: np.ndarray) -> int:
    """Bytes of the router and of the experts the rows of x select (float64 reference routing), fp16."""
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    try:
        h = engine.header
        ids, _ = engine.route(0, x.astype(np.float64))
    finally:
        engine.close()
    experts = len(np.unique(ids))
    return 2 * (h.hidden_size * h.num_experts + experts * 3 * h.hidden_size * h.intermediate_size)


def measure(path: Path, valid: int, tokens: int) -> dict:
    device = EmulatedDevice(profile_for(tokens), path)
    hidden = device.header.hidden_size
    x = np.zeros((tokens, hidden), dtype=np.float32)
    x[:valid] = np.random.default_rng(valid).standard_normal((valid, hidden))
    device.poison()
    records = device.run_recorded(x, valid_tokens=[valid])
    per_symbol: dict[str, np.ndarray] = {}
    for launch, stats in records:
        per_symbol[launch["symbol"]] = per_symbol.get(launch["symbol"], 0) + stats.astype(np.int64)
    return {
        "symbols": per_symbol,
        "total": sum(per_symbol.values()),
        "selected": selected_bytes(path, x[:valid]),
        "launches": len(records) // device.header.num_layers,
        "path": "gemv" if device.sizes.small_batch else "tiled",
    }


def ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def row_values(stats: np.ndarray, selected: int) -> tuple:
    w, a = stats[WEIGHTS], stats[ACTIVATIONS]
    return (ratio(w[MIN_SECTORS], w[SECTORS]), ratio(a[MIN_SECTORS], a[SECTORS]),
            ratio(32 * w[SECTORS], selected), ratio(w[BYTES], w[INSTR]))


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def fmt1(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (worst case over tokens 1-16)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    worst = {"weight_sector_efficiency": 1.0, "activation_sector_efficiency": 1.0, "weight_bytes_ratio": 0.0}
    cases = []
    lines = [f"{'shape':<11} {'tokens':>9} {'path':<5} {'kernel':<22} {'w-sect':>7} {'a-sect':>7} {'w-bytes':>8} "
             f"{'w-B/instr':>9} {'launch/layer':>12}"]
    with tempfile.TemporaryDirectory() as tmp:
        for shape, dims in SHAPES.items():
            if shape not in args.shapes:
                continue
            path = make_model(Path(tmp) / f"{shape.replace('/', '-')}.colibri", **dims)
            for valid, tokens in CASES:
                m = measure(path, valid, tokens)
                label = f"{valid}/{tokens}"
                for symbol, stats in m["symbols"].items():
                    w, a, b, bi = row_values(stats, m["selected"])
                    lines.append(f"{shape:<11} {label:>9} {m['path']:<5} {symbol:<22} {fmt(w):>7} {fmt(a):>7} "
                                 f"{fmt(b):>8} {fmt1(bi):>9}")
                w, a, b, bi = row_values(m["total"], m["selected"])
                lines.append(f"{shape:<11} {label:>9} {m['path']:<5} {'TOTAL':<22} {fmt(w):>7} {fmt(a):>7} "
                             f"{fmt(b):>8} {fmt1(bi):>9} {m['launches']:>12}")
                cases.append({"shape": shape, "valid_tokens": valid, "bundle_tokens": tokens, "path": m["path"],
                              "weight_sector_efficiency": w, "activation_sector_efficiency": a,
                              "weight_bytes_ratio": b, "launches_per_layer": m["launches"]})
                if valid <= 16:
                    worst["weight_sector_efficiency"] = min(worst["weight_sector_efficiency"], w)
                    worst["activation_sector_efficiency"] = min(worst["activation_sector_efficiency"], a)
                    worst["weight_bytes_ratio"] = max(worst["weight_bytes_ratio"], b)
    if args.json:
        print(json.dumps({**worst, "cases": cases}, indent=1))
    else:
        print("\n".join(lines))
        print("worst over tokens 1-16: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
        print("goals: weight sector efficiency >= 0.95, activation >= 0.80, weight bytes / selected <= 1.05")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
