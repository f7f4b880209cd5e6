"""GPU benchmark of the CUDA backend, everything measured side by side in one run.

Models: one MoE layer with Mixtral-8x7B dimensions (hidden 4096, intermediate 14336, 8 experts, top-2; synthetic
fp16 weights) and the embedded demo model (4 layers). For tokens 1, 4, 16, 64 (batch 1, fp16, a bundle built for
this GPU at each fixed shape):
  - per-call latency of `infer_padded` (host copies in and out included), CUDA Graph replay vs eager launches;
  - the memory-bandwidth floor: bytes of the experts the input selects (gate+up+down of each distinct expert of
    each layer, plus the routers) ÷ the device-to-device copy bandwidth measured on this GPU in the same run
    (cuMemcpyDtoD of 1 GiB, read + write bytes); reported as floor ÷ graph latency (1.0 = at the floor);
  - transformers' MixtralSparseMoeBlock (fp16, on this GPU, the same weights; residual between layers as the
    demo model), latency of its forward with torch.cuda.synchronize().

Usage: python bench/gpu_bench.py [--out DIR] [--iters N] [--skip-mixtral]
Prints a table and writes DIR/gpu_bench.json (default bench/results/gpu/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TOKENS = (1, 4, 16, 64)


def mixtral_layer(path: Path) -> Path:
    """A 1-layer fp16 .colibri file with Mixtral-8x7B sizes and synthetic N(0, 1/fan_in) weights.

    Fast to write (2.8 GB): one random block per tensor kind, each expert's tensor a rotation of it, written in the
    file order of docs/format.md (header, then gate/up/down/router blocks, experts in order).
    """
    from colibri_sdk.format import Header
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL, ROUTING_TOPK_SOFTMAX
    from colibri_sdk.format.writer import tensor_order

    h, i, e = 4096, 14336, 8
    header = Header(1, e, 2, h, i, dtype=1, routing=ROUTING_TOPK_SOFTMAX, composition=COMPOSITION_RESIDUAL)
    rng = np.random.default_rng(0)
    base = {}
    for kind in ("gate_proj", "up_proj", "down_proj", "router"):
        rows, cols = header.shape(kind)
        fan_in = cols if kind != "router" else rows
        base[kind] = (rng.standard_normal(rows * cols, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float16)
    with open(path, "wb") as f:
        f.write(header.pack())
        for kind, _, expert in tensor_order(header):
            f.write(np.roll(base[kind], 7919 * (expert or 0)).tobytes())
    assert path.stat().st_size == header.file_size
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB, best of 5."""
    from cuda.bindings import driver as cu

    from colibri_sdk.runtime.driver import check

    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    stream = cu.CUstream(0)
    n = 1 << 30
    src, dst = check(cu.cuMemAlloc(n), "cuMemAlloc"), check(cu.cuMemAlloc(n), "cuMemAlloc")
    start, stop = check(cu.cuEventCreate(0), "cuEventCreate"), check(cu.cuEventCreate(0), "cuEventCreate")
    best = float("inf")
    for _ in range(5):
        check(cu.cuEventRecord(start, stream), "cuEventRecord")
        check(cu.cuMemcpyDtoD(dst, src, n), "cuMemcpyDtoD")
        check(cu.cuEventRecord(stop, stream), "cuEventRecord")
        check(cu.cuEventSynchronize(stop), "cuEventSynchronize")
        best = min(best, check(cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3)
    for p in (src, dst):
        check(cu.cuMemFree(p), "cuMemFree")
    for event in (start, stop):
        check(cu.cuEventDestroy(event), "cuEventDestroy")
    check(cu.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")
    return 2 * n / best


def selected_bytes(weights_path: Path, x: np.ndarray) -> int:
    """Bytes of the experts x selects, layer by layer (routing by the float32 reference), plus the routers."""
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL
    from colibri_sdk.reference import ReferenceEngine

    engine = ReferenceEngine(weights_path)
    hd = engine.header
    h = x.reshape(-1, hd.hidden_size).astype(np.float32)
    per_expert = 3 * hd.hidden_size * hd.intermediate_size * hd.itemsize
    total = 0
    for layer in range(hd.num_layers):
        ids, _ = engine.route(layer, h)
        total += len(np.unique(ids)) * per_expert + hd.hidden_size * hd.num_experts * hd.itemsize
        y = engine.layer(layer, h)
        h = h + y if hd.composition == COMPOSITION_RESIDUAL else y
    engine.close()
    return total


def time_calls(fn, iters: int) -> float:
    """Median seconds per call after 5 warm-up calls."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def transformers_latency(weights_path: Path, x: np.ndarray, iters: int) -> float | None:
    """Median latency of the transformers Mixtral MoE blocks on the same weights (None without torch+CUDA)."""
    try:
        import torch
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from colibri_sdk.format import ColibriFile
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL

    f = ColibriFile(weights_path)
    hd = f.header
    config = MixtralConfig(hidden_size=hd.hidden_size, intermediate_size=hd.intermediate_size,
                           num_local_experts=hd.num_experts, num_experts_per_tok=hd.top_k)
    config._experts_implementation = "eager"
    blocks = []
    with torch.no_grad():
        for layer in range(hd.num_layers):
            block = MixtralSparseMoeBlock(config).to(device="cuda", dtype=torch.float16)
            gate = torch.from_numpy(np.asarray(f.experts("gate_proj", layer), dtype=np.float16))
            up = torch.from_numpy(np.asarray(f.experts("up_proj", layer), dtype=np.float16))
            block.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            block.experts.down_proj.copy_(torch.from_numpy(np.asarray(f.experts("down_proj", layer), dtype=np.float16)))
            block.gate.weight.copy_(torch.from_numpy(np.asarray(f.router(layer), dtype=np.float16).T.copy()))
            blocks.append(block)
    f.close()
    xt = torch.from_numpy(x).to(device="cuda", dtype=torch.float16)
    residual = hd.composition == COMPOSITION_RESIDUAL

    def forward():
        with torch.no_grad():
            h = xt
            for block in blocks:
                out = block(h)
                out = out[0] if isinstance(out, tuple) else out
                h = h + out if residual else out
            torch.cuda.synchronize()

    result = time_calls(forward, iters)
    blocks.clear()  # free the blocks' device memory before emptying the cache
    torch.cuda.empty_cache()
    return result


def bench_model(label: str, weights: Path, work: Path, bandwidth: float, iters: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from gpu_support import build, profile_for_this_gpu

    from colibri_sdk.bundle import Bundle
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    rows = []
    for tokens in TOKENS:
        profile = profile_for_this_gpu(dtype="fp16", shape={"batch": 1, "tokens": tokens})
        bundle = Bundle.open(build(profile, weights, work / f"{label}-t{tokens}"), verify=False)
        hidden = bundle.manifest["weights"]["header"]["hidden_size"]
        x = np.random.default_rng(tokens).standard_normal((1, tokens, hidden)).astype(np.float32)
        with CudaBackend(bundle) as graph:
            t_graph = time_calls(lambda: graph.infer_padded(x), iters)
        with CudaBackend(bundle, eager=True) as eager:
            t_eager = time_calls(lambda: eager.infer_padded(x), iters)
        t_hf = transformers_latency(bundle.weights_path, x, max(10, iters // 4))
        floor = selected_bytes(bundle.weights_path, x) / bandwidth
        rows.append({"model": label, "tokens": tokens, "graph_ms": t_graph * 1e3, "eager_ms": t_eager * 1e3,
                     "transformers_ms": None if t_hf is None else t_hf * 1e3, "floor_ms": floor * 1e3,
                     "floor_fraction": floor / t_graph})
        print(f"  {label} tokens {tokens}: graph {t_graph * 1e3:.3f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/gpu")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--skip-mixtral", action="store_true")
    args = parser.parse_args(argv)
    from colibri_sdk.demo import write_demo_model
    from colibri_sdk.runtime.driver import probe_driver

    ok, reason = probe_driver()
    if not ok:
        print(f"gpu_bench: no usable CUDA GPU: {reason}")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="colibri-gpu-bench-") as tmp:
        work = Path(tmp)
        rows += bench_model("demo", write_demo_model(work / "demo.colibri", dtype="fp16"), work, bandwidth, args.iters)
        if not args.skip_mixtral:
            weights = mixtral_layer(work / "mixtral-layer.colibri")
            rows += bench_model("mixtral-layer", weights, work, bandwidth, max(20, args.iters // 4))
    header = f"{'model':<14} {'tokens':>6} {'graph ms':>9} {'eager ms':>9} {'eager/graph':>11} {'HF ms':>8} " \
             f"{'HF/graph':>8} {'floor ms':>9} {'floor/graph':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        hf = r["transformers_ms"]
        hf_ms = "-" if hf is None else f"{hf:.3f}"
        hf_ratio = "-" if hf is None else f"{hf / r['graph_ms']:.2f}"
        lines.append(
            f"{r['model']:<14} {r['tokens']:>6} {r['graph_ms']:>9.3f} {r['eager_ms']:>9.3f} "
            f"{r['eager_ms'] / r['graph_ms']:>11.2f} {hf_ms:>8} {hf_ratio:>8} {r['floor_ms']:>9.3f} "
            f"{r['floor_fraction']:>11.2f}"
        )
    table = "\n".join(lines)
    print(table)
    (out / "gpu_bench.json").write_text(json.dumps({"copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows}, indent=2) + "\n")
    (out / "gpu_bench.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
