"""The launch plan and the scratch buffers agree with the kernel sources and with the padded-order limits."""

from __future__ import annotations

import copy
import re
from itertools import zip_longest

import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.format.constants import HEADER_SIZE

from kernel_support import make_header

SIGNATURE = re.compile(r'extern "C" __global__ void __launch_bounds__\([^)]*\)\s*(\w+)\(([^)]*)\)', re.S)


# A parameter block of a v2 feature in a kernel signature: `#if COLI_<FEATURE>` ... `#endif`.
FEATURE_PARAMS = re.compile(r"^#if (COLI_\w+)\b[^\n]*\n(.*?)^#endif\n", re.S | re.M)


def kernel_parameters(quant: bool = False, features: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """{symbol: [parameter names]} parsed from the .cu sources, with (quant) or without the parameters under
    `#if COLI_QUANT` (the scale and zero-point blocks of int8/int4 weights), and with the parameters under
    `#if COLI_<F>` for each F in `features` (e.g. "COLI_EXPERT_BIAS"), without those of the others."""
    out = {}
    enabled = set(features) | ({"COLI_QUANT"} if quant else set())
    for spec in catalog.KERNELS:
        text = (catalog.kernel_dir() / spec.source).read_text()
        for symbol, params in SIGNATURE.findall(_signatures(text, enabled)):
            out[symbol] = [p.split()[-1].lstrip("*") for p in params.split(",")]
    return out


def _bias_macros() -> dict[str, str]:
    """The parameter macros of common.cuh (GATE_UP_BIAS_PARAMS, DOWN_BIAS_PARAMS) as defined under
    `#if COLI_EXPERT_BIAS`: {name: the parameters they add}."""
    common = (catalog.kernel_dir() / "common.cuh").read_text()
    branch = common[common.index("#if COLI_EXPERT_BIAS\n#define"):]
    branch = branch[: branch.index("#else")]
    return dict(re.findall(r"^#define (\w+_BIAS_PARAMS) (.*)$", branch, re.M))


def _signatures(text: str, enabled: set[str]) -> str:
    """The sources with each `#if COLI_X` parameter block of a signature kept (X enabled) or dropped, and the bias
    parameter macros expanded (COLI_EXPERT_BIAS enabled) or dropped."""
    for name, params in _bias_macros().items():
        text = text.replace(name, params if "COLI_EXPERT_BIAS" in enabled else "")
    def one(match):
        start = text.rfind('extern "C"', 0, match.start())
        in_signature = start >= 0 and ") {" not in text[start : match.start()]
        if not in_signature:
            return match.group(0)
        return match.group(2) if match.group(1) in enabled else ""

    return FEATURE_PARAMS.sub(one, text)


# Pointer parameters a plan may bind to null: the pairs' outputs of atomic aggregation, the padded expert order
# colibri_routing builds only on the tiled path without expert capacity, the pair order of the GEMV path.
NULLABLE = ("pair_out", "down_counters", "expert_counts", "expert_offsets", "sorted_pairs", "block_experts",
            "pair_order")


def expected_parameter(arg: dict, layer: int, param: str | None = None) -> str:
    """The kernel parameter name a plan argument must bind to (`param`: the source's parameter at that place; a
    null binds to it when it is one of NULLABLE; no argument there: "(missing)")."""
    if arg is None:
        return "(missing)"
    if arg["kind"] == "weights":
        return arg["tensor"].replace("_proj", "").replace(".", "_")  # gate_proj.scales → gate_scales
    if arg["kind"] == "null":
        return param if param in NULLABLE else "pair_out"
    name = arg["name"]
    if name == f"x{layer % 2}":
        return "x"
    if name == f"x{(layer + 1) % 2}":
        return "x_next"
    return name


def test_tiled_path_takes_tensor_cores_where_it_can(orin_profile):
    """fp16 weights: the tensor-core kernels at any block_m and any size; fp32: the scalar tiles."""
    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 1, "tokens": 64}
    symbols = lambda header: [l["symbol"] for l in catalog.launch_plan(profile, header)][1:3]  # noqa: E731
    tc = ["colibri_gate_up_tc", "colibri_down_tc"]
    for block_m in (1, 16, 32, 64, 128):
        profile["kernels"]["routing"]["block_m"] = block_m
        assert symbols(make_header(hidden=256, inter=512, experts=8, top_k=4)) == tc
        assert symbols(make_header(hidden=2050, inter=770, experts=8, top_k=4)) == tc  # rows not 16-byte aligned
    profile["dtype"] = "fp32"
    assert symbols(make_header(hidden=256, inter=512, experts=8, top_k=4, dtype="fp32")) == [
        "colibri_gate_up", "colibri_down"]


CASES = [
    ({}, dict(layers=4)),  # the demo sizes at the Orin shape: GEMV path (32 pairs <= max_pairs 128)
    ({"shape": {"batch": 2, "tokens": 64}}, dict(layers=3, experts=64, top_k=4, hidden=100, inter=75)),  # tiled
    ({"aggregation": "atomic"}, dict(layers=2, experts=16, top_k=1)),
    ({"aggregation": "atomic", "shape": {"batch": 1, "tokens": 64}}, dict(layers=1, experts=256, top_k=8, dtype="fp32")),
]


@pytest.mark.parametrize("overrides,header_kwargs", CASES)
def test_plan_binds_every_parameter(orin_profile, overrides, header_kwargs):
    profile = copy.deepcopy(orin_profile)
    profile.update(overrides)
    header = make_header(**header_kwargs)
    params = kernel_parameters()
    buffers = catalog.device_buffers(profile, header)
    plan = catalog.launch_plan(profile, header)
    specs = {k.name: k for k in catalog.KERNELS}
    small = catalog.sizes(profile, header).small_batch
    per_layer = 3  # GEMV; tiled: the align is in colibri_routing, the ordered aggregation in the down kernel
    assert len(plan) == per_layer * header.num_layers
    atomic = profile["aggregation"] == "atomic"
    assert (catalog.DOWN_COUNTERS in buffers) == (not small and not atomic)
    for launch in plan:
        symbol, layer = launch["symbol"], launch["layer"]
        assert symbol in specs[launch["kernel"]].symbols
        names = [expected_parameter(a, layer, p) for a, p in zip_longest(launch["args"], params[symbol])]
        if symbol.startswith("colibri_down") and not small:  # pair_out, down_counters null exactly when atomic
            nulls = {p for a, p in zip(launch["args"], params[symbol]) if a["kind"] == "null"}
            assert nulls == ({"pair_out", "down_counters"} if atomic else set()), f"{symbol}: null {nulls}"
        assert names == params[symbol], f"layer {layer} {symbol}: plan binds {names}, source takes {params[symbol]}"
        for arg in launch["args"]:
            if arg["kind"] == "buffer":
                assert arg["name"] in buffers, f"{symbol}: unknown buffer {arg['name']}"
            elif arg["kind"] == "weights":
                expert = None if arg["tensor"] == "router" else 0
                assert arg["offset"] == header.tensor_offset(arg["tensor"], arg["layer"], expert) - HEADER_SIZE
                assert arg["layer"] == layer
        tc = symbol.endswith("_tc")  # the tensor-core tile has a fixed block
        assert launch["block"][0] == (catalog.TC_THREADS if tc else profile["kernels"][launch["kernel"]]["threads"])
        assert launch["block"][1:] == [1, 1] and launch["shared_bytes"] == 0
    last = plan[-1]  # the last launch writes the output buffer, as its x_next
    x_next = params[last["symbol"]].index("x_next")
    assert last["args"][x_next] == {"kind": "buffer", "name": catalog.io_buffers(header)["output"]}


@pytest.mark.parametrize("overrides,header_kwargs", CASES)
def test_grids_cover_the_outputs(orin_profile, overrides, header_kwargs):
    profile = copy.deepcopy(orin_profile)
    profile.update(overrides)
    header = make_header(**header_kwargs)
    k = profile["kernels"]
    tokens = profile["shape"]["batch"] * profile["shape"]["tokens"]
    e, h, i = header.num_experts, header.hidden_size, header.intermediate_size
    block_m = k["routing"]["block_m"]
    padded = tokens * header.top_k + e * (block_m - 1)
    for launch in catalog.launch_plan(profile, header):
        gx, gy, gz = launch["grid"]
        assert gz == 1
        s = launch["symbol"]
        pairs = tokens * header.top_k
        if s == "colibri_routing":  # hidden slices x token groups, each group's router rows read by one block
            grid = catalog.router_grid(profile, header)
            assert (gx - 1) * grid.slice_rows < h <= gx * grid.slice_rows
            assert (gy - 1) * grid.group_tokens < tokens <= gy * grid.group_tokens
        elif s == "colibri_align":
            assert (gx, gy) == (1, 1)
        elif s == "colibri_gate_up":
            assert gx == padded // block_m and (gy - 1) * k["gate_up"]["block_n"] < i <= gy * k["gate_up"]["block_n"]
        elif s == "colibri_down":
            assert gx == padded // block_m and (gy - 1) * k["down"]["block_n"] < h <= gy * k["down"]["block_n"]
        elif s in ("colibri_gate_up_tc", "colibri_down_tc"):
            n = i if s == "colibri_gate_up_tc" else h
            assert gx == padded // block_m
            assert (gy - 1) * catalog.TC_BLOCK_N < n <= gy * catalog.TC_BLOCK_N
        elif s == "colibri_gate_up_gemv":  # one row per warp; a slot per expert that valid pairs can select
            warps = k["small_batch"]["threads"] // 32
            assert gy == min(e, pairs) and (gx - 1) * warps < i <= gx * warps
        elif s == "colibri_down_gemv":  # two rows per warp (one above 512 threads), every expert in each block
            threads = k["small_batch"]["threads"]
            rows = threads // 32 * (2 if threads <= 512 else 1)
            assert gy == 1 and (gx - 1) * rows < h <= gx * rows
        else:
            pytest.fail(f"unexpected symbol {s}")


def test_buffer_sizes(orin_profile):
    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 2, "tokens": 24}
    profile["kernels"]["small_batch"]["max_pairs"] = 128  # the sizes of both paths, not the shipped crossover
    header = make_header(hidden=100, inter=75, experts=64, top_k=8)
    b = catalog.device_buffers(profile, header)  # 384 pairs > max_pairs: the tiled path
    tokens, pairs, block_m = 48, 48 * 8, profile["kernels"]["routing"]["block_m"]
    assert b["sorted_pairs"] == 4 * (pairs + 64 * (block_m - 1))
    assert b["block_experts"] == 4 * ((pairs + 64 * (block_m - 1)) // block_m)
    assert b["x0"] == b["x1"] == tokens * 100 * 4
    assert b["act"] == pairs * 75 * 4 and b["pair_out"] == pairs * 100 * 4
    # fp16: the tensor-core down tile, ceil(100 / 32) column blocks per token; fp32: the scalar tile, ceil(100 /
    # block_n)
    assert b[catalog.DOWN_COUNTERS] == tokens * -(-100 // 32) * 4
    profile["dtype"] = "fp32"
    fp32 = catalog.device_buffers(profile, make_header(hidden=100, inter=75, experts=64, top_k=8, dtype="fp32"))
    assert fp32[catalog.DOWN_COUNTERS] == tokens * -(-100 // profile["kernels"]["down"]["block_n"]) * 4
    assert catalog.is_counter_buffer(catalog.DOWN_COUNTERS)
    assert b["topk_ids"] == b["topk_weights"] == pairs * 4
    assert b["expert_counts"] == 64 * 4 and b["expert_offsets"] == 65 * 4
    assert b["valid_tokens"] == 2 * 4
    # 48 tokens: 3 groups of 16, one slice of 256 >= 100 rows; 16 tokens x 64 experts of partial logits per block
    assert b["routing_partials"] == 3 * 1 * 16 * 64 * 4 and b["routing_counters"] == (3 + 1) * 4
    profile["aggregation"] = "atomic"
    assert "pair_out" not in catalog.device_buffers(profile, header)
    assert catalog.DOWN_COUNTERS not in catalog.device_buffers(profile, header)
    profile["shape"] = {"batch": 2, "tokens": 4}  # 64 pairs: the GEMV path needs no padded order, no pair_out,
    # but the pair order colibri_routing builds for its blocks
    gemv = catalog.device_buffers(profile, header)
    assert sorted(gemv) == ["act", "pair_order", "routing_counters", "routing_partials", "topk_ids", "topk_weights",
                            "valid_tokens", "x0", "x1"]
    assert gemv["pair_order"] == (1 + 3 * 64 + 64) * 4  # nused, counts, offsets, used; the 64 pairs
    assert gemv["routing_partials"] == 1 * 1 * 8 * 64 * 4 and gemv["routing_counters"] == 2 * 4  # one group of 8


def test_io_buffers_name_scratch_buffers(orin_profile):
    """The runtime's copies target buffers that exist: input, output and the valid-token counts (batch,) int32."""
    header = make_header(layers=3)
    io = catalog.io_buffers(header)
    assert io == {"input": "x0", "output": "x1", "valid_tokens": "valid_tokens"}
    buffers = catalog.device_buffers(orin_profile, header)
    assert buffers[io["valid_tokens"]] == orin_profile["shape"]["batch"] * 4


def padded_order(topk_ids: np.ndarray, experts: int, block_m: int) -> tuple[np.ndarray, int]:
    """The rows each expert owns in colibri_align's padded order (count rounded up to block_m) and the total."""
    counts = np.bincount(topk_ids.ravel(), minlength=experts)
    rows = -(-counts // block_m) * block_m
    return rows, int(rows.sum())


@pytest.mark.parametrize("experts,top_k,tokens,block_m", [(8, 2, 16, 16), (64, 8, 33, 4), (256, 8, 7, 128), (16, 1, 1, 1)])
def test_padded_order_fits_the_fixed_size(orin_profile, experts, top_k, tokens, block_m):
    """For many routings (all on one expert, spread, random) the padded order fits the fixed buffers."""
    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 1, "tokens": tokens}
    profile["kernels"]["routing"]["block_m"] = block_m
    s = catalog.sizes(profile, make_header(experts=experts, top_k=top_k))
    rng = np.random.default_rng(7)
    routings = [np.arange(tokens * top_k).reshape(tokens, top_k) % experts]  # spread: most experts touched
    routings.append(np.stack([np.arange(top_k)] * tokens))  # every token on the same k experts
    routings += [np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]) for _ in range(50)]
    for ids in routings:
        _, used = padded_order(ids, experts, block_m)
        assert used <= s.padded and used // block_m <= s.blocks and used % block_m == 0
    assert s.padded == tokens * top_k + experts * (block_m - 1)
    assert s.blocks == s.padded // block_m


@pytest.mark.parametrize("zeros", [0, 1])
def test_quantized_plan_binds_every_parameter(orin_profile, zeros):
    """int4 weights: the GEMV kernels' extra parameters (kernels/small_batch.cu under COLI_QUANT) get the scale and
    zero-point blocks of the layer, zero points null when the file has none."""
    from colibri_sdk.format import HeaderV2

    header = HeaderV2(2, 8, 2, 256, 512, dtype=1, quant=2, group_size=64, zero_points=zeros)
    params = kernel_parameters(quant=True)
    for launch in catalog.launch_plan(orin_profile, header)[1::3] + catalog.launch_plan(orin_profile, header)[2::3]:
        symbol, layer = launch["symbol"], launch["layer"]
        names = [expected_parameter(a, layer, p) for a, p in zip_longest(launch["args"], params[symbol])]
        want = params[symbol]
        assert len(names) == len(want), (symbol, names, want)
        for name, param, arg in zip(names, want, launch["args"]):
            assert name == param or (arg["kind"] == "null" and param.endswith("_zeros") and not zeros), (symbol, names)
            if arg["kind"] == "weights":
                assert arg["layer"] == layer
                assert arg["offset"] == header.tensor_offset(arg["tensor"], layer, 0) - HEADER_SIZE


V2_FEATURES = dict(routing=2, norm_topk=1, n_group=2, topk_group=1, group_score=2, correction_bias=1,
                   routed_scaling_factor=2.5, router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0,
                   swiglu_alpha=1.702, num_shared_experts=2, shared_intermediate_size=48, shared_gate=1)


@pytest.mark.parametrize("quant,tokens", [(0, 4), (0, 128), (1, 4)], ids=["float-gemv", "float-tiled", "int8-gemv"])
def test_v2_feature_plan_binds_every_parameter(orin_profile, quant, tokens):
    """Every v2 feature at once: each launch binds exactly the parameters its kernel takes under the feature
    constants the header sets (biases, shared gate, shared blocks and, quantized, their scales), in order; shared
    experts add two launches per layer after the routed output."""
    from colibri_sdk.format import HeaderV2

    profile = copy.deepcopy(orin_profile)
    profile["shape"] = {"batch": 1, "tokens": tokens}
    header = HeaderV2(2, 8, 2, 64, 32, dtype=1, quant=quant, group_size=32 if quant else 0, **V2_FEATURES)
    defines = catalog.compile_defines(profile, header)
    features = tuple(name for name in ("COLI_ROUTER_BIAS", "COLI_CORRECTION_BIAS", "COLI_SHARED_GATE",
                                       "COLI_EXPERT_BIAS") if defines[name])
    assert len(features) == 4
    params = kernel_parameters(quant=bool(quant), features=features)
    plan = catalog.launch_plan(profile, header)
    buffers = catalog.device_buffers(profile, header)
    assert buffers["shared_act"] == 2 * tokens * 48 * 4 and buffers["shared_scale"] == tokens * 4
    small = catalog.sizes(profile, header).small_batch
    assert small == (tokens == 4)
    assert len(plan) == 5 * header.num_layers  # routing (+ the padded order), gate/up, down, 2 shared
    for layer in range(header.num_layers):
        symbols = [launch["symbol"] for launch in plan if launch["layer"] == layer]
        assert symbols[-2:] == ["colibri_shared_gate_up", "colibri_shared_down"]
    for launch in plan:
        symbol, layer = launch["symbol"], launch["layer"]
        names = [expected_parameter(a, layer, p) for a, p in zip_longest(launch["args"], params[symbol])]
        # zero points are null: the file has none
        names = [p if a["kind"] == "null" and p.endswith("_zeros") else n
                 for n, p, a in zip(names, params[symbol], launch["args"])] + names[len(params[symbol]):]
        assert names == params[symbol], f"layer {layer} {symbol}: plan binds {names}, source takes {params[symbol]}"
        for arg in launch["args"]:
            if arg["kind"] == "weights":
                expert = None if arg["tensor"] in catalog.PER_LAYER_KINDS else 0
                assert arg["offset"] == header.tensor_offset(arg["tensor"], layer, expert) - HEADER_SIZE
            elif arg["kind"] == "buffer":
                assert arg["name"] in buffers
    rows = catalog.down_gemv_rows(profile["kernels"]["small_batch"]["threads"])
    shared = [launch for launch in plan if launch["symbol"].startswith("colibri_shared")]
    assert shared[0]["grid"] == [-(-2 * 48 // (profile["kernels"]["small_batch"]["threads"] // 32)), 1, 1]
    assert shared[1]["grid"] == [-(-64 // rows), 1, 1]


@pytest.mark.parametrize("quant,expect_gemv", [(0, False), (1, True), (2, True)], ids=["fp16", "int8", "int4"])
def test_max_pairs_quantized_moves_only_int8_int4_experts(orin_profile, quant, expect_gemv):
    """32 pairs with max_pairs 16 and max_pairs_quantized 32: fp16 experts take the tiles (tensor cores), int8 and
    int4 the GEMV; without max_pairs_quantized every storage follows max_pairs."""
    from colibri_sdk.format import HeaderV2
    from colibri_sdk.profile import Profile

    data = copy.deepcopy(orin_profile)
    data["shape"] = {"batch": 1, "tokens": 16}
    data["kernels"]["small_batch"].update(max_pairs=16, max_pairs_quantized=32)
    profile = Profile.from_dict(data, toolchain=False).data
    header = HeaderV2(1, 8, 2, 256, 512, dtype=1, quant=quant, group_size=128 if quant == 2 else 0)
    s = catalog.sizes(profile, header)
    assert s.pairs == 32 and s.small_batch is expect_gemv
    assert catalog.gemv_max_pairs(profile, header) == (32 if quant else 16)
    symbols = {launch["symbol"] for launch in catalog.launch_plan(profile, header)}
    assert ("colibri_gate_up_gemv" in symbols) is expect_gemv
    del profile["kernels"]["small_batch"]["max_pairs_quantized"]
    assert catalog.sizes(profile, header).small_batch is False  # max_pairs 16 for every storage


@pytest.mark.parametrize("device, fp16_gemv, int4_gemv", [("h200", False, False), ("orin", True, False),
                                                       ("rtx4090", True, True)])
def test_the_shipped_crossover_at_16_tokens(device, fp16_gemv, int4_gemv):
    """The shipped crossovers (profiles/*.yaml, from the kernel model's estimates) at Mixtral's 16 tokens x top-2:
    h200 every storage on the tiles; orin fp16 on the GEMV (max_pairs 32), int4 on the tiles (max_pairs_quantized
    16); rtx4090 both on the GEMV (128, 32). One token on h200 and a100 (their 1-token shape): fp16 on the GEMV, int8
    and int4 on the tiles (max_pairs_quantized 0)."""
    from colibri_sdk.format import HeaderV2
    from colibri_sdk.profile import load_profile

    profile = load_profile(device, toolchain=False).for_shape(1, 16).data
    fp16 = HeaderV2(1, 8, 2, 4096, 14336, dtype=1)
    int4 = HeaderV2(1, 8, 2, 4096, 14336, dtype=1, quant=2, group_size=128)
    assert catalog.sizes(profile, fp16).small_batch is fp16_gemv
    assert catalog.sizes(profile, fp16).tensor_core is not fp16_gemv
    assert catalog.sizes(profile, int4).small_batch is int4_gemv
    assert catalog.sizes(profile, int4).quant_tensor_core is not int4_gemv
    if device == "h200":
        for name in ("h200", "a100"):
            one = load_profile(name, toolchain=False).for_shape(1, 1).data
            assert catalog.sizes(one, fp16).small_batch
            assert not catalog.sizes(one, int4).small_batch and catalog.sizes(one, int4).quant_tensor_core
            int8 = HeaderV2(1, 8, 2, 4096, 14336, dtype=1, quant=1)
            assert catalog.launch_plan(one, int8)[1]["symbol"] == "colibri_gate_up_qtc"
