"""GGUF headers whose counts or lengths run past the end of the file, or with an unknown value type, are refused in
one line naming the key (or its index) and the bytes needed and left, before gguf-py reads them (gguf_header).

Each conversion runs in a subprocess with a timeout: two flipped bits once made gguf-py build an int32 array of
7.9e18 elements, growing without end.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

gguf = pytest.importorskip("gguf", reason="the GGUF tests need gguf (the `convert` extra)")

KEY = b"general.architecture"
TYPES = ("0 uint8, 1 int8, 2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array, 10 uint64, "
         "11 int64, 12 float64")


def write_small(path: Path, nested=None) -> bytes:
    """A llama GGUF file: general.architecture, a string array, a uint32, one F32 tensor; returns its bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    if nested is not None:
        w.add_array("test.nested", nested)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def convert_subprocess(path: Path) -> str:
    """`colibri-sdk convert path` in a subprocess (a hang is a timeout); returns its one-line error."""
    proc = subprocess.run([sys.executable, "-m", "colibri_sdk", "convert", str(path), "-o",
                           str(path.with_suffix(".colibri")), "--quiet"],
                          capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri-sdk convert: error: "), proc.stderr
    return lines[0].removeprefix("colibri-sdk convert: error: ")


def edited(tmp_path: Path, edit) -> Path:
    data = bytearray(write_small(tmp_path / "source.gguf"))
    edit(data, data.index(KEY) + len(KEY))  # the offset of general.architecture's value type
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    return path


def test_two_flipped_bits_make_a_huge_int32_array(tmp_path):
    """The reported file: the value type STRING (8) → ARRAY (9), so the string's u64 length 5 reads as element type
    INT32 (5) and its next bytes, with one more bit flipped, as a count of 7.9e18."""
    def flip(data, at):
        data[at] ^= 1
        data[at + 10] ^= 1

    path = edited(tmp_path, flip)
    data = path.read_bytes()
    at = data.index(KEY) + len(KEY)
    count = int.from_bytes(data[at + 8:at + 16], "little")
    left = len(data) - (at + 16)
    assert count > 2**62
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key 'general.architecture': an array of {count} int32 elements needs {4 * count} bytes; "
        f"{left} bytes are left in the file")


def test_a_string_longer_than_the_file(tmp_path):
    path = edited(tmp_path, lambda data, at: struct.pack_into("<Q", data, at + 4, 2**62))
    left = path.stat().st_size - (path.read_bytes().index(KEY) + len(KEY) + 12)
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key 'general.architecture': a string of {2**62} bytes; {left} bytes are left in the file")


def test_a_key_value_count_the_file_cannot_hold(tmp_path):
    path = edited(tmp_path, lambda data, at: struct.pack_into("<Q", data, 16, 2**40))
    left = path.stat().st_size - 24
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF header: a key/value count of {2**40} (13 bytes each) needs at least {13 * 2**40} bytes; "
        f"{left} bytes are left in the file")


def test_a_tensor_count_the_file_cannot_hold(tmp_path):
    path = edited(tmp_path, lambda data, at: struct.pack_into("<Q", data, 8, 2**60))
    left = path.stat().st_size - 24
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF header: a tensor count of {2**60} (24 bytes each) needs at least {24 * 2**60} bytes; "
        f"{left} bytes are left in the file")


@pytest.mark.parametrize("code", [13, 0xFFFFFFFF])
def test_an_unknown_value_type(tmp_path, code):
    path = edited(tmp_path, lambda data, at: struct.pack_into("<I", data, at, code))
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key 'general.architecture': value type {code} is unknown; allowed: {TYPES}")


def test_a_string_array_longer_than_the_file(tmp_path):
    def edit(data, at):
        key = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
        assert struct.unpack_from("<IIQ", data, key) == (9, 8, 3)  # ARRAY of STRING, 3 elements
        struct.pack_into("<Q", data, key + 8, 2**61 + 3)

    path = edited(tmp_path, edit)
    data = path.read_bytes()
    left = len(data) - (data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 16)
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key 'tokenizer.ggml.tokens': an array of {2**61 + 3} strings (8 bytes each) needs at least "
        f"{8 * (2**61 + 3)} bytes; {left} bytes are left in the file")


def test_a_string_in_an_array_longer_than_the_file(tmp_path):
    second = b"\x02\x00\x00\x00\x00\x00\x00\x00bc"  # the u64 length of "bc", then its bytes
    path = edited(tmp_path, lambda data, at: struct.pack_into("<Q", data, data.index(second), 2**40))
    left = path.stat().st_size - path.read_bytes().index(b"bc\x03")
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key 'tokenizer.ggml.tokens': string #1 of an array of 3, of {2**40} bytes; {left} bytes "
        f"are left in the file")


def test_a_key_name_longer_than_the_file(tmp_path):
    path = edited(tmp_path, lambda data, at: struct.pack_into("<Q", data, 24, 2**50))
    left = path.stat().st_size - 32
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF key #0: the key of {2**50} bytes; {left} bytes are left in the file")


def test_a_tensor_with_more_dimensions_than_the_file_holds(tmp_path):
    def edit(data, at):
        name = data.index(b"blk.0.ffn_gate_inp.weight") + len(b"blk.0.ffn_gate_inp.weight")
        assert struct.unpack_from("<I", data, name) == (2,)
        struct.pack_into("<I", data, name, 0xFFFFFFFF)

    path = edited(tmp_path, edit)
    data = path.read_bytes()
    left = len(data) - (data.index(b"blk.0.ffn_gate_inp.weight") + len(b"blk.0.ffn_gate_inp.weight") + 4)
    assert convert_subprocess(path) == (
        f"m.gguf: GGUF tensor 'blk.0.ffn_gate_inp.weight': a dimension count of {0xFFFFFFFF} needs {8 * 0xFFFFFFFF} "
        f"bytes; "
        f"{left} bytes are left in the file")


def test_nested_arrays_pass_to_a_depth(tmp_path):
    """Arrays of arrays (gguf-py writes them) pass the check; nested deeper than MAX_NESTING (8) they are refused."""
    write_small(tmp_path / "two.gguf", nested=[[1, 2], [3]])
    assert convert_subprocess(tmp_path / "two.gguf").startswith("two.gguf: GGUF general.architecture = 'llama' is not")
    deep = [1]
    for _ in range(9):
        deep = [deep]
    write_small(tmp_path / "deep.gguf", nested=deep)
    assert convert_subprocess(tmp_path / "deep.gguf") == (
        "deep.gguf: GGUF key 'test.nested': arrays nested more than 8 deep; allowed: at most 8")
