"""One error hierarchy for the whole SDK.

Every error says what was wrong, the value seen and what is allowed. The CLI turns any `ColibriError` into a
one-line message and a non-zero exit code; anything else escaping the library is a bug.

    ColibriError
    ├── FormatError        .colibri files (reader, writer)
    ├── ConvertError       Hugging Face checkpoints → .colibri
    ├── ProfileError       device profiles (profiles/*.yaml)
    ├── CompileError       NVRTC compilation, cubin checks, resource limits
    ├── BundleError        bundles: manifest, checksums, self-test
    ├── InputError         bad input to the runtime or the reference engine
    ├── NonFiniteOutputError  a forward pass produced NaN/Inf from finite input (names the first such layer)
    ├── CudaError          a failed CUDA driver call (call name + CUDA error name)
    ├── BackendError       no usable backend (no driver, no device, arch mismatch)
    └── DeployError        pushing bundles to devices over SSH
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base class of every error the SDK raises on purpose."""


class FormatError(ColibriError):
    """A .colibri file is malformed, or a write to one is out of order or of the wrong shape."""


class ConvertError(ColibriError):
    """A Hugging Face checkpoint cannot be converted (unsupported feature, missing or extra tensor, overflow)."""


class ProfileError(ColibriError):
    """A device profile is invalid: unknown key, wrong type, out-of-range value, unsupported arch."""


class CompileError(ColibriError):
    """NVRTC failed, the NVRTC version does not fit the profile, or a compiled kernel breaks a resource limit."""


class BundleError(ColibriError):
    """A bundle is incomplete, tampered with, of an unknown schema, or fails its self-test."""


class InputError(ColibriError, ValueError):
    """An input array has the wrong shape, dtype, layout or values for the model or bundle."""


class NonFiniteOutputError(ColibriError):
    """A forward pass gave NaN or Inf at a valid position although the input there was finite (e.g. activations
    of 1e19 overflow float32 inside an expert).

    Attributes:
        layer: the first layer whose output is non-finite for the first bad token, as the CPU reference engine
            (float32, the bundle's weights) finds it; None when the reference gives finite values there (then the
            backend's own result is wrong, or, where the reference met values of 1e30 or more on the way, the same
            sums in another order overflowed: the message says which).
        position: (batch, token) of the first bad position.
        count: how many valid positions have a non-finite output.
    """

    def __init__(self, message: str, layer: int | None, position: tuple[int, int], count: int):
        super().__init__(message)
        self.layer = layer
        self.position = position
        self.count = count


class BackendError(ColibriError):
    """The requested backend cannot run here (no driver, no device, compute capability mismatch)."""


class CudaError(ColibriError):
    """A CUDA driver API call failed.

    Attributes:
        call: the driver function name, e.g. ``"cuModuleLoadData"``.
        code: the CUDA error name, e.g. ``"CUDA_ERROR_NO_BINARY_FOR_GPU"``.
    """

    def __init__(self, call: str, code: str, detail: str = ""):
        self.call = call
        self.code = code
        message = f"{call} failed: {code}"
        super().__init__(message + (f" ({detail})" if detail else ""))


class DeployError(ColibriError):
    """Deploying a bundle to a device failed."""
