"""The kernels' global-memory access model, measured on the CPU emulation (no GPU, no timing).

For each warp-level global load of one MoE layer's launch plan (one instruction across the 32 lanes of a warp,
recorded by tests/kernels/emu/cuda_shim.h) the emulator counts the 32-byte sectors it touches and the distinct
bytes its lanes asked for. Per kernel and in total this prints:

    weight sectors ÷ minimum    Σ ceil(bytes / 32) ÷ Σ sectors touched, over the loads from the weights buffer
    act sectors ÷ minimum       the same over the activation buffers (x0, x1, act, pair_out)
    weight bytes ÷ selected     32 × weight sectors touched ÷ the bytes of the weights the valid tokens need:
                                the router plus gate, up and down of every expert they select (the floor of a
                                memory-bound layer); padded tokens select nothing, so they add to the numerator only
    x-bytes                     the same over the expert kernels only (gate/up and down: codes, scales, zero
                                points) ÷ the stored bytes of the selected experts (incl. their scales and zero
                                points): the measure of the int8/int4 storages, whose fp32 router is a larger share
    w-B/instr                   weight bytes per warp-level load instruction (512: 16 bytes in each of 32 lanes)
    launches per layer

Storages: fp16 (v1), and as .colibri v2 with round-to-nearest codes and fp16 scales: int8 per row, int4 group 128,
int4 group 32 (docs/format.md "Matrix storage"). On the tiled path quantized weights run on the tensor-core kernels
of kernels/expert_quant_tc.cu (colibri_gate_up_qtc, colibri_down_qtc), which stream each selected expert's codes,
scales and zero points once per 32 of its pairs; the last line prints their worst x-bytes and weight sector
efficiency.

Shapes (fp16, the shipped h200 profile with `shape.tokens` 16 or 64):
    mixtral/16  the Mixtral-8x7B layer scaled down 16x, ratios kept: hidden 256, intermediate 896, 8 experts, top-2
                (full size, 4096 x 14336, takes minutes per case on the emulation)
    qwen3/4     the Qwen3-30B-A3B layer scaled down 4x: hidden 512, intermediate 192, 128 experts, top-8
    odd         odd sizes: hidden 2050, intermediate 770, 8 experts, top-2 (fp16 rows of 4100 and 1540 bytes, int8 rows
                of 2050 and 770, int4 rows of 1025 and 385: rows start at every offset of a 32-byte sector);
                storages fp16, int8 and int4 g128 only
Cases: 1, 4 and 16 valid tokens in a 16-token bundle, 64 in a 64-token bundle (the GEMV path for the Mixtral shape:
128 pairs <= max_pairs 128), and 64/64m64: the same with small_batch.max_pairs 64 (the tiled path for both shapes);
padded rows are zeros. `--tokens 64` runs the 64-token cases only.
The sector model assumes no cache: a weight sector read by two blocks counts twice (on a GPU L2 may catch it).

    python bench/kernel_access.py            # the table
    python bench/kernel_access.py --json     # one object: the worst case over tokens 1-16 of each ratio
    python bench/kernel_access.py --tokens 64 --storages int8 int4-g128 int4-g32   # the quantized tiled rows
    python bench/kernel_access.py --tokens 64 --max-pairs 64 --shapes mixtral/16 qwen3/4 --storages fp16 int8
                                                # the tiled path of both shapes
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
from colibri_sdk.format import Header, HeaderV2, write_arrays, write_model  # noqa: E402
from colibri_sdk.format.constants import QUANT_INT4, QUANT_INT8  # noqa: E402
from colibri_sdk.profile import Profile, load_profile  # noqa: E402
from colibri_sdk.reference import ReferenceEngine  # noqa: E402
from emulator import EmulatedDevice  # noqa: E402

SHAPES = {
    "mixtral/16": dict(hidden=256, inter=896, experts=8, top_k=2),
    "qwen3/4": dict(hidden=512, inter=192, experts=128, top_k=8),
    "odd": dict(hidden=2050, inter=770, experts=8, top_k=2),
}
ODD_STORAGES = ("fp16", "int8", "int4-g128")  # the odd shape is 8x larger per expert: three storages keep the run short
# (valid tokens, bundle tokens, small_batch.max_pairs: None = the h200 profile's crossover: max_pairs, and
# max_pairs_quantized for int8/int4); 64/64 with max_pairs 64 (every storage) puts the Mixtral shape (128 pairs) on the
# tiled path too
CASES = ((1, 16, None), (4, 16, None), (16, 16, None), (64, 64, None), (64, 64, 64))
WEIGHTS, ACTIVATIONS = 0, 1
INSTR, SECTORS, MIN_SECTORS, BYTES = range(4)


def profile_for(tokens: int, max_pairs: int | None = None) -> dict:
    data = copy.deepcopy(load_profile("h200", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": tokens}
    if max_pairs is not None:
        data["kernels"]["small_batch"]["max_pairs"] = max_pairs
        data["kernels"]["small_batch"].pop("max_pairs_quantized", None)  # the forced value for every storage
    return Profile.from_dict(data, toolchain=False).data


# storage → (quant code, group size); fp16 is a v1 file
STORAGES = {"fp16": None, "int8": (QUANT_INT8, 0), "int4-g128": (QUANT_INT4, 128), "int4-g32": (QUANT_INT4, 32)}
EXPERT_SYMBOLS = ("colibri_gate_up_gemv", "colibri_down_gemv", "colibri_gate_up", "colibri_down",
                  "colibri_gate_up_tc", "colibri_down_tc", "colibri_gate_up_qtc", "colibri_down_qtc")


def make_model(path: Path, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0,
               storage: str = "fp16") -> Path:
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((1, experts, inter, hidden)) / np.sqrt(hidden)
    up = rng.standard_normal((1, experts, inter, hidden)) / np.sqrt(hidden)
    down = rng.standard_normal((1, experts, hidden, inter)) / np.sqrt(inter)
    router = rng.standard_normal((1, hidden, experts)) / np.sqrt(hidden)
    if STORAGES[storage] is None:
        return write_model(path, Header(1, experts, top_k, hidden, inter, dtype=1), gate, up, down, router)
    quant, group = STORAGES[storage]
    header = HeaderV2(1, experts, top_k, hidden, inter, dtype=1, quant=quant, group_size=group)
    return write_arrays(path, header, {"gate_proj": gate, "up_proj": up, "down_proj": down, "router": router})


def selected_bytes(path: Path, x: np.ndarray) -> tuple[int, int]:
    """(router + selected experts, selected experts) stored bytes for the rows of x (float64 reference routing):
    the router block of the layer and, per selected expert, its gate, up and down tensors with their scale and
    zero-point tensors, as the file stores them."""
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    try:
        h = engine.header
        ids, _ = engine.route(0, x.astype(np.float64))
    finally:
        engine.close()
    experts = len(np.unique(ids))
    if isinstance(h, HeaderV2):
        per_expert = sum(b.tensor_bytes for b in h.blocks() if b.tensor in ("gate_proj", "up_proj", "down_proj"))
        router = h.block("router").tensor_bytes
    else:
        per_expert, router = 2 * 3 * h.hidden_size * h.intermediate_size, 2 * h.hidden_size * h.num_experts
    return router + experts * per_expert, experts * per_expert


def measure(path: Path, valid: int, tokens: int, max_pairs: int | None = None) -> dict:
    device = EmulatedDevice(profile_for(tokens, max_pairs), path)
    hidden = device.header.hidden_size
    x = np.zeros((tokens, hidden), dtype=np.float32)
    x[:valid] = np.random.default_rng(valid).standard_normal((valid, hidden))
    device.poison()
    records = device.run_recorded(x, valid_tokens=[valid])
    per_symbol: dict[str, np.ndarray] = {}
    for launch, stats in records:
        per_symbol[launch["symbol"]] = per_symbol.get(launch["symbol"], 0) + stats.astype(np.int64)
    selected, experts_selected = selected_bytes(path, x[:valid])
    return {
        "symbols": per_symbol,
        "total": sum(per_symbol.values()),
        "experts": sum(v for k, v in per_symbol.items() if k in EXPERT_SYMBOLS),
        "selected": selected,
        "experts_selected": experts_selected,
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
    parser.add_argument("--json-out", type=Path, metavar="FILE",
                        help="also write the --json object to FILE (with the table on stdout: one run, both outputs)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--storages", nargs="*", default=list(STORAGES), choices=list(STORAGES))
    parser.add_argument("--tokens", nargs="*", type=int, default=[c[0] for c in CASES],
                        choices=[c[0] for c in CASES], help="valid tokens of the cases to run")
    parser.add_argument("--max-pairs", type=int, choices=[c[2] for c in CASES if c[2] is not None],
                        help="only the cases with this small_batch.max_pairs (64: the 64/64m64 rows, the tiled path "
                             "for every shape)")
    args = parser.parse_args(argv)
    worst = {"weight_sector_efficiency": 1.0, "activation_sector_efficiency": 1.0, "weight_bytes_ratio": 0.0,
             "expert_bytes_ratio": 0.0}
    tiled_quant = {"weight_sector_efficiency": 1.0, "expert_bytes_ratio": 0.0}  # int8/int4 on the tiled path
    cases = []
    printed = 0  # lines of the table printed so far
    lines = [f"{'shape':<11} {'storage':<9} {'tokens':>8} {'path':<5} {'kernel':<22} {'w-sect':>7} {'a-sect':>7} "
             f"{'w-bytes':>8} {'x-bytes':>8} {'w-B/instr':>9} {'launch/layer':>12}"]
    with tempfile.TemporaryDirectory() as tmp:
        for shape, dims in SHAPES.items():
            if shape not in args.shapes:
                continue
            for storage in args.storages:
                if shape == "odd" and storage not in ODD_STORAGES:
                    continue
                path = make_model(Path(tmp) / f"{shape.replace('/', '-')}-{storage}.colibri", **dims, storage=storage)
                for valid, tokens, max_pairs in CASES:
                    if valid not in args.tokens or (args.max_pairs is not None and max_pairs != args.max_pairs):
                        continue
                    m = measure(path, valid, tokens, max_pairs)
                    label = f"{valid}/{tokens}" + ("" if max_pairs is None else f"m{max_pairs}")
                    head = f"{shape:<11} {storage:<9}"
                    for symbol, stats in m["symbols"].items():
                        w, a, b, bi = row_values(stats, m["selected"])
                        x = ratio(32 * stats[WEIGHTS][SECTORS], m["experts_selected"]) if symbol in EXPERT_SYMBOLS \
                            else None
                        lines.append(f"{head} {label:>8} {m['path']:<5} {symbol:<22} {fmt(w):>7} {fmt(a):>7} "
                                     f"{fmt(b):>8} {fmt(x):>8} {fmt1(bi):>9}")
                    w, a, b, bi = row_values(m["total"], m["selected"])
                    x = ratio(32 * m["experts"][WEIGHTS][SECTORS], m["experts_selected"])
                    lines.append(f"{head} {label:>8} {m['path']:<5} {'TOTAL':<22} {fmt(w):>7} {fmt(a):>7} "
                                 f"{fmt(b):>8} {fmt(x):>8} {fmt1(bi):>9} {m['launches']:>12}")
                    cases.append({"shape": shape, "storage": storage, "valid_tokens": valid, "bundle_tokens": tokens,
                                  "max_pairs": max_pairs, "path": m["path"], "weight_sector_efficiency": w,
                                  "activation_sector_efficiency": a,
                                  "weight_bytes_ratio": b, "expert_bytes_ratio": x,
                                  "launches_per_layer": m["launches"]})
                    if not args.json:  # as each case ends: a long run shows its rows before it finishes
                        print("\n".join(lines[printed:]), flush=True)
                        printed = len(lines)
                    if STORAGES[storage] is not None and m["path"] == "tiled":
                        tiled_quant["weight_sector_efficiency"] = min(tiled_quant["weight_sector_efficiency"], w)
                        tiled_quant["expert_bytes_ratio"] = max(tiled_quant["expert_bytes_ratio"], x)
                    if valid <= 16:
                        worst["weight_sector_efficiency"] = min(worst["weight_sector_efficiency"], w)
                        worst["activation_sector_efficiency"] = min(worst["activation_sector_efficiency"], a)
                        worst["weight_bytes_ratio"] = max(worst["weight_bytes_ratio"], b)
                        worst["expert_bytes_ratio"] = max(worst["expert_bytes_ratio"], x)
    result = json.dumps({**worst, "tiled_quantized": tiled_quant, "cases": cases}, indent=1)
    if args.json_out is not None:
        args.json_out.write_text(result + "\n")
    if args.json:
        print(result)
    else:
        if any(c["valid_tokens"] <= 16 for c in cases):
            print("worst over tokens 1-16: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
        if any(c["path"] == "tiled" and STORAGES[c["storage"]] is not None for c in cases):
            print("worst int8/int4 on the tiled (tensor-core) path: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in tiled_quant.items()))
        print("goals: weight sector efficiency >= 0.95, activation >= 0.80, weight bytes / selected <= 1.05 (fp16), "
              "expert weight bytes / selected experts' stored bytes <= 1.05 (every storage)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
