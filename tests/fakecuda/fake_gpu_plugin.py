"""pytest plugin for running tests/gpu against the fake driver (`-p fake_gpu_plugin`, in a process whose
LD_LIBRARY_PATH holds the fake libcuda.so.1): before each CudaBackend loads a bundle, the kernel emulation library
for that bundle's compile-time constants is built (tests/kernels/emulator.py, cached) and handed to the fake driver,
so the modules the backend loads run those kernels. The backend itself is not changed."""

from __future__ import annotations

import ctypes
import functools

from colibri_sdk.runtime import cuda_backend
from emulator import build_library


def _bind_kernels(init):
    @functools.wraps(init)
    def wrapper(self, bundle, *args, **kwargs):
        path = build_library(bundle.manifest["kernels"][0]["defines"])
        ctypes.CDLL("libcuda.so.1").colibri_fake_cuda_set_kernels(str(path).encode())
        return init(self, bundle, *args, **kwargs)

    return wrapper


cuda_backend.CudaBackend.__init__ = _bind_kernels(cuda_backend.CudaBackend.__init__)
