"""The kernel catalogue: which CUDA C files make up the pipeline, their entry points, the tunable parameters a
profile sets for each (`kernels.<name>.<param>` in profiles/*.yaml), the compile-time constants they receive, and
the launch plan of one forward pass.

Shared by the build (what to compile, what to record in the manifest) and the runtime (what to launch). One import
for all of it, in three rooms: the table of kernels and parameters (colibri_sdk.kernel_table), the compile-time
constants (here: `compile_defines`), and the sizes, buffers and launches of one forward pass
(colibri_sdk.launch_plan); this module re-exports the names of both. Needs only the standard library: it is
imported on the device.
"""

from __future__ import annotations

from .kernel_table import (  # noqa: F401  (re-exported: the catalogue's public names)
    CAPACITY_DROPPED,
    CAPACITY_KERNEL,
    KERNELS,
    MAX_EXPERTS,
    MAX_TOP_K,
    QUANT_SUFFIXES,
    THREADS,
    WEIGHTS_TAIL_BYTES,
    KernelSpec,
    Param,
    capacity_defines,
    capacity_flags,
    float_bits,
    is_v2,
    kernel_dir,
    kernel_routing,
    kernels_for,
    quant,
    weights_fp16,
)
from .launch_plan import (  # noqa: F401  (re-exported: the catalogue's public names)
    COUNTERS_SUFFIX,
    DOWN_COUNTERS,
    FLOAT32_BYTES,
    GEMV_TILE_BYTES,
    INT32_BYTES,
    PAIR_ORDER,
    PER_LAYER_KINDS,
    ROUTER_GROUP_TOKENS,
    ROUTER_MIN_SLICE_ROWS,
    ROUTER_ROWS_PER_TOKEN,
    TC_BLOCK_N,
    TC_PASS_ROWS,
    TC_THREADS,
    RouterGrid,
    Sizes,
    device_buffers,
    down_column_blocks,
    down_gemv_rows,
    gemv_max_pairs,
    gemv_max_tokens,
    io_buffers,
    is_counter_buffer,
    launch_plan,
    pair_order_ints,
    router_grid,
    sizes,
)


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
         "COLI_SCALE_FP16" (1 = fp16 scales, the header's `dtype` of a quantized file),
         the v2 model features (docs/kernels.md "Model features"; their "none" values for a v1 header):
         "COLI_ROUTER_F32" (1 = a v2 file: router and biases float32), "COLI_NORM_TOPK" (1 = renormalise the k
         weights), "COLI_N_GROUP", "COLI_TOPK_GROUP", "COLI_GROUP_SCORE" (1 max, 2 top-two sum), "COLI_ROUTER_BIAS",
         "COLI_CORRECTION_BIAS" (1 = the block exists), "COLI_ROUTED_SCALING_BITS" (float32 bits of
         routed_scaling_factor; 0x3f800000 = 1.0), "COLI_EXPERT_BIAS" (1 = gate/up/down biases), "COLI_ACTIVATION"
         (0 SwiGLU, 1 clamped SwiGLU), "COLI_SWIGLU_LIMIT_BITS", "COLI_SWIGLU_ALPHA_BITS" (float32 bits),
         "COLI_SHARED_EXPERTS" (S, 0 = none), "COLI_SHARED_INTER" (their width), "COLI_SHARED_GATE" (1 = sigmoid
         gate), the router grid (`router_grid`): "COLI_ROUTER_GROUP_TOKENS", "COLI_ROUTER_SLICE_ROWS",
         "COLI_ROUTING_FUSED_ALIGN" (1 = colibri_routing builds the padded expert order)}
        A v2 file is copied into the bundle as it is and the profile's dtype does not apply: the kernels follow
        the file's storage (COLI_FP16 = its fp16 float matrices; 0 for int8/int4: docs/kernels.md, "Quantized
        weights"); its router is float32 (COLI_ROUTER_F32).
        plus "COLI_<KERNEL>_<PARAM>" for every `kernels.<kernel>.<param>` of the profile, upper-cased
        (e.g. COLI_GATE_UP_BLOCK_M),
        plus, for a profile with `capacity`, the constants of `capacity_defines`,
        plus "COLI_PDL" 1 where the profile sets `programmatic_dependent_launch` (absent otherwise).
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
        "COLI_FP16": 1 if weights_fp16(profile, header) else 0,
        "COLI_ATOMIC_AGG": 1 if profile["aggregation"] == "atomic" else 0,
        "COLI_ROUTING": kernel_routing(header),
        "COLI_RESIDUAL": header.composition,
        "COLI_QUANT": quant(header),
        "COLI_GROUP_SIZE": getattr(header, "group_size", 0) if quant(header) else 0,
        "COLI_ZERO_POINTS": getattr(header, "zero_points", 0) if quant(header) else 0,
        "COLI_SCALE_FP16": 1 if quant(header) and header.dtype == 1 else 0,
    }
    defines.update(feature_defines(header))
    grid = router_grid(profile, header)
    defines.update(COLI_ROUTER_GROUP_TOKENS=grid.group_tokens, COLI_ROUTER_SLICE_ROWS=grid.slice_rows,
                   COLI_ROUTING_FUSED_ALIGN=1 if grid.fused_align else 0)
    for kernel, params in sorted(profile["kernels"].items()):
        for param, value in sorted(params.items()):
            defines[f"COLI_{kernel.upper()}_{param.upper()}"] = int(value)
    defines.update(capacity_defines(profile.get("capacity")))
    if profile.get("programmatic_dependent_launch"):  # absent otherwise: the kernels' default is 0 (common.cuh)
        defines["COLI_PDL"] = 1
    return defines


def feature_defines(header) -> dict[str, int]:
    """The v2 model-feature constants of `compile_defines` (all "none" for a v1 header)."""
    v2 = is_v2(header)
    get = lambda name, default=0: getattr(header, name, default) if v2 else default  # noqa: E731
    return {
        "COLI_ROUTER_F32": 1 if v2 else 0,
        "COLI_NORM_TOPK": 1 if get("norm_topk") and kernel_routing(header) != 0 else 0,
        "COLI_N_GROUP": get("n_group", 1),
        "COLI_TOPK_GROUP": get("topk_group", 1),
        "COLI_GROUP_SCORE": get("group_score"),
        "COLI_ROUTER_BIAS": get("router_bias"),
        "COLI_CORRECTION_BIAS": get("correction_bias"),
        "COLI_ROUTED_SCALING_BITS": float_bits(get("routed_scaling_factor", 1.0)),
        "COLI_EXPERT_BIAS": get("expert_bias"),
        "COLI_ACTIVATION": get("activation"),
        "COLI_SWIGLU_LIMIT_BITS": float_bits(get("swiglu_limit", 0.0)),
        "COLI_SWIGLU_ALPHA_BITS": float_bits(get("swiglu_alpha", 0.0)),
        "COLI_SHARED_EXPERTS": get("num_shared_experts"),
        "COLI_SHARED_INTER": get("shared_intermediate_size"),
        "COLI_SHARED_GATE": get("shared_gate"),
    }
