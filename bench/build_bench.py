"""Build time and build memory, side by side in one run.

1. Time to build every shipped profile from scratch with the demo model (goal: all of them in <= 30 s on 2 cores):
   per profile (every compiled shape of it), the wall time of a whole `build_bundle` and of the NVRTC compilation alone, with 1 and with 2
   parallel NVRTC compilations; and the same build again through a warm NVRTC cache (`colibri_sdk.aot.cache`,
   a cache folder of its own, filled by the first build of the run): the time a rebuild with nothing changed takes.
   The other builds run without the cache.
2. Peak memory of a build against the size of its weights (goal: flat, the build streams the weights): two
   Mixtral-like models with the same tensor shapes (hidden 4096, 8 experts, top-2) and 1 and 4 layers, each built
   for the orin profile (fp16) in a fresh process, once from fp16 weights (copied) and once from fp32 weights
   (converted to fp16). Printed: the peak resident set (VmHWM) of the build process, peak ÷ weights, and the
   growth of the peak per byte of weights between the two sizes (0 = flat).

    python bench/build_bench.py [--repeat 3] [--small-gb 0.3] [--large-gb 1.2] [--no-memory]
                                [--out bench/results/build_bench.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_sdk.aot.cache import NvrtcCache
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.aot.kernels import compile_catalog
from colibri_sdk.aot.nvrtc import nvrtc_version
from colibri_sdk.demo import demo_header
from colibri_sdk.profile import load_profile, packaged_names


def best(seconds: list[float]) -> str:
    return f"{min(seconds):6.2f} (median {statistics.median(seconds):5.2f})"


BUILD_CHILD = """
import json, sys
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.profile import load_profile

def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

profile = load_profile("orin")
base = status_mb("VmRSS")
result = build_bundle(profile, sys.argv[2], sys.argv[1], force=True, nvrtc_cache=False)
print(json.dumps({"base_mb": base, "peak_mb": status_mb("VmHWM"), "converted": result.converted}))
"""


def write_model(path: Path, layers: int, dtype: int) -> int:
    """A Mixtral-like model: hidden 4096, 8 experts, top-2, intermediate 1536, `layers` layers; returns its bytes.
    Every tensor is a shifted slice of one random vector (fast to write, distinct per tensor)."""
    from colibri_sdk.format import ColibriWriter, Header

    header = Header(num_layers=layers, num_experts=8, top_k=2, hidden_size=4096, intermediate_size=1536,
                    dtype=dtype)
    noise = (np.random.default_rng(1).standard_normal(4096 * 1536 + 97, dtype=np.float32) * 0.02)
    with ColibriWriter(path, header) as w:
        for k, (kind, layer, expert) in enumerate(w.pending()):
            rows, cols = header.shape(kind)
            w.write(kind, layer, expert, np.roll(noise, 13 * k)[: rows * cols].reshape(rows, cols))
    return header.file_size


def memory_rows(tmp: Path, small_gb: float, large_gb: float) -> list[str]:
    """The build-memory table (section 2)."""
    per_layer = {0: 3 * 8 * 4096 * 1536 * 4, 1: 3 * 8 * 4096 * 1536 * 2}  # weights bytes per layer, fp32 / fp16
    lines = [
        "",
        "build memory: orin profile (fp16), Mixtral-like layers (hidden 4096, 8 experts, intermediate 1536), "
        "fresh process per build",
        f"{'weights':<22} {'layers':>6} {'weights MB':>11} {'peak RSS MB':>12} {'peak / weights':>15}",
    ]
    print("\n".join(lines), flush=True)
    for dtype, label in ((1, "fp16 (copied)"), (0, "fp32 (converted)")):
        runs = []
        for gb in (small_gb, large_gb):
            layers = max(1, round(gb * 1e9 / per_layer[1]))  # the same layer counts for both dtypes
            weights = tmp / f"w{dtype}-{layers}.colibri"
            size = write_model(weights, layers, dtype)
            out = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(weights), str(tmp / "mem-bundle")],
                                 capture_output=True, text=True, check=False)
            weights.unlink()
            if out.returncode != 0:
                raise SystemExit(f"build child failed:\n{out.stderr}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append((layers, size, r["peak_mb"]))
            ratio = r["peak_mb"] * 2**20 / size
            line = f"{label:<22} {layers:>6} {size / 1e6:>11.1f} {r['peak_mb']:>12.1f} {ratio:>15.3f}"
            print(line, flush=True)
            lines.append(line)
        (l1, s1, p1), (l2, s2, p2) = runs
        growth = (p2 - p1) * 2**20 / (s2 - s1)
        line = (f"{label:<22} peak grows {p2 - p1:+.1f} MB for {(s2 - s1) / 1e6:+.0f} MB of weights: "
                f"{growth:+.4f} bytes of RSS per byte of weights (goal: 0, flat)")
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small-gb", type=float, default=0.3, help="weights of the small model (fp16 GB)")
    parser.add_argument("--large-gb", type=float, default=1.2, help="weights of the large model (fp16 GB)")
    parser.add_argument("--no-memory", action="store_true", help="section 1 only (build times)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "build_bench.txt"))
    args = parser.parse_args()

    major, minor = nvrtc_version()
    lines = [
        f"build_bench: {len(packaged_names())} shipped profiles, demo model, NVRTC {major}.{minor}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, repeat {args.repeat}",
        "seconds, best of the repeats (median)",
        f"{'profile':<10} {'compile, 1 worker':>26} {'compile, 2 workers':>26} {'whole build, 2 workers':>26} "
        f"{'rebuild, warm cache':>26}  shapes",
    ]
    print("\n".join(lines))
    totals = {"c1": [], "c2": [], "b2": [], "bc": []}
    with tempfile.TemporaryDirectory(prefix="colibri-build-bench-") as tmp:
        cache = NvrtcCache(Path(tmp) / "nvrtc-cache")
        for name in packaged_names():
            profile = load_profile(name)
            header = demo_header(profile.dtype)
            times = {"c1": [], "c2": [], "b2": [], "bc": []}
            build_bundle(profile, Path(tmp) / name, workers=2, force=True, nvrtc_cache=cache)  # fills the cache
            for _ in range(args.repeat):
                for key, workers in (("c1", 1), ("c2", 2)):
                    start = time.perf_counter()
                    for batch, tokens in profile.shapes:  # one catalogue per compiled shape, as the build does
                        compile_catalog(profile.for_shape(batch, tokens), header, workers=workers)
                    times[key].append(time.perf_counter() - start)
                start = time.perf_counter()
                build_bundle(profile, Path(tmp) / name, workers=2, force=True, nvrtc_cache=False)
                times["b2"].append(time.perf_counter() - start)
                start = time.perf_counter()
                build_bundle(profile, Path(tmp) / name, workers=2, force=True, nvrtc_cache=cache)
                times["bc"].append(time.perf_counter() - start)
            for key in totals:
                totals[key].append(min(times[key]))
            shapes = ",".join(f"{b}x{t}" for b, t in profile.shapes)
            line = (f"{name:<10} {best(times['c1']):>26} {best(times['c2']):>26} {best(times['b2']):>26} "
                    f"{best(times['bc']):>26}  {shapes}")
            print(line)
            lines.append(line)
    total = (
        f"{'all':<10} {sum(totals['c1']):>26.2f} {sum(totals['c2']):>26.2f} {sum(totals['b2']):>26.2f} "
        f"{sum(totals['bc']):>26.2f}\n"
        f"all shipped profiles built in {sum(totals['b2']):.2f} s (goal <= 30 s); compile speed-up of 2 workers over 1: "
        f"{sum(totals['c1']) / sum(totals['c2']):.2f}x; a rebuild through a warm NVRTC cache takes "
        f"{sum(totals['bc']) / sum(totals['b2']):.3f}x the time of a build without it"
    )
    print(total)
    lines.append(total)
    if not args.no_memory:
        with tempfile.TemporaryDirectory(prefix="colibri-build-mem-") as tmp:
            lines += memory_rows(Path(tmp), args.small_gb, args.large_gb)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
