"""The v2 header (0x0200): exact bytes, the layout it implies, and one typed error per invalid field or
combination (docs/format.md, "v2 (0x0200)")."""

from __future__ import annotations

import math

import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import Header, HeaderV2

SIZES = dict(num_layers=2, num_experts=16, top_k=4, hidden_size=32, intermediate_size=48)
FULL = dict(
    SIZES, dtype=1, routing=2, composition=1, quant=2, group_size=128, zero_points=1, norm_topk=1, n_group=4,
    topk_group=2, group_score=2, router_bias=1, correction_bias=1, num_shared_experts=1, shared_intermediate_size=64,
    shared_gate=1, expert_bias=1, activation=1, num_model_layers=5, routed_scaling_factor=2.5, swiglu_limit=7.0,
    swiglu_alpha=1.702, layer_map=(1, 4),
)
# Written out by hand from the v2 header table of docs/format.md.
PACKED = (
    b"COLI" + b"\x00\x02"                                       # magic, version 0x0200
    + b"\x02\x00" + b"\x10\x00" + b"\x04\x00" + b"\x20\x00" + b"\x30\x00"  # L 2, E 16, top_k 4, H 32, I 48
    + b"\x01\x00" + b"\x02\x00" + b"\x01\x00"                   # dtype fp16, routing sigmoid_topk, residual
    + b"\x02\x00" + b"\x80\x00" + b"\x01\x00" + b"\x01\x00"     # int4, group 128, zero points, norm_topk
    + b"\x04\x00" + b"\x02\x00" + b"\x02\x00"                   # n_group 4, topk_group 2, top2_sum
    + b"\x01\x00" + b"\x01\x00"                                 # router bias, correction bias
    + b"\x01\x00" + b"\x40\x00" + b"\x01\x00"                   # 1 shared expert of 64, gated
    + b"\x01\x00" + b"\x01\x00" + b"\x05\x00"                   # expert bias, clamped_swiglu, 5 model layers
    + b"\x00\x00\x20\x40" + b"\x00\x00\xe0\x40" + b"\x23\xdb\xd9\x3f"  # 2.5, 7.0, 1.702 (float32)
)
PREFIX = PACKED + b"\x01\x00\x04\x00" + bytes(60)  # layer map (1, 4), zero padding to 128


def test_pack_exact_bytes():
    h = HeaderV2(**FULL)
    assert len(PACKED) == 64 and h.pack() == PACKED
    assert h.pack_prefix() == PREFIX and h.prefix_size == 128


def test_unpack_round_trip_and_dispatch():
    h = Header.unpack(PREFIX)
    assert isinstance(h, HeaderV2) and h == HeaderV2(**FULL)
    assert h.layer_map == (1, 4) and h.swiglu_alpha == pytest.approx(1.702, rel=1e-7)
    assert h.to_dict()["routing"] == "sigmoid_topk" and h.to_dict()["quant"] == "int4"


def test_defaults_mean_none():
    h = HeaderV2(**SIZES)
    assert (h.quant, h.n_group, h.routed_scaling_factor, h.num_model_layers, h.layer_map) == (0, 1, 1.0, 2, (0, 1))
    assert h.v1_gaps() == [] and h.as_v1() == Header(**SIZES)


def test_layout_by_hand():
    """L 1, E 2, H 3, I 5, int4 g32 with zero points, fp16 scales: sizes and 64-byte aligned offsets by hand."""
    h = HeaderV2(num_layers=1, num_experts=2, top_k=1, hidden_size=3, intermediate_size=5, dtype=1, quant=2,
                 group_size=32, zero_points=1)
    got = [(b.name, b.offset, b.nbytes) for b in h.blocks()]
    assert got == [
        ("gate_proj", 128, 20), ("gate_proj.scales", 192, 20), ("gate_proj.zeros", 256, 10),
        ("up_proj", 320, 20), ("up_proj.scales", 384, 20), ("up_proj.zeros", 448, 10),
        ("down_proj", 512, 18), ("down_proj.scales", 576, 12), ("down_proj.zeros", 640, 6),
        ("router", 704, 24),
    ]
    assert h.file_size == 728
    assert h.tensor_offset("down_proj", 0, 1) == 512 + 9
    assert h.tensor_offset("down_proj.scales", 0, 1) == 576 + 6


def test_int8_per_row_and_float_sizes():
    h = HeaderV2(num_layers=1, num_experts=1, top_k=1, hidden_size=100, intermediate_size=10, quant=1, dtype=0)
    assert h.block("gate_proj").nbytes == 10 * 100 and h.block("gate_proj.scales").nbytes == 10 * 4
    f = HeaderV2(num_layers=1, num_experts=1, top_k=1, hidden_size=100, intermediate_size=10, dtype=1)
    assert [b.name for b in f.blocks()] == ["gate_proj", "up_proj", "down_proj", "router"]
    assert f.block("router").nbytes == 100 * 4  # the router is float32 in every v2 file


def test_shared_and_bias_blocks_in_order():
    h = HeaderV2(**FULL)
    names = [b.name for b in h.blocks()]
    assert names == [
        "gate_proj", "gate_proj.scales", "gate_proj.zeros", "up_proj", "up_proj.scales", "up_proj.zeros",
        "down_proj", "down_proj.scales", "down_proj.zeros", "router", "router_bias", "correction_bias",
        "gate_bias", "up_bias", "down_bias",
        "shared_gate_proj", "shared_gate_proj.scales", "shared_gate_proj.zeros",
        "shared_up_proj", "shared_up_proj.scales", "shared_up_proj.zeros",
        "shared_down_proj", "shared_down_proj.scales", "shared_down_proj.zeros", "shared_expert_gate",
    ]
    assert all(b.offset % 64 == 0 for b in h.blocks())
    assert h.block("shared_down_proj").nbytes == 2 * 1 * 32 * 32  # (L, S, H, ceil(64/2))
    assert "shared experts (1 × 64)" in h.v1_gaps() and "int4 weights (group size 128, zero points)" in h.v1_gaps()


def patch(offset: int, value: bytes, data: bytes = PREFIX) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


@pytest.mark.parametrize(
    "offset,value,match",
    [
        (4, b"\x00\x03", r"unsupported version 0x0300; this reader supports 0x0100, 0x0200"),
        (16, b"\x02\x00", r"dtype code 2; allowed: \[0, 1\]"),
        (18, b"\x03\x00", r"routing code 3 \(reserved bytes 18-19\); allowed: \{0: 'topk_softmax', 1: 'softmax_topk', 2: 'sigmoid_topk'\}"),
        (22, b"\x03\x00", r"quant code 3 \(bytes 22-23\); allowed: \{0: 'float', 1: 'int8', 2: 'int4'\}"),
        (24, b"\x10\x00", r"group_size 16 for int4 weights; allowed: 32, 64, 128$"),
        (24, b"\x00\x00", r"group_size 0 for int4 weights; allowed: 32, 64, 128$"),
        (26, b"\x02\x00", r"zero_points = 2; allowed: 0 or 1"),
        (28, b"\x02\x00", r"norm_topk = 2; allowed: 0 or 1"),
        (30, b"\x03\x00", r"n_group = 3; allowed: a divisor of num_experts = 16"),
        (30, b"\x00\x00", r"n_group = 0; allowed: a divisor of num_experts = 16"),
        (32, b"\x05\x00", r"topk_group = 5; allowed: 1\.\.n_group = 4"),
        (34, b"\x00\x00", r"group_score none with n_group = 4; allowed: max \(1\) or top2_sum \(2\)"),
        (34, b"\x03\x00", r"group_score code 3 \(bytes 34-35\)"),
        (36, b"\x02\x00", r"router_bias = 2; allowed: 0 or 1"),
        (40, b"\x00\x00", r"num_shared_experts = 0 with shared_intermediate_size = 64; allowed: both 0, or both >= 1"),
        (42, b"\x00\x00", r"num_shared_experts = 1 with shared_intermediate_size = 0"),
        (48, b"\x02\x00", r"activation code 2 \(bytes 48-49\); allowed: \{0: 'swiglu', 1: 'clamped_swiglu'\}"),
        (50, b"\x01\x00", r"num_model_layers = 1; allowed: num_layers \(2\)\.\.65535"),
        (50, b"\x00\x00", r"num_model_layers = 0; allowed: num_layers \(2\)\.\.65535"),
        (50, b"\x04\x00", r"layer_map\[1\] = 4; allowed: 0\.\.num_model_layers-1 \(3\)"),
        (52, b"\x00\x00\x00\x00", r"routed_scaling_factor = 0\.0; allowed: a finite float > 0"),
        (52, b"\x00\x00\x80\xbf", r"routed_scaling_factor = -1\.0; allowed: a finite float > 0"),
        (52, b"\x00\x00\xc0\x7f", r"routed_scaling_factor = nan \(float32 at header offset 52\); allowed: a finite float"),
        (56, b"\x00\x00\x80\x7f", r"swiglu_limit = inf \(float32 at header offset 56\)"),
        (60, b"\x00\x00\x00\x00", r"swiglu_alpha = 0\.0 with clamped_swiglu; allowed: a finite float > 0"),
        (64, b"\x04\x00", r"layer_map\[1\] = 4 after 4; allowed: strictly increasing model layers"),
        (70, b"\x01", r"padding byte 70 after the layer map is 0x01; allowed: 0"),
        (127, b"\x80", r"padding byte 127 after the layer map is 0x80"),
    ],
)
def test_unpack_errors(offset, value, match):
    with pytest.raises(FormatError, match=match):
        Header.unpack(patch(offset, value))


def test_short_prefix():
    with pytest.raises(FormatError, match=r"file is 100 bytes; a v2 file with 2 layers starts with 128 bytes"):
        Header.unpack(PREFIX[:100])


BASE = dict(SIZES, routing=1)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(BASE, quant=0, group_size=32), r"group_size 32 for float weights; allowed: 0$"),
        (dict(BASE, quant=1, group_size=256), r"group_size 256 for int8 weights; allowed: 0, 32, 64, 128 \(0 = one group per row\)"),
        (dict(BASE, zero_points=1), r"zero_points = 1 with float weights; allowed: zero points only for int8 or int4"),
        (dict(BASE, routing=0, norm_topk=1), r"norm_topk = 1 with routing topk_softmax"),
        (dict(BASE, correction_bias=1), r"correction_bias = 1 with routing softmax_topk; allowed only with sigmoid_topk"),
        (dict(BASE, n_group=1, topk_group=2), r"topk_group = 2; allowed: 1\.\.n_group = 1"),
        (dict(BASE, n_group=1, group_score=1), r"n_group = 1 with topk_group = 1, group_score = max; allowed with one group"),
        (dict(BASE, routing=0, n_group=4, topk_group=2, group_score=1), r"n_group = 4 with routing topk_softmax"),
        (dict(BASE, num_experts=16, n_group=16, topk_group=4, group_score=2), r"group_score top2_sum with 1 expert per group"),
        (dict(BASE, top_k=9, n_group=4, topk_group=2, group_score=1), r"top_k = 9 exceeds the 8 experts of topk_group = 2 groups of 4"),
        (dict(BASE, shared_gate=1), r"shared_gate = 1 without shared experts"),
        (dict(BASE, swiglu_limit=7.0), r"swiglu_limit = 7\.0 with activation swiglu; allowed: 0\.0"),
        (dict(BASE, activation=1, swiglu_alpha=1.702), r"swiglu_limit = 0\.0 with clamped_swiglu"),
        (dict(BASE, routed_scaling_factor=math.inf), r"routed_scaling_factor = inf; allowed: a finite float"),
        (dict(BASE, routed_scaling_factor="2"), r"routed_scaling_factor = '2'; allowed: a finite float"),
        (dict(BASE, quant=True), r"quant = True; allowed: an integer in 0\.\.65535"),
        (dict(BASE, n_group=70000), r"n_group = 70000; allowed: an integer in 0\.\.65535"),
        (dict(BASE, layer_map=(0,)), r"layer_map has 1 entries; allowed: one per file layer \(2\)"),
        (dict(BASE, layer_map=(1, 1), num_model_layers=3), r"layer_map\[1\] = 1 after 1"),
        (dict(BASE, layer_map=(0, True)), r"layer_map\[1\] = True"),
        (dict(BASE, version=0x0100), r"HeaderV2 version 0x0100; allowed: 0x0200"),
    ],
)
def test_constructor_errors(fields, match):
    with pytest.raises(FormatError, match=match):
        HeaderV2(**fields)


def test_v1_header_refuses_v2_version():
    with pytest.raises(FormatError, match=r"version 0x0200 is a HeaderV2"):
        Header(**SIZES, version=0x0200)


def test_as_v1_maps_renormalised_softmax_topk_and_refuses_the_rest():
    h = HeaderV2(**SIZES, routing=1, norm_topk=1)
    assert h.as_v1() == Header(**SIZES, routing=0)
    with pytest.raises(FormatError, match=r"needs features v1 does not have: sigmoid routing, routed_scaling_factor 2\.5"):
        HeaderV2(**SIZES, routing=2, routed_scaling_factor=2.5).as_v1()
