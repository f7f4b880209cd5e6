"""Time to build every shipped profile from scratch with the demo model (goal: all of them in <= 30 s on 2 cores).

Prints, per profile, the wall time of a whole `build_bundle` and of the NVRTC compilation alone, with 1 and with
2 parallel NVRTC compilations, side by side in one run. Usage:

    python bench/build_bench.py [--repeat 3] [--out bench/results/build_bench.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.aot.kernels import compile_catalog
from colibri_sdk.aot.nvrtc import nvrtc_version
from colibri_sdk.demo import demo_header
from colibri_sdk.profile import load_profile, packaged_names


def best(seconds: list[float]) -> str:
    return f"{min(seconds):6.2f} (median {statistics.median(seconds):5.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "build_bench.txt"))
    args = parser.parse_args()

    major, minor = nvrtc_version()
    lines = [
        f"build_bench: {len(packaged_names())} shipped profiles, demo model, NVRTC {major}.{minor}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, repeat {args.repeat}",
        "seconds, best of the repeats (median)",
        f"{'profile':<10} {'compile, 1 worker':>26} {'compile, 2 workers':>26} {'whole build, 2 workers':>26}",
    ]
    print("\n".join(lines))
    totals = {"c1": [], "c2": [], "b2": []}
    with tempfile.TemporaryDirectory(prefix="colibri-build-bench-") as tmp:
        for name in packaged_names():
            profile = load_profile(name)
            header = demo_header(profile.dtype)
            times = {"c1": [], "c2": [], "b2": []}
            for _ in range(args.repeat):
                for key, workers in (("c1", 1), ("c2", 2)):
                    start = time.perf_counter()
                    compile_catalog(profile, header, workers=workers)
                    times[key].append(time.perf_counter() - start)
                start = time.perf_counter()
                build_bundle(profile, Path(tmp) / name, workers=2)
                times["b2"].append(time.perf_counter() - start)
            for key in totals:
                totals[key].append(min(times[key]))
            line = f"{name:<10} {best(times['c1']):>26} {best(times['c2']):>26} {best(times['b2']):>26}"
            print(line)
            lines.append(line)
    total = (
        f"{'all':<10} {sum(totals['c1']):>26.2f} {sum(totals['c2']):>26.2f} {sum(totals['b2']):>26.2f}\n"
        f"all shipped profiles built in {sum(totals['b2']):.2f} s (goal <= 30 s); compile speed-up of 2 workers over 1: "
        f"{sum(totals['c1']) / sum(totals['c2']):.2f}x"
    )
    print(total)
    lines.append(total)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
