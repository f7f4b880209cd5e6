"""The CPU benchmark's system sections (bench/runtime_cpu_bench.py): the BLAS thread rule on the demo model at
tokens 1..1024, load time and memory of a small vs a large bundle, and the child processes every section runs in."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
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
    """The Orin profile compiled for one shape, batch x tokens; its GEMV threads lowered where the shape needs it
    (the GEMV output tile: batch*tokens <= 65536 / kernels.small_batch.threads, docs/kernels.md "Limits"); the CPU
    backend runs no kernel, so only the bundle's build sees them."""
    import yaml

    data = yaml.safe_load(ORIN.read_text())
    data["shape"] = {"batch": batch, "tokens": tokens}
    gemv = data["kernels"]["small_batch"]
    gemv["threads"] = max(32, min(gemv["threads"], 65536 // (batch * tokens) // 32 * 32))
    path = folder / f"orin-{batch}x{tokens}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
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
    p50s = {}  # label -> tokens -> the p50 of every round
    # Rounds in alternating order, each point keeping its fastest round (by p50): the machine's load drifts
    # during the run, and the order must not favour one setting.
    for round_index in range(args.rounds):
        for label, n in (configs if round_index % 2 == 0 else configs[::-1]):
            env = dict(env_none) if n is None else {**env_none, **{k: str(n) for k in BLAS_VARS[:2]}}
            # every setting's child does the same work (its own bundles and the padded one), so that none runs
            # beside a process of another size or cache footprint than the others'
            result = child(LATENCY_CHILD, [json.dumps(paths), str(bundles[PADDED_TOKENS]), str(args.iters), "1"],
                           env, replace_env=True)
            kept = results.setdefault(label, result)
            for t in map(str, TOKENS):
                p50s.setdefault(label, {}).setdefault(t, []).append(result[t]["own"]["p50"])
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
    from colibri_sdk.blas import SMALL_ROWS, SPLIT_ROWS

    say("")
    say(f"  default (no variable: one thread below {SPLIT_ROWS} token rows, the experts split between the CPUs from "
        f"there, one BLAS thread up to {SMALL_ROWS} rows) vs best explicit count, the median over the "
        f"{args.rounds} rounds of each setting's p50, ms")
    most = str(os.cpu_count() or 1)  # what an unconfigured OpenBLAS uses: one thread per CPU
    say(f"  {'tokens':>6} {'default':>9} {'best':>9} {'best at':>8} {'default/best':>13} "
        f"{most + ' thr/default':>15} {'CPU/call: default/best':>23}")
    worst = worst_same = 0.0
    cpus = os.cpu_count() or 1

    def median(label, t):
        return float(np.median(p50s[label][str(t)]))

    def same_setting(t: int) -> str | None:
        """The explicit count the default runs exactly as at t token rows (the same engine threads and BLAS
        threads), or None: below SPLIT_ROWS both are 1; above SMALL_ROWS both are the CPUs (the library's own
        count with no variable set)."""
        engine = 1 if t < SPLIT_ROWS else cpus
        blas = 1 if t <= SMALL_ROWS else cpus
        return str(engine) if engine == blas else None

    for t in TOKENS:
        default = median("default", t)
        label, best = min(((k, median(k, t)) for k in results if k != "default"), key=lambda kv: kv[1])
        same = label == same_setting(t)
        if same:
            worst_same = max(worst_same, default / best)
        else:
            worst = max(worst, default / best)
        unset = median(most, t) / default
        cpu = results["default"][str(t)]["own"]["cpu_ms"] / results[label][str(t)]["own"]["cpu_ms"]
        say(f"  {t:>6} {default:>9.2f} {best:>9.2f} {label + ' thr':>8} {default / best:>12.2f}x "
            f"{unset:>14.2f}x {cpu:>22.2f}x" + ("   (the default's own setting)" if same else ""))
    say(f"  worst default/best {worst:.2f}x where the best is another setting than the default's (goal <= 1.2x); "
        f"{worst_same:.2f}x where the best is the very setting the default runs (the same threads: the ratio is "
        f"the spread between two measurements of one configuration). Medians, not each setting's fastest round: "
        f"at one token "
        f"a process's speed varies from process to process whatever the variables (bimodal on the 2-core host "
        f"where this was written), so the fastest of more settings' rounds would win by chance. "
        f"'{most} thr/default': how much slower the BLAS library's own "
        f"thread count ({most}, no rule: what an unset variable gave before) is than the default. CPU/call: CPU "
        f"time of the whole process per call (ms, fastest rounds), which the machine's other load does not "
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
