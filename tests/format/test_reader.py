"""ColibriFile: zero-copy mmap views, strict size checks, and no crash or hang on any input."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, Header, write_model
from colibri_sdk.format.constants import HEADER_SIZE

from format_cases import SIZES


def test_views_hold_the_written_values(small_file):
    path, header, a = small_file
    with ColibriFile(path) as f:
        for kind in ("gate_proj", "up_proj", "down_proj"):
            for layer in range(2):
                for expert in range(3):
                    v = f.tensor(kind, layer, expert)
                    assert v.dtype == np.dtype("<f2") and v.shape == header.shape(kind)
                    np.testing.assert_array_equal(v, a[kind][layer, expert].astype(np.float16))
            np.testing.assert_array_equal(f.experts(kind, 1), a[kind][1].astype(np.float16))
            np.testing.assert_array_equal(f.block(kind), a[kind].astype(np.float16))
        np.testing.assert_array_equal(f.router(1), a["router"][1].astype(np.float16))


def test_views_are_zero_copy_and_read_only(small_file):
    """A view is the mapping itself: bytes changed on disk show through it, and it cannot be written."""
    path, header, _ = small_file
    f = ColibriFile(path)
    view = f.tensor("down_proj", 1, 2)
    assert not view.flags.writeable and not view.flags.owndata
    assert np.shares_memory(view, f.data())
    offset = header.tensor_offset("down_proj", 1, 2)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00\x3c", offset)  # 1.0 in fp16, little-endian
    finally:
        os.close(fd)
    assert view[0, 0] == 1.0
    with pytest.raises(ValueError):
        view[0, 0] = 2.0
    f.close()


def test_fp16_is_little_endian_on_disk(tmp_path):
    header = Header(num_layers=1, num_experts=1, top_k=1, hidden_size=1, intermediate_size=1, dtype=1)
    one = np.ones((1, 1, 1, 1), np.float32)
    write_model(tmp_path / "m.colibri", header, one, one * 2, one * -2, np.full((1, 1, 1), 0.5, ">f4"))
    data = (tmp_path / "m.colibri").read_bytes()[HEADER_SIZE:]
    # IEEE binary16: 1.0 = 0x3C00, 2.0 = 0x4000, -2.0 = 0xC000, 0.5 = 0x3800; low byte first.
    assert data == b"\x00\x3c" + b"\x00\x40" + b"\x00\xc0" + b"\x00\x38"


def test_fp32_is_little_endian_on_disk(tmp_path):
    header = Header(num_layers=1, num_experts=1, top_k=1, hidden_size=1, intermediate_size=1, dtype=0)
    one = np.ones((1, 1, 1, 1), ">f4")
    write_model(tmp_path / "m.colibri", header, one, one, one, np.ones((1, 1, 1), np.float64))
    assert (tmp_path / "m.colibri").read_bytes()[HEADER_SIZE:] == b"\x00\x00\x80\x3f" * 4


def test_truncated_file(small_file):
    path, header, _ = small_file
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(FormatError, match=rf"is truncated: {len(data) - 1} bytes, the header implies {len(data)}"):
        ColibriFile(path)
    path.write_bytes(data[:HEADER_SIZE])
    with pytest.raises(FormatError, match=rf"truncated: {HEADER_SIZE} bytes"):
        ColibriFile(path)


def test_extended_file(small_file):
    path, _, _ = small_file
    with open(path, "ab") as fh:
        fh.write(b"\x00" * 3)
    with pytest.raises(FormatError, match=r"has 3 trailing bytes"):
        ColibriFile(path)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(FormatError, match=r"cannot open .*nothing\.colibri: No such file"):
        ColibriFile(tmp_path / "nothing.colibri")
    with pytest.raises(FormatError, match=r"cannot open|is not a regular file"):
        ColibriFile(tmp_path)


def test_index_errors(small_file):
    path, _, _ = small_file
    with ColibriFile(path) as f:
        with pytest.raises(FormatError, match=r"layer 2 out of range; allowed: 0\.\.1"):
            f.tensor("gate_proj", 2, 0)
        with pytest.raises(FormatError, match=r"expert 3 out of range for up_proj; allowed: 0\.\.2"):
            f.tensor("up_proj", 0, 3)
        with pytest.raises(FormatError, match=r"unknown tensor kind 'w1'"):
            f.tensor("w1", 0, 0)
        with pytest.raises(FormatError, match=r"router tensors have no expert index"):
            f.tensor("router", 0, 1)
    with pytest.raises(FormatError, match=r"is closed"):
        f.router(0)


def test_every_header_bit_flip_is_caught_or_harmless(small_file):
    """Flip each of the 512 header bits: the reader raises FormatError, or opens a file of the same size for the
    three flips that give another valid header (top_k 2→3, routing 0→1, composition 0→1). Nothing else escapes."""
    path, header, _ = small_file
    data = bytearray(path.read_bytes())
    opened = []
    for bit in range(HEADER_SIZE * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(flipped)
        try:
            with ColibriFile(path) as f:
                opened.append(bit)
                assert f.block("router").shape == (2, 4, 3)
        except FormatError:
            pass
    assert opened == [10 * 8, 18 * 8, 20 * 8]


def test_data_bit_flips_are_not_detected_but_safe(small_file):
    """v1 has no checksum (bundles carry sha256): a flipped data bit opens and reads without error."""
    path, _, _ = small_file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(data)
    with ColibriFile(path) as f:
        assert f.router(1).shape == (4, 3)


# ---- a folder of malicious headers, generated here ----------------------------------------------------------
def _valid() -> bytes:
    return Header(**SIZES, dtype=1).pack()


def _hdr(**fields) -> bytes:
    import struct

    from colibri_sdk.format.constants import HEADER_STRUCT, MAGIC, VERSION

    values = dict(magic=MAGIC, version=VERSION, **SIZES, dtype=1, routing=0, composition=0)
    values.update(fields)
    order = ("magic", "version", "num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size",
             "dtype", "routing", "composition")
    head = struct.pack(HEADER_STRUCT, *(values[k] for k in order))
    return head + bytes(HEADER_SIZE - len(head))


MALICIOUS = {
    "empty": (b"", r"file is 0 bytes"),
    "one_byte": (b"C", r"file is 1 bytes"),
    "magic_only": (b"COLI", r"file is 4 bytes"),
    "zero_magic": (_hdr(magic=b"\0\0\0\0"), r"bad magic"),
    "gguf_magic": (b"GGUF" + bytes(60), r"bad magic b'GGUF'"),
    "lowercase_magic": (_hdr(magic=b"coli"), r"bad magic b'coli'"),
    "version_ffff": (_hdr(version=0xFFFF), r"unsupported version 0xffff"),
    "version_zero": (_hdr(version=0), r"unsupported version 0x0000"),
    "max_sizes_tiny_file": (
        _hdr(num_layers=65535, num_experts=65535, top_k=65535, hidden_size=65535, intermediate_size=65535),
        rf"truncated: 64 bytes, the header implies {64 + 2 * (3 * 65535**4 + 65535**3)} ",
    ),
    "max_sizes_fp32": (
        _hdr(num_layers=65535, num_experts=65535, top_k=1, hidden_size=65535, intermediate_size=65535, dtype=0)
        + bytes(100),
        r"truncated: 164 bytes",
    ),
    "top_k_ffff": (_hdr(top_k=0xFFFF), r"top_k = 65535 exceeds num_experts = 3"),
    "all_zero_sizes": (_hdr(num_layers=0, num_experts=0, top_k=0, hidden_size=0, intermediate_size=0), r"num_layers = 0"),
    "dtype_ffff": (_hdr(dtype=0xFFFF), r"dtype code 65535"),
    "routing_ffff": (_hdr(routing=0xFFFF), r"routing code 65535"),
    "composition_2": (_hdr(composition=2), r"composition code 2"),
    "reserved_tail": (_hdr()[:40] + b"\x01" + bytes(23), r"reserved byte 40 is 0x01"),
    "header_plus_one": (_hdr() + b"\x00", r"truncated: 65 bytes"),
    "all_ff": (b"\xff" * 4096, r"bad magic"),
}


@pytest.fixture(scope="module")
def malicious_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("malicious")
    for name, (data, _) in MALICIOUS.items():
        (folder / f"{name}.colibri").write_bytes(data)
    return folder


@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_malicious_headers(malicious_dir, name):
    start = time.perf_counter()
    with pytest.raises(FormatError, match=MALICIOUS[name][1]):
        ColibriFile(malicious_dir / f"{name}.colibri")
    assert time.perf_counter() - start < 1.0


def test_random_headers_never_escape(tmp_path):
    """500 random files (valid magic and version, small random fields, random tails, sometimes a random reserved
    byte): each is refused with FormatError or opens; no other exception, no hang."""
    rng = np.random.default_rng(99)
    path = tmp_path / "fuzz.colibri"
    outcomes = {"refused": 0, "opened": 0}
    for _ in range(500):
        fields = rng.integers(0, 4, 8).astype("<u2").tobytes()
        reserved = bytearray(42)
        if rng.random() < 0.2:
            reserved[int(rng.integers(0, 42))] = int(rng.integers(1, 256))
        tail = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        data = (b"COLI\x00\x01" + fields + bytes(reserved) + tail)[: int(rng.integers(0, 3200))]
        path.write_bytes(data)
        try:
            ColibriFile(path).close()
            outcomes["opened"] += 1
        except FormatError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 400
