"""Device-resident inputs and outputs: arrays exposing `__cuda_array_interface__` (CuPy, PyTorch, Numba) or only
DLPack (`__dlpack__` and `__dlpack_device__`).

The interface (https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html, version 2 or 3) gives a
device pointer, a shape, a typestr and strides; the runtime reads it without importing the array's library. Only
float32 ("<f4") C-contiguous arrays (strides None or the C strides) of rank 2 (tokens, hidden) or 3 (batch, tokens,
hidden) are taken. An object with both takes the interface.

DLPack (https://dmlc.github.io/dlpack/latest/, the Python specification of the array API standard): the runtime
asks `__dlpack_device__()` first and takes device type kDLCUDA (2) only; it then calls `__dlpack__(stream=S)` with
the caller's stream (S = 1 for the legacy default stream, the protocol's value; else the CUstream handle), so the
producer orders its own work before the call. The capsule, named "dltensor", holds a DLManagedTensor (read with
ctypes, the layout of dlpack.h below); the runtime renames it "used_dltensor" and calls the tensor's deleter once
the call no longer needs it: after the synchronisation on the legacy default stream, once the work is enqueued on
another stream (keep the array alive until that stream has run the call, as with the interface). Taken: dtype
float32 (code kDLFloat 2, 32 bits, 1 lane), strides NULL or the C-contiguous ones (in elements), the shapes above.
Versioned capsules ("dltensor_versioned", asked for with max_version) are not requested.
"""

from __future__ import annotations

import ctypes
import dataclasses

from ..errors import InputError
from .checks import counts_up_to

KDL_CPU, KDL_CUDA, KDL_FLOAT = 1, 2, 2  # dlpack.h DLDeviceType kDLCPU / kDLCUDA, DLDataTypeCode kDLFloat
DLPACK_DEVICES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal",
                  10: "kDLROCM", 11: "kDLROCMHost", 13: "kDLCUDAManaged", 14: "kDLOneAPI"}
DLPACK_CODES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}
LEGACY_DEFAULT_STREAM = 1  # the DLPack protocol's value for CUDA's legacy default stream


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DLDeleter)]

_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype, _capsule_get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype, _capsule_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype, _capsule_rename.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_USED = ctypes.create_string_buffer(b"used_dltensor")  # PyCapsule_SetName keeps the pointer: it lives as long as us


def _noop() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """A validated device array: ptr (int device address), shape (as given), batch, tokens; `release()` gives a
    consumed DLPack tensor back to its producer (its deleter; a no-op for the interface)."""

    ptr: int
    shape: tuple
    batch: int
    tokens: int
    release: object = _noop


def is_device_array(obj) -> bool:
    """True for an object the device path takes: `__cuda_array_interface__`, or `__dlpack__` with
    `__dlpack_device__` (NumPy arrays, which have DLPack too, are host arrays: False)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return False
    return _has(obj, "__cuda_array_interface__") or (_has(obj, "__dlpack__") and _has(obj, "__dlpack_device__"))


def _has(obj, name: str) -> bool:
    """hasattr, with an attribute whose getter raises (a broken array class) reported as an InputError."""
    try:
        return hasattr(obj, name)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:120]  # one line
        raise InputError(f"input {type(obj).__name__}.{name} raised {type(exc).__name__}: {reason}; allowed: a NumPy "
                         "array, or a device array whose __cuda_array_interface__ or __dlpack__ can be read") from None


def _check_shape(name: str, shape: tuple, fixed_shape: tuple, hidden: int) -> tuple[int, int]:
    if len(shape) not in (2, 3) or shape[-1] != hidden:
        raise InputError(f"{name} shape {shape}; expected (batch, tokens, {hidden}) or (tokens, {hidden})")
    batch, tokens = (1, shape[0]) if len(shape) == 2 else shape[:2]
    fb, ft = fixed_shape
    if not (1 <= batch <= fb and 1 <= tokens <= ft):
        raise InputError(f"{name} shape {shape}; allowed: batch {counts_up_to(fb)}, tokens {counts_up_to(ft)} "
                         f"(the bundle's fixed shape)")
    return int(batch), int(tokens)


def dlpack_view(obj, name: str, fixed_shape: tuple, hidden: int, stream: int = 0) -> DeviceArray:
    """Consume `obj.__dlpack__(stream=...)` as a (batch, tokens, hidden) float32 CUDA array.

    Args:
        stream: the caller's CUstream handle (0: the legacy default stream, passed to the producer as 1).

    Returns:
        A DeviceArray whose `release()` calls the DLManagedTensor's deleter (once); the capsule is already renamed
        "used_dltensor". On a refusal the deleter has been called.

    Raises:
        InputError: a device other than kDLCUDA, a capsule that is not an unused "dltensor", a dtype other than
            float32, non-C-contiguous strides, a shape the bundle cannot take, a null pointer; each names the value
            seen and what is allowed.
    """
    device = obj.__dlpack_device__()
    try:
        dev_type, dev_id = (int(v) for v in device)
    except (TypeError, ValueError):
        raise InputError(f"{name} __dlpack_device__() returned {device!r}; allowed: a (device_type, device_id) "
                         "pair") from None
    if dev_type != KDL_CUDA:
        raise InputError(f"{name} DLPack device {DLPACK_DEVICES.get(dev_type, 'type')} ({dev_type}); allowed: "
                         f"kDLCUDA ({KDL_CUDA}), a CUDA device array (pass host data as a NumPy array)")
    capsule = obj.__dlpack__(stream=LEGACY_DEFAULT_STREAM if stream == 0 else int(stream))
    if not _capsule_valid(capsule, b"dltensor"):
        raise InputError(f"{name} __dlpack__() returned {type(capsule).__name__} {capsule!r}; allowed: an unused "
                         "PyCapsule named 'dltensor'")
    managed = DLManagedTensor.from_address(_capsule_get(capsule, b"dltensor"))
    _capsule_rename(capsule, _USED)  # consumed: the producer's capsule destructor no longer frees it
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            if managed.deleter:
                managed.deleter(ctypes.pointer(managed))

    try:
        t = managed.dl_tensor
        dtype = (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes))
        if dtype != (KDL_FLOAT, 32, 1):
            kind = DLPACK_CODES.get(dtype[0], f"code {dtype[0]}")
            raise InputError(f"{name} DLPack dtype {kind}{dtype[1]} (code {dtype[0]}, bits {dtype[1]}, lanes "
                             f"{dtype[2]}); allowed: float32 (code {KDL_FLOAT}, bits 32, lanes 1)")
        shape = tuple(int(t.shape[i]) for i in range(int(t.ndim)))
        if t.strides:
            strides = tuple(int(t.strides[i]) for i in range(int(t.ndim)))
            contiguous = tuple(int(_prod(shape[i + 1:])) for i in range(len(shape)))
            if strides != contiguous:
                raise InputError(f"{name} DLPack strides {strides}; allowed: NULL or the C-contiguous {contiguous} "
                                 "(in elements)")
        batch, tokens = _check_shape(name, shape, fixed_shape, hidden)
        if not t.data:
            raise InputError(f"{name} DLPack tensor has a null data pointer")
        return DeviceArray(int(t.data) + int(t.byte_offset), shape, batch, tokens, release)
    except BaseException:
        release()
        raise


def device_view(obj, name: str, fixed_shape: tuple, hidden: int, stream: int = 0) -> DeviceArray:
    """Validate `obj.__cuda_array_interface__` (or, without it, consume its DLPack capsule: `dlpack_view`) for a
    (batch, tokens, hidden) float32 device array. `stream`: the caller's CUstream handle (DLPack's stream argument).

    Raises:
        InputError: no interface and no DLPack, or a typestr, rank, hidden size, batch/tokens above `fixed_shape`,
            strides or read-only flag that the runtime cannot take; the message names the value seen and what is
            allowed.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
            return dlpack_view(obj, name, fixed_shape, hidden, stream)
        raise InputError(f"{name} is a {type(obj).__name__} without __cuda_array_interface__ or DLPack "
                         "(__dlpack__ and __dlpack_device__)")
    shape = tuple(int(v) for v in cai.get("shape", ()))
    typestr = cai.get("typestr")
    if typestr != "<f4":
        raise InputError(f"{name} typestr {typestr!r}; allowed: '<f4' (float32)")
    batch, tokens = _check_shape(name, shape, fixed_shape, hidden)
    strides = cai.get("strides")
    contiguous = tuple(4 * int(_prod(shape[i + 1:])) for i in range(len(shape)))
    if strides is not None and tuple(int(s) for s in strides) != contiguous:
        raise InputError(f"{name} strides {tuple(strides)}; allowed: None or the C-contiguous {contiguous}")
    ptr, read_only = cai.get("data", (0, False))
    if name == "out" and read_only:
        raise InputError("out is read-only (__cuda_array_interface__ data flag); pass a writable device array")
    if not ptr:
        raise InputError(f"{name} has a null device pointer")
    return DeviceArray(int(ptr), shape, int(batch), int(tokens))


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= int(v)
    return n


def stream_handle(stream) -> int:
    """The raw CUstream address of `stream`: None → 0 (legacy default stream); an int; a cuda-bindings CUstream
    (int()able); torch.cuda.Stream (`cuda_stream`); cupy.cuda.Stream (`ptr`); anything with `handle`.

    Raises:
        InputError: an object none of these.
    """
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr) and not isinstance(stream, int):
            stream = getattr(stream, attr)
            break
    try:
        value = int(stream)
    except (TypeError, ValueError):
        raise InputError(f"stream {stream!r}; allowed: None, an int CUstream handle, a CUstream, "
                         "torch.cuda.Stream or cupy.cuda.Stream") from None
    if value < 0:
        raise InputError(f"stream {value}; a CUstream handle is a non-negative address")
    return value
