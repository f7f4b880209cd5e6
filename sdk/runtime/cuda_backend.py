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

This module holds the device, the load, the graph capture and the whole-model call; step 1's image choice and the
launch-plan check are in cuda_image.py, step 3 in cuda_upload.py (`WeightUpload`), and the per-layer calls, device
I/O and pipelined enqueue/finish in cuda_calls.py (`DeviceCalls`), both mixed into `CudaBackend`.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .. import catalog
from ..errors import BackendError, InputError
from .cuda_calls import POISON_WORD, DeviceCalls
from .cuda_image import checked_launch_plan, parse_version, select_image
from .cuda_upload import UPLOAD_CHUNK, WeightUpload
from .driver import check, launch_kernel
from .padding import check_valid_tokens

# Re-exported: the names this module held before the image check, the upload and the call paths moved out.
__all__ = ["POISON_WORD", "UPLOAD_CHUNK", "CudaBackend", "checked_launch_plan", "parse_version", "select_image"]


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


class CudaBackend(WeightUpload, DeviceCalls):
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
        plan = checked_launch_plan(manifest, self.header)  # refused before any image, weight or buffer is loaded
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
        self._launch_pdl = [bool(launch.get("pdl")) for launch in plan]  # programmatic dependent launch (sm_90)
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
        for i, entry in enumerate(self._launches):  # the first follows the input copy: no programmatic edge
            launch_kernel(cu, entry, stream, pdl=i > 0 and self._launch_pdl[i])
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
