"""A DLPack producer for the tests: an object exposing only `__dlpack__` / `__dlpack_device__`, whose capsule holds
a real DLManagedTensor built with ctypes (the dlpack.h layout of colibri_sdk.runtime.device_io) over a given
address, as CuPy and PyTorch CUDA tensors export theirs. It records the stream argument of each export and the
deleter calls."""

from __future__ import annotations

import ctypes

from colibri_sdk.runtime.device_io import DLDataType, DLDeleter, DLDevice, DLManagedTensor, DLTensor

_new = ctypes.pythonapi.PyCapsule_New
_new.restype, _new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_name = ctypes.pythonapi.PyCapsule_GetName
_name.restype, _name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_NAME = ctypes.create_string_buffer(b"dltensor")


class DLPackArray:
    """shape (ints), ptr (device address), device_type (2 kDLCUDA), dtype (code, bits, lanes), strides in elements
    or None (NULL), byte_offset. `streams`: the stream argument of each __dlpack__ call; `deleted`: deleter calls;
    `capsule_names`: the names of the exported capsules now."""

    def __init__(self, ptr: int, shape, device_type=2, dtype=(2, 32, 1), strides=None, byte_offset=0):
        self.ptr, self.shape, self.device_type, self.dtype = int(ptr), tuple(shape), device_type, dtype
        self.strides, self.byte_offset = strides, byte_offset
        self.streams: list = []
        self.deleted = 0
        self._keep: list = []
        self._capsules: list = []

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        n = len(self.shape)
        shape = (ctypes.c_int64 * n)(*self.shape)
        strides = (ctypes.c_int64 * n)(*self.strides) if self.strides is not None else None
        managed = DLManagedTensor()
        managed.dl_tensor = DLTensor(
            ctypes.c_void_p(self.ptr), DLDevice(self.device_type, 0), n, DLDataType(*self.dtype),
            ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
            ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)) if strides is not None else None, self.byte_offset)

        def delete(_tensor):
            self.deleted += 1

        managed.deleter = DLDeleter(delete)
        self._keep += [shape, strides, managed, managed.deleter]
        capsule = _new(ctypes.addressof(managed), _NAME, None)
        self._capsules.append(capsule)
        return capsule

    @property
    def capsule_names(self) -> list[str]:
        return [_name(c).decode() for c in self._capsules]
