"""The memory floor of this GPU: device-to-device copy bandwidth and a read-only streaming kernel.

copy_dtod: cuMemcpyDtoDAsync of `nbytes`, timed by CUDA events; bandwidth counts bytes read + written.
read_stream: colibri_bench_read over `nbytes` (each byte read once, 16-byte loads, four in flight per thread,
    8 blocks of 256 threads per SM); bandwidth counts bytes read. This is the floor the layer is held against: a
    decode step must read the selected experts' weights at least once.
Each is the best of `iters` timed runs after one warm-up (the first touch of the buffers).
"""

from __future__ import annotations

import numpy as np

from device import Device, pointer_args


def copy_bandwidth(device: Device, nbytes: int, iters: int) -> dict:
    cu = device.cu
    src, dst = device.alloc(nbytes), device.alloc(nbytes)
    start, stop = device.event(), device.event()
    samples = []
    for i in range(iters + 1):
        device.record(start)
        device.check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, device.stream),
                     "cuMemcpyDtoDAsync")
        device.record(stop)
        ms = device.elapsed_ms(start, stop)
        if i:
            samples.append(ms)
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
    start, stop = device.event(), device.event()
    samples = []
    for i in range(iters + 1):
        device.record(start)
        device.launch(kernels["colibri_bench_read"], (grid, 1, 1), (256, 1, 1), 0, params)
        device.record(stop)
        ms = device.elapsed_ms(start, stop)
        if i:
            samples.append(ms)
    del keep
    device.free(src)
    device.free(sink)
    best = min(samples)
    return {"bytes": nvec * 16, "best_ms": best, "gbs": nvec * 16 / (best * 1e-3) / 1e9, "counted": "read",
            "grid": grid, "block": 256, "samples_ms": [round(s, 4) for s in samples]}
