"""The 64-byte .colibri header and the layout it implies (block offsets, tensor shapes, file size).

`Header` is a v1 header (0x0100); `HeaderV2` (0x0200, quantized weights and the MoE families) is a subclass whose
first nine fields are v1's. `Header.unpack` returns whichever the bytes say: a subclass registers the version it
reads (`class HeaderV2(Header, version_code=VERSION_2)`), so header_v2.py imports this module and never the other
way round (the package imports both). All sizes are computed with Python
integers, so no header value can overflow them. Spec: docs/format.md.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

import numpy as np

from ..errors import FormatError
from .constants import (
    COMPOSITION_NAMES,
    DTYPE_NAMES,
    DTYPES,
    EXTENSION_END,
    HEADER_SIZE,
    HEADER_STRUCT,
    KINDS,
    MAGIC,
    ROUTING_NAMES,
    U16_MAX,
    VERSION,
    VERSION_2,
)


@dataclasses.dataclass(frozen=True)
class Header:
    """Header fields of a .colibri v1 file (docs/format.md, "Header").

    Attributes:
        num_layers, num_experts, top_k, hidden_size, intermediate_size: model sizes, each 1..65535,
            with top_k <= num_experts.
        dtype: 0 = float32, 1 = float16 (storage dtype of every block).
        routing: 0 = softmax over the top-k logits (renormalised), 1 = softmax over all experts, not renormalised.
        composition: 0 = sequential layers, 1 = residual layers.
    """

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: int = 0
    routing: int = 0
    composition: int = 0
    version: int = VERSION

    # The header class of each later version, by version code (`__init_subclass__`).
    _versions: ClassVar[dict[int, type]] = {}

    def __init_subclass__(cls, version_code: int | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if version_code is not None:
            Header._versions[version_code] = cls

    def __post_init__(self):
        self.validate()

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise FormatError naming the first field that is out of range."""
        if self.version != VERSION:
            if self.version == VERSION_2:
                raise FormatError("version 0x0200 is a HeaderV2; Header holds v1 (0x0100) headers")
            raise FormatError(f"unsupported version {_hex(self.version)}; this reader supports 0x0100, 0x0200")
        self._validate_v1_fields(ROUTING_NAMES)

    def _validate_v1_fields(self, routing_names: dict[int, str]) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= U16_MAX:
                raise FormatError(f"{name} = {value!r}; allowed: an integer in 1..{U16_MAX}")
        if self.top_k > self.num_experts:
            raise FormatError(f"top_k = {self.top_k} exceeds num_experts = {self.num_experts}; allowed: 1..num_experts")
        for name in ("dtype", "routing", "composition"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise FormatError(f"{name} code {value!r}; allowed: an integer code")
        if self.dtype not in DTYPES:
            raise FormatError(f"dtype code {self.dtype!r}; allowed: {sorted(DTYPES)} ({DTYPE_NAMES})")
        if self.routing not in routing_names:
            raise FormatError(f"routing code {self.routing!r} (reserved bytes 18-19); allowed: {routing_names}")
        if self.composition not in COMPOSITION_NAMES:
            raise FormatError(
                f"composition code {self.composition!r} (reserved bytes 20-21); allowed: {COMPOSITION_NAMES}"
            )

    # ---- bytes ------------------------------------------------------------------------------------------------
    def packed_start(self) -> tuple:
        """The values of bytes 0..21, in `HEADER_STRUCT` order: magic, version and the nine v1 fields (the start
        v1 and v2 headers share)."""
        return (MAGIC, self.version, self.num_layers, self.num_experts, self.top_k, self.hidden_size,
                self.intermediate_size, self.dtype, self.routing, self.composition)

    def pack(self) -> bytes:
        """The 64 header bytes, little-endian, unused reserved bytes zero."""
        head = struct.pack(HEADER_STRUCT, *self.packed_start())
        return head + bytes(HEADER_SIZE - len(head))

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        """Parse and validate 64 header bytes.

        Raises:
            FormatError: short header, bad magic, unknown version, dtype, routing or composition code, a size of
                zero, top_k > num_experts, or a non-zero reserved byte this version does not define.
        """
        fields = unpack_start(data, HEADER_STRUCT)
        version = fields[1]
        if version in Header._versions:
            return Header._versions[version].unpack(data)
        if version != VERSION:
            raise FormatError(f"unsupported version 0x{version:04x}; this reader supports 0x0100, 0x0200")
        rest = bytes(data[EXTENSION_END:HEADER_SIZE])
        if any(rest):
            first = next(i for i, b in enumerate(rest) if b) + EXTENSION_END
            raise FormatError(
                f"reserved byte {first} is 0x{data[first]:02x}; this reader understands bytes 18-21 "
                f"(routing, composition) and requires bytes {EXTENSION_END}-{HEADER_SIZE - 1} to be zero"
            )
        return cls(*fields[2:], version=version)

    @staticmethod
    def prefix_size_of(data: bytes) -> int:
        """Bytes before the first block for the header that starts `data` (at least 64 bytes): 64 for v1; for v2
        the header, the layer map and its padding. Reads only the version and num_layers."""
        version, layers = struct.unpack_from("<HH", data, 4)
        if version in Header._versions:
            return Header._versions[version].prefix_size_for(layers)
        return HEADER_SIZE

    @staticmethod
    def prefix_size_for(num_layers: int) -> int:
        """Bytes before the first block of a file of this version with `num_layers` layers (v1: 64)."""
        return HEADER_SIZE

    @property
    def prefix_size(self) -> int:
        """Bytes before the first block (v1: the 64-byte header)."""
        return HEADER_SIZE

    # ---- layout -----------------------------------------------------------------------------------------------
    @property
    def np_dtype(self) -> np.dtype:
        """Little-endian NumPy dtype of the stored blocks."""
        return DTYPES[self.dtype]

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    def shape(self, kind: str) -> tuple[int, int]:
        """Shape of one tensor of `kind`: gate/up (intermediate, hidden), down (hidden, intermediate),
        router (hidden, num_experts)."""
        h, i, e = self.hidden_size, self.intermediate_size, self.num_experts
        shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "router": (h, e)}
        if kind not in shapes:
            raise FormatError(f"unknown tensor kind {kind!r}; allowed: {KINDS}")
        return shapes[kind]

    def block_elements(self, kind: str) -> int:
        """Elements in the whole block of `kind` (all layers, all experts)."""
        rows, cols = self.shape(kind)
        per_layer = 1 if kind == "router" else self.num_experts
        return self.num_layers * per_layer * rows * cols

    def block_offset(self, kind: str) -> int:
        """Byte offset where the block of `kind` starts (blocks in KINDS order, right after the header)."""
        offset = HEADER_SIZE
        for k in KINDS:
            if k == kind:
                return offset
            offset += self.block_elements(k) * self.itemsize
        raise FormatError(f"unknown tensor kind {kind!r}; allowed: {KINDS}")

    def tensor_offset(self, kind: str, layer: int, expert: int | None = None) -> int:
        """Byte offset of one tensor. `expert` is required for gate/up/down and must be None for the router."""
        self.check_index(kind, layer, expert)
        rows, cols = self.shape(kind)
        index = layer if kind == "router" else layer * self.num_experts + expert
        return self.block_offset(kind) + index * rows * cols * self.itemsize

    def check_index(self, kind: str, layer: int, expert: int | None) -> None:
        """Raise FormatError unless (kind, layer, expert) names a tensor of this file."""
        if kind not in KINDS:
            raise FormatError(f"unknown tensor kind {kind!r}; allowed: {KINDS}")
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise FormatError(f"layer {layer!r} out of range; allowed: 0..{self.num_layers - 1}")
        if kind == "router":
            if expert is not None:
                raise FormatError(f"router tensors have no expert index (got expert={expert!r})")
        elif not isinstance(expert, (int, np.integer)) or not 0 <= expert < self.num_experts:
            raise FormatError(f"expert {expert!r} out of range for {kind}; allowed: 0..{self.num_experts - 1}")

    @property
    def data_size(self) -> int:
        """Bytes of tensor data after the header."""
        return sum(self.block_elements(k) for k in KINDS) * self.itemsize

    @property
    def file_size(self) -> int:
        """Exact size in bytes of a valid file with this header."""
        return HEADER_SIZE + self.data_size

    def to_dict(self) -> dict:
        """JSON-friendly fields, with names for the codes."""
        return {
            "magic": MAGIC.decode(),
            "version": f"0x{self.version:04x}",
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "dtype": self.dtype_name,
            "routing": ROUTING_NAMES[self.routing],
            "composition": COMPOSITION_NAMES[self.composition],
        }


def unpack_start(data: bytes, layout: str) -> tuple:
    """`struct.unpack_from(layout, data)` once the checks every header version shares have passed.

    Raises:
        FormatError: `data` is shorter than the 64-byte header, or its magic is not b"COLI".
    """
    if len(data) < HEADER_SIZE:
        raise FormatError(f"file is {len(data)} bytes; a .colibri file starts with a {HEADER_SIZE}-byte header")
    fields = struct.unpack_from(layout, data)
    if fields[0] != MAGIC:
        raise FormatError(f"bad magic {fields[0]!r}; expected {MAGIC!r}")
    return fields


def _hex(value) -> str:
    return f"0x{value:04x}" if isinstance(value, int) else repr(value)
