"""The CUDA backend: a bundle's kernels on a GPU through the driver API (cuda-bindings 12.x and 13.x).

At load (docs/runtime-cuda.md):
  1. cuInit, device 0, its compute capability against the bundle's: same major and >= minor runs the cubin; a newer
     GPU JIT-compiles the PTX if the driver is at least as new as the PTX; anything else is a BackendError naming
     both capabilities.
  2. cuModuleLoadData for each catalogue kernel; cuModuleGetFunction for each symbol of the launch plan.
  3. The weights (the .colibri data after the header) are uploaded once from the mmap'ed file in 64 MiB chunks:
     through two pinned staging buffers on a discrete GPU; directly from the mapping on an integrated GPU
     (CU_DEVICE_ATTRIBUTE_INTEGRATED, e.g. Jetson Orin), dropping each chunk's pages afterwards (madvise
     MADV_DONTNEED, posix_fadvise POSIX_FADV_DONTNEED) so the weights are not resident twice.
  4. Every scratch buffer of `catalog.device_buffers` is allocated once; input and output live in pinned host memory.
  5. The whole forward pass (input copy, every layer's launches, output copy) is captured once into a CUDA Graph.
Per call: copy x and the valid-token counts into pinned memory, cuGraphLaunch (its first nodes copy both to the
device: `catalog.io_buffers`), one cuStreamSynchronize, copy the pinned output out. Eager
mode enqueues the same copies and launches without the graph. With expert capacity, the per-layer dropped-pair
counts (`catalog.CAPACITY_DROPPED`) are copied back after the call. A lock serialises calls; `close()` frees
everything.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

from .. import catalog
from ..errors import BackendError, BundleError, InputError
from ..format.constants import HEADER_SIZE
from ..driver_version import format_driver_version
from .driver import check
from .padding import check_valid_tokens

UPLOAD_CHUNK = 64 << 20  # bytes per weight upload step
POISON_WORD = 0x7FC00000  # a float32 quiet NaN; as int32 a large positive value no kernel accepts as an index


def parse_version(text: str) -> int:
    """"12.9" → 12090, cuDriverGetVersion's encoding (1000*major + 10*minor)."""
    major, _, minor = str(text).partition(".")
    return 1000 * int(major) + 10 * int(minor or 0)


def select_image(device_cc, bundle_cc, driver_version: int, min_driver: int, nvrtc_version: str) -> str:
    """Which image of a bundle runs on a device.

    Args:
        device_cc, bundle_cc: (major, minor) compute capabilities of the GPU and of the bundle's arch.
        driver_version: cuDriverGetVersion of this driver (e.g. 12060).
        min_driver: the bundle's minimum driver (manifest `min_driver`).
        nvrtc_version: the NVRTC that wrote the PTX ("12.9"); JIT needs a driver at least that new.

    Returns:
        "cubin" (same major, device minor >= bundle minor) or "ptx" (a newer GPU and a new enough driver).

    Raises:
        BackendError: the driver is older than the bundle's minimum, or the GPU is older than the bundle's arch,
            or PTX JIT would need a newer driver; the message names both capabilities and versions.
    """
    dev, bun = tuple(int(v) for v in device_cc), tuple(int(v) for v in bundle_cc)
    names = f"the GPU is sm_{dev[0]}{dev[1]}, the bundle is built for sm_{bun[0]}{bun[1]}"
    if driver_version < min_driver:
        raise BackendError(
            f"the CUDA driver is {format_driver_version(driver_version)}; the bundle needs at least "
            f"{format_driver_version(min_driver)} (manifest min_driver {min_driver}); {names}"
        )
    if dev[0] == bun[0] and dev[1] >= bun[1]:
        return "cubin"
    if dev < bun:
        raise BackendError(
            f"{names}: its code cannot run on an older GPU; build the bundle with a profile for "
            f"sm_{dev[0]}{dev[1]} or older"
        )
    needed = max(min_driver, parse_version(nvrtc_version))
    if driver_version < needed:
        raise BackendError(
            f"{names}: the cubin needs compute capability {bun[0]}.x, and JIT-compiling the PTX (NVRTC "
            f"{nvrtc_version}) needs a CUDA driver >= {format_driver_version(needed)}, this one is "
            f"{format_driver_version(driver_version)}"
        )
    return "ptx"


class _Resources:
    """Everything the backend holds on the GPU and in pinned memory, released once (by close or the finalizer)."""

    def __init__(self, cu):
        self.cu = cu
        self.ctx = None
        self.device = None
        self.stream = None
        self.modules: list = []
        self.device_ptrs: list = []
        self.host_ptrs: list = []
        self.events: list = []
        self.graph = None
        self.graph_exec = None
        self.released = False

    def release(self) -> None:
        """Free in reverse order of creation; errors are ignored (a dead context frees everything anyway)."""
        if self.released:
            return
        self.released = True
        cu = self.cu
        if self.ctx is not None:
            cu.cuCtxSetCurrent(self.ctx)
        if self.stream is not None:
            cu.cuStreamSynchronize(self.stream)
        if self.graph_exec is not None:
            cu.cuGraphExecDestroy(self.graph_exec)
        if self.graph is not None:
            cu.cuGraphDestroy(self.graph)
        for event in self.events:
            cu.cuEventDestroy(event)
        for ptr in self.device_ptrs:
            cu.cuMemFree(ptr)
        for ptr in self.host_ptrs:
            cu.cuMemFreeHost(ptr)
        for module in self.modules:
            cu.cuModuleUnload(module)
        if self.stream is not None:
            cu.cuStreamDestroy(self.stream)
        if self.ctx is not None:
            cu.cuDevicePrimaryCtxRelease(self.device)
        self.graph_exec = self.graph = self.stream = self.ctx = None
        self.events, self.device_ptrs, self.host_ptrs, self.modules = [], [], [], []


def _launch_plan(manifest: dict, header) -> list[dict]:
    """The catalogue's launch plan for the bundle's profile (at its shape) and weights. A manifest's `launch`, when
    present, must equal it, and every kernel's `defines` the catalogue's compile constants: a grid, buffer name or
    weights offset of its own, or kernels compiled for another shape, would run the kernels outside their buffers.

    Raises:
        BundleError: naming the first kernel or launch that differs.
    """
    import json

    defines = json.loads(json.dumps(catalog.compile_defines(manifest["profile"], header)))
    for i, kernel in enumerate(manifest["kernels"]):
        if kernel.get("defines") != defines:  # e.g. another shape's kernels: they would index past this one's buffers
            raise BundleError(
                f"manifest.json: kernels[{i}] ({kernel.get('name')!r}).defines differ from the catalogue's compile "
                f"constants for the bundle's profile and weights at shape batch {manifest['shape']['batch']} x "
                f"tokens {manifest['shape']['tokens']}; allowed: the kernels colibri-sdk build compiled for it "
                "(rebuild the bundle)"
            )
    from ..bundle.records import check_buffer_records

    check_buffer_records(manifest, header, only=(manifest["shape"]["batch"], manifest["shape"]["tokens"]))  # what a C runtime allocates
    plan = catalog.launch_plan(manifest["profile"], header)
    recorded = manifest.get("launch")
    expected = json.loads(json.dumps(plan))
    if recorded is not None and recorded != expected:
        index = next((i for i, (a, b) in enumerate(zip(recorded, expected)) if a != b),
                     min(len(recorded), len(expected)))
        raise BundleError(
            f"manifest.json: launch[{index}] differs from the catalogue's launch plan for the bundle's profile and "
            f"weights ({len(recorded)} launches recorded, {len(expected)} expected); allowed: the plan colibri-sdk "
            "build writes (rebuild the bundle)"
        )
    return plan


class CudaBackend:
    """Runs a bundle on device `device` through the CUDA driver API.

    Args:
        bundle: an opened `colibri_sdk.bundle.Bundle`.
        eager: launch kernels one by one on each call instead of replaying the captured CUDA Graph.
        device: CUDA device ordinal.
        share: another CudaBackend of the same bundle (another compiled shape, `Bundle.for_shape`) whose device and
            uploaded weights this one uses instead of uploading its own; its kernels, scratch buffers, pinned I/O,
            stream and graph are its own. `share` must be closed after this one (the Runtime closes the smaller
            shapes first).

    Attributes:
        name: "cuda".
        image_kind: "cubin" or "ptx" (JIT), per `select_image`.
        device_name, compute_capability (major, minor), integrated (bool), driver_version (int).
        shape: (batch, tokens) fixed shape; hidden: hidden size.

    Raises:
        BackendError: driver too old, or the bundle's code cannot run on this GPU (names both capabilities).
        CudaError: a driver call failed (call name + CUDA error name).
    """

    name = "cuda"

    def __init__(self, bundle, eager: bool = False, device: int = 0, share: "CudaBackend | None" = None):
        from cuda.bindings import driver as cu

        self._cu = cu
        self._lock = threading.Lock()
        self._res = _Resources(cu)
        self._finalizer = weakref.finalize(self, self._res.release)
        self.eager = bool(eager)
        if hasattr(bundle, "for_shape"):  # a bundle of several shapes runs its largest (top-level) one here
            bundle = bundle.for_shape(*bundle.shape)
        self.bundle = bundle
        self._share = share  # keeps the owner of the weights alive while this backend is
        try:
            self._open_device(device if share is None else share.device_ordinal)
            self._load(bundle)
        except BaseException:
            self.close()
            raise

    # ---- load -------------------------------------------------------------------------------------------------
    def _open_device(self, ordinal: int) -> None:
        cu, res = self._cu, self._res
        check(cu.cuInit(0), "cuInit")
        self.driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        if not 0 <= ordinal < count:
            raise BackendError(f"CUDA device {ordinal} does not exist; allowed: 0..{count - 1}")
        dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.device_ordinal = ordinal
        res.device = dev
        res.ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
        self.compute_capability = (int(major), int(minor))
        self.integrated = bool(check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_INTEGRATED, dev), "cuDeviceGetAttribute"))
        raw = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        self.device_name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        res.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")

    def _load(self, bundle) -> None:
        manifest = bundle.manifest
        self.image_kind = select_image(
            self.compute_capability,
            bundle.compute_capability,
            self.driver_version,
            int(manifest["min_driver"]),
            str(manifest["nvrtc_version"]),
        )
        with bundle.open_weights() as weights:
            self.header = weights.header
        profile = manifest["profile"]
        self.capacity = profile.get("capacity")  # expert capacity (kernels/capacity.cu) or None: dropless
        self.last_dropped = 0  # pairs dropped by expert capacity in the latest call (Runtime.stats)
        self.shape = tuple(bundle.shape)
        self.hidden = self.header.hidden_size
        plan = _launch_plan(manifest, self.header)  # refused before any image, weight or buffer is loaded
        self._functions = self._load_functions(bundle)
        if self._share is not None:  # another shape of the same bundle: its weights are already on the device
            self._weights = self._share._weights
        else:
            self._weights = self._upload_weights(bundle.weights_path)
        self._buffers = {name: self._alloc(size) for name, size in sorted(catalog.device_buffers(profile, self.header).items())}
        self._zero_counters(catalog.device_buffers(profile, self.header))
        self._io = catalog.io_buffers(self.header)
        self._launches = [self._prepare(launch) for launch in plan]
        self._launch_layers = [int(launch["layer"]) for launch in plan]  # per-layer calls run a sub-range
        self._capacity_launch = [launch["symbol"] == "colibri_capacity" for launch in plan]
        if self.capacity is not None:  # the per-layer dropped-pair counts, read back after each call
            self._dropped_ptr, pinned = self._pinned(self.header.num_layers * 4)
            self._dropped = pinned.view(np.int32)
        batch, tokens = self.shape
        self._io_bytes = batch * tokens * self.hidden * 4
        # The pinned input holds x, then the (batch,) int32 valid-token counts.
        self._in_ptr, pinned_in = self._pinned(self._io_bytes + batch * 4)
        self._in, self._valid = pinned_in[: self._io_bytes], pinned_in[self._io_bytes :].view(np.int32)
        self._valid[:] = tokens
        self._out_ptr, self._out = self._pinned(self._io_bytes)
        if not self.eager:
            self._capture()

    def _load_functions(self, bundle) -> dict[str, object]:
        cu, res = self._cu, self._res
        functions = {}
        for kernel in bundle.manifest["kernels"]:
            image = bundle.kernel_image(kernel["name"], self.image_kind)
            if self.image_kind == "ptx" and not image.endswith(b"\0"):
                image += b"\0"  # cuModuleLoadData reads PTX as a NUL-terminated string
            data = np.frombuffer(image, dtype=np.uint8)
            module = check(cu.cuModuleLoadData(data.ctypes.data), f"cuModuleLoadData({kernel['name']}.{self.image_kind})")
            res.modules.append(module)
            for symbol in kernel["symbols"]:
                functions[symbol] = check(cu.cuModuleGetFunction(module, symbol.encode()), f"cuModuleGetFunction({symbol})")
        return functions

    def _zero_counters(self, sizes: dict[str, int]) -> None:
        """Zero the int32 counter buffers (`catalog.is_counter_buffer`): the kernels that count in them expect zeros
        and leave zeros behind."""
        for name, ptr in self._buffers.items():
            if catalog.is_counter_buffer(name):
                check(self._cu.cuMemsetD32(self._cu.CUdeviceptr(ptr), 0, sizes[name] // 4), "cuMemsetD32")

    def _alloc(self, size: int) -> int:
        ptr = check(self._cu.cuMemAlloc(max(int(size), 1)), "cuMemAlloc")
        self._res.device_ptrs.append(ptr)
        return int(ptr)

    def _pinned(self, size: int) -> tuple[int, np.ndarray]:
        """Page-locked host memory and a uint8 NumPy view of it (valid until close)."""
        ptr = check(self._cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc")
        self._res.host_ptrs.append(ptr)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(int(ptr)))
        return int(ptr), view

    def _upload_weights(self, path) -> int:
        """Copy the .colibri data after the header into one device buffer; returns its device pointer."""
        cu, stream = self._cu, self._res.stream
        size = self.header.data_size
        dst = self._alloc(size + catalog.WEIGHTS_TAIL_BYTES)  # the GEMV's aligned windows may read past the data
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # the path was checked by Bundle (no links)
        try:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            try:
                if self.integrated:
                    self._upload_integrated(fd, mapping, dst, size)
                else:
                    self._upload_staged(mapping, dst, size)
            finally:
                mapping.close()
        finally:
            os.close(fd)
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return dst

    def _upload_integrated(self, fd: int, mapping: mmap.mmap, dst: int, size: int) -> None:
        """Copy straight from the mapping, then drop the copied pages: GPU and CPU share the DRAM, so keeping the
        file's pages resident would hold the weights twice."""
        cu = self._cu
        page = mmap.PAGESIZE
        dropped = 0  # file offset up to which pages were dropped (page-aligned)
        for offset in range(0, size, UPLOAD_CHUNK):
            n = min(UPLOAD_CHUNK, size - offset)
            start = HEADER_SIZE + offset
            chunk = np.frombuffer(mapping, dtype=np.uint8, count=n, offset=start)
            try:
                check(cu.cuMemcpyHtoD(cu.CUdeviceptr(dst + offset), chunk.ctypes.data, n), "cuMemcpyHtoD")
            finally:
                # Release the view even when the copy fails: an exported buffer would make mapping.close() raise
                # BufferError and hide the CudaError.
                del chunk
            end = (start + n) // page * page if offset + n < size else len(mapping)
            if end > dropped:
                mapping.madvise(mmap.MADV_DONTNEED, dropped, end - dropped)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, dropped, end - dropped, os.POSIX_FADV_DONTNEED)
                dropped = end

    def _upload_staged(self, mapping: mmap.mmap, dst: int, size: int) -> None:
        """Two pinned staging buffers: fill one while the other's copy runs."""
        cu, res = self._cu, self._res
        chunk_size = min(UPLOAD_CHUNK, max(size, 1))
        stages = [self._pinned(chunk_size) for _ in range(2)]
        events = []
        for _ in range(2):  # recorded one by one: if the second fails, close() still destroys the first
            events.append(check(cu.cuEventCreate(0), "cuEventCreate"))
            res.events.append(events[-1])
        source = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=HEADER_SIZE)
        try:
            for i, offset in enumerate(range(0, size, chunk_size)):
                n = min(chunk_size, size - offset)
                ptr, view = stages[i % 2]
                if i >= 2:
                    check(cu.cuEventSynchronize(events[i % 2]), "cuEventSynchronize")
                view[:n] = source[offset : offset + n]
                check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dst + offset), ptr, n, res.stream), "cuMemcpyHtoDAsync")
                check(cu.cuEventRecord(events[i % 2], res.stream), "cuEventRecord")
        finally:
            del source
        # The staging buffers (up to 2 x 64 MiB page-locked) and their events are not kept for the backend's life.
        check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
        staged = [ptr for ptr, _ in stages]
        stages = view = None  # no NumPy view of the freed memory stays reachable
        res.host_ptrs = [p for p in res.host_ptrs if int(p) not in staged]
        res.events = [e for e in res.events if all(e is not x for x in events)]
        for ptr in staged:
            check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")
        for event in events:
            check(cu.cuEventDestroy(event), "cuEventDestroy")

    # ---- the forward pass -------------------------------------------------------------------------------------
    def _pointer(self, arg: dict) -> int:
        kind = arg["kind"]
        if kind == "buffer":
            return self._buffers[arg["name"]]
        if kind == "weights":
            return self._weights + int(arg["offset"])
        if kind == "null":
            return 0
        if kind == "i32":  # by value: the kernel reads the low 4 bytes of the 8-byte slot (little-endian)
            return int(arg["value"]) & 0xFFFFFFFF
        raise BackendError(f"launch argument kind {kind!r}; allowed: buffer, weights, null, i32")

    def _prepare(self, launch: dict) -> tuple:
        """(function, grid, block, shared bytes, kernelParams array, the arrays it points into)."""
        symbol = launch["symbol"]
        if symbol not in self._functions:
            raise BackendError(f"launch plan names {symbol!r}; the bundle's kernels define {sorted(self._functions)}")
        values = np.array([self._pointer(a) for a in launch["args"]], dtype=np.uint64)
        params = np.array([values.ctypes.data + 8 * i for i in range(len(values))], dtype=np.uint64)
        return (self._functions[symbol], tuple(launch["grid"]), tuple(launch["block"]), int(launch["shared_bytes"]),
                params, values)

    def _enqueue(self) -> None:
        """Input copy, every launch, output copy, on the backend's stream (captured or not)."""
        cu, stream = self._cu, self._res.stream
        check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self._buffers[self._io["input"]]), self._in_ptr, self._io_bytes,
                                   stream), "cuMemcpyHtoDAsync")
        if "valid_tokens" in self._io and self._io["valid_tokens"] in self._buffers:
            check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self._buffers[self._io["valid_tokens"]]),
                                       self._in_ptr + self._io_bytes, self._valid.nbytes, stream), "cuMemcpyHtoDAsync")
        for function, grid, block, shared, params, _ in self._launches:
            check(cu.cuLaunchKernel(function, *grid, *block, shared, stream, params.ctypes.data, 0), "cuLaunchKernel")
        check(cu.cuMemcpyDtoHAsync(self._out_ptr, cu.CUdeviceptr(self._buffers[self._io["output"]]), self._io_bytes,
                                   stream), "cuMemcpyDtoHAsync")

    def _capture(self) -> None:
        cu, res = self._cu, self._res
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(res.stream, mode), "cuStreamBeginCapture")
        try:
            self._enqueue()
        except BaseException:
            cu.cuStreamEndCapture(res.stream)  # end the broken capture; the first error is the one to report
            raise
        res.graph = check(cu.cuStreamEndCapture(res.stream), "cuStreamEndCapture")
        res.graph_exec = check(cu.cuGraphInstantiate(res.graph, 0), "cuGraphInstantiate")

    def infer_padded(self, x: np.ndarray, valid_tokens=None) -> np.ndarray:
        """Run the bundle on one input at the fixed shape.

        Args:
            x: float32 C-contiguous (batch, tokens, hidden) at exactly the bundle's fixed shape.
            valid_tokens: (batch,) ints 0..tokens, the valid (first) tokens of each sequence; None: all. Padded
                tokens select no expert and cost no expert weight traffic (docs/kernels.md, "Padded tokens").

        Returns:
            float32 (batch, tokens, hidden), a new array; a padded row is its input row (residual composition) or
            zeros.

        Raises:
            InputError: another shape, dtype or layout; valid_tokens of another shape or out of range.
            BackendError: the backend is closed.
            CudaError: a driver call failed (e.g. a kernel fault reported by cuStreamSynchronize).
        """
        batch, tokens = self.shape
        expected = (batch, tokens, self.hidden)
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != expected or not x.flags.c_contiguous:
            got = f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}".strip()
            raise InputError(f"infer_padded takes a C-contiguous float32 array of shape {expected}; got {got}")
        counts = check_valid_tokens(valid_tokens, batch, tokens)
        cu = self._cu
        with self._lock:
            if self._res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(self._res.ctx), "cuCtxSetCurrent")
            self._in[:] = x.reshape(-1).view(np.uint8)
            self._valid[:] = counts
            if self.eager:
                self._enqueue()
            else:
                check(cu.cuGraphLaunch(self._res.graph_exec, self._res.stream), "cuGraphLaunch")
            check(cu.cuStreamSynchronize(self._res.stream), "cuStreamSynchronize")
            self._read_dropped(0, self.header.num_layers, self._res.stream)
            return self._out.view(np.float32).reshape(expected).copy()

    # ---- per-layer calls and device-resident I/O (docs/runtime-cuda.md, "Per-layer calls, device I/O") -------
    def _enqueue_layers(self, start: int, stop: int, stream, skip=()) -> None:
        """The launches of layers start..stop-1 on `stream`; they read x{start%2} and leave x{stop%2}. `skip`: per
        launch of the plan, True to leave it out (the capacity launches of a dropless run)."""
        cu = self._cu
        launches = zip(self._launches, self._launch_layers)
        for i, ((function, grid, block, shared, params, _), layer) in enumerate(launches):
            if start <= layer < stop and not (skip and skip[i]):
                check(cu.cuLaunchKernel(function, *grid, *block, shared, stream, params.ctypes.data, 0),
                      "cuLaunchKernel")

    def _read_dropped(self, start: int, stop: int, stream) -> None:
        """`last_dropped` = the pairs dropped by layers start..stop-1 (the capacity_dropped buffer, one int32 per
        layer, written by colibri_capacity on every call), after `stream` has finished the call's launches."""
        if self.capacity is None:
            return
        cu = self._cu
        check(cu.cuMemcpyDtoHAsync(self._dropped_ptr, cu.CUdeviceptr(self._buffers[catalog.CAPACITY_DROPPED]),
                                   self._dropped.nbytes, stream), "cuMemcpyDtoHAsync")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        self.last_dropped = int(self._dropped[start:stop].sum())

    def _write_valid_tokens(self, stream, counts) -> None:
        """Where the launch plan has a `valid_tokens` buffer (`catalog.io_buffers`): entry b = counts[b] (an int
        for every sequence, or one per sequence; sequences past len(counts) get 0), written on `stream` before a
        sub-range's or a device call's launches, which do not run the whole-model input copy."""
        name = self._io.get("valid_tokens")
        if name not in self._buffers:
            return
        cu, fixed_batch = self._cu, self.shape[0]
        values = [int(counts)] * fixed_batch if np.ndim(counts) == 0 else [int(v) for v in counts]
        values += [0] * (fixed_batch - len(values))
        ptr = self._buffers[name]
        for b, value in enumerate(values):
            check(cu.cuMemsetD32Async(cu.CUdeviceptr(ptr + 4 * b), value, 1, stream), "cuMemsetD32Async")

    def enqueue_call(self, x: np.ndarray, valid_tokens=None) -> None:
        """Start the whole model on a host input at the fixed shape without waiting for it: x and the valid-token
        counts into this backend's pinned input, then cuGraphLaunch (or the eager launches) on its own stream.
        `finish_call` waits for it and reads the output. Used by `Runtime.submit`'s pipeline, which gives each slot
        its own backend (stream, pinned I/O, scratch buffers, graph), so calls of different slots are in flight
        together (docs/runtime.md, "Pipelined calls").

        Args:
            x: float32 C-contiguous (batch, tokens, hidden) at the fixed shape (validated by Runtime).
            valid_tokens: (batch,) ints, each sequence's valid tokens, or None (all).

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            self._in[:] = x.reshape(-1).view(np.uint8)
            self._valid[:] = self.shape[1] if valid_tokens is None else valid_tokens
            if self.eager:
                self._enqueue()
            else:
                check(cu.cuGraphLaunch(res.graph_exec, res.stream), "cuGraphLaunch")

    def finish_call(self, out: np.ndarray) -> None:
        """Wait for the call `enqueue_call` started (cuStreamSynchronize on this backend's stream) and copy the
        pinned output into `out` (float32 C-contiguous, the fixed shape).

        Raises:
            BackendError: closed. CudaError: the synchronisation reported a fault.
        """
        cu, res = self._cu, self._res
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
            out.reshape(-1).view(np.uint8)[:] = self._out
            self._read_dropped(0, self.header.num_layers, res.stream)  # capacity bundles: this call's dropped pairs

    def run_layers(self, x: np.ndarray, out: np.ndarray, start: int, stop: int, valid_tokens=None,
                   valid_rows=None, capacity: bool = True) -> None:
        """Layers start..stop-1 on a host input at the fixed shape, into `out` (the Runtime's contract).

        The whole model (0..num_layers) replays the CUDA Graph (or the eager launches); a sub-range enqueues that
        range's launches eagerly: input copy into x{start%2}, the launches, output copy from x{stop%2}.

        Args:
            x, out: float32 C-contiguous (batch, tokens, hidden) at the fixed shape (validated by Runtime).
            valid_tokens: (batch,) ints, each sequence's valid tokens, or None (all); used where the launch plan
                has a `valid_tokens` buffer (padded tokens then select no expert).
            valid_rows: instead of valid_tokens, (batch * tokens,) bool with each sequence's valid rows first (the
                Runtime's call for a bundle with expert capacity, as on the CPU backend).
            capacity: False skips the colibri_capacity launches (eagerly): dropless, for the self-test, whose stored
                reference output is dropless.

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        if valid_rows is not None:
            valid_tokens = np.asarray(valid_rows, dtype=bool).reshape(self.shape).sum(axis=1)
        skip = [] if capacity else self._capacity_launch
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            self._in[:] = x.reshape(-1).view(np.uint8)
            counts = self.shape[1] if valid_tokens is None else valid_tokens
            if hasattr(self, "_valid"):  # the pinned valid-token counts the whole-model input copy sends
                self._valid[:] = counts
            if start == 0 and stop == self.header.num_layers and not any(skip):
                if self.eager:
                    self._enqueue()
                else:
                    check(cu.cuGraphLaunch(res.graph_exec, res.stream), "cuGraphLaunch")
            else:
                src, dst = self._buffers[f"x{start % 2}"], self._buffers[f"x{stop % 2}"]
                check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(src), self._in_ptr, self._io_bytes, res.stream),
                      "cuMemcpyHtoDAsync")
                self._write_valid_tokens(res.stream, counts)
                self._enqueue_layers(start, stop, res.stream, skip)
                check(cu.cuMemcpyDtoHAsync(self._out_ptr, cu.CUdeviceptr(dst), self._io_bytes, res.stream),
                      "cuMemcpyDtoHAsync")
            check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
            out.reshape(-1).view(np.uint8)[:] = self._out
            if capacity:
                self._read_dropped(start, stop, res.stream)
            else:
                self.last_dropped = 0

    def run_device(self, src: int, dst: int, batch: int, tokens: int, start: int, stop: int, stream: int) -> None:
        """Layers start..stop-1 from device memory to device memory on the caller's stream: no host round trip.

        Args:
            src, dst: device addresses of C-contiguous float32 (batch, tokens, hidden) arrays (they may be equal).
            batch, tokens: the arrays' shape, at most the fixed shape; padding rows of the scratch input are zeroed.
            stream: the caller's CUstream handle; 0 is the legacy default stream, synchronised before returning.
                On any other stream the call returns once the work is enqueued (the caller synchronises), so the
                launches can be part of the caller's own stream capture. One Runtime's scratch buffers are shared by
                its calls: issue a Runtime's device calls on one stream at a time.
                With expert capacity, `last_dropped` is read back on stream 0 only (0 on another stream: the
                call has not run yet when this returns).

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        fixed_batch, fixed_tokens = self.shape
        row = self.hidden * 4
        s = cu.CUstream(stream)
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            x_in, x_out = self._buffers[f"x{start % 2}"], self._buffers[f"x{stop % 2}"]
            if (batch, tokens) != (fixed_batch, fixed_tokens):
                check(cu.cuMemsetD32Async(cu.CUdeviceptr(x_in), 0, self._io_bytes // 4, s), "cuMemsetD32Async")
            whole = tokens == fixed_tokens
            spans = [(0, batch * tokens * row)] if whole else [(b, tokens * row) for b in range(batch)]
            for b, n in spans:
                check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(x_in + b * fixed_tokens * row),
                                           cu.CUdeviceptr(src + b * tokens * row), n, s), "cuMemcpyDtoDAsync")
            self._write_valid_tokens(s, [tokens] * batch)
            self._enqueue_layers(start, stop, s)
            for b, n in spans:
                check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(dst + b * tokens * row),
                                           cu.CUdeviceptr(x_out + b * fixed_tokens * row), n, s), "cuMemcpyDtoDAsync")
            if stream == 0:
                check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
                self._read_dropped(start, stop, s)
            elif self.capacity is not None:
                self.last_dropped = 0  # not read back: the call is still in flight on the caller's stream

    def poison(self) -> None:
        """Fill every scratch buffer and the pinned output with 0x7FC00000 words (float32 NaN), for tests that
        check that every value a call reads was written during that call."""
        cu = self._cu
        with self._lock:
            check(cu.cuCtxSetCurrent(self._res.ctx), "cuCtxSetCurrent")
            sizes = catalog.device_buffers(self.bundle.manifest["profile"], self.header)
            for name, ptr in self._buffers.items():
                check(cu.cuMemsetD32(cu.CUdeviceptr(ptr), POISON_WORD, sizes[name] // 4), "cuMemsetD32")
            self._zero_counters(sizes)
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            self._out.view(np.uint32)[:] = POISON_WORD

    # ---- lifetime ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the graph, buffers, modules, stream and the context reference. Safe to call twice."""
        with self._lock:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._res.released

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("eager" if self.eager else "graph")
        return f"CudaBackend({getattr(self, 'device_name', '?')}, {self.image_kind if hasattr(self, 'image_kind') else '?'}, {state})"
