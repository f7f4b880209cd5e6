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
    python bench/capacity_bench.py --kernels          # + the kernel path without a GPU (about 2 minutes)

--kernels adds, for dropless / soft 1.0 / hard 1.0, what the CUDA kernel path shows without a GPU: launches per
call (the plan), the ptxas report of colibri_capacity (registers, static shared memory, spills; NVRTC, the Orin
profile's sm_87), and on the CPU emulation of the kernels (tests/kernels/emulator.py, the access model of
bench/kernel_access.py) the global-load bytes per call of the whole forward pass and of the weights, next to the
modelled bytes of colibri_capacity's scan, and the dropped pairs the kernels count (capacity_dropped) next to the
CPU backend's.
The emulation counts requested bytes, not GPU time: nothing here ran on a GPU.
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


def kernel_path(bundle, x: np.ndarray) -> tuple:
    """(launches per call, colibri_capacity's ptxas resources or None, its modelled scan bytes, all load bytes,
    weight load bytes, dropped pairs the emulated kernels count) for one call on x (1, 16, hidden)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    from emulator import EmulatedDevice

    m = bundle.manifest
    cap = next((k["resources"]["colibri_capacity"] for k in m["kernels"] if k["name"] == "capacity"), None)
    device = EmulatedDevice(m["profile"], bundle.weights_path)
    records = device.run_recorded(x.reshape(-1, x.shape[-1]))
    # colibri_capacity reads topk_ids / topk_weights with plain loads (it writes them too, so not through __ldg,
    # which the access model records): its scan is modelled, per layer pairs^2 ids (4 B) and, policy score, the two
    # weights (8 B) of each compare, served from L1/L2 (the pairs of one call are a few KiB).
    pairs = device.sizes.pairs
    score = (m["profile"].get("capacity") or {}).get("policy", "score") == "score"
    cap_bytes = device.header.num_layers * pairs * pairs * (12 if score else 4) if cap else 0
    all_bytes = sum(int(s[:, 3].sum()) for _, s in records)
    weight_bytes = sum(int(s[0, 3]) for _, s in records)
    dropped = int(device.buffer("capacity_dropped", np.int32).sum()) if "capacity_dropped" in device.buffers else 0
    return len(m["launch"]), cap, cap_bytes, all_bytes, weight_bytes, dropped


def main() -> int:
    from colibri_sdk.runtime import Runtime

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--kernels", action="store_true", help="add the kernel path: plan, ptxas, emulated loads")
    args = parser.parse_args()
    kernel_rows = []
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
                if args.kernels and name in ("dropless", "soft 1.0", "hard 1.0"):
                    rt.infer(xs[0])
                    kernel_rows.append((name, *kernel_path(rt.bundle, xs[0]), rt.stats().last_dropped_pairs))
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
        machine_line(),
        f"{'variant':>10} {'p50 ms':>8} {'p99 ms':>8} {'dropped/call':>13} {'max|dy|/max|y|':>15} {'||dy||/||y||':>13}",
    ]
    for name, p50, p99, dropped, mx, fro in rows:
        lines.append(f"{name:>10} {p50:>8.2f} {p99:>8.2f} {dropped:>13.1f} {mx:>15.4f} {fro:>13.4f}")
    if kernel_rows:
        lines += [
            "",
            "the kernel path without a GPU (NVRTC sm_87 ptxas report; CPU emulation of the kernels, one call on "
            "input 0; "
            "cap scan B modelled, the other loads counted by the access model):",
            f"{'variant':>10} {'launches':>9} {'cap regs':>9} {'cap smem':>9} {'cap spill':>10} {'cap scan B':>11} "
            f"{'all load B':>11} {'weights B':>10} {'cap/all':>8} {'dropped':>8} {'cpu':>5}",
        ]
        for name, launches, res, cap_bytes, all_bytes, weight_bytes, dropped, cpu in kernel_rows:
            regs, smem, spill = (res["registers"], res["shared_bytes"],
                                 res["spill_store_bytes"] + res["spill_load_bytes"]) if res else ("-", "-", "-")
            lines.append(f"{name:>10} {launches:>9} {regs:>9} {smem:>9} {spill:>10} {cap_bytes:>11} {all_bytes:>11} "
                         f"{weight_bytes:>10} {cap_bytes / all_bytes:>8.4f} {dropped:>8} {cpu:>5}")
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
