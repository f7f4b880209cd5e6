"""A bounds check of a GGUF file's header, run before gguf-py parses it.

gguf-py's `GGUFReader` trusts the counts and lengths it reads: an array whose element count runs past the end of the
file makes it append empty views one element at a time, with no end in sight (two flipped bits turned a string
into an int32 array of 7.9e18 elements: 1 GB of memory in 27 s, still growing), and a string or a tensor name
longer than the file is cut short without a word. This walk reads the same header with `struct` from a read-only
memory map and checks every count and length against the bytes left in the file; gguf-py then does the real
parsing (it stays the reader; this only guards it).

Layout (ggml docs/gguf.md, versions 2 and 3; little-endian, or big-endian where gguf-py finds the version's low
16 bits zero, as it does):

    magic "GGUF", u32 version, u64 tensor count, u64 key/value count
    each key/value: key (u64 length + UTF-8 bytes), u32 value type (gguf.GGUFValueType), the value:
        a fixed-size scalar; a string (u64 length + bytes); an array (u32 element type, u64 count, the elements)
    each tensor info: name (u64 length + bytes), u32 n_dims, n_dims × u64 dims, u32 GGML type, u64 data offset

Sizes of the fixed-size types come from gguf-py (`GGUFReader.gguf_scalar_to_np`), the value types from
`gguf.GGUFValueType`. The magic and the version are left to gguf-py, which refuses them before reading further.
Arrays of arrays (gguf-py writes them; llama.cpp reads none) are walked to MAX_NESTING levels.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from ..errors import ConvertError

LEAST_KV = 8 + 4 + 1  # key length, value type, the smallest value (a uint8, int8 or bool)
LEAST_TENSOR = 8 + 4 + 4 + 8  # name length, n_dims, GGML type, data offset (a name of 0 bytes, 0 dims)
LEAST_STRING = 8  # the u64 length of an empty string
LEAST_ARRAY = 4 + 8  # element type, count of an empty array
MAX_NESTING = 8  # arrays of arrays
SHOWN_NAME = 80  # characters of a key or tensor name quoted in a message


class _Walk:
    """A cursor over the header bytes; every read is checked against the bytes left in the file first."""

    def __init__(self, buf, file: str, order: str, types, sizes: dict[int, int]):
        self.buf, self.file, self.order, self.types, self.sizes = buf, file, order, types, sizes
        self.pos = 0
        self.where = "header"

    def fail(self, what: str) -> ConvertError:
        return ConvertError(f"{self.file}: GGUF {self.where}: {what}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, nbytes: int, what: str, least: bool = False) -> None:
        left = self.left()
        if nbytes > left:
            raise self.fail(f"{what} needs {'at least ' if least else ''}{nbytes} bytes; "
                            f"{left} bytes are left in the file")

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(self.order + fmt)
        self.need(size, what)
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self, what: str) -> int:
        """Skip a string (u64 length + bytes); returns where its bytes start."""
        (length,) = self.unpack("Q", f"the length of {what}")
        if length > self.left():
            raise self.fail(f"{what} of {length} bytes; {self.left()} bytes are left in the file")
        start = self.pos
        self.pos += length
        return start

    def name(self, what: str) -> str:
        """A key or tensor name, quoted for messages (shortened, undecodable bytes escaped)."""
        start = self.string(what)
        raw = bytes(self.buf[start:min(self.pos, start + 4 * SHOWN_NAME)])
        text = raw.decode("utf-8", "backslashreplace")
        cut = len(text) > SHOWN_NAME or self.pos - start > len(raw)
        return repr(text[:SHOWN_NAME] + ("…" if cut else ""))

    def strings(self, count: int) -> None:
        """Skip `count` strings (an array's elements), one length at a time."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct(self.order + "Q").unpack_from
        for index in range(count):
            if pos + LEAST_STRING > end:
                self.pos = pos
                self.need(LEAST_STRING, f"the length of string #{index} of the array")
            (n,) = length(buf, pos)
            pos += LEAST_STRING
            if n > end - pos:
                raise self.fail(f"string #{index} of an array of {count}, of {n} bytes; {end - pos} bytes are "
                                f"left in the file")
            pos += n
        self.pos = pos

    def value_type(self, code: int, what: str) -> None:
        if code not in self.types:
            allowed = ", ".join(f"{t.value} {t.name.lower()}" for t in self.types.values())
            raise self.fail(f"{what} {code} is unknown; allowed: {allowed}")

    def value(self, code: int, depth: int = 0) -> None:
        """Skip one value of type `code` (known): a scalar, a string or an array, nested arrays walked."""
        kind = self.types[code]
        if code in self.sizes:
            self.need(self.sizes[code], f"a {kind.name.lower()} value")
            self.pos += self.sizes[code]
        elif kind.name == "STRING":
            self.string("a string")
        else:  # ARRAY
            if depth == MAX_NESTING:
                raise self.fail(f"arrays nested more than {MAX_NESTING} deep; allowed: at most {MAX_NESTING}")
            (element,) = self.unpack("I", "an array's element type")
            self.value_type(element, "array element type")
            (count,) = self.unpack("Q", "an array's element count")
            inner = self.types[element]
            if element in self.sizes:
                self.need(count * self.sizes[element], f"an array of {count} {inner.name.lower()} elements")
                self.pos += count * self.sizes[element]
                return
            if inner.name == "STRING":
                self.need(count * LEAST_STRING, f"an array of {count} strings ({LEAST_STRING} bytes each)", least=True)
                self.strings(count)
                return
            self.need(count * LEAST_ARRAY, f"an array of {count} arrays ({LEAST_ARRAY} bytes each)", least=True)
            for _ in range(count):
                self.value(element, depth + 1)


def check_header(path: Path, gguf) -> None:
    """Walk the header of the GGUF file at `path` (key/values and tensor infos) without building any value.

    Args:
        path: the file (a regular file; gguf_model has checked it exists).
        gguf: the imported `gguf` package (its value types, magic, supported versions and scalar sizes).

    Raises:
        ConvertError: a count or length that needs more bytes than are left in the file (the key, its index or
            the tensor, the bytes needed and the bytes left), or an unknown value type (and the allowed ones).
    """
    types = {t.value: t for t in gguf.GGUFValueType}
    sizes = {t.value: np.dtype(np_type).itemsize for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) < 8:
                return  # gguf-py refuses it (no magic and version)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                magic, version = struct.unpack_from("<II", buf, 0)
                order = "<" if version & 0xFFFF else ">"
                version = struct.unpack_from(order + "I", buf, 4)[0]
                if magic != gguf.GGUF_MAGIC or version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
                    return  # gguf-py refuses these, before reading further
                _walk(_Walk(buf, path.name, order, types, sizes))
    except OSError as exc:
        raise ConvertError(f"cannot read {path}: {exc.strerror}") from None


def _walk(w: _Walk) -> None:
    w.pos = 8
    tensors, kvs = w.unpack("QQ", "the tensor and key/value counts")
    w.need(kvs * LEAST_KV, f"a key/value count of {kvs} ({LEAST_KV} bytes each)", least=True)
    w.need(tensors * LEAST_TENSOR, f"a tensor count of {tensors} ({LEAST_TENSOR} bytes each)", least=True)
    for index in range(kvs):
        w.where = f"key #{index}"  # until its name is read
        w.where = f"key {w.name('the key')}"
        (code,) = w.unpack("I", "the value type")
        w.value_type(code, "value type")
        w.value(code)
    w.where = "tensor infos"
    w.need(tensors * LEAST_TENSOR, f"a tensor count of {tensors} ({LEAST_TENSOR} bytes each)", least=True)
    for index in range(tensors):
        w.where = f"tensor #{index}"  # until its name is read
        w.where = f"tensor {w.name('the tensor name')}"
        (dims,) = w.unpack("I", "the dimension count")
        w.need(dims * 8, f"a dimension count of {dims}")
        w.pos += dims * 8
        w.unpack("IQ", "the GGML type and data offset")
