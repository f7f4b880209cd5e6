"""The memory floor of this GPU: device-to-device copy bandwidth and a read-only streaming kernel.

copy_dtod: cuMemcpyDtoDAsync of `nbytes`, timed by CUDA events; bandwidth counts bytes read + written.
read_stream: colibri_bench_read over `nbytes` (each byte read once, 16-byte loads, four in flight per thread,
    8 blocks of 256 threads per SM); bandwidth counts bytes read. This is the floor the layer is held against: a
    decode step must read the selected experts' weights at least once.
Each is the best of `iters` timed runs after warm-up runs of at least 0.1 s together (the first touch of the
buffers, and the clocks up from idle), at most 50.
"""

from __future__ import annotations

import numpy as np

from device import Device, pointer_args

WARM_S = 0.1
WARM_MAX = 50


def timed_runs(device: Device, enqueue, iters: int) -> list[float]:
    """Event times in ms of `iters` runs of `enqueue()`, after the warm-up runs."""
    start, stop = device.event(), device.event()
    warm, runs, samples = 0.0, 0, []
    while runs < WARM_MAX and (runs == 0 or warm < WARM_S):
        device.record(start)
        enqueue()
        device.record(stop)
        warm += device.elapsed_ms(start, stop) / 1e3
        runs += 1
    for _ in range(iters):
        device.record(start)
        enqueue()
        device.record(stop)
        samples.append(device.elapsed_ms(start, stop))
    return samples


def copy_bandwidth(device: Device, nbytes: int, iters: int) -> dict:
    cu = device.cu
    src, dst = device.alloc(nbytes), device.alloc(nbytes)

    def copy():
        device.check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, device.stream),
                     "cuMemcpyDtoDAsync")

    samples = timed_runs(device, copy, iters)
    device.free(src)
    device.free(dst)
    best = min(samples)
    return {"bytes": nbytes, "best_ms": best, "gbs": 2 * nbytes / (best * 1e-3) / 1e9, "counted": "read + write",
            "samples_ms": [round(s, 4) for s in samples]}


def read_bandwidth(device: Device, kernels: dict, nbytes: int, iters: int) -> dict:
    nvec = min(nbytes // 16, (1 << 32) - 1)
    src, sink = device.alloc(nbytes), device.alloc(4)
    grid = max(1, min(device.sm_count * 8, -(-nvec // 256)))
    params, keep = pointer_args([(np.uint64, src), (np.uint32, nvec), (np.uint64, sink)])
    samples = timed_runs(device, lambda: device.launch(kernels["colibri_bench_read"], (grid, 1, 1), (256, 1, 1), 0,
                                                       params), iters)
    del keep
    device.free(src)
    device.free(sink)
    best = min(samples)
    return {"bytes": nvec * 16, "best_ms": best, "gbs": nvec * 16 / (best * 1e-3) / 1e9, "counted": "read",
            "grid": grid, "block": 256, "samples_ms": [round(s, 4) for s in samples]}
