"""Pipelined calls (`Runtime.submit`, docs/runtime.md "Pipelined calls"): throughput and latency vs the stream count N,
measured side by side with synchronous `infer` on the same bundle and inputs.

    python bench/pipeline_bench.py                 # CPU backend
    python bench/pipeline_bench.py --fake          # also the CUDA backend on the fake driver (tests/fakecuda; g++)

Per N: CALLS calls submitted back to back (each a fresh N(0, 1) input at the bundle's shape), wall time for all of
them → calls/s and its ratio to the synchronous loop; per-call latency = submit → future done, p50/p99 in ms.
Neither backend here runs calls concurrently on a device (the CPU worker runs them in order; the fake driver runs
each call when it is enqueued), so these numbers show the pipeline's overhead, not what N buys on a GPU: that needs
a GPU run (the same script on a GPU machine, backend cuda).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CALLS = 24
DEPTHS = (1, 2, 4)


def build(folder: Path) -> Path:
    """A small bundle: 2 layers, 8 experts, top-2, hidden 64, intermediate 32, orin profile at batch 1 x tokens 4."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from gpu_support import random_model

    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    weights = random_model(folder / "model.colibri", layers=2, experts=8, top_k=2, hidden=64, inter=32, seed=3)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": 4}
    return build_bundle(Profile.from_dict(data), folder / "bundle", weights, workers=2).path


def measure(bundle: Path, backend: str) -> list[dict]:
    from colibri_sdk.runtime import Runtime

    rng = np.random.default_rng(0)
    rows = []
    with Runtime.load(bundle, backend=backend, verify=False) as rt:
        xs = [rng.standard_normal(rt.shape + (rt.hidden_size,)).astype(np.float32) for _ in range(CALLS)]
        rt.infer(xs[0])  # warm
        start = time.perf_counter()
        lat = []
        for x in xs:
            t = time.perf_counter()
            rt.infer(x)
            lat.append(time.perf_counter() - t)
        sync = time.perf_counter() - start
        rows.append(dict(backend=rt.backend_name, mode="infer", n=0, calls_per_s=CALLS / sync, ratio=1.0,
                         p50_ms=float(np.percentile(lat, 50)) * 1e3, p99_ms=float(np.percentile(lat, 99)) * 1e3))
    for n in DEPTHS:
        with Runtime.load(bundle, backend=backend, verify=False, streams=n) as rt:
            rt.submit(xs[0]).result()  # warm: builds the slots
            done_at = [0.0] * CALLS
            submitted = [0.0] * CALLS
            start = time.perf_counter()
            futures = []
            for i, x in enumerate(xs):
                submitted[i] = time.perf_counter()
                f = rt.submit(x)
                f.add_done_callback(lambda _, i=i: done_at.__setitem__(i, time.perf_counter()))
                futures.append(f)
            for f in futures:
                f.result()
            wall = time.perf_counter() - start
            lat = [(d - s) * 1e3 for d, s in zip(done_at, submitted)]
            rows.append(dict(backend=rt.backend_name, mode="submit", n=n, calls_per_s=CALLS / wall,
                             ratio=(CALLS / wall) / rows[0]["calls_per_s"], p50_ms=float(np.percentile(lat, 50)),
                             p99_ms=float(np.percentile(lat, 99))))
    return rows


def fake_env(bundle: Path, work: Path) -> dict:
    """LD_LIBRARY_PATH with the fake libcuda.so.1 (built with g++) and its kernel emulation library."""
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    from emulator import build_library

    from colibri_sdk.bundle import Bundle

    lib = work / "libcuda.so.1"
    driver = sorted(str(p) for p in (ROOT / "tests" / "fakecuda" / "driver").glob("*.cpp"))
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wno-unused-parameter",
                    *driver, "-o", str(lib), "-ldl", "-pthread"], check=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(work), env.get("LD_LIBRARY_PATH")) if p)
    env["COLIBRI_FAKE_CUDA_KERNELS"] = str(build_library(Bundle.open(bundle).kernels[0]["defines"]))
    return env


def show(rows: list[dict]) -> None:
    for r in rows:
        what = "infer (synchronous)" if r["mode"] == "infer" else f"submit, N = {r['n']}"
        print(f"  {r['backend']:<5} {what:<20} {r['calls_per_s']:8.1f} calls/s  x{r['ratio']:.2f} vs infer  "
              f"latency p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="also the CUDA backend on the fake driver")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # BUNDLE: measure cuda here, print JSON
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child), "cuda")))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bundle = build(work)
        print(f"pipeline_bench: {CALLS} calls per row, batch 1 x tokens 4, 2 layers x 8 experts, hidden 64")
        show(measure(bundle, "cpu"))
        if args.fake:
            done = subprocess.run([sys.executable, __file__, "--child", str(bundle)], env=fake_env(bundle, work),
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            show(json.loads(done.stdout.strip().splitlines()[-1]))
    print("  (no GPU here: the CPU backend runs submitted calls one at a time and the fake driver runs each call when "
          "it is enqueued, so these rows show the pipeline's overhead only; throughput vs N on a GPU needs a GPU run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
