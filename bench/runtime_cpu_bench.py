"""CPU backend benchmark, measured side by side in one run: one MoE layer against transformers' block and a NumPy
copy, `Runtime.infer` against the backend's own call, the BLAS thread rule, and load time and memory.

MoE layer ("moe"): shape A (hidden 1024, intermediate 2816, 8 experts, top-2; Mixtral's block) and shape B (hidden
2048, intermediate 768, 128 experts, top-8; Qwen3-MoE's block with norm_topk_prob), one layer each. fp32: the
transformers block at random initialisation and the .colibri file written from its weights (outputs compared);
fp16 / int8 per row / int4 g128: files of random codes and scales of the same shape. Per point (shape, storage,
tokens 1/4/16/64, threads 1 and 2) the fastest call of interleaved rounds (the machine is shared: each round runs
every point once, in alternating order): `CpuBackend.run_layers` (threads: BLAS threads through threadpoolctl; the
compiled kernels run on the calling thread), torch (torch.set_num_threads), and at T=1 a NumPy copy of as many bytes
as the selected experts store, from a pool of the layer's size (the same cache footprint). Ratios: torch time ÷
colibri time (> 1: colibri faster); effective bandwidth = the selected experts' stored bytes ÷ time, ÷ the copy's.
Goals (issue 24): >= 1.5x torch at T=1, >= 1.2x at 4/16/64 (fp32); bandwidth >= 0.8x the copy's for every storage.
A llama.cpp peer (llama-cpp-python + gguf) is reported where importable, else skipped with the reason.

Overhead ("overhead"): `Runtime.infer` vs `CpuBackend.run_layers` at T=1 on shape A fp32 (goal <= 1.1x).

Latency: one bundle per fixed shape (batch 1 x tokens T, built with `colibri-sdk build` from profiles/orin.yaml with
`shape.tokens` replaced), each timed at its own shape; next to it (default threads, T <= 64), the tokens-64 bundle
fed T tokens (padded to 64 internally). Each in a child process: once with no thread variable set ("default": the
backend chooses its BLAS threads itself, colibri_sdk.blas), and once per explicit BLAS thread count
(OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = 1 .. the CPU count, which the backend respects), in rounds of alternating
order; each point keeps its fastest round. "best" is the fastest of the explicit counts; the goal is default within
1.2x of best at every T. Also printed: the CPU time per call, which other load on the machine inflates less.

Load: the demo bundle (25 MB of weights) and a large one (one Mixtral-like layer of ~1 GB, hidden 4096, 8 experts,
top-2), each loaded in a fresh child process: load time without and with checksums (`verify`), resident set after
loading and after the first call, and the peak. The weights are mmap'ed and read only when a call touches them, so
load time and RSS after load should not depend on the weights' size.

    python bench/runtime_cpu_bench.py --json           # writes bench/results/runtime_cpu_bench.txt and .json
    python bench/runtime_cpu_bench.py --sections moe,overhead --moe-rounds 5
    python bench/runtime_cpu_bench.py --iters 50 --large-gb 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ORIN = ROOT / "profiles" / "orin.yaml"
TOKENS = (1, 4, 16, 64, 256, 1024)
PADDED_TOKENS = 64
RESULTS = ROOT / "bench" / "results" / "runtime_cpu_bench.txt"

LATENCY_CHILD = """
import json, sys, time
import numpy as np
from colibri_sdk.runtime import Runtime
bundles, padded_bundle, iters = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
BUDGET_S = 3.0  # per point: stop after this many seconds of timed calls (at least 3 calls)

def timed(rt, x):
    for _ in range(2):
        rt.infer(x)
    times = []
    cpu = time.process_time()
    while len(times) < iters and (len(times) < 3 or sum(times) < BUDGET_S):
        start = time.perf_counter()
        rt.infer(x)
        times.append(time.perf_counter() - start)
    cpu_ms = (time.process_time() - cpu) * 1e3 / len(times)  # CPU time of all the process's threads, per call
    ms = np.asarray(times) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "calls": len(times),
            "cpu_ms": cpu_ms}

rng = np.random.default_rng(0)
out = {}
with Runtime.load(padded_bundle, backend="cpu", verify=False) as padded:
    for tokens, path in bundles.items():
        x = rng.standard_normal((1, int(tokens), padded.hidden_size)).astype(np.float32)
        with Runtime.load(path, backend="cpu", verify=False) as rt:
            own = timed(rt, x)
        with_padding = sys.argv[4] == "1" and int(tokens) <= padded.shape[1]
        out[tokens] = {"own": own, "padded": timed(padded, x) if with_padding else None}
print(json.dumps(out))
"""

LOAD_CHILD = """
import json, sys, time
import numpy as np
from colibri_sdk.runtime import Runtime

def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

def rss_mb():
    return status_mb("VmRSS")

path, verify = sys.argv[1], sys.argv[2] == "1"
base = rss_mb()
start = time.perf_counter()
rt = Runtime.load(path, backend="cpu", verify=verify)
load_s = time.perf_counter() - start
after_load = rss_mb()
b, t = rt.shape
x = np.random.default_rng(0).standard_normal((b, t, rt.hidden_size)).astype(np.float32)
start = time.perf_counter()
rt.infer(x)
first_s = time.perf_counter() - start
after_call = rss_mb()
rt.close()
peak = status_mb("VmHWM")  # this process's high-water mark (ru_maxrss would include the forking parent's)
print(json.dumps({"load_ms": load_s * 1e3, "first_ms": first_s * 1e3, "base_mb": base, "load_mb": after_load,
                  "call_mb": after_call, "peak_mb": peak}))
"""


def build(out: Path, profile: Path, weights: Path | None = None) -> Path:
    """`colibri-sdk build` in this process, its printout swallowed."""
    from colibri_sdk.cli import main

    model = ["--weights", str(weights)] if weights else ["--demo"]
    args = ["build", "--profile", str(profile), "-o", str(out), *model]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    if code != 0:
        raise SystemExit(f"colibri-sdk {' '.join(args)} failed with exit code {code}")
    return out


def profile_with_shape(folder: Path, batch: int, tokens: int) -> Path:
    text = ORIN.read_text()
    text = re.sub(r"(?m)^  batch: \d+", f"  batch: {batch}", text)
    text = re.sub(r"(?m)^  tokens: \d+", f"  tokens: {tokens}", text)
    path = folder / f"orin-{batch}x{tokens}.yaml"
    path.write_text(text)
    return path


def write_large_model(path: Path, gb: float) -> int:
    """One Mixtral-like fp16 layer (hidden 4096, 8 experts, top-2) of about `gb` x 10^9 bytes; returns its bytes."""
    from colibri_sdk.format import ColibriWriter, Header

    hidden, experts = 4096, 8
    inter = max(64, int(gb * 1e9 / (3 * experts * hidden * 2)) // 64 * 64)
    header = Header(num_layers=1, num_experts=experts, top_k=2, hidden_size=hidden, intermediate_size=inter, dtype=1)
    rng = np.random.default_rng(1)
    noise = (rng.standard_normal(hidden * inter + 7, dtype=np.float32) * 0.02).astype(np.float16)
    with ColibriWriter(path, header) as w:
        for k, (kind, layer, expert) in enumerate(w.pending()):
            rows, cols = header.shape(kind)
            w.write(kind, layer, expert, np.roll(noise, 13 * k)[: rows * cols].reshape(rows, cols))
    return header.data_size


BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


def child(code: str, args: list[str], env: dict | None = None, replace_env: bool = False) -> dict:
    environment = dict(env or {}) if replace_env else {**os.environ, **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(code: str, args: list[str], repeats: int) -> dict:
    """Run a child `repeats` times; the run with the median load time."""
    runs = sorted((child(code, args) for _ in range(repeats)), key=lambda r: r["load_ms"])
    return runs[len(runs) // 2]



# ---- one MoE layer: colibri vs transformers vs a NumPy copy ------------------------------------------------------
SHAPES = {"A": (1024, 2816, 8, 2), "B": (2048, 768, 128, 8)}  # hidden, intermediate, experts, top-k
STORAGES = {"fp32": (0, 0, 0), "fp16": (0, 0, 1), "int8": (1, 0, 1), "int4 g128": (2, 128, 1)}  # quant, group, dtype
MOE_TOKENS = (1, 4, 16, 64)
POOL_BYTES = 1 << 30  # the copy's source: the storage's layer size, at most 1 GiB (L3 here: 480 MiB)
MOE_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[4])
import runtime_cpu_bench as bench
print(json.dumps(bench.moe_child(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
"""
SEED = 0


def torch_block(shape: str):
    """The transformers block of `shape` with N(0, 1/fan_in) weights from SEED (the same in every process)."""
    import torch
    import transformers

    H, I, E, k = SHAPES[shape]
    torch.manual_seed(SEED)
    if shape == "A":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                            num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=8,
                                            num_key_value_heads=8)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                             num_experts_per_tok=k, norm_topk_prob=True, num_hidden_layers=1,
                                             num_attention_heads=8, num_key_value_heads=8)
    block = Block(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
    return block


def moe_header(shape: str, quant: int, group: int, dtype: int):
    from colibri_sdk.format import HeaderV2

    H, I, E, k = SHAPES[shape]
    # A: Mixtral (softmax over the k selected logits); B: Qwen3-MoE (softmax over all, top-k, renormalised).
    routing = dict(routing=0) if shape == "A" else dict(routing=1, norm_topk=1)
    return HeaderV2(num_layers=1, num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, dtype=dtype,
                    composition=0, quant=quant, group_size=group, **routing)


def write_moe_files(folder: Path, shape: str) -> dict[str, Path]:
    """One .colibri file per storage: fp32 and fp16 from the torch block's weights, int8 / int4 random codes."""
    from colibri_sdk.format.quant import QuantizedTensor
    from colibri_sdk.format.writer import ColibriWriter, write_arrays

    block = torch_block(shape)
    H, I, E, k = SHAPES[shape]
    gate_up = block.experts.gate_up_proj.detach().numpy()  # (E, 2I, H), gate rows first
    arrays = {"gate_proj": gate_up[None, :, :I], "up_proj": gate_up[None, :, I:],
              "down_proj": block.experts.down_proj.detach().numpy()[None],
              "router": block.gate.weight.detach().numpy().T[None].copy()}
    paths = {}
    for name, (quant, group, dtype) in STORAGES.items():
        path = paths[name] = folder / f"{shape}-{name.replace(' ', '-')}.colibri"
        header = moe_header(shape, quant, group, dtype)
        if quant == 0:
            write_arrays(path, header, arrays)
            continue
        rng = np.random.default_rng(1)
        lo, hi = (-128, 127) if quant == 1 else (-8, 7)
        with ColibriWriter(path, header) as w:
            for kind, layer, expert in w.pending():
                if kind == "router":
                    w.write(kind, layer, expert, arrays["router"][0])
                    continue
                rows, cols = header.shape(kind)
                codes = rng.integers(lo, hi + 1, (rows, cols), dtype=np.int8)
                groups = 1 if group == 0 else -(-cols // group)
                scale = 3.0 / (np.sqrt(cols) * hi)  # values of about the fp32 weights' size
                scales = (rng.random((rows, groups), dtype=np.float32) * scale + scale / 2).astype(np.float16)
                w.write(kind, layer, expert, QuantizedTensor(codes, scales, None, cols, group, quant))
    del block, gate_up, arrays
    return paths


class _Weights:
    """The part of colibri_sdk.bundle.Bundle that CpuBackend uses, for a bare .colibri file."""

    def __init__(self, path: Path, tokens: int):
        self.path, self.shape, self.manifest = path, (1, tokens), {}

    def open_weights(self):
        from colibri_sdk.format import ColibriFile

        return ColibriFile(self.path)


def _fastest(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def moe_child(paths: dict, rounds: int, calls: int) -> dict:
    """In a process whose BLAS and torch thread counts are set: every (shape, storage, tokens) point, interleaved
    rounds, the fastest call of each; ms, and the selected experts' stored bytes at T=1."""
    import torch

    from colibri_sdk.format import ColibriFile
    from colibri_sdk.runtime.cpu_backend import CpuBackend

    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(2)
    points, results, runners = [], {}, {}
    tokens_of = paths.pop("_tokens")
    for shape, files in paths.items():
        H, I, E, k = SHAPES[shape]
        block = torch_block(shape)
        tokens = tokens_of[shape]
        inputs = {t: [rng.standard_normal((1, t, H)).astype(np.float32) for _ in range(8)] for t in tokens}
        for name, path in files.items():
            backends = {t: CpuBackend(_Weights(Path(path), t)) for t in tokens}
            runners[(shape, name)] = (backends, inputs, block if name == "fp32" else None,
                                      min(os.path.getsize(path), POOL_BYTES))
            for t in tokens:
                points.append((shape, name, t))
        runners[(shape, "copy")] = np.ones(min(os.path.getsize(files["fp32"]), POOL_BYTES), np.uint8)
    diffs = {}
    for shape in paths:  # the fp32 file against the torch block it was written from
        backends, inputs, block, _ = runners[(shape, "fp32")]
        x = inputs[1][0]
        out = np.empty_like(x)
        backends[1].run_layers(x, out, 0, 1)
        with torch.no_grad():
            want = block(torch.from_numpy(x)).numpy()
        diffs[shape] = float(np.abs(out - want).max() / np.abs(want).max())
    for r in range(rounds):
        for shape, name, t in (points if r % 2 == 0 else points[::-1]):
            backends, inputs, block, footprint = runners[(shape, name)]
            backend, out = backends[t], np.empty((1, t, SHAPES[shape][0]), np.float32)
            i = [0]

            def ours():
                i[0] += 1
                backend.run_layers(inputs[t][i[0] % 8], out, 0, 1)

            key = f"{shape}|{name}|{t}"
            entry = results.setdefault(key, {"colibri_ms": float("inf")})
            entry["colibri_ms"] = min(entry["colibri_ms"], _fastest(ours, calls) * 1e3)
            if t == 1:
                selected = int(np.count_nonzero(np.diff(backend._engine.starts)))
                stored = _expert_bytes(backend._engine) * selected
                entry["selected_bytes"] = stored
                pool = runners[(shape, "copy")][:footprint]  # the storage's layer size: the same cache footprint
                dst = np.empty(stored, np.uint8)
                j = [0]

                def copy():
                    j[0] = (j[0] + stored) % max(1, pool.size - stored)
                    np.copyto(dst, pool[j[0]: j[0] + stored])

                entry["copy_ms"] = min(entry.get("copy_ms", float("inf")), _fastest(copy, calls) * 1e3)
            if block is not None:
                m = [0]

                def theirs():
                    m[0] += 1
                    with torch.no_grad():
                        block(torch.from_numpy(inputs[t][m[0] % 8]))

                entry["torch_ms"] = min(entry.get("torch_ms", float("inf")), _fastest(theirs, calls) * 1e3)
    for backends, _, _, _ in (runners[(s, n)] for s, n, _ in points):
        for b in backends.values():
            b.close()
    return {"threads": threads, "points": results, "max_rel_diff_vs_torch": diffs,
            "experts_impl": {s: getattr(runners[(s, "fp32")][2].experts.config, "_experts_implementation", None)
                             for s in paths}}


def _expert_bytes(engine) -> int:
    """Stored bytes of one routed expert (codes, scales, zero points of gate, up and down)."""
    total = 0
    for kind in ("gate_proj", "up_proj", "down_proj"):
        m = engine._layer(0)[kind]
        total += m.codes[0].nbytes
        if m.typed_scales is not None:
            total += m.typed_scales[0].nbytes + (m.zeros[0].nbytes if engine.has_zero else 0)
    return total


def llama_cpp_peer() -> str:
    """The llama.cpp peer's line: skipped with the reason where llama-cpp-python or gguf is missing."""
    missing = [name for name in ("llama_cpp", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"llama.cpp peer: skipped ({', '.join(missing)} not importable; `pip install llama-cpp-python gguf` "
                f"builds llama.cpp from source)")
    return "llama.cpp peer: skipped (a one-layer GGUF MoE of these shapes is not written by this bench yet)"


def moe_section(tmp: Path, args, say) -> dict:
    import torch

    folder = Path(args.moe_files) if args.moe_files else tmp
    shapes = args.moe_shapes.split(",")
    paths = {}
    for shape in shapes:
        want = {name: folder / f"{shape}-{name.replace(' ', '-')}.colibri" for name in STORAGES}
        have = all(p.exists() for p in want.values())
        paths[shape] = {k: str(v) for k, v in (want if have else write_moe_files(folder, shape)).items()}
    tokens = {"A": MOE_TOKENS, "B": tuple(int(t) for t in args.moe_b_tokens.split(","))}
    env_base = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    runs = {}
    for threads in (int(t) for t in args.moe_threads.split(",")):
        env = {**env_base, **{k: str(threads) for k in BLAS_VARS[:2]}}
        # 2 threads: shape A only (shape B's layer is 2.4 GB in fp32; one child holds it once)
        wanted = {s: p for s, p in paths.items() if threads == 1 or s == "A"}
        wanted["_tokens"] = {s: tokens[s] for s in wanted}
        runs[threads] = child(MOE_CHILD, [json.dumps(wanted), str(args.moe_rounds), str(args.moe_calls),
                                          str(Path(__file__).parent)], env, replace_env=True)
    say("")
    say(f"One MoE layer, CpuBackend.run_layers vs transformers' block (torch {torch.__version__}) and a NumPy copy; "
        f"fastest call of {args.moe_rounds} interleaved rounds x {args.moe_calls} calls; A = {SHAPES['A']}, "
        f"B = {SHAPES['B']} (hidden, intermediate, experts, top-k)")
    for threads, run in runs.items():
        say(f"  {threads} thread(s); fp32 output vs torch, max rel diff: "
            + ", ".join(f"{s} {d:.1e}" for s, d in run["max_rel_diff_vs_torch"].items())
            + f"; torch experts implementation: {run['experts_impl']}")
        say(f"    {'shape':<5} {'storage':<10} {'tokens':>6} {'colibri ms':>11} {'torch ms':>9} {'torch/colibri':>14} "
            f"{'GB/s':>7} {'copy GB/s':>10} {'bw/copy':>8} {'fp32/x':>7}")
        for key, p in run["points"].items():
            shape, name, t = key.split("|")
            torch_ms = p.get("torch_ms")
            ratio = f"{torch_ms / p['colibri_ms']:>13.2f}x" if torch_ms else f"{'':>14}"
            bw = ""
            if "selected_bytes" in p:
                gbs = p["selected_bytes"] / p["colibri_ms"] / 1e6
                copy = p["selected_bytes"] / p["copy_ms"] / 1e6
                p["bandwidth_ratio"] = gbs / copy
                bw = f"{gbs:>7.2f} {copy:>10.2f} {gbs / copy:>7.2f}x"
            else:
                bw = f"{'':>7} {'':>10} {'':>8}"
            fp32 = run["points"][f"{shape}|fp32|{t}"]["colibri_ms"] / p["colibri_ms"]
            say(f"    {shape:<5} {name:<10} {t:>6} {p['colibri_ms']:>11.3f} "
                f"{(f'{torch_ms:.3f}' if torch_ms else ''):>9} {ratio} {bw} {fp32:>6.2f}x")
    say("  " + llama_cpp_peer())
    return {"moe": runs}


def overhead_section(tmp: Path, args, say) -> dict:
    """Runtime.infer vs CpuBackend.run_layers at T=1 on shape A fp32 (a CPU bundle by the bundle contract)."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from runtime_bundles import write_bundle, write_manifest

    from colibri_sdk.bundle.reader import header_record
    from colibri_sdk.format import ColibriFile
    from colibri_sdk.runtime import Runtime

    folder = Path(args.moe_files) if args.moe_files else tmp
    weights = folder / "A-fp32.colibri"
    if not weights.exists():
        write_moe_files(folder, "A")
    bundle = write_bundle(tmp / "bundle-A", weights, 1, 1)
    manifest = json.loads((bundle / "manifest.json").read_text())
    with ColibriFile(bundle / "model.colibri") as f:
        manifest["weights"]["header"] = header_record(f.header)  # the v2 fields too
    write_manifest(bundle, manifest)
    x = np.random.default_rng(3).standard_normal((1, 1, SHAPES["A"][0])).astype(np.float32)
    out = np.empty_like(x)
    best = {"infer": float("inf"), "run_layers": float("inf")}
    with Runtime.load(bundle, backend="cpu", verify=False) as rt:
        backend = rt._backend
        calls = {"infer": lambda: rt.infer(x, out=out), "run_layers": lambda: backend.run_layers(x, out, 0, 1)}
        for r in range(args.moe_rounds * 4):
            for name in (("infer", "run_layers") if r % 2 == 0 else ("run_layers", "infer")):
                best[name] = min(best[name], _fastest(calls[name], args.moe_calls))
    ratio = best["infer"] / best["run_layers"]
    say("")
    say(f"Runtime.infer vs CpuBackend.run_layers, shape A fp32, T=1, fastest of {args.moe_rounds * 4} interleaved "
        f"rounds x {args.moe_calls}: infer {best['infer'] * 1e3:.3f} ms, run_layers {best['run_layers'] * 1e3:.3f} ms, "
        f"{ratio:.3f}x (goal <= 1.1x)")
    return {"overhead": {"infer_ms": best["infer"] * 1e3, "run_layers_ms": best["run_layers"] * 1e3, "ratio": ratio}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per point (default: 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the thread settings (default: 3)")
    parser.add_argument("--large-gb", type=float, default=1.0, help="size of the large model (default: 1 GB)")
    parser.add_argument("--repeats", type=int, default=3, help="load measurements per bundle (median; default: 3)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--sections", default="moe,overhead,threads,load",
                        help="comma-separated: moe, overhead, threads, load (default: all)")
    parser.add_argument("--moe-rounds", type=int, default=3, help="interleaved rounds of the MoE layer (default: 3)")
    parser.add_argument("--moe-calls", type=int, default=3, help="calls per point and round (default: 3)")
    parser.add_argument("--moe-shapes", default="A,B", help="MoE layer shapes to run (default: A,B)")
    parser.add_argument("--moe-threads", default="1,2", help="thread counts (default: 1,2; 2 runs shape A only)")
    parser.add_argument("--moe-b-tokens", default="1,4,16,64", help="token counts of shape B (default: 1,4,16,64)")
    parser.add_argument("--moe-files", default=None, help="folder of the MoE layer files, reused when present")
    parser.add_argument("--json", action="store_true", help="also write the results as JSON next to --output")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"moe", "overhead", "threads", "load"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; allowed: moe, overhead, threads, load")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "load_average_at_start": os.getloadavg()[0]}

    lines = [
        f"# bench/runtime_cpu_bench.py  ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, NumPy {np.__version__}, load average "
        f"{os.getloadavg()[0]:.1f} at start)",
    ]

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="colibri-rt-bench-") as tmp:
        tmp = Path(tmp)
        if "moe" in sections:
            report.update(moe_section(tmp, args, say))
        if "overhead" in sections:
            report.update(overhead_section(tmp, args, say))
        for leftover in tmp.glob("*.colibri"):  # (files in --moe-files are kept)
            leftover.unlink()
        if sections & {"threads", "load"}:
            thread_and_load_sections(tmp, args, say, sections, report)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.output}")
    if args.json:
        path = args.output.with_suffix(".json")
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def threads_section(bundles: dict, args, say) -> dict:
    """Default vs explicit BLAS thread counts on the demo model, each bundle at its own fixed tokens."""
    say("")
    say(f"CPU backend latency, demo model (4 layers x 8 experts, top-2, hidden 256, intermediate 512, fp16), "
        f"batch 1, ms; per point {args.iters} calls, or fewer (at least 3) once 3 s of calls are timed; the "
        f"fastest of {args.rounds} rounds")
    say(f"  {'BLAS threads':<14} {'tokens':>6} {'p50':>9} {'p99':>9} {'CPU/call':>9} {'calls':>6}   "
        f"{'padded to 64: p50':>17} {'p99':>9}")
    paths = {str(t): str(p) for t, p in bundles.items()}
    # Without a variable the rule of colibri_sdk.blas applies; with one, the backend keeps the variable's count.
    env_none = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    configs = [("default", None)] + [(str(n), n) for n in range(1, (os.cpu_count() or 1) + 1)]
    results = {}
    # Rounds in alternating order, each point keeping its fastest round (by p50): the machine's load drifts
    # during the run, and the order must not favour one setting.
    for round_index in range(args.rounds):
        for label, n in (configs if round_index % 2 == 0 else configs[::-1]):
            env = dict(env_none) if n is None else {**env_none, **{k: str(n) for k in BLAS_VARS[:2]}}
            result = child(LATENCY_CHILD, [json.dumps(paths), str(bundles[PADDED_TOKENS]), str(args.iters),
                                           "1" if n is None else "0"], env, replace_env=True)
            kept = results.setdefault(label, result)
            for t in map(str, TOKENS):
                if result[t]["own"]["p50"] < kept[t]["own"]["p50"]:  # the round's CPU time goes with it
                    kept[t]["own"] = result[t]["own"]
                if result[t]["padded"] and result[t]["padded"]["p50"] < kept[t]["padded"]["p50"]:
                    kept[t]["padded"] = result[t]["padded"]
    for label, _ in configs:
        result = results[label]
        for t in TOKENS:
            own, pad = result[str(t)]["own"], result[str(t)]["padded"]
            padded = f"{pad['p50']:>17.2f} {pad['p99']:>9.2f}" if pad else f"{'':>17} {'':>9}"
            say(f"  {label:<14} {t:>6} {own['p50']:>9.2f} {own['p99']:>9.2f} {own['cpu_ms']:>9.2f} "
                f"{own['calls']:>6}   {padded}")
    from colibri_sdk.blas import SMALL_ROWS

    say("")
    say(f"  default (no variable; the backend uses 1 BLAS thread for calls of <= {SMALL_ROWS} token rows) "
        f"vs best explicit count, p50 ms")
    most = str(os.cpu_count() or 1)  # what an unconfigured OpenBLAS uses: one thread per CPU
    say(f"  {'tokens':>6} {'default':>9} {'best':>9} {'best at':>8} {'default/best':>13} "
        f"{most + ' thr/default':>15} {'CPU/call: default/best':>23}")
    worst = 0.0
    for t in TOKENS:
        default = results["default"][str(t)]["own"]["p50"]
        label, best = min(((k, r[str(t)]["own"]["p50"]) for k, r in results.items() if k != "default"),
                          key=lambda kv: kv[1])
        worst = max(worst, default / best)
        unset = results[most][str(t)]["own"]["p50"] / default
        cpu = results["default"][str(t)]["own"]["cpu_ms"] / results[label][str(t)]["own"]["cpu_ms"]
        say(f"  {t:>6} {default:>9.2f} {best:>9.2f} {label + ' thr':>8} {default / best:>12.2f}x "
            f"{unset:>14.2f}x {cpu:>22.2f}x")
    say(f"  worst default/best {worst:.2f}x (goal <= 1.2x). '{most} thr/default': how much slower the BLAS "
        f"library's own thread count ({most}, no rule: what an unset variable gave before) is than the default. "
        f"CPU/call: CPU time of the whole process per call (ms), which the machine's other load does not "
        f"inflate as it does wall time")
    return results


def thread_and_load_sections(tmp: Path, args, say, sections: set, report: dict) -> None:
    """The BLAS thread rule on the demo model at tokens 1..1024, and load time / memory of a small vs a large
    bundle."""
    bundles = {t: build(tmp / f"demo-{t}", profile_with_shape(tmp, 1, t)) for t in TOKENS}

    if "threads" in sections:
        report["threads"] = threads_section(bundles, args, say)
    if "load" not in sections:
        return

    large_weights = tmp / "large.colibri"
    large_bytes = write_large_model(large_weights, args.large_gb)
    large = build(tmp / "large", profile_with_shape(tmp, 1, 1), large_weights)
    large_weights.unlink()
    small = bundles[16]
    small_bytes = (small / "model.colibri").stat().st_size

    say("")
    say(f"Load, fresh process per load (median of {args.repeats}); RSS in MB above the process after imports")
    say(f"  {'bundle':<8} {'weights MB':>10} {'load ms':>8} {'verify ms':>10} {'RSS load':>9} {'RSS call':>9} "
        f"{'peak':>7} {'first call ms':>14}")
    rows = {}
    for name, path, size in (("small", small, small_bytes), ("large", large, large_bytes)):
        fast = median_run(LOAD_CHILD, [str(path), "0"], args.repeats)
        checked = median_run(LOAD_CHILD, [str(path), "1"], args.repeats)
        rows[name] = fast
        base = fast["base_mb"]
        say(f"  {name:<8} {size / 1e6:>10.1f} {fast['load_ms']:>8.2f} {checked['load_ms']:>10.1f} "
            f"{fast['load_mb'] - base:>9.1f} {fast['call_mb'] - base:>9.1f} {fast['peak_mb'] - base:>7.1f} "
            f"{fast['first_ms']:>14.1f}")
    s, g = rows["small"], rows["large"]
    say("")
    say(f"  weights ratio large/small         {large_bytes / small_bytes:8.1f}x")
    say(f"  load time ratio (no verify)        {g['load_ms'] / s['load_ms']:8.2f}x")
    grown = (g["load_mb"] - g["base_mb"]) - (s["load_mb"] - s["base_mb"])
    say(f"  RSS after load, large - small      {grown:8.1f} MB")
    peak_s, peak_g = s["peak_mb"] - s["base_mb"], g["peak_mb"] - g["base_mb"]
    say(f"  peak RSS above imports, large/small {peak_g / peak_s:7.2f}x  ({peak_s:.1f} MB vs {peak_g:.1f} MB; "
        f"÷ weights: small {peak_s * 2**20 / small_bytes:.2f}, large {peak_g * 2**20 / large_bytes:.2f})")
    say("  (a call touches only the routed experts' pages: the large model's first call maps 2 of 8 experts)")



if __name__ == "__main__":
    sys.exit(main())
