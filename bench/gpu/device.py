"""The GPU of the check through the CUDA driver API (cuda-bindings 12.x/13.x), and the results file.

Every driver call goes through `colibri_sdk.runtime.driver.check` (a `CudaError` names the call and the CUDA error).
On the fake driver (`scripts/gpu_check.sh --fake`, COLIBRI_GPU_CHECK_FAKE=1) each module load first binds the kernel
emulation library of its sources (tests/kernels/emulator.py) to the fake libcuda.so.1, as tests/fakecuda does.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = Path(__file__).resolve().parent
FAKE = os.environ.get("COLIBRI_GPU_CHECK_FAKE") == "1"


class Results:
    """OUT/results.jsonl, one JSON object per line, appended and flushed as soon as a value exists.

    Every line has "phase", "name", "status" ("ok", "skip" or "fail"; "reason" says why for the last two) and
    "time" (UTC, ISO 8601); the rest are the measurement's values (units in the key: _us, _ms, _gbs, _bytes).
    """

    def __init__(self, out: str | os.PathLike, phase: str):
        self.path = Path(out) / "results.jsonl"
        self.phase = phase

    def write(self, _name: str, _status: str = "ok", **values) -> dict:
        name, status = _name, _status
        line = {"phase": self.phase, "name": name, "status": status,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **values}
        text = json.dumps(_finite(line), default=_plain, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[{self.phase}] {name}: {status} " + " ".join(f"{k}={v}" for k, v in values.items() if _short(v)),
              flush=True)
        return line

    def fail(self, name: str, exc: BaseException, **values) -> dict:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return self.write(name, "fail", reason=f"{type(exc).__name__}: {first}"[:500], **values)


def _finite(value):
    """NaN and infinities become None (strict JSON); containers are walked."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return None
    return value


def _plain(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (tuple, set, np.ndarray)):
        return list(value)
    return str(value)


def _short(value) -> bool:
    return isinstance(value, (int, float, str)) and len(str(value)) <= 100


def seconds_left() -> float:
    """Seconds until this phase's deadline (COLIBRI_GPU_CHECK_DEADLINE, epoch seconds, set by gpu_check.sh);
    infinite without one."""
    deadline = os.environ.get("COLIBRI_GPU_CHECK_DEADLINE")
    return float(deadline) - time.time() if deadline else float("inf")


def stats_us(samples_ms: list[float]) -> dict:
    """median / min / max of event times given in ms, as microseconds."""
    us = [1e3 * s for s in samples_ms]
    return {"median_us": round(statistics.median(us), 3), "min_us": round(min(us), 3), "max_us": round(max(us), 3),
            "samples": len(us)}


def bind_emulation(source_dir: Path, units, defines: dict) -> None:
    """On the fake driver only: make the next module loads run the CPU emulation of these sources."""
    if not FAKE:
        return
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    from emulator import build_library

    path = build_library(defines, source_dir=source_dir, units=units)
    ctypes.CDLL("libcuda.so.1").colibri_fake_cuda_set_kernels(str(path).encode())


class Device:
    """Device 0: its primary context, one non-blocking stream, allocations freed by `close()`.

    Attributes:
        name, compute_capability (major, minor), driver_version (cuDriverGetVersion, e.g. 13000), sm_count.
    """

    def __init__(self, ordinal: int = 0):
        from cuda.bindings import driver as cu

        from colibri_sdk.runtime.driver import check

        self.cu, self.check = cu, check
        check(cu.cuInit(0), "cuInit")
        self.driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        self.dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        get = lambda a: int(check(cu.cuDeviceGetAttribute(a, self.dev), "cuDeviceGetAttribute"))  # noqa: E731
        self.compute_capability = (get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                   get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        raw = check(cu.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        self.name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        self._device_ptrs: dict[int, object] = {}
        self._host_ptrs: list = []
        self._modules: list = []
        self._events: list = []

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        free, total = self.check(self.cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # ---- memory ---------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int, zero: bool = True) -> int:
        ptr = self.check(self.cu.cuMemAlloc(max(int(nbytes), 1)), "cuMemAlloc")
        self._device_ptrs[int(ptr)] = ptr
        if zero:
            self.check(self.cu.cuMemsetD8(self.cu.CUdeviceptr(int(ptr)), 0, max(int(nbytes), 1)), "cuMemsetD8")
        return int(ptr)

    def free(self, ptr: int) -> None:
        handle = self._device_ptrs.pop(int(ptr), None)
        if handle is not None:
            self.check(self.cu.cuMemFree(handle), "cuMemFree")

    def pinned(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Page-locked host memory and a uint8 view of it (valid until close)."""
        ptr = self.check(self.cu.cuMemHostAlloc(max(int(nbytes), 1), 0), "cuMemHostAlloc")
        self._host_ptrs.append(ptr)
        return int(ptr), np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(int(ptr)))

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        """A synchronous copy of `nbytes` at device address `ptr` into a new uint8 array."""
        self.sync()
        out = np.empty(int(nbytes), np.uint8)
        self.check(self.cu.cuMemcpyDtoH(out.ctypes.data, self.cu.CUdeviceptr(int(ptr)), int(nbytes)), "cuMemcpyDtoH")
        return out

    def copy_to(self, dst: int, src: int, nbytes: int, device_dst: bool) -> None:
        """Synchronous copy from device address `src` to `dst` (a device address, or host memory)."""
        self.sync()
        cu = self.cu
        if device_dst:
            self.check(cu.cuMemcpyDtoD(cu.CUdeviceptr(int(dst)), cu.CUdeviceptr(int(src)), int(nbytes)), "cuMemcpyDtoD")
        else:
            self.check(cu.cuMemcpyDtoH(int(dst), cu.CUdeviceptr(int(src)), int(nbytes)), "cuMemcpyDtoH")
        self.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    # ---- modules and launches -------------------------------------------------------------------------------
    def load(self, image: bytes, emulation: tuple | None = None):
        """cuModuleLoadData of a cubin; `emulation` = (source dir, units, defines) for the fake driver."""
        if emulation is not None:
            bind_emulation(*emulation)
        data = np.frombuffer(image, dtype=np.uint8)
        module = self.check(self.cu.cuModuleLoadData(data.ctypes.data), "cuModuleLoadData")
        self._modules.append(module)
        return module

    def function(self, module, symbol: str):
        return self.check(self.cu.cuModuleGetFunction(module, symbol.encode()), f"cuModuleGetFunction({symbol})")

    def allow_shared(self, function, nbytes: int) -> None:
        """Let `function` take `nbytes` of dynamic shared memory (needed above 48 KiB)."""
        attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.check(self.cu.cuFuncSetAttribute(function, attr, int(nbytes)), "cuFuncSetAttribute")

    def launch(self, function, grid, block, shared: int, params: np.ndarray, pdl: bool = False) -> None:
        """One launch on the stream; pdl: with the programmatic stream serialization attribute (the runtime's
        `launch_kernel`, a launch plan's "pdl")."""
        from colibri_sdk.runtime.driver import launch_kernel

        launch_kernel(self.cu, (function, tuple(grid), tuple(block), int(shared), params), self.stream, pdl)

    def event(self):
        ev = self.check(self.cu.cuEventCreate(0), "cuEventCreate")
        self._events.append(ev)
        return ev

    def record(self, ev) -> None:
        self.check(self.cu.cuEventRecord(ev, self.stream), "cuEventRecord")

    def elapsed_ms(self, start, stop) -> float:
        self.check(self.cu.cuEventSynchronize(stop), "cuEventSynchronize")
        elapsed = getattr(self.cu, "cuEventElapsedTime", None) or self.cu.cuEventElapsedTime_v2
        return float(self.check(elapsed(start, stop), "cuEventElapsedTime"))

    def sync(self) -> None:
        self.check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # ---- graphs ---------------------------------------------------------------------------------------------
    def capture(self, enqueue):
        """Capture what `enqueue()` puts on the stream into an executable CUDA Graph; returns (graph, exec)."""
        cu = self.cu
        self.check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                   "cuStreamBeginCapture")
        try:
            enqueue()
        except BaseException:
            cu.cuStreamEndCapture(self.stream)
            raise
        graph = self.check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        return graph, self.check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def graph_launch(self, graph_exec) -> None:
        self.check(self.cu.cuGraphLaunch(graph_exec, self.stream), "cuGraphLaunch")

    def destroy_graph(self, graph, graph_exec) -> None:
        self.check(self.cu.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")
        self.check(self.cu.cuGraphDestroy(graph), "cuGraphDestroy")

    def close(self) -> None:
        """Free everything; errors are ignored (the process ends next)."""
        cu = self.cu
        cu.cuCtxSetCurrent(self.ctx)
        cu.cuStreamSynchronize(self.stream)
        for ev in self._events:
            cu.cuEventDestroy(ev)
        for ptr in self._device_ptrs.values():
            cu.cuMemFree(ptr)
        for ptr in self._host_ptrs:
            cu.cuMemFreeHost(ptr)
        for module in self._modules:
            cu.cuModuleUnload(module)
        cu.cuStreamDestroy(self.stream)
        cu.cuDevicePrimaryCtxRelease(self.dev)
        self._events, self._device_ptrs, self._host_ptrs, self._modules = [], {}, [], []


def pointer_args(values: list[tuple[np.dtype, int | float]]) -> tuple[np.ndarray, list]:
    """A cuLaunchKernel kernelParams array for (dtype, value) arguments, and the arrays it points into."""
    holders = [np.array([v], dtype=t) for t, v in values]
    params = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
    return params, holders


def fake_nvrtc_cache():
    """On the fake driver, the NVRTC cache (`colibri_sdk.aot.cache.NvrtcCache`, COLIBRI_CACHE_DIR or the user's
    cache folder), so the phases' processes compile each kernel once; on a GPU None (NVRTC runs every time, and
    `compile_s` is NVRTC's own time)."""
    if not FAKE:
        return None
    from colibri_sdk.aot.cache import NvrtcCache

    return NvrtcCache()


def compile_bench_kernels(device: Device):
    """NVRTC-compile bench_kernels.cu for the device's arch and load it; returns {symbol: function}."""
    from colibri_sdk.aot.nvrtc import compile_source

    symbols = ("colibri_bench_fill", "colibri_bench_read", "colibri_bench_spin")
    source = (BENCH_DIR / "bench_kernels.cu").read_text()
    cache = fake_nvrtc_cache()
    compiled = (cache.compile_source if cache else compile_source)(source, "bench_kernels.cu", device.arch, {},
                                                                    [BENCH_DIR])
    module = device.load(compiled.cubin, (BENCH_DIR, [("bench_kernels.cu", symbols)], {}))
    return {s: device.function(module, s) for s in symbols}


def fill_weights(device: Device, kernels: dict, ptr: int, nbytes: int, seed: int) -> float:
    """Fill `nbytes` at `ptr` with hashed fp16 values (colibri_bench_fill, chunks of 2^31 words); returns the
    kernels' time in ms."""
    words = int(nbytes) // 4
    chunk_words = 1 << 31
    start, stop = device.event(), device.event()
    keep = []
    device.record(start)
    for chunk, first in enumerate(range(0, words, chunk_words)):
        n = min(chunk_words, words - first)
        grid = max(1, min(device.sm_count * 8, -(-n // 256)))
        params, holders = pointer_args([(np.uint64, ptr + 4 * first), (np.uint32, n), (np.uint32, seed),
                                        (np.uint32, chunk)])
        keep.append((params, holders))
        device.launch(kernels["colibri_bench_fill"], (grid, 1, 1), (256, 1, 1), 0, params)
    device.record(stop)
    ms = device.elapsed_ms(start, stop)
    del keep
    return ms


def spin(device: Device, kernels: dict, cycles: int) -> list:
    """Enqueue one busy-wait kernel of `cycles` clocks; returns the argument arrays to keep alive until it ran."""
    params, keep = pointer_args([(np.uint32, cycles)])
    device.launch(kernels["colibri_bench_spin"], (1, 1, 1), (32, 1, 1), 0, params)
    return [params, keep]
