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

# The most experts per token (top-k) the kernels are compiled for (kernels/common.cuh static_asserts it through
# COLI_MAX_TOP_K). `convert` and `build` refuse a model above it, naming this limit, before anything is written or
# compiled.
MAX_TOP_K = 16

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
        params: the tunable parameters the profile must give.
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
        ("colibri_down", "colibri_aggregate", "colibri_down_tc"),
        (
            THREADS,
            Param("block_n", 16, 256, power_of_two=True, doc="hidden columns per tile"),
            Param("block_k", 16, 128, power_of_two=True, doc="intermediate elements per shared-memory stage"),
        ),
    ),
    KernelSpec(
        "small_batch",
        "small_batch.cu",
        ("colibri_gate_up_gemv", "colibri_down_gemv"),
        (THREADS, Param("max_pairs", 1, 4096, doc="tokens*top_k at or below this take the GEMV path (the GEMV / "
                        "tiled crossover)")),
    ),
)


def kernel_dir() -> Path:
    """The folder holding the .cu sources: inside the installed package, or kernels/ of a source checkout."""
    from . import kernels

    return Path(kernels.__file__).parent


def kernel_routing(header) -> int:
    """The kernels' routing code: the format's, with v2 softmax_topk + norm_topk (renormalised over the k) being
    topk_softmax (docs/format.md, v2 "Semantics"; HeaderV2.as_v1 makes the same mapping)."""
    if getattr(header, "norm_topk", 0) and header.routing == 1:
        return 0
    return header.routing


def quant(header) -> int:
    """The storage code of the expert matrices (docs/format.md v2 `quant`): 0 float, 1 int8, 2 int4; 0 for v1."""
    return int(getattr(header, "quant", 0))


# Weight kinds the GEMV kernels read for each matrix of a quantized file, in argument order after the float
# arguments (kernels/small_batch.cu Q_ARGS2_ / Q_ARGS1_): the scales, then the zero points.
QUANT_SUFFIXES = (".scales", ".zeros")


def compile_defines(profile: dict, header) -> dict[str, int]:
    """Compile-time constants (`-D NAME=VALUE`) every kernel source receives.

    Args:
        profile: the validated profile as a plain dict (the YAML structure of profiles/*.yaml).
        header: the weights' `colibri_sdk.format.Header`.

    Returns:
        {"COLI_HIDDEN", "COLI_INTER", "COLI_EXPERTS", "COLI_TOPK", "COLI_MAX_TOP_K" (MAX_TOP_K),
         "COLI_MAX_TOKENS" (batch * tokens), "COLI_BATCH", "COLI_SEQ_TOKENS" (the fixed batch and tokens),
         "COLI_GEMV" (1 = the launch plan takes the GEMV path, `Sizes.small_batch`),
         "COLI_TC" (1 = the tiled path runs on tensor cores, `Sizes.tensor_core`),
         "COLI_FP16" (1 = fp16 storage, fp32 accumulation; 0 = fp32), "COLI_ATOMIC_AGG" (1 = atomicAdd aggregation),
         "COLI_ROUTING" (format routing code), "COLI_RESIDUAL" (1 = residual composition),
         "COLI_QUANT" (expert storage: 0 float, 1 int8, 2 int4; a v1 header: 0), "COLI_GROUP_SIZE" (scale group
         along the reduction dimension, 0 = per row), "COLI_ZERO_POINTS" (1 = int8 zero points),
         "COLI_SCALE_FP16" (1 = fp16 scales, the header's `dtype` of a quantized file)}
        For quantized weights COLI_FP16 is 0 (the router of a v2 file is float32) and the profile's dtype does not
        apply: the kernels follow the file's storage (docs/kernels.md, "Quantized weights").
        plus "COLI_<KERNEL>_<PARAM>" for every `kernels.<kernel>.<param>` of the profile, upper-cased
        (e.g. COLI_GATE_UP_BLOCK_M).
    """
    shape = profile["shape"]
    defines = {
        "COLI_HIDDEN": header.hidden_size,
        "COLI_INTER": header.intermediate_size,
        "COLI_EXPERTS": header.num_experts,
        "COLI_TOPK": header.top_k,
        "COLI_MAX_TOP_K": MAX_TOP_K,
        "COLI_MAX_TOKENS": shape["batch"] * shape["tokens"],
        "COLI_BATCH": shape["batch"],
        "COLI_SEQ_TOKENS": shape["tokens"],
        "COLI_GEMV": 1 if sizes(profile, header).small_batch else 0,
        "COLI_TC": 1 if sizes(profile, header).tensor_core else 0,
        "COLI_FP16": 0 if quant(header) else (1 if profile["dtype"] == "fp16" else 0),
        "COLI_ATOMIC_AGG": 1 if profile["aggregation"] == "atomic" else 0,
        "COLI_ROUTING": kernel_routing(header),
        "COLI_RESIDUAL": header.composition,
        "COLI_QUANT": quant(header),
        "COLI_GROUP_SIZE": getattr(header, "group_size", 0) if quant(header) else 0,
        "COLI_ZERO_POINTS": getattr(header, "zero_points", 0) if quant(header) else 0,
        "COLI_SCALE_FP16": 1 if quant(header) and header.dtype == 1 else 0,
    }
    for kernel, params in sorted(profile["kernels"].items()):
        for param, value in sorted(params.items()):
            defines[f"COLI_{kernel.upper()}_{param.upper()}"] = int(value)
    return defines


# ---- fixed-shape sizes, buffers and the launch plan ------------------------------------------------------------
# Every size below follows from the profile's fixed shape and the weights' header alone, never from a routing
# outcome: one launch sequence serves every input, so it can be captured once into a CUDA Graph.

FLOAT32_BYTES = 4
TC_BLOCK_M, TC_THREADS, TC_BLOCK_N = 16, 128, 32  # the tensor-core tile (common.cuh tc_tile): rows, threads, columns
INT32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The fixed-shape sizes of one forward pass (docs/kernels.md, "Padded expert order").

    Attributes:
        tokens: batch * tokens of the profile's shape (padded tokens included).
        pairs: tokens * top_k, the (token, slot) pairs.
        block_m: rows per tile of the padded expert order (profile `kernels.routing.block_m`).
        padded: tokens * top_k + experts * (block_m - 1), the most rows the padded expert order can need.
        blocks: padded // block_m, the most tiles of block_m rows it can need.
        small_batch: True when pairs <= `kernels.small_batch.max_pairs`: the GEMV kernels replace the tiled ones.
        tensor_core: tiled path with fp16 (never quantized) weights, block_m 16 and hidden and intermediate multiples of 8: the
            tensor-core kernels (colibri_gate_up_tc, colibri_down_tc) replace colibri_gate_up and colibri_down.
    """

    tokens: int
    pairs: int
    block_m: int
    padded: int
    blocks: int
    small_batch: bool
    tensor_core: bool = False


def sizes(profile: dict, header) -> Sizes:
    """The fixed-shape sizes for a validated profile dict and a weights header."""
    tokens = profile["shape"]["batch"] * profile["shape"]["tokens"]
    pairs = tokens * header.top_k
    block_m = profile["kernels"]["routing"]["block_m"]
    padded = pairs + header.num_experts * (block_m - 1)
    small = pairs <= profile["kernels"]["small_batch"]["max_pairs"]
    # sum_e ceil(c_e / block_m) <= (pairs + experts*(block_m-1)) / block_m, and the left side is an integer.
    return Sizes(
        tokens=tokens,
        pairs=pairs,
        block_m=block_m,
        padded=padded,
        blocks=padded // block_m,
        small_batch=small,
        tensor_core=(not small and not quant(header) and profile["dtype"] == "fp16" and block_m == TC_BLOCK_M
                     and header.hidden_size % 8 == 0 and header.intermediate_size % 8 == 0),
    )


def device_buffers(profile: dict, header) -> dict[str, int]:
    """Scratch buffers of one forward pass, allocated once at load: name → size in bytes.

    The weights are not listed: they are one more buffer holding the .colibri data after the header, byte for byte.

        x0, x1           (tokens, hidden) float32   activations; layer l reads x{l%2} and writes x{(l+1)%2}
        valid_tokens     (batch,) int32             valid tokens of each sequence, written by the input copy
        topk_ids         (tokens, top_k) int32      selected experts, largest logit first; `experts` (NO_EXPERT)
                                                    in every slot of a padded token
        topk_weights     (tokens, top_k) float32    routing weights (0 for padded tokens)
        act              (pairs, intermediate) float32   silu(gate) * up per pair (rows of padded tokens unwritten)
      tiled path only (`Sizes.small_batch` False):
        expert_counts    (experts,) int32           (token, slot) pairs per expert
        expert_offsets   (experts + 1,) int32       start of each expert's rows in the padded order
        sorted_pairs     (padded,) int32            pair index token*top_k+slot per row, -1 for padding rows
        block_experts    (blocks,) int32            expert of each tile of block_m rows, -1 for unused tiles
        pair_out         (pairs, hidden) float32    routing weight * down per pair (ordered aggregation only)
    """
    s = sizes(profile, header)
    e, h, i = header.num_experts, header.hidden_size, header.intermediate_size
    buffers = {
        "x0": s.tokens * h * FLOAT32_BYTES,
        "x1": s.tokens * h * FLOAT32_BYTES,
        "valid_tokens": profile["shape"]["batch"] * INT32_BYTES,
        "topk_ids": s.pairs * INT32_BYTES,
        "topk_weights": s.pairs * FLOAT32_BYTES,
        "act": s.pairs * i * FLOAT32_BYTES,
    }
    if not s.small_batch:
        buffers.update(
            expert_counts=e * INT32_BYTES,
            expert_offsets=(e + 1) * INT32_BYTES,
            sorted_pairs=s.padded * INT32_BYTES,
            block_experts=s.blocks * INT32_BYTES,
        )
        if profile["aggregation"] == "ordered":
            buffers["pair_out"] = s.pairs * h * FLOAT32_BYTES
    return buffers


def io_buffers(header) -> dict[str, str]:
    """The buffers the runtime's copies use: {"input": "x0", "output": "x0"|"x1", "valid_tokens": "valid_tokens"}.

    Before the first launch (inside the captured graph), the input copy writes the input (batch*tokens, hidden)
    float32 into "input" and the valid-token counts into "valid_tokens": (batch,) int32, entry b the number of
    valid tokens of sequence b (its first ones; 0..tokens). Row t = b*tokens + i is valid when i < entry b; the
    other rows are padding: they select no expert, and their output rows are the input rows (residual composition)
    or zeros. After the last launch the output copy reads "output".
    """
    return {"input": "x0", "output": f"x{header.num_layers % 2}", "valid_tokens": "valid_tokens"}


def _buf(name: str) -> dict:
    return {"kind": "buffer", "name": name}


def _weights(header, kind: str, layer: int) -> dict:
    """A pointer into the weights buffer: the layer's first tensor of `kind` (experts follow contiguously)."""
    from .format.constants import HEADER_SIZE

    expert = None if kind == "router" else 0
    offset = header.tensor_offset(kind, layer, expert) - HEADER_SIZE
    return {"kind": "weights", "tensor": kind, "layer": layer, "offset": offset}


def _quant_args(header, kinds: tuple[str, ...], layer: int) -> list[dict]:
    """The scale blocks of `kinds`, then their zero-point blocks (null without zero points), of one layer; [] for
    float weights. Each a `weights` pointer like the matrices'."""
    if not quant(header):
        return []
    scales = [_weights(header, kind + QUANT_SUFFIXES[0], layer) for kind in kinds]
    zeros = [_weights(header, kind + QUANT_SUFFIXES[1], layer) if header.zero_points else {"kind": "null"}
             for kind in kinds]
    return scales + zeros


def check_path(profile: dict, header) -> None:
    """Refuse a shape the kernels cannot run for these weights: quantized weights run on the GEMV path only.

    Raises:
        CompileError: quantized weights and tokens*top_k above kernels.small_batch.max_pairs, naming both.
    """
    s = sizes(profile, header)
    if quant(header) and not s.small_batch:
        from .errors import CompileError

        name = ("int8", "int4")[quant(header) - 1]
        raise CompileError(
            f"{name} weights run on the GEMV path only: this shape has batch*tokens*top_k = {s.pairs} pairs, "
            f"above kernels.small_batch.max_pairs = {profile['kernels']['small_batch']['max_pairs']}; allowed: "
            f"pairs <= max_pairs (lower shape.batch/shape.tokens, or raise max_pairs to at least {s.pairs}), or "
            f"float weights for the tiled path"
        )


def _launch(layer: int, kernel: str, symbol: str, grid, threads: int, args: list[dict]) -> dict:
    return {
        "layer": layer,
        "kernel": kernel,
        "symbol": symbol,
        "grid": [int(g) for g in grid],
        "block": [int(threads), 1, 1],
        "shared_bytes": 0,
        "args": args,
    }


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def down_gemv_rows(threads: int) -> int:
    """Hidden rows per block of colibri_down_gemv: 2 per warp, 1 above 512 threads (small_batch.cu DOWN_ROWS_)."""
    return (threads // 32) * (1 if threads > 512 else 2)


def launch_plan(profile: dict, header) -> list[dict]:
    """The kernel launches of one forward pass, in order.

    Each launch is {"layer", "kernel" (KERNELS name), "symbol", "grid" [x, y, z], "block" [x, y, z],
    "shared_bytes" (dynamic shared memory; the kernels use static shared memory only, so 0), "args"}. The argument
    kinds, each one kernel parameter, a pointer:
        {"kind": "buffer", "name": N}      the `device_buffers` entry N
        {"kind": "weights", "tensor", "layer", "offset"}   weights buffer + offset bytes (the buffer holds the
                                           .colibri data after the header; tensor and layer name what it points at)
        {"kind": "null"}                   a null pointer
    The runtime's input copy writes `io_buffers(header)["input"]` and `["valid_tokens"]` before the first launch;
    the output is copied out of `io_buffers(header)["output"]` after the last.

    Per layer, GEMV path (tokens*top_k <= `kernels.small_batch.max_pairs`): routing → gate/up GEMV → down GEMV (the
    aggregation folded in), 3 launches. Tiled path: routing → align → gate/up → down → aggregate (ordered
    aggregation only), 5 or 4 launches. Quantized weights (GEMV path only): the gate/up launch takes the scale
    blocks of gate and up, then their zero-point blocks, after its float arguments; the down launch those of down
    (`weights` pointers; `{"kind": "null"}` for zero points the file does not have).

    Raises:
        CompileError: quantized weights on a shape that takes the tiled path (`check_path`).
    """
    check_path(profile, header)
    s = sizes(profile, header)
    k = profile["kernels"]
    e, h, i = header.num_experts, header.hidden_size, header.intermediate_size
    ordered = profile["aggregation"] == "ordered"
    valid = _buf("valid_tokens")
    plan = []
    for layer in range(header.num_layers):
        x, x_next = _buf(f"x{layer % 2}"), _buf(f"x{(layer + 1) % 2}")
        plan.append(
            _launch(
                layer, "routing", "colibri_routing", (s.tokens, 1, 1), k["routing"]["threads"],
                [x, _weights(header, "router", layer), valid, _buf("topk_ids"), _buf("topk_weights"), x_next],
            )
        )
        gate, up, down = (_weights(header, kind, layer) for kind in ("gate_proj", "up_proj", "down_proj"))
        if s.small_batch:
            threads = k["small_batch"]["threads"]
            warps = threads // 32
            plan.append(
                _launch(
                    layer, "small_batch", "colibri_gate_up_gemv", (_ceil_div(i, warps), min(e, s.pairs), 1),
                    threads, [x, gate, up, valid, _buf("topk_ids"), _buf("act"),
                              *_quant_args(header, ("gate_proj", "up_proj"), layer)],
                )
            )
            plan.append(
                _launch(
                    layer, "small_batch", "colibri_down_gemv", (_ceil_div(h, down_gemv_rows(threads)), 1, 1), threads,
                    [x, _buf("act"), down, _buf("topk_ids"), _buf("topk_weights"), x_next,
                     *_quant_args(header, ("down_proj",), layer)],
                )
            )
            continue
        pair_out = _buf("pair_out") if ordered else {"kind": "null"}
        plan.append(
            _launch(
                layer, "routing", "colibri_align", (1, 1, 1), k["routing"]["threads"],
                [_buf("topk_ids"), _buf("expert_counts"), _buf("expert_offsets"), _buf("sorted_pairs"),
                 _buf("block_experts")],
            )
        )
        tiles = [_buf("sorted_pairs"), _buf("block_experts")]
        if s.tensor_core:
            gate_up_launch = ("colibri_gate_up_tc", (s.blocks, _ceil_div(i, TC_BLOCK_N), 1), TC_THREADS)
            down_launch = ("colibri_down_tc", (s.blocks, _ceil_div(h, TC_BLOCK_N), 1), TC_THREADS)
        else:
            gate_up_launch = ("colibri_gate_up", (s.blocks, _ceil_div(i, k["gate_up"]["block_n"]), 1),
                              k["gate_up"]["threads"])
            down_launch = ("colibri_down", (s.blocks, _ceil_div(h, k["down"]["block_n"]), 1), k["down"]["threads"])
        plan.append(_launch(layer, "gate_up", *gate_up_launch, [x, gate, up, *tiles, _buf("act")]))
        plan.append(
            _launch(layer, "down", *down_launch,
                    [_buf("act"), down, _buf("topk_weights"), *tiles, pair_out, x_next])
        )
        if ordered:
            plan.append(
                _launch(
                    layer, "down", "colibri_aggregate", (s.tokens, 1, 1), k["down"]["threads"],
                    [x, _buf("topk_ids"), _buf("pair_out"), x_next],
                )
            )
    return plan
