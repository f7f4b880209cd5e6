"""Host time per call: the C runtime (libcolibri) vs the Python runtime (Runtime.infer on the CUDA backend), side by
side on the same bundle and the same fake driver.

Both run against the fake libcuda.so.1 (tests/fakecuda/driver/) with a kernel library whose kernels return at
once (bench/noop_kernels.cpp), so what is measured is the host side of one call: input checks and the copy into
pinned memory, cuGraphLaunch, cuStreamSynchronize, the output copy — plus the fake driver's own replay of the graph's
nodes, the same for both. It says nothing about GPU time; on a GPU run `bash scripts/gpu_check.sh`.

A second table: a 1-token call (batch 1 x tokens 1) on the same bundle of several compiled shapes, run at the
smallest shape that holds it (`colibri_set_input_shape`; Python: `Runtime.infer` of the (1, 1, hidden) input) next to
what a C program did while libcolibri ran only the largest shape: the call zero-padded to the largest shape with
`input_lengths` (`colibri_set_input`). On the fake driver with no-op kernels this measures only the host side (the
copies of the padded input and output, the graph launch); the kernels' time at each shape is not measured.

    python bench/c_runtime_bench.py [--calls 2000] [--profile orin]

Prints the median / p90 / p99 µs per call of each and the ratios; writes bench/results/c_runtime_bench.txt.
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
        b, t = (int(v) for v in sys.argv[3:5]) if len(sys.argv) > 4 else rt.shape
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
    c_bench, calls = [str(build / "c_runtime_bench"), str(bundle), str(args.calls)], str(args.calls)
    rows = {  # name: command; each run in its own process, one after the other
        "C (libcolibri)": c_bench,
        "Python (Runtime, cuda backend)": [sys.executable, "-c", PYTHON_SIDE, str(bundle), calls],
        "C, 1 token at the smallest shape": [*c_bench, "1", "1", "shape"],
        "C, 1 token padded to the largest": [*c_bench, "1", "1", "padded"],
        "Python, 1 token (smallest shape)": [sys.executable, "-c", PYTHON_SIDE, str(bundle), calls, "1", "1"],
    }
    results = {}
    for name, cmd in rows.items():
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    c, py = results["C (libcolibri)"], results["Python (Runtime, cuda backend)"]
    small, padded = results["C, 1 token at the smallest shape"], results["C, 1 token padded to the largest"]
    b, t = manifest["shape"]["batch"], manifest["shape"]["tokens"]
    hidden = manifest["weights"]["header"]["hidden_size"]
    shapes = [(e["batch"], e["tokens"]) for e in manifest.get("shapes", [manifest["shape"]])]
    first = shapes[0]  # smallest first: the one a 1-token call runs at
    header = f"{'runtime':34s} {'median µs':>10s} {'p90 µs':>10s} {'p99 µs':>10s} {'mean µs':>10s}"

    def row(name: str) -> str:
        r = results[name]
        return f"{name:34s} {r['median_us']:10.1f} {r['p90_us']:10.1f} {r['p99_us']:10.1f} {r['mean_us']:10.1f}"

    lines = [
        f"host time per call on the fake driver, no-op kernels: profile {args.profile}, shape ({b}, {t}, {hidden}) "
        f"float32, {len(manifest['launch'])} launches in the graph, {args.calls} calls each",
        header, row("C (libcolibri)"), row("Python (Runtime, cuda backend)"),
        f"ratio Python / C: median {py['median_us'] / c['median_us']:.1f}x, p99 {py['p99_us'] / c['p99_us']:.1f}x",
        "",
        f"a 1-token call, compiled shapes {', '.join(f'{sb}x{st}' for sb, st in shapes)} (batch x tokens): at the "
        f"smallest that holds it ({first[0]}x{first[1]}) vs padded to the largest ({b}x{t}, what the C runtime did "
        "before it chose shapes)",
        header, row("C, 1 token at the smallest shape"), row("C, 1 token padded to the largest"),
        row("Python, 1 token (smallest shape)"),
        f"ratio padded / smallest (C): median {padded['median_us'] / small['median_us']:.1f}x, "
        f"p99 {padded['p99_us'] / small['p99_us']:.1f}x",
        "(host side only: input checks and copies, graph launch, synchronisation, the fake driver's replay of the "
        "graph nodes on the CPU with no-op kernels; the kernels' time at each shape, the larger part on a GPU, is "
        "not measured)",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
