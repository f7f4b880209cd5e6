"""The CUDA driver, found safely: a probe that never hangs, and the one checker for every driver call.

Calling driver APIs where no driver is installed can raise or even hang (cuda.core's `get_kernel` hangs on a
second call), so `probe_driver()` first looks for the driver library itself (`libcuda.so.1`) with ctypes, asks it
for its version and device count, and only then reports the driver as usable. Nothing here imports cuda.bindings at
import time.

Every cuda.bindings.driver call in the runtime goes through `check(result, call_name)`, which works with the tuple
returns of cuda-bindings 12.x and 13.x and raises `CudaError(call, CUDA error name)` on failure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading

from ..driver_version import format_driver_version
from ..errors import CudaError

# Names the driver library has on Linux (desktop drivers and JetPack's /usr/lib/aarch64-linux-gnu/tegra).
_LIBRARY_NAMES = ("libcuda.so.1", "libcuda.so")
_PROBE_TIMEOUT_S = 20.0
CUDA_SUCCESS = 0


def _open_driver_library() -> tuple[ctypes.CDLL | None, str]:
    """dlopen the driver library: (library, "") or (None, why not)."""
    names = list(_LIBRARY_NAMES)
    found = ctypes.util.find_library("cuda")
    if found and found not in names:
        names.append(found)
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), ""
        except OSError as exc:
            errors.append(str(exc))
    if all("cannot open shared object file" in e for e in errors):
        return None, f"no CUDA driver ({names[0]} not found)"
    return None, "no CUDA driver library could be loaded (" + "; ".join(errors[:2]) + ")"


def _probe_with_ctypes() -> tuple[bool, str]:
    lib, reason = _open_driver_library()
    if lib is None:
        return False, reason
    result = lib.cuInit(ctypes.c_uint(0))
    if result != CUDA_SUCCESS:
        return False, f"cuInit failed with CUresult {result} ({_ctypes_error_name(lib, result)})"
    version = ctypes.c_int(0)
    result = lib.cuDriverGetVersion(ctypes.byref(version))
    if result != CUDA_SUCCESS:
        return False, f"cuDriverGetVersion failed with CUresult {result} ({_ctypes_error_name(lib, result)})"
    count = ctypes.c_int(0)
    result = lib.cuDeviceGetCount(ctypes.byref(count))
    if result != CUDA_SUCCESS:
        return False, f"cuDeviceGetCount failed with CUresult {result} ({_ctypes_error_name(lib, result)})"
    if count.value < 1:
        return False, f"the CUDA driver ({format_driver_version(version.value)}) sees no device"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as exc:
        return False, f"a CUDA driver is installed but cuda-bindings is not ({exc}); pip install 'colibri-sdk[cuda]'"
    mismatch = bindings_driver_mismatch(_bindings_version(), version.value)
    if mismatch:
        return False, mismatch
    return True, f"CUDA driver {format_driver_version(version.value)}, {count.value} device(s)"


def _bindings_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cuda-bindings")
    except PackageNotFoundError:
        return ""


def bindings_driver_mismatch(bindings_version: str, driver_version: int) -> str | None:
    """Why the installed cuda-bindings cannot run on this driver, naming the pin that fixes it; None if it can.

    cuda-bindings M.x needs a driver for CUDA M.0 or newer (cuDriverGetVersion >= 1000 * M): 13.x needs driver
    >= 580, while JetPack 6 ships driver 540 (CUDA 12.2 / 12.6).
    """
    try:
        major = int(bindings_version.split(".")[0])
    except ValueError:
        return None
    if driver_version >= major * 1000:
        return None
    return (f"cuda-bindings {bindings_version} needs a driver for CUDA {major}.0 or newer (>= 580 for 13.x), but "
            f"this driver supports CUDA {format_driver_version(driver_version)}: install cuda-bindings 12.x, "
            f"pip install 'cuda-bindings>=12,<13' (the extra colibri-sdk[jetson])")


def _ctypes_error_name(lib, result: int) -> str:
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(ctypes.c_int(result), ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
    except AttributeError:
        pass
    return "unknown error"


@functools.lru_cache(maxsize=1)
def probe_driver() -> tuple[bool, str]:
    """Whether the CUDA driver and a device can be used here, without risking a hang.

    Opens the driver library with ctypes (no cuda.bindings call before that), then calls cuInit, cuDriverGetVersion
    and cuDeviceGetCount through it, in a worker thread given at most 20 s. The result is cached for the process.

    Returns:
        (ok, reason): ok True with a line naming the driver version and device count, or False with why not
        (no library, cuInit's error name, no device, cuda-bindings missing, or the probe timed out).
    """
    box: list[tuple[bool, str]] = []

    def run():
        try:
            box.append(_probe_with_ctypes())
        except Exception as exc:  # a broken driver library must not take the caller down
            box.append((False, f"the CUDA driver probe failed: {type(exc).__name__}: {exc}"))

    worker = threading.Thread(target=run, name="colibri-cuda-probe", daemon=True)
    worker.start()
    worker.join(_PROBE_TIMEOUT_S)
    if not box:
        return False, f"the CUDA driver did not answer cuInit within {_PROBE_TIMEOUT_S:.0f} s"
    return box[0]


def error_name(code) -> str:
    """The CUDA error name of a CUresult (e.g. "CUDA_ERROR_INVALID_VALUE"), from cuGetErrorName."""
    from cuda.bindings import driver

    try:
        err, name = driver.cuGetErrorName(code)
        if int(err) == CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # cuGetErrorName itself failed: fall back to the enum name
        pass
    return getattr(code, "name", f"CUresult {int(code)}")


def check(result, call: str):
    """Check a cuda.bindings.driver result and return its values.

    Args:
        result: what the binding returned: `(CUresult, *values)` (cuda-bindings 12.x and 13.x) or a bare CUresult.
        call: the driver function name, quoted in the error (e.g. "cuModuleLoadData").

    Returns:
        None, the single value, or a tuple of the values.

    Raises:
        CudaError: the CUresult is not CUDA_SUCCESS; carries the call and the CUDA error name.
    """
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if int(code) != CUDA_SUCCESS:
        raise CudaError(call, error_name(code))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def launch_kernel(cu, entry: tuple, stream, pdl: bool = False) -> None:
    """Enqueue one prepared launch on `stream`: `entry` = (function, grid (x, y, z), block (x, y, z), dynamic shared
    bytes, kernelParams uint64 array, ...) as the backends prepare it from the launch plan. pdl: set the programmatic
    stream serialization attribute (cuLaunchKernelEx, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the
    launch may start while the one before it on the stream finishes, its kernels waiting for it with
    `griddepcontrol.wait` (a plan entry's "pdl"; colibri_sdk.launch_plan). Raises CudaError as `check`."""
    function, grid, block, shared, params = entry[:5]
    if not pdl:
        check(cu.cuLaunchKernel(function, *grid, *block, shared, stream, params.ctypes.data, 0), "cuLaunchKernel")
        return
    attribute = cu.CUlaunchAttribute()
    attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared
    config.hStream = stream
    config.attrs = [attribute]
    config.numAttrs = 1
    check(cu.cuLaunchKernelEx(config, function, params.ctypes.data, 0), "cuLaunchKernelEx")
