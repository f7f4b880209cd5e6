"""kernels/expert_quant_tc.cu compiles with NVRTC (real ptxas resource report, no GPU) for int8 and int4 weights at
full model sizes, without spills or stack, with its scales staged in shared memory or read from global memory
(NVRTC's output kept in the tests' cache, tests/nvrtc_cache_support.py)."""

from __future__ import annotations

import copy

import pytest

from colibri_sdk import catalog
from colibri_sdk.format import HeaderV2

from nvrtc_cache_support import compile_source

# (quant, group size, zero points, scale dtype, hidden, intermediate, experts, top-k, arch, scale staging)
CONFIGS = {
    "mixtral-int8-per-row-fp16-sm87": (1, 0, 0, 1, 4096, 14336, 8, 2, "sm_87", "shared"),
    "mixtral-int4-g128-fp16-sm87": (2, 128, 0, 1, 4096, 14336, 8, 2, "sm_87", "shared"),
    "qwen3-int4-g32-zeros-fp16-sm87": (2, 32, 1, 1, 2048, 768, 128, 8, "sm_87", "shared"),
    "qwen3-int8-g64-zeros-fp32-global-sm90": (1, 64, 1, 0, 2048, 768, 128, 8, "sm_90", "global"),
    "odd-int4-g64-sm80": (2, 64, 0, 0, 101, 75, 16, 4, "sm_80", "shared"),
}
SHARED_LIMIT = 48 * 1024  # static shared memory per block without opt-in


@pytest.mark.parametrize("config", CONFIGS)
def test_quantized_tensor_core_kernels_compile_without_spills(orin_profile, config):
    quant, group, zeros, dtype, hidden, inter, experts, top_k, arch, stage = CONFIGS[config]
    header = HeaderV2(1, experts, top_k, hidden, inter, dtype=dtype, quant=quant, group_size=group,
                      zero_points=zeros)
    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 1, "tokens": 64}
    profile["kernels"]["small_batch"]["max_pairs"] = 64  # 64 tokens x top-k > 64 pairs: the tiled path
    assert catalog.sizes(profile, header).quant_tensor_core
    defines = catalog.compile_defines(profile, header)
    if stage == "global":
        defines["COLI_QUANT_STAGE_MAX"] = 0
    source = (catalog.kernel_dir() / "expert_quant_tc.cu").read_text()
    out = compile_source(source, "expert_quant_tc.cu", arch, defines, [catalog.kernel_dir()])
    for instruction in (b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", b"sub.f16x2"):
        assert instruction in out.ptx, instruction
    assert b"cp.async.cg.shared.global" in out.ptx  # code rows of any length and start (32-byte windows)
    for symbol in ("colibri_gate_up_qtc", "colibri_down_qtc"):
        r = out.resources[symbol]
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["stack_bytes"] == 0, (symbol, r)
        assert r["shared_bytes"] <= SHARED_LIMIT, (symbol, r)


def test_float_weights_compile_empty_entry_points(orin_profile):
    """With float weights the file still defines both symbols (the build compiles every catalogue source), empty."""
    header = HeaderV2(1, 8, 2, 256, 512, dtype=1)
    source = (catalog.kernel_dir() / "expert_quant_tc.cu").read_text()
    out = compile_source(source, "expert_quant_tc.cu", "sm_87", catalog.compile_defines(orin_profile, header),
                         [catalog.kernel_dir()])
    assert b"mma.sync" not in out.ptx
    assert {s: out.resources[s]["shared_bytes"] for s in ("colibri_gate_up_qtc", "colibri_down_qtc")} == {
        "colibri_gate_up_qtc": 0, "colibri_down_qtc": 0}
