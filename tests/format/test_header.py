"""The 64-byte header: exact bytes, and one typed error per invalid field."""

from __future__ import annotations

import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import Header

SIZES = dict(num_layers=2, num_experts=16, top_k=4, hidden_size=32, intermediate_size=48)
# Written out by hand from docs/format.md: magic, version 0x0100, five sizes, dtype 1, routing 1, composition 1.
PACKED = (
    b"COLI" + b"\x00\x01" + b"\x02\x00" + b"\x10\x00" + b"\x04\x00" + b"\x20\x00" + b"\x30\x00"
    + b"\x01\x00" + b"\x01\x00" + b"\x01\x00" + bytes(42)
)


def test_pack_exact_bytes():
    assert Header(**SIZES, dtype=1, routing=1, composition=1).pack() == PACKED
    assert len(PACKED) == 64


def test_unpack_round_trip():
    h = Header.unpack(PACKED)
    assert (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size) == (2, 16, 4, 32, 48)
    assert (h.dtype, h.routing, h.composition, h.version) == (1, 1, 1, 0x0100)


def test_all_zero_reserved_area_means_source_semantics():
    h = Header.unpack(PACKED[:18] + bytes(46))
    assert h.to_dict()["routing"] == "topk_softmax" and h.to_dict()["composition"] == "sequential"


def test_layout_sizes():
    h = Header(**SIZES, dtype=1)
    # gate: 2 layers * 16 experts * 48 * 32 * 2 bytes = 98304
    assert [h.block_offset(k) for k in ("gate_proj", "up_proj", "down_proj", "router")] == [64, 98368, 196672, 294976]
    assert h.file_size == 294976 + 2 * 32 * 16 * 2
    assert h.tensor_offset("up_proj", 1, 3) == 98368 + (16 + 3) * 48 * 32 * 2
    assert h.tensor_offset("router", 1) == 294976 + 32 * 16 * 2


def patch(offset: int, value: bytes) -> bytes:
    return PACKED[:offset] + value + PACKED[offset + len(value):]


@pytest.mark.parametrize(
    "data,match",
    [
        (PACKED[:63], r"file is 63 bytes; a \.colibri file starts with a 64-byte header"),
        (patch(0, b"COLJ"), r"bad magic b'COLJ'; expected b'COLI'"),
        (patch(4, b"\x00\x03"), r"unsupported version 0x0300; this reader supports 0x0100, 0x0200"),
        (patch(4, b"\x00\x02"), r"file is 64 bytes; a v2 file with 2 layers starts with 128 bytes"),
        (patch(4, b"\x01\x00"), r"unsupported version 0x0001"),
        (patch(6, b"\x00\x00"), r"num_layers = 0; allowed: an integer in 1\.\.65535"),
        (patch(8, b"\x00\x00"), r"num_experts = 0; allowed"),
        (patch(10, b"\x00\x00"), r"top_k = 0; allowed"),
        (patch(12, b"\x00\x00"), r"hidden_size = 0; allowed"),
        (patch(14, b"\x00\x00"), r"intermediate_size = 0; allowed"),
        (patch(10, b"\x11\x00"), r"top_k = 17 exceeds num_experts = 16"),
        (patch(16, b"\x02\x00"), r"dtype code 2; allowed: \[0, 1\]"),
        (patch(18, b"\x02\x00"), r"routing code 2 \(reserved bytes 18-19\)"),
        (patch(20, b"\x00\x01"), r"composition code 256 \(reserved bytes 20-21\)"),
        (patch(22, b"\x01"), r"reserved byte 22 is 0x01; .* requires bytes 22-63 to be zero"),
        (patch(63, b"\x80"), r"reserved byte 63 is 0x80"),
    ],
)
def test_unpack_errors(data, match):
    with pytest.raises(FormatError, match=match):
        Header.unpack(data)


@pytest.mark.parametrize("offset", range(22, 64))
def test_every_unknown_reserved_byte_is_refused(offset):
    with pytest.raises(FormatError, match=rf"reserved byte {offset} is 0xff"):
        Header.unpack(patch(offset, b"\xff"))


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(SIZES, num_layers=65536), r"num_layers = 65536; allowed: an integer in 1\.\.65535"),
        (dict(SIZES, hidden_size=-1), r"hidden_size = -1"),
        (dict(SIZES, top_k=True), r"top_k = True"),
        (dict(SIZES, num_experts=2.0), r"num_experts = 2\.0"),
        (dict(SIZES, dtype=5), r"dtype code 5"),
        (dict(SIZES, dtype=1.0), r"dtype code 1\.0; allowed: an integer code"),
        (dict(SIZES, routing=True), r"routing code True; allowed: an integer code"),
    ],
)
def test_constructor_errors(fields, match):
    with pytest.raises(FormatError, match=match):
        Header(**fields)
