"""The kernel table: which CUDA C files make up the pipeline, their entry points, the tunable parameters a profile
sets for each (`kernels.<name>.<param>` in profiles/*.yaml), the kernels' compiled limits (top-k, experts), and what
a weights header tells the kernels (routing code, storage, fp16).

Part of the kernel catalogue (colibri_sdk.catalog re-exports every name). Needs only the standard library: it is
imported on the device.
"""

from __future__ import annotations

import dataclasses
import struct
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
        required: False where a profile may leave it out (its meaning without it is in `doc`).
    """

    name: str
    minimum: int
    maximum: int
    multiple_of: int = 1
    power_of_two: bool = False
    doc: str = ""
    required: bool = True

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

# The most experts per token (top-k) the kernels are compiled for (kernels/common.cuh static_asserts it through
# COLI_MAX_TOP_K). `convert` and `build` refuse a model above it, naming this limit, before anything is written or
# compiled.
MAX_TOP_K = 16

# The most experts per layer the kernels are compiled for (kernels/common.cuh static_asserts COLI_EXPERTS <= 256;
# docs/kernels.md "Limits"). `build` refuses a model above it, naming this limit, before anything is compiled.
MAX_EXPERTS = 256

# Bytes allocated on the device after the weights (the .colibri data): the GEMV kernels read every weight row through
# its aligned window of 16-byte vectors (docs/kernels.md "The GEMV path"), up to 15 bytes past the row's end, so the
# last row of the file may reach past the data. The C runtime has the same value (libcolibri internal.h).
WEIGHTS_TAIL_BYTES = 16


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One CUDA C source file in kernels/ and its profile section.

    Attributes:
        name: profile key under `kernels:` and the base name of the cubin/PTX files in a bundle.
        source: file name in kernels/.
        symbols: the `extern "C" __global__` entry points it defines.
        params: the tunable parameters the profile must give (none: the kernel has no `kernels.<name>` section).
    """

    name: str
    source: str
    symbols: tuple[str, ...]
    params: tuple[Param, ...]


# The pipeline of one MoE layer, in launch order. docs/kernels.md describes each kernel.
KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec(
        "routing",
        "routing.cu",
        ("colibri_routing", "colibri_align"),
        (
            THREADS,
            Param("block_m", 1, 128, power_of_two=True, doc="rows (token, slot pairs) per tile of the padded order"),
        ),
    ),
    KernelSpec(
        "gate_up",
        "expert_gate_up.cu",
        ("colibri_gate_up", "colibri_gate_up_tc"),
        (
            THREADS,
            Param("block_n", 16, 256, power_of_two=True, doc="intermediate columns per tile"),
            Param("block_k", 16, 128, power_of_two=True, doc="hidden elements per shared-memory stage"),
        ),
    ),
    KernelSpec(
        "down",
        "expert_down.cu",
        ("colibri_down", "colibri_down_tc"),
        (
            THREADS,
            Param("block_n", 16, 256, power_of_two=True, doc="hidden columns per tile"),
            Param("block_k", 16, 128, power_of_two=True, doc="intermediate elements per shared-memory stage"),
        ),
    ),
    KernelSpec(
        "small_batch",
        "small_batch.cu",
        ("colibri_gate_up_gemv", "colibri_down_gemv", "colibri_shared_gate_up", "colibri_shared_down"),
        (THREADS, Param("max_pairs", 1, 4096, doc="tokens*top_k at or below this take the GEMV path (the GEMV / "
                        "tiled crossover)"),
         Param("max_pairs_quantized", 0, 4096, required=False, doc="max_pairs for int8/int4 experts (optional; "
               "without it, max_pairs holds for every storage; 0: int8/int4 always take the tensor-core tiles)")),
    ),
    # int8/int4 weights on the tiled path (tensor cores): a fixed tile, no profile section (no params).
    KernelSpec("expert_quant", "expert_quant_tc.cu", ("colibri_gate_up_qtc", "colibri_down_qtc"), ()),
    # Compiled and launched only for a bundle with expert capacity (profile `capacity`, `kernels_for`); it runs
    # with kernels.routing.threads, so it has no profile section of its own.
    KernelSpec("capacity", "capacity.cu", ("colibri_capacity",), ()),
)

CAPACITY_KERNEL = "capacity"
CAPACITY_DROPPED = "capacity_dropped"  # the device buffer of the per-layer dropped-pair counts (device_buffers)


def kernels_for(profile: dict) -> tuple[KernelSpec, ...]:
    """The catalogue kernels a bundle of `profile` compiles: every one, less the capacity kernel when the profile
    sets no `capacity` (dropless, the default: no extra kernel and no extra launch)."""
    return tuple(k for k in KERNELS if k.name != CAPACITY_KERNEL or profile.get("capacity") is not None)


def capacity_defines(spec: dict | None) -> dict[str, int]:
    """The capacity kernel's -D constants for a profile `capacity` mapping (None: {}); mode, policy and order are a
    launch argument (`capacity_flags`). COLI_CAPACITY_MIN (min_capacity) is defined only where it is not 1, so a
    profile without min_capacity compiles with the constants it had before the key existed.

    factor = COLI_CAPACITY_FACTOR_NUM * 2^-COLI_CAPACITY_FACTOR_SHIFT exactly (`float.as_integer_ratio`: the
    denominator of a double is a power of two), so kernels/capacity.cu computes C = ceil(T*k*factor/experts) with the
    same IEEE double operations as colibri_sdk.capacity.Capacity.limit.
    """
    if spec is None:
        return {}
    num, den = float(spec["factor"]).as_integer_ratio()
    defines = {"COLI_CAPACITY": 1, "COLI_CAPACITY_FACTOR_NUM": num, "COLI_CAPACITY_FACTOR_SHIFT": den.bit_length() - 1}
    if int(spec.get("min_capacity", 1)) != 1:
        defines["COLI_CAPACITY_MIN"] = int(spec["min_capacity"])
    return defines


def capacity_flags(spec: dict) -> int:
    """colibri_capacity's `flags` argument: bit 0 mode soft (else hard), bit 1 policy position (else score), bit 2
    order choice (first choices first; else by the policy alone)."""
    return ((1 if spec.get("mode", "hard") == "soft" else 0) | (2 if spec.get("policy", "score") == "position" else 0)
            | (4 if spec.get("order", "policy") == "choice" else 0))


def kernel_dir() -> Path:
    """The folder holding the .cu sources: colibri_sdk/kernels of the installed package (kernels/ of the checkout).

    kernels/ has no __init__.py on purpose: it is a namespace package, so a checkout's kernels/ on sys.path (the
    working directory of `python -m pytest`) never shadows the `kernels` distribution that transformers imports.
    A setuptools editable install (`pip install -e .`, as scripts/gpu_check.sh does where it can) does not map a
    namespace subpackage of a package it maps (colibri_sdk -> sdk/), so there the checkout's kernels/ beside sdk/
    is the folder. Raises FileNotFoundError (naming where it looked) when neither holds common.cuh."""
    try:
        from . import kernels

        return Path(next(iter(kernels.__path__)))
    except ImportError:
        return checkout_kernel_dir(Path(__file__).resolve().parent)


def checkout_kernel_dir(sdk: Path) -> Path:
    """kernels/ beside a checkout's sdk/ folder `sdk` (kernel_dir under an editable install); FileNotFoundError
    when it holds no common.cuh."""
    folder = sdk.parent / "kernels"
    if not (folder / "common.cuh").is_file():
        raise FileNotFoundError(f"kernel sources: colibri_sdk.kernels is not importable and {folder} holds no "
                                "common.cuh; allowed: an installed colibri-sdk or a checkout (sdk/ beside kernels/)")
    return folder


def kernel_routing(header) -> int:
    """The kernels' routing code: the format's (0 topk_softmax, 1 softmax_topk, 2 sigmoid_topk), with v2
    softmax_topk + norm_topk (renormalised over the k) and no group limit being topk_softmax (docs/format.md, v2
    "Semantics"; HeaderV2.as_v1 makes the same mapping). With a group limit the selection needs the softmax scores
    themselves (a top-two group sum is not monotonic in the logits), so it stays 1 with COLI_NORM_TOPK."""
    if getattr(header, "norm_topk", 0) and header.routing == 1 and getattr(header, "n_group", 1) == 1:
        return 0
    return header.routing


def is_v2(header) -> bool:
    """True for a v2 (0x0200) header (colibri_sdk.format.HeaderV2; duck-typed: this module imports no package)."""
    return hasattr(header, "layer_map")


def weights_fp16(profile: dict, header) -> bool:
    """True when the expert matrices the kernels read are fp16: a v1 file is converted to the profile's dtype by the
    build; a v2 file is copied as it is, so its own storage counts (quantized: False)."""
    if is_v2(header):
        return not quant(header) and header.dtype == 1
    return profile["dtype"] == "fp16"


def float_bits(value: float) -> int:
    """The float32 bit pattern of `value`, as an integer (how a float reaches the kernels as a -D constant;
    common.cuh reads it back with __uint_as_float)."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def quant(header) -> int:
    """The storage code of the expert matrices (docs/format.md v2 `quant`): 0 float, 1 int8, 2 int4; 0 for v1."""
    return int(getattr(header, "quant", 0))


# Weight kinds the GEMV kernels read for each matrix of a quantized file, in argument order after the float
# arguments (kernels/small_batch.cu Q_ARGS2_ / Q_ARGS1_): the scales, then the zero points.
QUANT_SUFFIXES = (".scales", ".zeros")
