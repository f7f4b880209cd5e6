"""The kernel catalogue: which CUDA C files make up the pipeline, their entry points, the tunable parameters a
profile sets for each (`kernels.<name>.<param>` in profiles/*.yaml), the compile-time constants they receive, and
the launch plan of one forward pass.

Shared by the build (what to compile, what to record in the manifest) and the runtime (what to launch). Needs only
the standard library: it is imported on the device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Param:
    """A tunable kernel parameter set by the profile.

    Attributes:
        name: key under `kernels.<kernel>` in the profile.
        minimum, maximum: inclusive range.
        multiple_of: the value must be a multiple of this (32 for thread counts: whole warps).
        power_of_two: the value must be a power of two.
        doc: one line for error messages and docs.
    """

    name: str
    minimum: int
    maximum: int
    multiple_of: int = 1
    power_of_two: bool = False
    doc: str = ""

    def check(self, value) -> str | None:
        """None if `value` is allowed, else the reason (the caller names the key)."""
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {type(value).__name__}"
        if not self.minimum <= value <= self.maximum:
            return f"must be in {self.minimum}..{self.maximum}"
        if value % self.multiple_of:
            return f"must be a multiple of {self.multiple_of}"
        if self.power_of_two and value & (value - 1):
            return "must be a power of two"
        return None

    def allowed(self) -> str:
        parts = [f"{self.minimum}..{self.maximum}"]
        if self.multiple_of > 1:
            parts.append(f"multiple of {self.multiple_of}")
        if self.power_of_two:
            parts.append("power of two")
        return ", ".join(parts)


THREADS = Param("threads", 32, 1024, multiple_of=32, doc="threads per block")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One CUDA C source file in kernels/ and its profile section.

    Attributes:
        name: profile key under `kernels:` and the base name of the cubin/PTX files in a bundle.
        source: file name in kernels/.
        symbols: the `extern "C" __global__` entry points it defines.
        params: the tunable parameters the profile must give.
    """

    name: str
    source: str
    symbols: tuple[str, ...]
    params: tuple[Param, ...]


# The pipeline of one MoE layer, in launch order.
KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec("routing", "routing.cu", ("colibri_routing", "colibri_align"), (THREADS,)),
    KernelSpec(
        "gate_up",
        "expert_gate_up.cu",
        ("colibri_gate_up",),
        (
            THREADS,
            Param("block_m", 1, 128, power_of_two=True, doc="rows (token, slot pairs) per tile"),
            Param("block_n", 16, 256, power_of_two=True, doc="intermediate columns per tile"),
            Param("block_k", 16, 128, power_of_two=True, doc="hidden elements per shared-memory stage"),
        ),
    ),
    KernelSpec(
        "down",
        "expert_down.cu",
        ("colibri_down", "colibri_aggregate"),
        (
            THREADS,
            Param("block_m", 1, 128, power_of_two=True, doc="rows (token, slot pairs) per tile"),
            Param("block_n", 16, 256, power_of_two=True, doc="hidden columns per tile"),
            Param("block_k", 16, 128, power_of_two=True, doc="intermediate elements per shared-memory stage"),
        ),
    ),
    KernelSpec(
        "small_batch",
        "small_batch.cu",
        ("colibri_gate_up_gemv", "colibri_down_gemv"),
        (THREADS, Param("max_pairs", 1, 4096, doc="tokens*top_k at or below this take the GEMV fast path")),
    ),
)


def kernel_dir() -> Path:
    """The folder holding the .cu sources: inside the installed package, or kernels/ of a source checkout."""
    from . import kernels

    return Path(kernels.__file__).parent


def spec(name: str) -> KernelSpec:
    for k in KERNELS:
        if k.name == name:
            return k
    raise KeyError(name)


def compile_defines(profile: dict, header) -> dict[str, int]:
    """Compile-time constants (`-D NAME=VALUE`) every kernel source receives.

    Args:
        profile: the validated profile as a plain dict (the YAML structure of profiles/*.yaml).
        header: the weights' `colibri_sdk.format.Header`.

    Returns:
        {"COLI_HIDDEN", "COLI_INTER", "COLI_EXPERTS", "COLI_TOPK", "COLI_MAX_TOKENS" (batch * tokens),
         "COLI_FP16" (1 = fp16 storage, fp32 accumulation; 0 = fp32), "COLI_ATOMIC_AGG" (1 = atomicAdd aggregation),
         "COLI_ROUTING" (format routing code), "COLI_RESIDUAL" (1 = residual composition)}
        plus "COLI_<KERNEL>_<PARAM>" for every `kernels.<kernel>.<param>` of the profile, upper-cased
        (e.g. COLI_GATE_UP_BLOCK_M).
    """
    shape = profile["shape"]
    defines = {
        "COLI_HIDDEN": header.hidden_size,
        "COLI_INTER": header.intermediate_size,
        "COLI_EXPERTS": header.num_experts,
        "COLI_TOPK": header.top_k,
        "COLI_MAX_TOKENS": shape["batch"] * shape["tokens"],
        "COLI_FP16": 1 if profile["dtype"] == "fp16" else 0,
        "COLI_ATOMIC_AGG": 1 if profile["aggregation"] == "atomic" else 0,
        "COLI_ROUTING": header.routing,
        "COLI_RESIDUAL": header.composition,
    }
    for kernel, params in sorted(profile["kernels"].items()):
        for param, value in sorted(params.items()):
            defines[f"COLI_{kernel.upper()}_{param.upper()}"] = int(value)
    return defines
