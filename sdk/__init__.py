"""colibri-sdk: Hugging Face MoE checkpoints → .colibri weights → AOT-built bundles → on-device runtime.

The device side imports with NumPy only: `colibri_sdk.format`, `colibri_sdk.reference`, `colibri_sdk.runtime`.
Build-side modules (NVRTC, converter, deploy) import their extra dependencies lazily.
"""

__version__ = "0.1.0"

import logging as _logging

# The library never prints: notices go to loggers under "colibri_sdk". Without a handler of the application's
# (the command line adds one), they go nowhere rather than to Python's last-resort handler on stderr.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

from .errors import (  # noqa: E402
    BackendError,
    BundleError,
    ColibriError,
    CompileError,
    ConvertError,
    CudaError,
    DeployError,
    FormatError,
    InputError,
    NonFiniteOutputError,
    ProfileError,
)

__all__ = [
    "__version__",
    "BackendError",
    "BundleError",
    "ColibriError",
    "CompileError",
    "ConvertError",
    "CudaError",
    "DeployError",
    "FormatError",
    "InputError",
    "NonFiniteOutputError",
    "ProfileError",
]
