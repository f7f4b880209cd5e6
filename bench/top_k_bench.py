"""Top-k override benchmark: the demo model's own k (2) against builds with `--top-k K`, side by side on the CPU
backend — p50/p99 latency per call, and how far the output moves from the own-k output.

Each bundle is built with `colibri-sdk build --profile orin --top-k K` (batch 1 x tokens 16) and run on the same
N(0, 1) inputs with OPENBLAS_NUM_THREADS=1. Output change: max |y_K - y_k| / max |y_k| and the relative Frobenius
norm ||y_K - y_k|| / ||y_k|| over all inputs (composition residual, 4 layers).

    python bench/top_k_bench.py                       # writes bench/results/top_k_bench.txt
    python bench/top_k_bench.py --k 3 4 8 --iters 50
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib  # noqa: E402
import io  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from bench_report import machine_line, write_report  # noqa: E402 (bench/, the script's folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "top_k_bench.txt"


def build(out: Path, k: int | None) -> Path:
    from colibri_sdk.cli import main

    args = ["build", "--profile", "orin", "--demo", "-o", str(out)] + ([] if k is None else ["--top-k", str(k)])
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0, f"build {args} failed"
    return out


def measure(bundle: Path, xs: list[np.ndarray], iters: int) -> tuple[list[np.ndarray], float, float]:
    from colibri_sdk.runtime import Runtime

    with Runtime.load(bundle, backend="cpu", verify=False) as rt:
        ys = [rt.infer(x) for x in xs]
        times = []
        for i in range(iters):
            start = time.perf_counter()
            rt.infer(xs[i % len(xs)])
            times.append(time.perf_counter() - start)
    p50, p99 = np.percentile(np.asarray(times) * 1e3, [50, 99])
    return ys, float(p50), float(p99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 4, 8], help="overrides to compare (default 3 4 8)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    xs = [np.random.default_rng(s).standard_normal((1, 16, 256)).astype(np.float32) for s in range(4)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_y, base_p50, base_p99 = measure(build(Path(tmp) / "own", None), xs, args.iters)
        rows.append(("2 (own)", base_p50, base_p99, 1.0, 0.0, 0.0))
        for k in args.k:
            ys, p50, p99 = measure(build(Path(tmp) / f"k{k}", k), xs, args.iters)
            diff = np.concatenate([(y - b).ravel() for y, b in zip(ys, base_y)])
            ref = np.concatenate([b.ravel() for b in base_y])
            rows.append((str(k), p50, p99, p50 / base_p50, float(np.abs(diff).max() / np.abs(ref).max()),
                         float(np.linalg.norm(diff) / np.linalg.norm(ref))))
    lines = [
        f"top-k override on the CPU backend: demo model (4 layers, 8 experts, own k 2, hidden 256), batch 1 x 16 "
        f"tokens, {args.iters} calls each, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}",
        machine_line(),
        f"{'top-k':>8} {'p50 ms':>9} {'p99 ms':>9} {'p50 / own':>10} {'max |dy| / max |y|':>19} {'||dy|| / ||y||':>15}",
    ]
    for k, p50, p99, ratio, mx, fro in rows:
        lines.append(f"{k:>8} {p50:>9.2f} {p99:>9.2f} {ratio:>10.2f} {mx:>19.3f} {fro:>15.3f}")
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
