"""The on-device runtime: load a bundle, run it on CUDA (graph replay) or the CPU, self-test it.

Imports with NumPy only; the CUDA backend (cuda-bindings) is imported when a CUDA backend is asked for. See
docs/runtime.md.
"""

from .runtime import BACKENDS, Runtime, SelfTestResult, available_backends, cuda_status
from .stats import RuntimeStats

__all__ = ["BACKENDS", "Runtime", "RuntimeStats", "SelfTestResult", "available_backends", "cuda_status"]
