"""Backend selection: which backends can run here, and one backend per compiled shape of a bundle.

"cuda" (colibri_sdk.runtime.cuda_backend, the CUDA driver API through cuda-bindings) is imported only when asked
for; "cpu" (colibri_sdk.runtime.cpu_backend) is the NumPy reference engine. "auto" takes CUDA where a driver and a
suitable device exist, else the CPU with a one-line notice (docs/runtime.md, "Backends").
"""

from __future__ import annotations

from ..errors import BackendError

BACKENDS = ("auto", "cuda", "cpu")


def cuda_status() -> tuple[bool, str]:
    """Whether the CUDA driver can be used here, without risking a hang.

    Returns:
        (ok, reason): ok is True when the CUDA backend is installed and `driver.probe_driver()` found a working
        driver with at least one device; reason is the probe's line (why not, when not ok). Whether the device
        can run a given bundle (compute capability, driver version) is checked when the bundle is loaded.
    """
    try:
        from .driver import probe_driver
    except ImportError as exc:
        return False, f"the CUDA backend cannot be imported ({exc})"
    ok, reason = probe_driver()
    return bool(ok), " ".join(str(reason).split())


def available_backends() -> list[str]:
    """Backends that can run here, preferred first: ["cuda", "cpu"] when a CUDA driver is usable, else ["cpu"]."""
    ok, _ = cuda_status()
    return ["cuda", "cpu"] if ok else ["cpu"]


def _load_cuda(bundle, eager: bool, hint: str = "; use the cpu or auto backend"):
    """Construct the CUDA backend (imported here so the CPU path never imports cuda.bindings).

    Args:
        hint: appended to the error message (what the caller can do instead); "" when "auto" falls back anyway.

    Raises:
        BackendError: no usable driver or device, or the bundle's code cannot run on the device.
    """
    ok, reason = cuda_status()
    if not ok:
        raise BackendError(f"no usable CUDA GPU here: {reason}{hint}")
    try:
        from .cuda_backend import CudaBackend
    except ImportError as exc:
        raise BackendError(f"backend 'cuda' cannot be imported here ({exc}){hint}") from exc
    return CudaBackend(bundle, eager=eager)


def _load_cpu(bundle, eager: bool):
    """The CPU backend; BackendError in one line where its kernels' compiler (numba) cannot run: not installed, a
    NUMBA_* variable it refuses (e.g. NUMBA_NUM_THREADS=0), or NUMBA_DISABLE_JIT set (the kernels are numba
    intrinsics and machine-code loops, not Python)."""
    try:
        from .cpu_backend import CpuBackend
        from numba import config
    except ImportError as exc:
        raise BackendError(f"backend 'cpu' needs numba, which cannot be imported ({exc}); pip install "
                           "'numba>=0.59' (a dependency of colibri-sdk)") from None
    except ValueError as exc:  # numba's configuration rejects a NUMBA_* environment variable at import
        raise BackendError(f"backend 'cpu': numba refuses its environment ({exc}); fix or unset that NUMBA_* "
                           "variable") from None
    if config.DISABLE_JIT:
        raise BackendError("backend 'cpu': NUMBA_DISABLE_JIT is set; the CPU kernels run compiled only: unset it")
    return CpuBackend(bundle, eager=eager)


def shape_backends(bundle, first, eager: bool = False) -> dict:
    """One backend per compiled shape of `bundle`, of the same kind as `first` (the backend of the largest shape,
    from `select_backend`): {(batch, tokens): backend}, `first` included. CUDA backends share `first`'s context and
    its one copy of the weights on the device (`CudaBackend(share=...)`); CPU backends map the same file.

    Raises:
        as the backends' constructors; the backends built so far are closed first.
    """
    backends = {tuple(bundle.shape): first}
    try:
        for batch, tokens in bundle.shapes[:-1]:
            view = bundle.for_shape(batch, tokens)
            if first.name == "cuda":
                from .cuda_backend import CudaBackend

                backends[(batch, tokens)] = CudaBackend(view, eager=eager, share=first)
            else:
                backends[(batch, tokens)] = type(first)(view, eager=eager)
    except BaseException:
        for shape, engine in backends.items():
            if engine is not first:
                engine.close()
        raise
    return backends


def select_backend(bundle, backend: str = "auto", eager: bool = False):
    """Construct the backend for `bundle`.

    Args:
        backend: "cuda", "cpu", or "auto" (CUDA when a driver and a suitable device exist, else CPU).

    Returns:
        (backend object, notice): notice is None, or one line saying why "auto" fell back to the CPU.

    Raises:
        BackendError: an unknown backend name, or "cuda" asked for where it cannot run (the reason is quoted).
    """
    if backend not in BACKENDS:
        raise BackendError(f"backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "cpu":
        return _load_cpu(bundle, eager), None
    if backend == "cuda":
        return _load_cuda(bundle, eager), None
    try:
        return _load_cuda(bundle, eager, hint=""), None
    except BackendError as exc:
        reason = " ".join(str(exc).split())
        return _load_cpu(bundle, eager), f"running on the CPU backend: {reason}"



def close_all(backends: list) -> None:
    """Close backends in the order given (the smaller shapes first: they borrow the largest one's weights)."""
    for backend in backends:
        backend.close()
