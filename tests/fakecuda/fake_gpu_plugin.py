"""pytest plugin for running tests/gpu against the fake driver (`-p fake_gpu_plugin`, in a process whose
LD_LIBRARY_PATH holds the fake libcuda.so.1): before each CudaBackend loads a bundle, the kernel emulation library
for that bundle's compile-time constants and kernels is built (tests/kernels/emulator.py, cached; the units of the
kernels the manifest lists, so a bundle without the capacity kernel costs no capacity.cu compile) and handed to the
fake driver, so the modules the backend loads run those kernels. The backend itself is not changed."""

from __future__ import annotations

import ctypes
import functools

from colibri_sdk.runtime import cuda_backend
from fakecuda_support import emulation_library


def _bind_kernels(init):
    @functools.wraps(init)
    def wrapper(self, bundle, *args, **kwargs):
        path = emulation_library(bundle.manifest["kernels"])
        ctypes.CDLL("libcuda.so.1").colibri_fake_cuda_set_kernels(str(path).encode())
        return init(self, bundle, *args, **kwargs)

    return wrapper


cuda_backend.CudaBackend.__init__ = _bind_kernels(cuda_backend.CudaBackend.__init__)
