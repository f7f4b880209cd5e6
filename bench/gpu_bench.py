"""The GPU check's measurements, one phase per process (scripts/gpu_check.sh runs them in order; docs/gpu_check.md).

    python bench/gpu_bench.py PHASE --out OUT [--fake]

Beside each measured kernel and forward time: the kernel's registers and static shared memory (ptxas), its
resident blocks per SM (the CUDA occupancy rules, bench/gpu/model_estimate.py) and the time model's ESTIMATE for
that device, storage and token count (bench/results/kernel_model.json), so that a GPU run calibrates the model.

Phases (each appends JSON lines to OUT/results.jsonl as soon as a value exists, see bench/gpu/device.py `Results`):
  versions      the GPU (name, compute capability, SMs, memory, driver), cuda-bindings, NVRTC, torch, transformers
  floor         device-to-device copy bandwidth and the read-only streaming kernel (bench/gpu/floor.py)
  layer         one Mixtral-8x7B layer (hidden 4096, intermediate 14336, 8 experts, top-2, fp16; weights filled on
                the device) at tokens 1, 4, 16, 64 on every path of the launch plan: per-kernel times, the forward
                pass as a CUDA Graph and eager, and the fraction of the floor (bench/gpu/layer.py)
  layer-quant   the same layer with int8 per-row and int4 group-128 experts at tokens 1 and 16, the profile's own path
  layers        32 such layers at tokens 1, graph vs eager
  correctness   the tests/gpu cases, each in its own process with a time limit (bench/gpu/correctness.py)
  transformers  MixtralSparseMoeBlock on the same GPU and weights, against the colibri layer (bench/gpu/hf_compare.py)
  table         print OUT/results.jsonl as a table (and write OUT/table.txt)

--fake: tiny shapes and few iterations, for the fake driver (tests/fakecuda), where the same code paths run on the
CPU emulation of the kernels; nothing it prints is a GPU measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import numpy as np  # noqa: E402

from device import FAKE, Device, Results, compile_bench_kernels, fill_weights, seconds_left  # noqa: E402

REAL = dict(hidden=4096, inter=14336, experts=8, top_k=2, tokens=(1, 4, 16, 64), layers=32, copy_bytes=1 << 30,
            read_bytes=4 << 30, floor_iters=5, kernel_iters=20, kernel_warm=3, iters=50, warm=5, layers_iters=20,
            hf_tokens=(1, 4, 16, 64), hf_iters=20, hf_warm=3, case_s=90, workers=6, padded_shape=16)
FAKE_CONFIG = dict(hidden=64, inter=32, experts=4, top_k=2, tokens=(1,), layers=2, copy_bytes=1 << 20,
                   read_bytes=1 << 16, floor_iters=1, kernel_iters=1, kernel_warm=0, iters=1, warm=0, layers_iters=1,
                   hf_tokens=(1,), hf_iters=1, hf_warm=0, case_s=60, workers=2, padded_shape=4)
# The tests/gpu cases run on the fake driver (fast on the CPU emulation; the PTX JIT cases skip there with the reason
# when the fake driver is set older than NVRTC). On a GPU every collected case runs.
FAKE_CASES = ("test_ptx_jit.py::test_shipped_profile_runs[a100]", "test_cuda_backend.py::test_bad_input_and_close")
SEED = 20261201


def config() -> dict:
    return FAKE_CONFIG if FAKE else REAL


def rng_input(tokens: int, hidden: int, seed: int) -> np.ndarray:
    """N(0, 1) float32 (tokens, hidden), rounded to fp16 values (so the fp16 transformers block sees the same)."""
    return np.random.default_rng(seed).standard_normal((tokens, hidden)).astype(np.float16).astype(np.float32)


def ratio(a, b, digits: int = 3):
    """round(a / b, digits), or None when either is missing or b is not positive."""
    return round(a / b, digits) if a is not None and b else None


def last_value(out: Path, phase: str, name: str, key: str):
    """`key` of the last ok line (phase, name) in OUT/results.jsonl, or None."""
    value = None
    path = out / "results.jsonl"
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if line.get("phase") == phase and line.get("name") == name and line.get("status") == "ok":
                value = line.get(key, value)
    return value


# ---- phases ---------------------------------------------------------------------------------------------------
def phase_versions(results: Results, out: Path) -> None:
    soft = {"python": platform.python_version(), "platform": platform.platform(), "fake_driver": FAKE,
            "install": os.environ.get("COLIBRI_GPU_CHECK_INSTALL", "?")}
    from importlib import metadata

    for name, dist in (("numpy", "numpy"), ("cuda_bindings", "cuda-bindings"), ("torch", "torch"),
                       ("transformers", "transformers"), ("cupy", "cupy-cuda13x"), ("cupy_cuda12", "cupy-cuda12x"),
                       ("setuptools", "setuptools"), ("pytest", "pytest")):
        try:
            soft[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            soft[name] = None  # not installed
    try:
        from colibri_sdk.aot.nvrtc import nvrtc_version, supported_archs

        soft["nvrtc"] = "%d.%d" % nvrtc_version()
        soft["nvrtc_archs"] = supported_archs()
    except Exception as exc:
        soft["nvrtc"] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        import colibri_sdk

        soft["colibri_sdk"] = str(Path(colibri_sdk.__file__).resolve().parent)
    except Exception as exc:
        soft["colibri_sdk"] = f"unavailable ({exc})"
    if not FAKE and soft["torch"]:
        try:
            import torch

            soft["torch_cuda"] = torch.version.cuda
        except Exception as exc:
            soft["torch_cuda"] = f"unavailable ({type(exc).__name__})"
    results.write("software", **soft)
    from colibri_sdk.driver_version import format_driver_version
    from colibri_sdk.runtime.driver import probe_driver

    ok, reason = probe_driver()
    if not ok:
        results.write("gpu", "fail", reason=f"no usable CUDA GPU: {reason}")
        return
    device = Device()
    free, total = device.mem_info()
    smi = ""
    if not FAKE:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=15).stdout.strip()
        except Exception as exc:
            smi = f"unavailable ({type(exc).__name__})"
    results.write("gpu", gpu=device.name, arch=device.arch, sm_count=device.sm_count,
                  driver=format_driver_version(device.driver_version), driver_version=device.driver_version,
                  memory_total_bytes=total, memory_free_bytes=free, nvidia_smi=smi)
    device.close()


def phase_floor(results: Results, out: Path) -> None:
    from floor import copy_bandwidth, read_bandwidth

    cfg = config()
    device = Device()
    try:
        results.write("copy_dtod", **copy_bandwidth(device, cfg["copy_bytes"], cfg["floor_iters"]))
    except Exception as exc:
        results.fail("copy_dtod", exc)
    kernels = compile_bench_kernels(device)
    results.write("read_stream", **read_bandwidth(device, kernels, cfg["read_bytes"], cfg["floor_iters"]))
    device.close()


def floor_gbs(results: Results, out: Path, device: Device, kernels: dict) -> float:
    """The read-stream bandwidth of the floor phase, or measured here (smaller) when that phase gave none."""
    from floor import read_bandwidth

    gbs = last_value(out, "floor", "read_stream", "gbs")
    if gbs:
        return float(gbs)
    cfg = config()
    measured = read_bandwidth(device, kernels, min(cfg["read_bytes"], 1 << 30), 3)
    results.write("read_stream", **measured, note="measured in this phase: the floor phase reported none")
    return float(measured["gbs"])


def measure_config(results, device, kernels, base, header, weights, tokens, label, data, default, gbs,
                   valid=None, variant=None, storage="fp16") -> None:
    from layer import LayerRun, expert_bytes, router_bytes, selected_experts
    from model_estimate import Estimates, resident_blocks

    cfg = config()
    run = LayerRun(device, data, header, weights)
    try:
        shape_tokens = run.tokens
        x = rng_input(shape_tokens, header.hidden_size, SEED + shape_tokens)
        real = shape_tokens if valid is None else valid
        x[real:] = 0.0
        y = run.run(x, valid)
        where = {"tokens": real, "shape_tokens": shape_tokens, "path": label, "crossover": variant,
                 "storage": storage}
        est = Estimates().est(device.arch, storage, real) if not FAKE else None
        per_kernel, gap_free = run.time_kernels(kernels, cfg["kernel_iters"], cfg["kernel_warm"])
        for index, (launch, stats) in enumerate(zip(run.plan, per_kernel)):
            res = run.resources.get(launch["symbol"], {})
            threads = int(np.prod(launch["block"]))
            blocks_sm = resident_blocks(device.arch, threads, res.get("registers"), res.get("shared_bytes"),
                                        run.data["hardware"]["shared_memory_per_sm"])
            results.write("kernel", **where, index=index, layer=launch.get("layer"), kernel=launch["kernel"],
                          symbol=launch["symbol"], grid=launch["grid"], block=launch["block"],
                          shared_bytes=launch.get("shared_bytes", 0), registers=res.get("registers"),
                          static_shared_bytes=res.get("shared_bytes"), resident_blocks_per_sm=blocks_sm,
                          est_us=(est or {}).get("kernels", {}).get(launch["symbol"]), **stats)
        graph = run.time_graph(cfg["iters"], cfg["warm"])
        eager = run.time_eager(cfg["iters"], cfg["warm"])
        experts = selected_experts(device, weights, header, x[:real])
        device_ids = None
        if "topk_ids" in run.buffers:
            ids = device.to_host(run.buffers["topk_ids"], run.buffer_sizes["topk_ids"]).view(np.int32)
            ids = ids[: real * header.top_k]
            device_ids = sorted(int(v) for v in np.unique(ids) if 0 <= v < header.num_experts)
        nbytes = len(experts) * expert_bytes(header) + router_bytes(header)
        floor_us = nbytes / (gbs * 1e9) * 1e6 if gbs > 0 else None
        kernel_sum = sum(s["median_us"] for s in per_kernel)
        results.write("forward", **where, default_path=default, kernels=sorted({l["kernel"] for l in run.plan}),
                      launches=len(run.plan), graph_median_us=graph["median_us"], graph_min_us=graph["min_us"],
                      graph_wall_us=graph["wall_median_us"], eager_median_us=eager["median_us"],
                      eager_wall_us=eager["wall_median_us"],
                      eager_over_graph=ratio(eager["median_us"], graph["median_us"]),
                      kernel_sum_us=round(kernel_sum, 3), gap_free=gap_free, selected_experts=experts,
                      device_selected_experts=device_ids, selected_bytes=nbytes, floor_gbs=round(gbs, 1),
                      floor_us=ratio(floor_us, 1), floor_fraction=ratio(floor_us, graph["median_us"], 4),
                      floor_fraction_kernels=ratio(floor_us, kernel_sum, 4),
                      output_finite=bool(np.isfinite(y).all()), compile_s=round(run.compile_s, 2),
                      est_layer_us=(est or {}).get("layer_us"), est_floor_fraction=(est or {}).get("floor_fraction"),
                      est_note="an estimate of bench/kernel_model.py (the h200/orin/a100/rtx4090 model), for calibration"
                      if est else None)
    finally:
        run.close()


def phase_layer(results: Results, out: Path, variant: str) -> None:
    """The layer at every token count with the crossover parameter at `variant` ("max" or "min"): one process per
    variant, so a kernel fault on one path (a CUDA context is lost with it) leaves the other path's numbers."""
    from layer import base_profile, io_buffers, mixtral_header, path_profiles, weights_bytes

    cfg = config()
    device = Device()
    kernels = compile_bench_kernels(device)
    gbs = floor_gbs(results, out, device, kernels)
    header = mixtral_header(1, cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"])
    base = base_profile(device.arch)
    size = weights_bytes({**base, "shape": {"batch": 1, "tokens": 1}}, header)
    weights = device.alloc(size, zero=False)
    fill_ms = fill_weights(device, kernels, weights, size, SEED)
    results.write("weights", bytes=size, fill_ms=round(fill_ms, 3), fill_gbs=ratio(size / 1e9, fill_ms * 1e-3, 1),
                  hidden=header.hidden_size, intermediate=header.intermediate_size, experts=header.num_experts,
                  top_k=header.top_k, profile=base["name"], arch=base["target"]["arch"])
    for tokens in cfg["tokens"]:
        entries = path_profiles(base, tokens, header, variant)
        if not entries:
            results.write("forward", "skip", tokens=tokens, variant=variant,
                          reason=f"the crossover parameter at its {variant}imum gives the plan already measured")
        for label, data, default in entries:
            if seconds_left() < 10:
                results.write("forward", "skip", tokens=tokens, path=label, reason="not run: the phase's time is spent")
                continue
            try:
                measure_config(results, device, kernels, base, header, weights, tokens, label, data, default, gbs,
                               variant=variant)
            except Exception as exc:
                results.fail("forward", exc, tokens=tokens, path=label)
    shape = {**base, "shape": {"batch": 1, "tokens": cfg["padded_shape"]}}
    if "valid_tokens" in io_buffers(shape, header):
        for label, data, default in path_profiles(base, cfg["padded_shape"], header, variant):
            if default:
                try:
                    measure_config(results, device, kernels, base, header, weights, 1, label, data, default, gbs,
                                   valid=1, variant=variant)
                except Exception as exc:
                    results.fail("forward", exc, tokens=1, shape_tokens=cfg["padded_shape"], path=label)
    elif variant == "max":
        results.write("padded", "skip", reason="catalog.io_buffers names no valid_tokens buffer: padded tokens are "
                                              "computed as real ones, so a padded shape is not measured")
    device.close()


QUANT_STORAGES = ("int8", "int4_g128")
QUANT_TOKENS = (1, 16)


def phase_layer_quant(results: Results, out: Path) -> None:
    """The layer with int8 per-row and int4 group-128 experts (fp16 scales, fp32 router; weights filled on the
    device: every byte pattern is a valid code, the fill's fp16 values are valid scales) at tokens 1 and 16 on the
    profile's own path."""
    from layer import base_profile, path_profiles, quant_header, weights_bytes

    cfg = config()
    device = Device()
    kernels = compile_bench_kernels(device)
    gbs = floor_gbs(results, out, device, kernels)
    base = base_profile(device.arch)
    tokens_list = [t for t in QUANT_TOKENS if not FAKE or t in cfg["tokens"]]
    for storage in QUANT_STORAGES:
        header = quant_header(1, cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"], storage)
        size = weights_bytes({**base, "shape": {"batch": 1, "tokens": 1}}, header)
        weights = device.alloc(size, zero=False)
        fill_ms = fill_weights(device, kernels, weights, size, SEED)
        results.write("weights", storage=storage, bytes=size, fill_ms=round(fill_ms, 3))
        for tokens in tokens_list:
            for label, data, default in path_profiles(base, tokens, header, None):
                if not default:
                    continue
                if seconds_left() < 10:
                    results.write("forward", "skip", tokens=tokens, storage=storage, path=label,
                                  reason="not run: the phase's time is spent")
                    continue
                try:
                    measure_config(results, device, kernels, base, header, weights, tokens, label, data, default,
                                   gbs, storage=storage)
                except Exception as exc:
                    results.fail("forward", exc, tokens=tokens, storage=storage, path=label)
        device.free(weights)
    device.close()


def phase_layers(results: Results, out: Path) -> None:
    from layer import (LayerRun, base_profile, expert_bytes, mixtral_header, path_profiles, router_bytes,
                       weights_bytes)

    cfg = config()
    device = Device()
    kernels = compile_bench_kernels(device)
    gbs = floor_gbs(results, out, device, kernels)
    layers = cfg["layers"]
    one = mixtral_header(1, cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"])
    base = base_profile(device.arch)
    free, _ = device.mem_info()
    per_layer = weights_bytes({**base, "shape": {"batch": 1, "tokens": 1}}, one)
    fit = max(1, int((free - (4 << 30 if not FAKE else 0)) // per_layer))
    if fit < layers:
        results.write("memory", "skip", reason=f"{layers} layers need {layers * per_layer} bytes, {free} free: "
                                               f"measuring {fit} layers", layers=fit)
        layers = fit
    header = mixtral_header(layers, cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"])
    label, data, _ = next(p for p in path_profiles(base, 1, header) if p[2])
    size = weights_bytes(data, header)
    weights = device.alloc(size, zero=False)
    fill_ms = fill_weights(device, kernels, weights, size, SEED + 1)
    run = LayerRun(device, data, header, weights)
    run.run(rng_input(1, header.hidden_size, SEED))
    graph = run.time_graph(cfg["layers_iters"], cfg["warm"])
    eager = run.time_eager(cfg["layers_iters"], cfg["warm"])
    # at one token every layer reads exactly top_k distinct experts and its router
    nbytes = layers * (header.top_k * expert_bytes(header) + router_bytes(header))
    floor_us = nbytes / (gbs * 1e9) * 1e6 if gbs > 0 else None
    results.write("forward", layers=layers, tokens=1, path=label, launches=len(run.plan), weights_bytes=size,
                  fill_ms=round(fill_ms, 3), graph_median_us=graph["median_us"], graph_wall_us=graph["wall_median_us"],
                  eager_median_us=eager["median_us"], eager_wall_us=eager["wall_median_us"],
                  eager_over_graph=ratio(eager["median_us"], graph["median_us"]), selected_bytes=nbytes,
                  floor_us=ratio(floor_us, 1), floor_fraction=ratio(floor_us, graph["median_us"], 4))
    x = rng_input(1, header.hidden_size, SEED)
    y_off = run.run(x)
    run.close()
    measure_pdl(results, device, data, header, weights, x, y_off, graph, label, layers)
    device.close()


def measure_pdl(results: Results, device, data: dict, header, weights: int, x, y_off, graph_off: dict, label: str,
                layers: int) -> None:
    """The same layers with programmatic dependent launch (the profile's `programmatic_dependent_launch`, sm_90
    and a CUDA 12.3 driver): the graph's time beside the one without, and its output, which must be the same bits."""
    from layer import LayerRun

    cfg = config()
    if device.compute_capability < (9, 0) or device.driver_version < 12030:
        results.write("forward_pdl", "skip", reason=f"programmatic dependent launch needs sm_90 and a CUDA 12.3 "
                                                   f"driver; this is {device.arch}, driver {device.driver_version}")
        return
    on = copy.deepcopy(data)
    on["programmatic_dependent_launch"] = True
    on["target"]["min_driver"] = max(on["target"]["min_driver"], 12030)
    run = LayerRun(device, on, header, weights)
    try:
        y_on = run.run(x)
        graph = run.time_graph(cfg["layers_iters"], cfg["warm"])
        results.write("forward_pdl", layers=layers, tokens=1, path=label, launches=len(run.plan),
                      pdl_launches=sum(1 for launch in run.plan if launch.get("pdl")),
                      graph_median_us=graph["median_us"], graph_off_median_us=graph_off["median_us"],
                      off_over_on=ratio(graph_off["median_us"], graph["median_us"], 4),
                      saved_us_per_layer=ratio(graph_off["median_us"] - graph["median_us"], layers, 3),
                      bitwise_equal=bool(np.array_equal(y_on.view(np.uint32), y_off.view(np.uint32))))
    finally:
        run.close()


def phase_correctness(results: Results, out: Path) -> None:
    from correctness import collect, run_cases

    cfg = config()
    args = ["-p", "fake_gpu_plugin"] if FAKE else []
    ids = collect(args, timeout=60)
    if FAKE:
        ids = [i for i in ids if i.split("tests/gpu/", 1)[-1] in FAKE_CASES]
    results.write("collected", cases=len(ids))
    from colibri_sdk.runtime.driver import probe_driver

    gpu, _ = probe_driver()  # on a GPU machine, a case skipped for lack of a GPU is a failure
    counts = run_cases(results, ids, args, cfg["case_s"], cfg["workers"], out / "correctness.log",
                       require_gpu=gpu and not FAKE)
    results.write("summary", "ok" if counts["fail"] == 0 else "fail", **counts)


def phase_transformers(results: Results, out: Path) -> None:
    from hf_compare import build_block, forward, implementations, load_weights, time_block
    from layer import LayerRun, base_profile, mixtral_header, path_profiles, weights_bytes

    cfg = config()
    try:
        import torch
        import transformers
    except Exception as exc:
        results.write("import", "skip", reason=f"torch / transformers not importable: {type(exc).__name__}: {exc}")
        return
    if torch.cuda.is_available():
        torch_device = "cuda"
    elif FAKE:
        torch_device = "cpu"  # the fake driver's "device memory" is host memory: the comparison runs on the CPU
    else:
        results.write("import", "skip", reason="torch sees no CUDA device (torch.cuda.is_available() is False)")
        return
    device = Device()
    if torch_device == "cuda":
        torch.cuda.init()
    kernels = compile_bench_kernels(device)
    header = mixtral_header(1, cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"])
    base = base_profile(device.arch)
    size = weights_bytes({**base, "shape": {"batch": 1, "tokens": 1}}, header)
    weights = device.alloc(size, zero=False)
    fill_weights(device, kernels, weights, size, SEED)
    ours = {}  # tokens -> (x, MoE(x) of colibri, graph stats, path)
    for tokens in cfg["hf_tokens"]:
        try:
            label, data, _ = next(p for p in path_profiles(base, tokens, header) if p[2])
            run = LayerRun(device, data, header, weights)
            x = rng_input(tokens, header.hidden_size, SEED + tokens)
            y = run.run(x)
            ours[tokens] = (x, y - x, run.time_graph(cfg["iters"], cfg["warm"]), label)
            run.close()
        except Exception as exc:
            results.fail("colibri", exc, tokens=tokens)
    for implementation in implementations(torch_device):
        try:
            block = build_block(header, torch_device, implementation)
            layout = load_weights(block, device, weights, header, torch_device)
            results.write("block", transformers=transformers.__version__, torch=torch.__version__, device=torch_device,
                          layout=layout, experts_implementation=implementation)
        except Exception as exc:
            results.fail("block", exc, experts_implementation=implementation)
            continue
        for tokens, (x, moe, graph, label) in ours.items():
            try:
                xt = torch.from_numpy(x).to(device=torch_device, dtype=torch.float16).reshape(1, tokens, -1)
                with torch.no_grad():
                    theirs = forward(block, xt).float().reshape(tokens, -1).cpu().numpy()
                scale = float(np.abs(theirs).max())
                per_token = np.abs(moe - theirs).max(axis=1)
                err = float(per_token.max())
                off = int((per_token > 2e-2 * scale + 1e-3).sum())  # e.g. a router near-tie resolved otherwise
                timing = time_block(block, xt, cfg["hf_iters"], cfg["hf_warm"], torch_device)
                results.write("moe_block", tokens=tokens, path=label, experts_implementation=implementation,
                              transformers_median_us=timing["median_us"], transformers_timer=timing["timer"],
                              colibri_graph_median_us=graph["median_us"],
                              speedup=ratio(timing["median_us"], graph["median_us"]), max_abs_err=err,
                              output_scale=scale, relative_err=ratio(err, scale, 6),
                              tokens_off=off, match=off == 0)
            except Exception as exc:
                results.fail("moe_block", exc, tokens=tokens, experts_implementation=implementation)
        del block
        if torch_device == "cuda":
            torch.cuda.empty_cache()
    device.close()


NEEDS_GPU = ("floor", "layer", "layer-quant", "layers", "transformers")  # skipped with the probe's reason without a GPU
PHASES = {"versions": phase_versions, "floor": phase_floor, "layer": phase_layer, "layer-quant": phase_layer_quant,
          "layers": phase_layers,
          "correctness": phase_correctness, "transformers": phase_transformers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=[*PHASES, "table"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--crossover", choices=("max", "min"), default="max",
                        help="layer: the GEMV/tiled crossover parameter at its maximum or minimum")
    parser.add_argument("--fake", action="store_true", help="tiny shapes for the fake driver (sets "
                                                            "COLIBRI_GPU_CHECK_FAKE=1 semantics)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "table":
        from table import print_table

        return print_table(out)
    if args.fake and not FAKE:
        parser.error("--fake needs COLIBRI_GPU_CHECK_FAKE=1 in the environment (scripts/gpu_check.sh --fake sets it)")
    results = Results(out, args.phase)
    t = time.monotonic()
    try:
        if args.phase in NEEDS_GPU:
            from colibri_sdk.runtime.driver import probe_driver

            ok, reason = probe_driver()
            if not ok:
                results.write("gpu", "skip", reason=f"no usable CUDA GPU: {reason}")
                return 0
        if args.phase == "layer":
            phase_layer(results, out, args.crossover)
        else:
            PHASES[args.phase](results, out)
    except Exception as exc:
        results.fail("error", exc)
        import traceback

        traceback.print_exc()
        return 1
    finally:
        print(f"[{args.phase}] {time.monotonic() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
