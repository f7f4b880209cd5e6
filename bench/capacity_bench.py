"""Expert-capacity benchmark with skewed routing: dropless against soft and hard capacity, side by side on the CPU
backend — p50/p99 latency per call, pairs dropped per call, and the output error vs the dropless output (which is
what transformers computes).

The model: 4 layers, 8 experts, top-2, hidden 256, intermediate 512, residual composition, random weights whose
router columns of experts 0 and 1 carry an extra 8/hidden per dimension; the inputs are N(0, 1) + 0.5, so these
two experts' logits are about 4 (one logit standard deviation) higher and draw the share of layer-0 pairs printed.
Every variant is built with
`colibri-sdk build --profile orin --weights W [--capacity-factor F --capacity-mode M]` (batch 1 x 16 tokens) and
run with OPENBLAS_NUM_THREADS=1 on the same N(0, 1) inputs.

    python bench/capacity_bench.py                    # writes bench/results/capacity_bench.txt
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib  # noqa: E402
import io  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "capacity_bench.txt"
VARIANTS = [("dropless", None, None), ("soft 1.25", 1.25, "soft"), ("hard 1.25", 1.25, "hard"),
            ("soft 1.0", 1.0, "soft"), ("hard 1.0", 1.0, "hard")]


def skewed_model(path: Path) -> Path:
    from colibri_sdk.format import Header, write_model

    rng = np.random.default_rng(0)
    L, E, H, I = 4, 8, 256, 512
    router = rng.standard_normal((L, H, E)) / np.sqrt(H) * 4
    router[:, :, :2] += 8.0 / H  # with the inputs' common offset of 0.5 per dimension: +4 on these logits
    header = Header(num_layers=L, num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=0, routing=0,
                    composition=1)
    return write_model(path, header, rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                       rng.standard_normal((L, E, I, H)) / np.sqrt(H), rng.standard_normal((L, E, H, I)) / np.sqrt(I),
                       router)


def build(out: Path, weights: Path, factor, mode) -> Path:
    from colibri_sdk.cli import main

    args = ["build", "--profile", "orin", "--weights", str(weights), "-o", str(out)]
    if factor is not None:
        args += ["--capacity-factor", str(factor), "--capacity-mode", mode]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0, f"build {args} failed"
    return out


def main() -> int:
    from colibri_sdk.runtime import Runtime

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    xs = [(np.random.default_rng(s).standard_normal((1, 16, 256)) + 0.5).astype(np.float32) for s in range(4)]
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        weights = skewed_model(Path(tmp) / "skewed.colibri")
        from colibri_sdk.reference import ReferenceEngine

        engine = ReferenceEngine(weights)
        ids = np.concatenate([engine.route(0, x.reshape(-1, 256))[0].ravel() for x in xs])
        share = float(np.isin(ids, (0, 1)).mean())
        engine.close()
        for name, factor, mode in VARIANTS:
            with Runtime.load(build(Path(tmp) / name.replace(" ", "_"), weights, factor, mode), backend="cpu",
                              verify=False) as rt:
                ys = [rt.infer(x) for x in xs]
                dropped = rt.stats().dropped_pairs / len(xs)
                times = []
                for i in range(args.iters):
                    start = time.perf_counter()
                    rt.infer(xs[i % len(xs)])
                    times.append(time.perf_counter() - start)
            y = np.concatenate([v.ravel() for v in ys])
            base = y if base is None else base
            p50, p99 = np.percentile(np.asarray(times) * 1e3, [50, 99])
            rows.append((name, p50, p99, dropped, float(np.abs(y - base).max() / np.abs(base).max()),
                         float(np.linalg.norm(y - base) / np.linalg.norm(base))))
    pairs = 16 * 2 * 4
    lines = [
        "expert capacity on the CPU backend, skewed routing (experts 0, 1 favoured): 4 layers, 8 experts, top-2, "
        f"hidden 256, batch 1 x 16 tokens ({pairs} pairs per call), {args.iters} calls each, "
        f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}",
        f"layer 0: {share:.0%} of the pairs go to experts 0 and 1 (2 of 8); C = ceil(16 * 2 * factor / 8)",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        f"{'variant':>10} {'p50 ms':>8} {'p99 ms':>8} {'dropped/call':>13} {'max|dy|/max|y|':>15} {'||dy||/||y||':>13}",
    ]
    for name, p50, p99, dropped, mx, fro in rows:
        lines.append(f"{name:>10} {p50:>8.2f} {p99:>8.2f} {dropped:>13.1f} {mx:>15.4f} {fro:>13.4f}")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
