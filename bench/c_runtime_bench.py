"""Host time per call: the C runtime (libcolibri) vs the Python runtime (Runtime.infer on the CUDA backend), side by
side on the same bundle and the same fake driver.

Both run against the fake libcuda.so.1 (tests/fakecuda/fake_cuda.cpp) with a kernel library whose kernels return at
once (bench/noop_kernels.cpp), so what is measured is the host side of one call: input checks and the copy into
pinned memory, cuGraphLaunch, cuStreamSynchronize, the output copy — plus the fake driver's own replay of the graph's
nodes, the same for both. It says nothing about GPU time; on a GPU run `bash scripts/gpu_check.sh`.

    python bench/c_runtime_bench.py [--calls 2000] [--profile orin]

Prints the median / p90 / p99 µs per call of each and the ratio Python ÷ C; writes bench/results/c_runtime_bench.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "c_runtime_bench.txt"

PYTHON_SIDE = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from colibri_sdk.runtime import Runtime
    calls = int(sys.argv[2])
    with Runtime.load(sys.argv[1], backend="cuda", verify=False) as rt:
        b, t = rt.shape
        x = (np.arange(b * t * rt.hidden_size, dtype=np.float32) % 7 * 0.1).reshape(b, t, rt.hidden_size)
        for _ in range(50):
            rt.infer(x)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            rt.infer(x)
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    print(json.dumps({"calls": calls, "median_us": times[calls // 2], "p90_us": times[calls * 9 // 10],
                      "p99_us": times[calls * 99 // 100], "mean_us": sum(times) / calls}))
    """
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", default="orin")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="colibri-c-bench-"))
    build = work / "build"
    subprocess.run(["bash", str(ROOT / "scripts" / "c_runtime.sh"), "build", str(build)], check=True,
                   stdout=subprocess.DEVNULL)
    bundle = work / "bundle"
    subprocess.run([sys.executable, "-m", "colibri_sdk", "build", "--profile", args.profile, "--demo", "-o", str(bundle)],
                   check=True, stdout=subprocess.DEVNULL)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(build), env.get("LD_LIBRARY_PATH")) if p)
    env["COLIBRI_FAKE_CUDA_KERNELS"] = str(build / "libnoop_kernels.so")
    manifest = json.loads((bundle / "manifest.json").read_text())
    major, minor = manifest["compute_capability"]
    env["COLIBRI_FAKE_CUDA_CC"] = f"{major}.{minor}"
    results = {}
    for name, cmd in (
        ("C (libcolibri)", [str(build / "c_runtime_bench"), str(bundle), str(args.calls)]),
        ("Python (Runtime, cuda backend)", [sys.executable, "-c", PYTHON_SIDE, str(bundle), str(args.calls)]),
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    c, py = results["C (libcolibri)"], results["Python (Runtime, cuda backend)"]
    b, t = manifest["shape"]["batch"], manifest["shape"]["tokens"]
    hidden = manifest["weights"]["header"]["hidden_size"]
    lines = [
        f"host time per call on the fake driver, no-op kernels: profile {args.profile}, shape ({b}, {t}, {hidden}) "
        f"float32, {len(manifest['launch'])} launches in the graph, {args.calls} calls each",
        f"{'runtime':34s} {'median µs':>10s} {'p90 µs':>10s} {'p99 µs':>10s} {'mean µs':>10s}",
    ]
    for name, r in results.items():
        lines.append(f"{name:34s} {r['median_us']:10.1f} {r['p90_us']:10.1f} {r['p99_us']:10.1f} {r['mean_us']:10.1f}")
    lines.append(f"ratio Python / C: median {py['median_us'] / c['median_us']:.1f}x, p99 {py['p99_us'] / c['p99_us']:.1f}x")
    lines.append("(both include the fake driver's replay of the graph nodes on the CPU; no GPU time is measured)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
