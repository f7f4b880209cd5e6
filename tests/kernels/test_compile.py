"""Every kernel source compiles with NVRTC for each supported arch, in fp16 and fp32, with odd sizes, without spills.

Real NVRTC (cuda.bindings.nvrtc, the build's compile helper), its output kept in the tests' cache
(tests/nvrtc_cache_support.py); no GPU needed.
"""

from __future__ import annotations

import copy

import pytest

from colibri_sdk import catalog
from colibri_sdk.aot.cubin import cubin_sm
from colibri_sdk.errors import CompileError

from kernel_support import make_header
from nvrtc_cache_support import compile_source

ARCHS = ("sm_80", "sm_87", "sm_89", "sm_90")
# (label, header kwargs, profile overrides)
CONFIGS = {
    "demo-fp16": (dict(hidden=256, inter=512, experts=8, top_k=2, dtype="fp16"), {}),
    "odd-fp32": (dict(hidden=100, inter=75, experts=64, top_k=8, dtype="fp32", routing=1, composition=0),
                 {"dtype": "fp32"}),
    "odd-fp16-atomic": (dict(hidden=130, inter=97, experts=16, top_k=4, dtype="fp16"), {"aggregation": "atomic"}),
    # Few pairs: serial loops over them must not be unrolled into registers (they spilled once).
    "few-pairs": (dict(hidden=64, inter=33, experts=64, top_k=1, dtype="fp32"),
                  {"dtype": "fp32", "shape": {"batch": 1, "tokens": 3}, "kernels_routing": {"block_m": 1}}),
    "max-experts": (dict(hidden=4096, inter=14336, experts=256, top_k=8, dtype="fp16", routing=1), {}),
    # top-k at the limit (MAX_TOP_K 16): GEMV path with 256 pairs, and the tiled path
    "top-k-16-gemv": (dict(hidden=2048, inter=768, experts=128, top_k=16, dtype="fp16"),
                      {"kernels_small_batch": {"max_pairs": 256}}),
    "top-k-16-tiled": (dict(hidden=2048, inter=768, experts=128, top_k=16, dtype="fp16"),
                       {"kernels_small_batch": {"max_pairs": 1}}),
}


def compile_all(profile: dict, header, arch: str) -> dict[str, dict]:
    """Compile every catalogue source; return {symbol: resources} and check each cubin names `arch`."""
    defines = catalog.compile_defines(profile, header)
    resources = {}
    for spec in catalog.KERNELS:
        source = (catalog.kernel_dir() / spec.source).read_text()
        out = compile_source(source, spec.source, arch, defines, [catalog.kernel_dir()])
        assert cubin_sm(out.cubin) == int(arch[3:]), f"{spec.source}: cubin SM differs from {arch}"
        assert out.ptx.lstrip().startswith(b"//"), f"{spec.source}: PTX text expected"
        for symbol in spec.symbols:
            assert symbol in out.resources, f"{spec.source}: {symbol} not compiled (found {sorted(out.resources)})"
        resources.update(out.resources)
    return resources


def profile_with(base: dict, overrides: dict) -> dict:
    p = copy.deepcopy(base)
    overrides = dict(overrides)
    p["kernels"]["routing"].update(overrides.pop("kernels_routing", {}))
    p["kernels"]["small_batch"].update(overrides.pop("kernels_small_batch", {}))
    p.update(overrides)
    return p


def _shipped_or_full(arch: str, config: str):
    """sm_87 (Orin) and sm_90 in the default run; sm_80 and sm_89 (the same register file and limits as sm_87) in
    `bash scripts/test_full.sh`: their demo-model kernels are also compiled, spill-free or refused, by the shipped
    a100 and rtx4090 builds of tests/build/test_bundle_build.py."""
    return (arch, config) if arch in ("sm_87", "sm_90") else pytest.param(arch, config, marks=pytest.mark.full)


@pytest.mark.parametrize(
    "arch,config",
    [_shipped_or_full(a, "demo-fp16") for a in ARCHS] + [_shipped_or_full(a, "odd-fp32") for a in ARCHS]
    + [("sm_87", "odd-fp16-atomic"), ("sm_90", "max-experts"), ("sm_80", "few-pairs"), ("sm_90", "few-pairs")]
    + [(a, c) for a in ("sm_87", "sm_90") for c in ("top-k-16-gemv", "top-k-16-tiled")],
)
def test_compiles_without_spills(orin_profile, arch, config):
    header_kwargs, overrides = CONFIGS[config]
    profile = profile_with(orin_profile, overrides)
    resources = compile_all(profile, make_header(**header_kwargs), arch)
    for symbol, r in resources.items():
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, f"{symbol} spills: {r}"
        assert r["stack_bytes"] == 0, f"{symbol} uses a stack frame: {r}"
        assert r["shared_bytes"] <= 48 * 1024, f"{symbol}: {r['shared_bytes']} bytes of static shared memory"


def test_largest_allowed_tiles_compile(orin_profile):
    """block_m 16 x block_n 256 at 128 threads: 32 accumulators per thread, the documented limit."""
    profile = copy.deepcopy(orin_profile)
    profile["kernels"]["routing"].update(threads=1024, block_m=16)
    profile["kernels"]["gate_up"].update(threads=128, block_n=256, block_k=16)
    profile["kernels"]["down"].update(threads=128, block_n=256, block_k=32)
    profile["kernels"]["small_batch"].update(threads=1024)
    resources = compile_all(profile, make_header(hidden=200, inter=300, experts=32, top_k=4), "sm_87")
    assert all(r["spill_store_bytes"] == 0 for r in resources.values()), resources


def test_too_many_accumulators_is_a_compile_error(orin_profile):
    profile = copy.deepcopy(orin_profile)
    profile["kernels"]["routing"]["block_m"] = 128
    profile["kernels"]["gate_up"].update(threads=32, block_n=256)
    defines = catalog.compile_defines(profile, make_header())
    source = (catalog.kernel_dir() / "expert_gate_up.cu").read_text()
    with pytest.raises(CompileError, match=r"block_m \* gate_up.block_n / gate_up.threads must be <= 32"):
        compile_source(source, "expert_gate_up.cu", "sm_87", defines, [catalog.kernel_dir()])


def test_top_k_above_the_limit_is_a_compile_error(orin_profile):
    defines = catalog.compile_defines(orin_profile, make_header(experts=64, top_k=catalog.MAX_TOP_K + 1))
    source = (catalog.kernel_dir() / "routing.cu").read_text()
    with pytest.raises(CompileError, match=r"COLI_TOPK must be in 1..COLI_MAX_TOP_K"):
        compile_source(source, "routing.cu", "sm_87", defines, [catalog.kernel_dir()])


def test_missing_defines_name_the_catalogue(orin_profile):
    source = (catalog.kernel_dir() / "routing.cu").read_text()
    with pytest.raises(CompileError, match=r"(?s)routing.cu.*common.cuh.*need the -D constants of sdk/catalog.py compile_defines"):
        compile_source(source, "routing.cu", "sm_87", {}, [catalog.kernel_dir()])


def test_sources_open_with_a_description():
    """Each kernel file starts with a comment saying what it computes, its grid mapping and its limits."""
    for spec in catalog.KERNELS:
        head = (catalog.kernel_dir() / spec.source).read_text().split("#include")[0]
        assert head.startswith(f"// {spec.source}:"), spec.source
        assert "grid (" in head and "Limits" in head, f"{spec.source}: header comment lacks grid mapping or limits"
        for symbol in spec.symbols:
            assert symbol in head, f"{spec.source}: {symbol} not described in the header comment"


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_core_wrappers_compile(orin_profile, arch):
    """common.cuh's mma_m16n8k16 and cp_async16 (used by tests/kernels/mma_tile.cu) are valid PTX for every arch."""
    from pathlib import Path

    source = (Path(__file__).parent / "mma_tile.cu").read_text()
    defines = catalog.compile_defines(orin_profile, make_header())
    out = compile_source(source, "mma_tile.cu", arch, defines, [catalog.kernel_dir()])
    assert b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in out.ptx and b"cp.async.cg.shared.global" in out.ptx
    r = out.resources["mma_tile"]
    assert r["spill_store_bytes"] == 0 and r["stack_bytes"] == 0, r


# int8 / int4 weights on the GEMV path (COLI_QUANT): (quant, group size, zero points, scale dtype, threads)
QUANT_CONFIGS = {
    "int8-per-row-fp16": (1, 0, 0, 1, 256),
    "int8-g64-zeros-fp32": (1, 64, 1, 0, 256),
    "int4-g128-fp16": (2, 128, 0, 1, 256),
    "int4-g32-zeros-fp16-1024": (2, 32, 1, 1, 1024),
}


@pytest.mark.parametrize("config,arch,stage", [(c, "sm_87", "shared") for c in QUANT_CONFIGS]
                         + [("int4-g32-zeros-fp16-1024", "sm_90", "global"), ("int8-per-row-fp16", "sm_90", "global")])
def test_quantized_gemv_compiles_without_spills(orin_profile, arch, config, stage):
    from colibri_sdk.format import HeaderV2

    quant, group, zeros, dtype, threads = QUANT_CONFIGS[config]
    header = HeaderV2(1, 128, 8, 2048, 768, dtype=dtype, quant=quant, group_size=group, zero_points=zeros)
    profile = profile_with(orin_profile, {"kernels_small_batch": {"max_pairs": 64, "threads": threads},
                                          "shape": {"batch": 1, "tokens": 4}})
    defines = catalog.compile_defines(profile, header)
    if stage == "global":  # scales read by each lane from global memory, as for rows with too many groups
        defines["COLI_QUANT_STAGE_MAX"] = 0
    source = (catalog.kernel_dir() / "small_batch.cu").read_text()
    out = compile_source(source, "small_batch.cu", arch, defines, [catalog.kernel_dir()])
    assert b"ld.global.nc.L1::no_allocate.v4.u32" in out.ptx  # 16-byte code loads
    for symbol in ("colibri_gate_up_gemv", "colibri_down_gemv"):
        r = out.resources[symbol]
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["stack_bytes"] == 0, (symbol, r)


@pytest.mark.parametrize("quant,group,arch", [(2, 128, "sm_87"), (1, 0, "sm_87"), (2, 128, "sm_90")])
def test_quantized_gemv_fits_two_blocks_per_sm(orin_profile, quant, group, arch):
    """At 256 threads the int8/int4 GEMVs of a Mixtral-8x7B layer keep within 128 registers (two resident blocks per
    SM: __launch_bounds__(256, 2)) without spills; they held 144-239 with the dequantization loop fully unrolled."""
    from colibri_sdk.format import HeaderV2

    header = HeaderV2(1, 8, 2, 4096, 14336, dtype=1, quant=quant, group_size=group)
    profile = profile_with(orin_profile, {"shape": {"batch": 1, "tokens": 1}})
    source = (catalog.kernel_dir() / "small_batch.cu").read_text()
    out = compile_source(source, "small_batch.cu", arch, catalog.compile_defines(profile, header),
                         [catalog.kernel_dir()])
    for symbol in ("colibri_gate_up_gemv", "colibri_down_gemv"):
        r = out.resources[symbol]
        assert r["registers"] <= 128 and r["spill_store_bytes"] == r["stack_bytes"] == 0, (symbol, r)


def test_every_source_compiles_for_int4_weights(orin_profile):
    """The build compiles the whole catalogue for any weights; with int4 ones the tiled sources still compile."""
    from colibri_sdk.format import HeaderV2

    header = HeaderV2(1, 8, 2, 256, 512, dtype=1, quant=2, group_size=128)
    compile_all(orin_profile, header, "sm_87")


# The v2 families at their real sizes (config.json of each model): (header fields, batch x tokens of the shape).
FAMILY_HEADERS = {
    # Qwen1.5-MoE-A2.7B: 60 experts, top-4, hidden 2048, moe_intermediate 1408, one shared expert of 5632, gated
    "qwen2moe-int4-g128": (dict(num_experts=60, top_k=4, hidden_size=2048, intermediate_size=1408, routing=1,
                                quant=2, group_size=128, dtype=1, num_shared_experts=1,
                                shared_intermediate_size=5632, shared_gate=1), 4),
    # DeepSeek-V2-Lite: 64 experts, top-6, hidden 2048, 1408, 2 shared (stored as one of 2816), softmax, no groups
    "deepseek_v2_lite-fp16": (dict(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408, routing=1,
                                   dtype=1, num_shared_experts=1, shared_intermediate_size=2816), 16),
    # DeepSeek-V3-style router on 256 experts: sigmoid + correction bias, 8 groups keep 4, top-two sum, top-8
    "deepseek_v3-router-int8": (dict(num_experts=256, top_k=8, hidden_size=2048, intermediate_size=512, routing=2,
                                     norm_topk=1, n_group=8, topk_group=4, group_score=2, correction_bias=1,
                                     routed_scaling_factor=2.5, quant=1, group_size=0, dtype=1,
                                     num_shared_experts=1, shared_intermediate_size=512), 4),
    # gpt-oss-20b: 32 experts, top-4, hidden 2880, intermediate 2880, biases, clamped SwiGLU
    "gpt_oss_20b-fp16": (dict(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880, routing=0,
                              router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0, swiglu_alpha=1.702,
                              dtype=1), 64),
}


@pytest.mark.slow  # 16 NVRTC compiles, about 35 s on 2 cores
@pytest.mark.parametrize("family", list(FAMILY_HEADERS))
def test_family_kernels_compile_without_spills(orin_profile, family):
    """Every catalogue source compiles (NVRTC, sm_87) for the real sizes of each v2 family, every entry point
    without register spills or a stack frame: the feature epilogues, the group-limited router and the shared
    kernels fit in registers like the kernels without them."""
    from colibri_sdk.format import HeaderV2

    fields, tokens = FAMILY_HEADERS[family]
    header = HeaderV2(num_layers=1, **fields)
    profile = profile_with(orin_profile, {"shape": {"batch": 1, "tokens": tokens}})
    defines = catalog.compile_defines(profile, header)
    for spec in catalog.KERNELS:
        source = (catalog.kernel_dir() / spec.source).read_text()
        out = compile_source(source, spec.source, "sm_87", defines, [catalog.kernel_dir()])
        for symbol in spec.symbols:
            r = out.resources[symbol]
            assert r["spill_store_bytes"] == 0 and r["stack_bytes"] == 0, (spec.source, symbol, r)


# colibri_routing of v2 files (a float32 router: the 16-byte vector path up to 512 threads): 16-token groups, the
# fused align on the tiled path, 256 experts with every routing feature, 1024 threads (the scalar path).
ROUTER_V2 = dict(routing=2, norm_topk=1, n_group=8, topk_group=4, group_score=2, correction_bias=1,
                 routed_scaling_factor=2.5, router_bias=1, num_shared_experts=1, shared_intermediate_size=64,
                 shared_gate=1)


@pytest.mark.parametrize("experts,tokens,threads,features", [
    (128, 16, 512, {}), (128, 64, 128, {}), (256, 16, 128, ROUTER_V2), (256, 64, 1024, ROUTER_V2),
], ids=["e128-16tokens-512threads", "e128-64tokens-tiled", "e256-every-feature", "e256-tiled-1024threads"])
def test_routing_compiles_without_spills(orin_profile, experts, tokens, threads, features):
    from colibri_sdk.format import HeaderV2

    header = HeaderV2(1, experts, 8, 2048, 768, dtype=1, **features)
    profile = profile_with(orin_profile, {"shape": {"batch": 1, "tokens": tokens},
                                          "kernels_routing": {"threads": threads}})
    source = (catalog.kernel_dir() / "routing.cu").read_text()
    out = compile_source(source, "routing.cu", "sm_90", catalog.compile_defines(profile, header),
                         [catalog.kernel_dir()])
    r = out.resources["colibri_routing"]
    assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["stack_bytes"] == 0, r
    assert r["shared_bytes"] <= 34 * 1024, r
