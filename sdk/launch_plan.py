"""The launch plan of one forward pass: its fixed-shape sizes (`Sizes`, the router's grid), the scratch buffers it
needs (`device_buffers`, `io_buffers`) and the kernel launches in order (`launch_plan`).

Every size here follows from the profile's fixed shape and the weights' header alone, never from a routing outcome:
one launch sequence serves every input, so it can be captured once into a CUDA Graph. Part of the kernel catalogue
(colibri_sdk.catalog re-exports every name). Needs only the standard library: it is imported on the device.
"""

from __future__ import annotations

import dataclasses

from .kernel_table import CAPACITY_DROPPED, CAPACITY_KERNEL, QUANT_SUFFIXES, capacity_flags, quant, weights_fp16

FLOAT32_BYTES = 4
# The fp16 tensor-core tiles (common.cuh tc_tile_rows): rows per pass over the weights (4 tiles of 16), threads,
# output columns per block.
TC_PASS_ROWS, TC_THREADS, TC_BLOCK_N = 64, 128, 32
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
        small_batch: True when pairs <= `gemv_max_pairs` (kernels.small_batch.max_pairs, or max_pairs_quantized
            for int8/int4 experts): the GEMV kernels replace the tiled ones.
        tensor_core: tiled path with fp16 (never quantized) weights, any block_m and sizes: the tensor-core kernels
            (colibri_gate_up_tc, colibri_down_tc) replace colibri_gate_up and colibri_down, which remain for fp32
            weights.
        quant_tensor_core: tiled path with int8/int4 weights (any block_m and sizes): colibri_gate_up_qtc and
            colibri_down_qtc (kernels/expert_quant_tc.cu) replace colibri_gate_up and colibri_down.
    """

    tokens: int
    pairs: int
    block_m: int
    padded: int
    blocks: int
    small_batch: bool
    tensor_core: bool = False
    quant_tensor_core: bool = False


def gemv_max_pairs(profile: dict, header) -> int:
    """The most pairs (tokens * top_k) that take the GEMV path for this header's expert storage:
    `kernels.small_batch.max_pairs_quantized` for int8/int4 experts where the profile sets it, else
    `kernels.small_batch.max_pairs` (docs/profiles.md)."""
    small_batch = profile["kernels"]["small_batch"]
    if quant(header) and "max_pairs_quantized" in small_batch:
        return small_batch["max_pairs_quantized"]
    return small_batch["max_pairs"]


def sizes(profile: dict, header) -> Sizes:
    """The fixed-shape sizes for a validated profile dict and a weights header."""
    tokens = profile["shape"]["batch"] * profile["shape"]["tokens"]
    pairs = tokens * header.top_k
    block_m = profile["kernels"]["routing"]["block_m"]
    padded = pairs + header.num_experts * (block_m - 1)
    small = pairs <= gemv_max_pairs(profile, header)
    # sum_e ceil(c_e / block_m) <= (pairs + experts*(block_m-1)) / block_m, and the left side is an integer.
    return Sizes(
        tokens=tokens,
        pairs=pairs,
        block_m=block_m,
        padded=padded,
        blocks=padded // block_m,
        small_batch=small,
        tensor_core=not small and weights_fp16(profile, header),
        quant_tensor_core=not small and bool(quant(header)),
    )


# The router kernel's grid (kernels/routing.cu colibri_routing): tokens in groups of at most ROUTER_GROUP_TOKENS, each
# group's router read once, cut into slices of ROUTER_ROWS_PER_TOKEN rows per group token (at least
# ROUTER_MIN_SLICE_ROWS), so the partial logits the last block of a group adds up are 1/ROUTER_ROWS_PER_TOKEN of the
# router's elements, and a one-token bundle spreads its router over hidden / 32 blocks.
ROUTER_GROUP_TOKENS = 16
ROUTER_ROWS_PER_TOKEN = 16
ROUTER_MIN_SLICE_ROWS = 32


@dataclasses.dataclass(frozen=True)
class RouterGrid:
    """The grid of colibri_routing (docs/kernels.md "Router").

    Attributes:
        group_tokens: tokens per group, min(tokens, ROUTER_GROUP_TOKENS): each block computes the logits of one
            group's tokens, so the router is read once per group.
        slice_rows: hidden rows per slice, max(ROUTER_MIN_SLICE_ROWS, ROUTER_ROWS_PER_TOKEN * group_tokens).
        slices: ceil(hidden / slice_rows), grid x.
        groups: ceil(tokens / group_tokens), grid y.
        fused_align: the routing kernel also builds the padded expert order (tiled path without expert capacity:
            colibri_capacity must drop pairs before the order is built, so with capacity colibri_align follows it).
        counters: int32 entries of routing_counters, groups + 1 (one per group, one for the align).
        partials: float32 entries of routing_partials, groups * slices * group_tokens * (experts + shared gate).
    """

    group_tokens: int
    slice_rows: int
    slices: int
    groups: int
    fused_align: bool
    counters: int
    partials: int


def router_grid(profile: dict, header) -> RouterGrid:
    """colibri_routing's grid (slices, groups) and scratch sizes for a validated profile dict and a header."""
    s = sizes(profile, header)
    group = min(s.tokens, ROUTER_GROUP_TOKENS)
    rows = max(ROUTER_MIN_SLICE_ROWS, ROUTER_ROWS_PER_TOKEN * group)
    slices, groups = _ceil_div(header.hidden_size, rows), _ceil_div(s.tokens, group)
    columns = header.num_experts + (1 if getattr(header, "shared_gate", 0) else 0)
    return RouterGrid(group_tokens=group, slice_rows=rows, slices=slices, groups=groups,
                      fused_align=not s.small_batch and profile.get("capacity") is None,
                      counters=groups + 1, partials=groups * slices * group * columns)


# Scratch buffers of int32 counters are named "<user>_counters" (docs/kernels.md, "Counters"): every backend sets
# them to zero once, after allocating them (and again after `poison`), and each kernel that counts in one sets the
# counters it used back to zero before it exits, so every call and every graph replay starts from zeros.
COUNTERS_SUFFIX = "_counters"


# The counters of the ordered aggregation folded into the tiled down kernels (kernels/common.cuh fold_aggregate).
DOWN_COUNTERS = "down_counters"


def down_column_blocks(profile: dict, header) -> int:
    """Column blocks of the tiled down kernel (its grid's y): ceil(hidden / 32) for colibri_down_tc and
    colibri_down_qtc (TC_BLOCK_N), ceil(hidden / kernels.down.block_n) for colibri_down. `down_counters` holds one
    int32 counter per (token, column block)."""
    s = sizes(profile, header)
    width = TC_BLOCK_N if s.tensor_core or s.quant_tensor_core else profile["kernels"]["down"]["block_n"]
    return _ceil_div(header.hidden_size, width)


def is_counter_buffer(name: str) -> bool:
    """True for a scratch buffer of int32 counters (its name ends in COUNTERS_SUFFIX), which the backends zero once
    after allocating it instead of leaving it unset."""
    return name.endswith(COUNTERS_SUFFIX)


# The GEMV path's pair order (kernels/common.cuh PairOrder, docs/kernels.md "Pair order (GEMV path)").
PAIR_ORDER = "pair_order"


def pair_order_ints(experts: int, pairs: int) -> int:
    """int32 entries of the `pair_order` buffer: nused (1), counts, offsets and used (experts each), then the
    pairs sorted by expert (pairs)."""
    return 1 + 3 * experts + pairs


def device_buffers(profile: dict, header) -> dict[str, int]:
    """Scratch buffers of one forward pass, allocated once at load: name → size in bytes.

    The weights are not listed: they are one more buffer holding the .colibri data after the header, byte for byte.

        x0, x1           (tokens, hidden) float32   activations; layer l reads x{l%2} and writes x{(l+1)%2}
        valid_tokens     (batch,) int32             valid tokens of each sequence, written by the input copy
        topk_ids         (tokens, top_k) int32      selected experts, largest logit first; `experts` (NO_EXPERT)
                                                    in every slot of a padded token
        topk_weights     (tokens, top_k) float32    routing weights (0 for padded tokens)
        act              (pairs, intermediate) float32   silu(gate) * up per pair (rows of padded tokens unwritten)
        routing_partials (groups, slices, group_tokens, experts [+ 1 shared gate]) float32   partial router logits
                                                    per hidden slice (`router_grid`)
        routing_counters (groups + 1,) int32        colibri_routing's last-block counters (zero between calls)
      GEMV path only (`Sizes.small_batch` True):
        pair_order       (1 + 3 * experts + pairs,) int32   the valid pairs grouped by expert (`pair_order_ints`;
                                                    kernels/common.cuh PairOrder): built once per layer by
                                                    colibri_routing (and colibri_capacity), read by the GEMV kernels
      tiled path only (`Sizes.small_batch` False):
        expert_counts    (experts,) int32           (token, slot) pairs per expert
        expert_offsets   (experts + 1,) int32       start of each expert's rows in the padded order
        sorted_pairs     (padded,) int32            pair index token*top_k+slot per row, -1 for padding rows
        block_experts    (blocks,) int32            expert of each tile of block_m rows, -1 for unused tiles
        pair_out         (pairs, hidden) float32    routing weight * down per pair (ordered aggregation only)
        down_counters    (tokens, down column blocks) int32   ordered aggregation only: kept pairs counted per
                                                    (token, column block of the down kernel: `down_column_blocks`)
                                                    by the fold of the down kernels; zero between launches
      expert capacity only (profile `capacity`):
        capacity_rank    (2 * pairs,) int32         each pair's rank in its expert's priority order, then keep flags
        capacity_dropped (layers,) int32            pairs dropped by layer l's capacity in the latest call
                                                    (CAPACITY_DROPPED; the runtime sums the layers it ran)
      shared experts only (v2 num_shared_experts S >= 1, width Is):
        shared_act       (S, tokens, Is) float32    silu(gate) * up of each shared expert per token (0 for padded)
        shared_scale     (tokens,) float32          sigmoid(x . shared_expert_gate) per token (shared_gate only)
    A name ending in COUNTERS_SUFFIX is an int32 counter buffer, zero at every launch (`is_counter_buffer`).
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
        "routing_partials": router_grid(profile, header).partials * FLOAT32_BYTES,
        "routing_counters": router_grid(profile, header).counters * INT32_BYTES,
    }
    if s.small_batch:
        buffers[PAIR_ORDER] = pair_order_ints(header.num_experts, s.pairs) * INT32_BYTES
    else:
        buffers.update(
            expert_counts=e * INT32_BYTES,
            expert_offsets=(e + 1) * INT32_BYTES,
            sorted_pairs=s.padded * INT32_BYTES,
            block_experts=s.blocks * INT32_BYTES,
        )
        if profile["aggregation"] == "ordered":
            buffers["pair_out"] = s.pairs * h * FLOAT32_BYTES
            buffers[DOWN_COUNTERS] = s.tokens * down_column_blocks(profile, header) * INT32_BYTES
    if profile.get("capacity") is not None:
        buffers["capacity_rank"] = 2 * s.pairs * INT32_BYTES
        buffers[CAPACITY_DROPPED] = header.num_layers * INT32_BYTES
    shared = getattr(header, "num_shared_experts", 0)
    if shared:
        buffers["shared_act"] = shared * s.tokens * header.shared_intermediate_size * FLOAT32_BYTES
        if header.shared_gate:
            buffers["shared_scale"] = s.tokens * FLOAT32_BYTES
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


# Per-layer tensors of a file (no expert index): the router and the float32 vectors of a v2 file.
PER_LAYER_KINDS = ("router", "router_bias", "correction_bias", "gate_bias", "up_bias", "down_bias",
                   "shared_expert_gate")


def _weights(header, kind: str, layer: int) -> dict:
    """A pointer into the weights buffer: the layer's first tensor of `kind` (experts follow contiguously)."""
    from .format.constants import HEADER_SIZE

    expert = None if kind in PER_LAYER_KINDS else 0
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


GEMV_TILE_BYTES = 16 * 1024  # kernels/small_batch.cu: the static_assert on its per-token shared-memory tiles


def gemv_max_tokens(threads: int) -> int:
    """The most batch*tokens small_batch.cu compiles for at `threads` per block (it is compiled for every bundle):
    its output tile `tokens * down_gemv_rows(threads) * 4` bytes and its partials `2 * tokens * warps * 4` bytes are
    each at most GEMV_TILE_BYTES (the static_assert there)."""
    return GEMV_TILE_BYTES // (4 * max(down_gemv_rows(threads), 2 * (threads // 32)))


def launch_plan(profile: dict, header) -> list[dict]:
    """The kernel launches of one forward pass, in order.

    Each launch is {"layer", "kernel" (KERNELS name), "symbol", "grid" [x, y, z], "block" [x, y, z],
    "shared_bytes" (dynamic shared memory; the kernels use static shared memory only, so 0), "args"}. The argument
    kinds, each one kernel parameter, a pointer:
        {"kind": "buffer", "name": N}      the `device_buffers` entry N
        {"kind": "weights", "tensor", "layer", "offset"}   weights buffer + offset bytes (the buffer holds the
                                           .colibri data after the header; tensor and layer name what it points at)
        {"kind": "null"}                   a null pointer
        {"kind": "i32", "value": V}        an int32 passed by value (colibri_capacity's layer and flags)
    The runtime's input copy writes `io_buffers(header)["input"]` and `["valid_tokens"]` before the first launch;
    the output is copied out of `io_buffers(header)["output"]` after the last.

    Per layer, GEMV path (tokens*top_k <= `kernels.small_batch.max_pairs`): routing → gate/up GEMV → down GEMV (the
    aggregation folded in), 3 launches. Tiled path: routing (which also builds the padded expert order) → gate/up →
    down, 3 launches in both aggregation modes (with expert capacity routing → capacity → align → gate/up → down:
    colibri_align builds the order of the kept pairs). Ordered aggregation: the down kernel also sums each token's
    slots in slot order into x_next (the last of its blocks for a token and column block does: `down_counters`,
    docs/kernels.md "Aggregation folded into down (tiled path)"); atomic: it adds each pair into x_next with
    atomicAdd. colibri_routing's grid is (`router_grid` slices, groups), its arguments x, router, valid_tokens,
    topk_ids, topk_weights, x_next, routing_partials, routing_counters, then expert_counts, expert_offsets,
    sorted_pairs, block_experts (null unless `router_grid(...).fused_align`), pair_order (GEMV path, else null),
    then the v2 ones below. The GEMV kernels take the pair order colibri_routing built: colibri_gate_up_gemv (x,
    gate, up, valid_tokens (not read), pair_order, act), colibri_down_gemv (x, act, down, pair_order,
    topk_weights, x_next); colibri_capacity (valid_tokens, topk_ids, topk_weights, capacity_rank,
    capacity_dropped, pair_order (GEMV path, else null), layer, flags) rebuilds it when it drops pairs. The tiled down
    kernels take (act, down, topk_weights, sorted_pairs, block_experts | expert_offsets, pair_out, x_next, x,
    topk_ids, down_counters) — pair_out and down_counters null with atomic aggregation. With shared experts,
    colibri_shared_gate_up and colibri_shared_down follow (2 more launches, both paths). v2 features add `weights`
    arguments at the end of a launch's list, each
    only when the file has it: colibri_routing router_bias, correction_bias, shared_expert_gate + the shared_scale
    buffer; the gate/up kernels gate_bias, up_bias and the down kernels down_bias (after any quantized
    arguments); the shared kernels take the shared blocks (and, quantized, their scale and zero-point blocks).
    Quantized weights: the gate/up launch takes the scale blocks of gate and up, then their zero-point blocks,
    after its float arguments; the down launch those of down (`weights` pointers; `{"kind": "null"}` for zero
    points the file does not have). On the tiled path they run colibri_gate_up_qtc / colibri_down_qtc (grid
    (experts, ceil(columns / 32)), 128 threads), which take expert_offsets in place of block_experts. With expert
    capacity (profile `capacity`) colibri_capacity follows each routing launch (grid 1, kernels.routing.threads);
    without it the plan has no capacity launch.
    With the profile's `programmatic_dependent_launch` every launch after the first has "pdl": true: the backends
    launch it with the programmatic stream serialization attribute (cuLaunchKernelEx) when the operation before it
    on the stream is a launch of the same call, so its blocks may be scheduled while that launch finishes; its
    kernels wait for it at their start (`griddepcontrol.wait`, COLI_PDL; docs/kernels.md "Programmatic dependent
    launch"). Without it no launch has the key.
    """
    s = sizes(profile, header)
    k = profile["kernels"]
    e, h, i = header.num_experts, header.hidden_size, header.intermediate_size
    ordered = profile["aggregation"] == "ordered"
    valid = _buf("valid_tokens")
    grid = router_grid(profile, header)
    plan = []
    for layer in range(header.num_layers):
        x, x_next = _buf(f"x{layer % 2}"), _buf(f"x{(layer + 1) % 2}")
        order = ([_buf(name) for name in ("expert_counts", "expert_offsets", "sorted_pairs", "block_experts")]
                 if grid.fused_align else [{"kind": "null"}] * 4)
        pair_order = _buf(PAIR_ORDER) if s.small_batch else {"kind": "null"}
        plan.append(
            _launch(
                layer, "routing", "colibri_routing", (grid.slices, grid.groups, 1), k["routing"]["threads"],
                [x, _weights(header, "router", layer), valid, _buf("topk_ids"), _buf("topk_weights"), x_next,
                 _buf("routing_partials"), _buf("routing_counters"), *order, pair_order,
                 *_routing_feature_args(header, layer)],
            )
        )
        if profile.get("capacity") is not None:
            plan.append(
                _launch(
                    layer, CAPACITY_KERNEL, "colibri_capacity", (1, 1, 1), k["routing"]["threads"],
                    [valid, _buf("topk_ids"), _buf("topk_weights"), _buf("capacity_rank"), _buf(CAPACITY_DROPPED),
                     pair_order, {"kind": "i32", "value": layer}, {"kind": "i32", "value": capacity_flags(profile["capacity"])}],
                )
            )
        gate, up, down = (_weights(header, kind, layer) for kind in ("gate_proj", "up_proj", "down_proj"))
        gate_up_bias, down_bias = _bias_args(header, ("gate_bias", "up_bias"), layer), _bias_args(
            header, ("down_bias",), layer)
        if s.small_batch:
            threads = k["small_batch"]["threads"]
            warps = threads // 32
            plan.append(
                _launch(
                    layer, "small_batch", "colibri_gate_up_gemv", (_ceil_div(i, warps), min(e, s.pairs), 1),
                    threads, [x, gate, up, valid, pair_order, _buf("act"),
                              *_quant_args(header, ("gate_proj", "up_proj"), layer), *gate_up_bias],
                )
            )
            plan.append(
                _launch(
                    layer, "small_batch", "colibri_down_gemv", (_ceil_div(h, down_gemv_rows(threads)), 1, 1), threads,
                    [x, _buf("act"), down, pair_order, _buf("topk_weights"), x_next,
                     *_quant_args(header, ("down_proj",), layer), *down_bias],
                )
            )
            plan.extend(_shared_launches(profile, header, layer, s))
            continue
        pair_out = _buf("pair_out") if ordered else {"kind": "null"}
        counters = _buf(DOWN_COUNTERS) if ordered else {"kind": "null"}
        if not grid.fused_align:  # after colibri_capacity: the order holds the kept pairs only
            plan.append(
                _launch(
                    layer, "routing", "colibri_align", (1, 1, 1), k["routing"]["threads"],
                    [_buf("topk_ids"), _buf("expert_counts"), _buf("expert_offsets"), _buf("sorted_pairs"),
                     _buf("block_experts")],
                )
            )
        tiles = [_buf("sorted_pairs"), _buf("block_experts")]
        if s.quant_tensor_core:
            tiles = [_buf("sorted_pairs"), _buf("expert_offsets")]
            gate_up_launch = ("expert_quant", "colibri_gate_up_qtc", (e, _ceil_div(i, TC_BLOCK_N), 1), TC_THREADS)
            down_launch = ("expert_quant", "colibri_down_qtc", (e, _ceil_div(h, TC_BLOCK_N), 1), TC_THREADS)
        elif s.tensor_core:
            gate_up_launch = ("gate_up", "colibri_gate_up_tc", (s.blocks, _ceil_div(i, TC_BLOCK_N), 1), TC_THREADS)
            down_launch = ("down", "colibri_down_tc", (s.blocks, _ceil_div(h, TC_BLOCK_N), 1), TC_THREADS)
        else:
            gate_up_launch = ("gate_up", "colibri_gate_up", (s.blocks, _ceil_div(i, k["gate_up"]["block_n"]), 1),
                              k["gate_up"]["threads"])
            down_launch = ("down", "colibri_down", (s.blocks, _ceil_div(h, k["down"]["block_n"]), 1),
                           k["down"]["threads"])
        plan.append(_launch(layer, *gate_up_launch, [x, gate, up, *tiles, _buf("act"),
                                                     *_quant_args(header, ("gate_proj", "up_proj"), layer),
                                                     *gate_up_bias]))
        plan.append(
            _launch(layer, *down_launch, [_buf("act"), down, _buf("topk_weights"), *tiles, pair_out, x_next, x,
                                          _buf("topk_ids"), counters, *_quant_args(header, ("down_proj",), layer),
                                          *down_bias])
        )
        plan.extend(_shared_launches(profile, header, layer, s))
    if profile.get("programmatic_dependent_launch"):
        for launch in plan[1:]:  # each may start while the launch before it finishes (its kernels wait: COLI_PDL)
            launch["pdl"] = True
    return plan


def _routing_feature_args(header, layer: int) -> list[dict]:
    """colibri_routing's v2 arguments after its v1 ones (kernels/routing.cu): router_bias, correction_bias, then
    shared_expert_gate and the shared_scale buffer, each only when the file has it."""
    args = [_weights(header, kind, layer) for kind in ("router_bias", "correction_bias") if getattr(header, kind, 0)]
    if getattr(header, "shared_gate", 0):
        args += [_weights(header, "shared_expert_gate", layer), _buf("shared_scale")]
    return args


def _bias_args(header, kinds: tuple[str, ...], layer: int) -> list[dict]:
    """The expert-bias blocks `kinds` of one layer (float32 (experts, I or H)), or [] without expert biases."""
    if not getattr(header, "expert_bias", 0):
        return []
    return [_weights(header, kind, layer) for kind in kinds]


def _shared_launches(profile: dict, header, layer: int, s: Sizes) -> list[dict]:
    """The shared experts of one layer, after its routed output is complete (kernels/small_batch.cu
    colibri_shared_gate_up, colibri_shared_down; docs/kernels.md "Shared experts"); [] without shared experts."""
    shared = getattr(header, "num_shared_experts", 0)
    if not shared:
        return []
    threads = profile["kernels"]["small_batch"]["threads"]
    x, x_next, valid = _buf(f"x{layer % 2}"), _buf(f"x{(layer + 1) % 2}"), _buf("valid_tokens")
    rows = shared * header.shared_intermediate_size
    scale = _buf("shared_scale") if header.shared_gate else {"kind": "null"}
    kinds = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
    gate, up, down = (_weights(header, kind, layer) for kind in kinds)
    return [
        _launch(layer, "small_batch", "colibri_shared_gate_up", (_ceil_div(rows, threads // 32), 1, 1), threads,
                [x, gate, up, valid, _buf("shared_act"), *_quant_args(header, kinds[:2], layer)]),
        _launch(layer, "small_batch", "colibri_shared_down",
                (_ceil_div(header.hidden_size, down_gemv_rows(threads)), 1, 1), threads,
                [_buf("shared_act"), down, valid, scale, x_next, *_quant_args(header, kinds[2:], layer)]),
    ]
