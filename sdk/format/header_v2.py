"""The v2 (0x0200) header: quantized expert matrices, the routing variants, shared experts, biases, the clamped
SwiGLU and the layer map, and the block layout they imply. Byte-level spec: docs/format.md, "v2 (0x0200)".

`HeaderV2` subclasses the v1 `Header`: the first nine dataclass fields are v1's with the same meaning, so code that
records or compares only those (bundle manifests) reads a v2 header unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import NamedTuple

import numpy as np

from ..errors import FormatError
from .constants import (
    ACTIVATION_NAMES,
    BIAS_KINDS,
    BLOCK_ALIGN,
    COMPOSITION_NAMES,
    DTYPE_NAMES,
    DTYPES,
    GROUP_SCORE_NAMES,
    GROUP_SCORE_NONE,
    HEADER_SIZE,
    HEADER_V2_FIELDS,
    HEADER_V2_FLOATS,
    HEADER_V2_STRUCT,
    LAYER_MAP_OFFSET,
    MAGIC,
    MATRIX_KINDS,
    QUANT_FLOAT,
    QUANT_INT4,
    QUANT_NAMES,
    ROUTING_SIGMOID_TOPK,
    ROUTING_SOFTMAX_TOPK,
    ROUTING_TOPK_SOFTMAX,
    ROUTING_V2_NAMES,
    SCALES_SUFFIX,
    SHARED_KINDS,
    U16_MAX,
    VERSION_2,
    ZEROS_SUFFIX,
)
from .header import Header, unpack_start
from .rules_v2 import check_experts, check_layer_map, check_routing, check_storage

F32 = np.dtype("<f4")
I8 = np.dtype("i1")
U8 = np.dtype("u1")
_FLAGS = ("zero_points", "norm_topk", "router_bias", "correction_bias", "shared_gate", "expert_bias")


def align(offset: int) -> int:
    """The next multiple of BLOCK_ALIGN (64) at or after `offset`."""
    return -(-offset // BLOCK_ALIGN) * BLOCK_ALIGN


def prefix_size(num_layers: int) -> int:
    """Bytes before the first v2 block: the 64-byte header and the u16 layer map, padded to 64."""
    return align(LAYER_MAP_OFFSET + 2 * num_layers)


def groups(cols: int, group_size: int) -> int:
    """Groups per row along the reduction dimension: ceil(cols / group_size), 1 for group_size 0 (per row)."""
    return 1 if group_size == 0 else -(-cols // group_size)


class Block(NamedTuple):
    """One block of a v2 file.

    name: block name (`gate_proj`, `gate_proj.scales`, `router`, ...); tensor: the logical tensor kind it belongs
    to (`gate_proj` for `gate_proj.scales`); count: tensors per layer (experts, shared experts or 1); shape: one
    tensor as stored (int4: (rows, ceil(cols/2)) bytes); dtype: stored element dtype; offset, nbytes: in bytes.
    """

    name: str
    tensor: str
    count: int
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    nbytes: int

    @property
    def tensor_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class HeaderV2(Header, version_code=VERSION_2):
    """Header of a .colibri v2 file (docs/format.md, "v2 (0x0200)").

    Attributes (beyond v1's `num_layers, num_experts, top_k, hidden_size, intermediate_size, dtype, routing,
    composition`; `dtype` is the element type of float expert matrices and of the scales of quantized ones):
        quant: 0 float, 1 int8, 2 int4 — storage of every expert matrix (routed and shared).
        group_size: 0 (one group per row; int8 only), 32, 64 or 128 — groups along the reduction dimension.
        zero_points: 1 = one int8 zero point per group (asymmetric imports).
        norm_topk: 1 = renormalise the k routing weights (routing 1, 2).
        n_group, topk_group, group_score: group-limited selection (1, 1, 0 = none; score 1 max, 2 top-two sum).
        router_bias, correction_bias: 1 = a per-expert logit bias / a selection-only score bias (routing 2).
        num_shared_experts, shared_intermediate_size, shared_gate: shared experts and their sigmoid gate.
        expert_bias: 1 = biases on the routed experts' gate, up and down projections.
        activation: 0 SwiGLU, 1 clamped SwiGLU (gpt-oss) with swiglu_limit, swiglu_alpha.
        num_model_layers: decoder layers of the source model (0 in the constructor = num_layers).
        routed_scaling_factor: multiplies the routing weights (1.0 = none).
        layer_map: for each file layer the model layer it came from (() in the constructor = 0..num_layers-1).
    Float fields are rounded to float32, as stored.

    Raises:
        FormatError: any field outside its allowed set, naming the field, the value and what is allowed.
    """

    version: int = VERSION_2
    quant: int = QUANT_FLOAT
    group_size: int = 0
    zero_points: int = 0
    norm_topk: int = 0
    n_group: int = 1
    topk_group: int = 1
    group_score: int = GROUP_SCORE_NONE
    router_bias: int = 0
    correction_bias: int = 0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    shared_gate: int = 0
    expert_bias: int = 0
    activation: int = 0
    num_model_layers: int = 0
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    layer_map: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.num_model_layers, int) and self.num_model_layers == 0:
            object.__setattr__(self, "num_model_layers", self.num_layers)
        if isinstance(self.layer_map, (tuple, list)) and len(self.layer_map) == 0 and isinstance(self.num_layers, int):
            object.__setattr__(self, "layer_map", tuple(range(self.num_layers)))
        elif isinstance(self.layer_map, (tuple, list, np.ndarray)):
            as_int = tuple(int(v) if isinstance(v, np.integer) else v for v in self.layer_map)
            object.__setattr__(self, "layer_map", as_int)
        for name in HEADER_V2_FLOATS:
            value = getattr(self, name)
            if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
                object.__setattr__(self, name, float(np.float32(value)))
        self.validate()

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise FormatError naming the first field that is out of range (docs/format.md, v2 header table)."""
        if self.version != VERSION_2:
            raise FormatError(f"HeaderV2 version 0x{self.version:04x}; allowed: 0x0200 (use Header for 0x0100)")
        self._validate_v1_fields(ROUTING_V2_NAMES)
        for name in HEADER_V2_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value <= U16_MAX:
                raise FormatError(f"{name} = {value!r}; allowed: an integer in 0..{U16_MAX}")
        for name in _FLAGS:
            if getattr(self, name) not in (0, 1):
                raise FormatError(f"{name} = {getattr(self, name)}; allowed: 0 or 1")
        for name in HEADER_V2_FLOATS:
            value = getattr(self, name)
            if not isinstance(value, float) or not math.isfinite(value):
                raise FormatError(f"{name} = {value!r}; allowed: a finite float")
        check_storage(self)
        check_routing(self)
        check_experts(self)
        check_layer_map(self)

    # ---- bytes ------------------------------------------------------------------------------------------------
    def pack(self) -> bytes:
        """The 64 header bytes (docs/format.md, v2 header table)."""
        return struct.pack(
            HEADER_V2_STRUCT,
            *self.packed_start(),
            *(getattr(self, name) for name in HEADER_V2_FIELDS),
            *(getattr(self, name) for name in HEADER_V2_FLOATS),
        )

    def pack_prefix(self) -> bytes:
        """Everything before the first block: the header, the layer map (u16 each) and zero padding to 64."""
        head = self.pack() + struct.pack(f"<{self.num_layers}H", *self.layer_map)
        return head + bytes(self.prefix_size - len(head))

    @staticmethod
    def prefix_size_for(num_layers: int) -> int:
        """Bytes before the first v2 block (`prefix_size`)."""
        return prefix_size(num_layers)

    @classmethod
    def unpack(cls, data: bytes) -> "HeaderV2":
        """Parse and validate a v2 header and its layer map (`data` holds at least the first prefix_size bytes).

        Raises:
            FormatError: short data, bad magic or version, any field outside its allowed set, a non-zero padding
                byte after the layer map.
        """
        fields = unpack_start(data, HEADER_V2_STRUCT)
        if fields[1] != VERSION_2:
            raise FormatError(f"unsupported version 0x{fields[1]:04x}; HeaderV2 reads 0x0200")
        layers = fields[2]
        need = prefix_size(layers)
        if len(data) < need:
            raise FormatError(
                f"file is {len(data)} bytes; a v2 file with {layers} layers starts with {need} bytes "
                f"(header, layer map, padding)"
            )
        for name, value in zip(HEADER_V2_FLOATS, fields[-3:]):
            if not math.isfinite(value):
                raise FormatError(f"{name} = {value!r} (float32 at header offset {52 + 4 * HEADER_V2_FLOATS.index(name)}); allowed: a finite float")
        layer_map = struct.unpack_from(f"<{layers}H", data, LAYER_MAP_OFFSET)
        pad = bytes(data[LAYER_MAP_OFFSET + 2 * layers : need])
        if any(pad):
            first = next(i for i, b in enumerate(pad) if b) + LAYER_MAP_OFFSET + 2 * layers
            raise FormatError(f"padding byte {first} after the layer map is 0x{data[first]:02x}; allowed: 0")
        ints = dict(zip(HEADER_V2_FIELDS, fields[10:25]))
        floats = dict(zip(HEADER_V2_FLOATS, fields[25:]))
        if ints["num_model_layers"] == 0:  # the constructor's "same as num_layers"; never valid on disk
            raise FormatError(f"num_model_layers = 0; allowed: num_layers ({layers})..{U16_MAX}")
        return cls(*fields[2:10], version=VERSION_2, **ints, **floats, layer_map=tuple(layer_map))

    # ---- names ------------------------------------------------------------------------------------------------
    @property
    def quant_name(self) -> str:
        return QUANT_NAMES[self.quant]

    @property
    def quantized(self) -> bool:
        return self.quant != QUANT_FLOAT

    @property
    def prefix_size(self) -> int:
        """Bytes before the first block: header, layer map, padding to 64."""
        return prefix_size(self.num_layers)

    # ---- layout -----------------------------------------------------------------------------------------------
    def shape(self, kind: str) -> tuple[int, ...]:
        """Logical shape of one tensor of `kind`: matrices (rows, cols) with cols the reduction dimension, the
        router (hidden, experts), router/correction bias (experts,), gate/up bias (experts, intermediate), down
        bias (experts, hidden), shared gate (hidden,)."""
        shapes = self._logical_shapes()
        if kind not in shapes:
            raise FormatError(f"unknown tensor kind {kind!r}; allowed for this file: {tuple(shapes)}")
        return shapes[kind]

    def _logical_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, e, si = self.hidden_size, self.intermediate_size, self.num_experts, self.shared_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "router": (h, e)}
        if self.router_bias:
            shapes["router_bias"] = (e,)
        if self.correction_bias:
            shapes["correction_bias"] = (e,)
        if self.expert_bias:
            shapes.update(gate_bias=(e, i), up_bias=(e, i), down_bias=(e, h))
        if self.num_shared_experts:
            shapes.update(shared_gate_proj=(si, h), shared_up_proj=(si, h), shared_down_proj=(h, si))
        if self.shared_gate:
            shapes["shared_expert_gate"] = (h,)
        return shapes

    @property
    def kinds(self) -> tuple[str, ...]:
        """The logical tensor kinds of this file, in file order."""
        return tuple(self._logical_shapes())

    def count(self, kind: str) -> int:
        """Tensors of `kind` per layer: experts for routed matrices, shared experts for shared ones, else 1."""
        if kind in MATRIX_KINDS:
            return self.num_experts
        if kind in SHARED_KINDS:
            return self.num_shared_experts
        self.shape(kind)
        return 1

    def is_matrix(self, kind: str) -> bool:
        """True for the expert matrices, stored as `quant` says (routed and shared gate/up/down)."""
        return kind in MATRIX_KINDS or kind in SHARED_KINDS

    def groups(self, kind: str) -> int:
        """Scale groups per row of a matrix kind."""
        return groups(self.shape(kind)[1], self.group_size)

    def groups_for(self, cols: int) -> int:
        """Scale groups per row of a matrix with `cols` columns."""
        return groups(cols, self.group_size)

    def row_bytes(self, kind: str) -> int:
        """Bytes of one stored row of a matrix kind."""
        cols = self.shape(kind)[1]
        if self.quant == QUANT_FLOAT:
            return cols * self.itemsize
        return -(-cols // 2) if self.quant == QUANT_INT4 else cols

    def blocks(self) -> list[Block]:
        """Every block of the file in order, with offsets and sizes (docs/format.md, v2 "Blocks")."""
        L = self.num_layers
        specs: list[tuple[str, str, int, tuple[int, ...], np.dtype]] = []
        scale_dtype = DTYPES[self.dtype]

        def matrices(kinds):
            for kind in kinds:
                rows, cols = self.shape(kind)
                count = self.count(kind)
                if self.quant == QUANT_FLOAT:
                    specs.append((kind, kind, count, (rows, cols), DTYPES[self.dtype]))
                    continue
                stored = I8 if self.quant != QUANT_INT4 else U8
                specs.append((kind, kind, count, (rows, self.row_bytes(kind)), stored))
                g = groups(cols, self.group_size)
                specs.append((kind + SCALES_SUFFIX, kind, count, (rows, g), scale_dtype))
                if self.zero_points:
                    specs.append((kind + ZEROS_SUFFIX, kind, count, (rows, g), I8))

        matrices(MATRIX_KINDS)
        for kind in ("router", "router_bias", "correction_bias", *BIAS_KINDS):
            if kind in self._logical_shapes():
                specs.append((kind, kind, 1, self.shape(kind), F32))
        if self.num_shared_experts:
            matrices(SHARED_KINDS)
        if self.shared_gate:
            specs.append(("shared_expert_gate", "shared_expert_gate", 1, (self.hidden_size,), F32))
        out, offset = [], self.prefix_size
        for name, tensor, count, shape, dtype in specs:
            offset = align(offset)
            nbytes = L * count * int(np.prod(shape)) * dtype.itemsize
            out.append(Block(name, tensor, count, shape, dtype, offset, nbytes))
            offset += nbytes
        return out

    @functools.cached_property
    def _blocks_by_name(self) -> dict[str, Block]:
        return {b.name: b for b in self.blocks()}

    def block(self, name: str) -> Block:
        """The Block named `name` (e.g. `up_proj.scales`)."""
        b = self._blocks_by_name.get(name)
        if b is not None:
            return b
        raise FormatError(f"no block {name!r} in this file; blocks: {tuple(b.name for b in self.blocks())}")

    def block_elements(self, kind: str) -> int:
        b = self.block(kind)
        return self.num_layers * b.count * int(np.prod(b.shape))

    def block_offset(self, kind: str) -> int:
        return self.block(kind).offset

    def tensor_offset(self, kind: str, layer: int, expert: int | None = None) -> int:
        """Byte offset of one stored tensor of block `kind` (a matrix kind, its `.scales`/`.zeros`, or a float32
        kind). `expert` indexes routed or shared experts; it must be None for per-layer tensors."""
        b = self.block(kind)
        self.check_index(b.tensor, layer, expert)
        index = layer * b.count + (0 if expert is None else expert)
        return b.offset + index * b.tensor_bytes

    def check_index(self, kind: str, layer: int, expert: int | None) -> None:
        """Raise FormatError unless (kind, layer, expert) names a tensor of this file."""
        count = self.count(kind)
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise FormatError(f"layer {layer!r} out of range; allowed: 0..{self.num_layers - 1}")
        if not self.is_matrix(kind):
            if expert is not None:
                raise FormatError(f"{kind} tensors have no expert index (got expert={expert!r})")
        elif not isinstance(expert, (int, np.integer)) or isinstance(expert, bool) or not 0 <= expert < count:
            raise FormatError(f"expert {expert!r} out of range for {kind}; allowed: 0..{count - 1}")

    @property
    def data_size(self) -> int:
        """Bytes after the 64-byte header (layer map, padding and blocks)."""
        return self.file_size - HEADER_SIZE

    @property
    def file_size(self) -> int:
        last = self.blocks()[-1]
        return last.offset + last.nbytes

    # ---- v1 equivalence ---------------------------------------------------------------------------------------
    def v1_gaps(self) -> list[str]:
        """What a v1 file (and so today's CUDA kernels) cannot hold, as short phrases; [] = v1-expressible."""
        gaps = []
        if self.quant != QUANT_FLOAT:
            group = "per row" if self.group_size == 0 else f"group size {self.group_size}"
            gaps.append(f"{self.quant_name} weights ({group}{', zero points' if self.zero_points else ''})")
        if self.routing == ROUTING_SIGMOID_TOPK:
            gaps.append("sigmoid routing")
        if self.n_group > 1:
            gaps.append(f"group-limited routing (n_group {self.n_group}, topk_group {self.topk_group})")
        if self.router_bias:
            gaps.append("a router bias")
        if self.routed_scaling_factor != 1.0:
            gaps.append(f"routed_scaling_factor {self.routed_scaling_factor:g}")
        if self.num_shared_experts:
            gaps.append(f"shared experts ({self.num_shared_experts} × {self.shared_intermediate_size})")
        if self.expert_bias:
            gaps.append("expert biases")
        if self.activation != 0:
            gaps.append(f"the {ACTIVATION_NAMES[self.activation]} activation")
        return gaps

    def as_v1(self) -> Header:
        """The v1 header of the same model (routing softmax_topk with norm_topk = topk_softmax).

        Raises:
            FormatError: the file needs v2 (the message lists what).
        """
        gaps = self.v1_gaps()
        if gaps:
            raise FormatError(f"this v2 file needs features v1 does not have: {', '.join(gaps)}")
        routing = ROUTING_TOPK_SOFTMAX if self.routing == ROUTING_SOFTMAX_TOPK and self.norm_topk else self.routing
        return Header(
            self.num_layers, self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
            dtype=self.dtype, routing=routing, composition=self.composition,
        )

    def to_dict(self) -> dict:
        """JSON-friendly fields, with names for the codes."""
        d = {
            "magic": MAGIC.decode(),
            "version": f"0x{self.version:04x}",
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "dtype": DTYPE_NAMES[self.dtype],
            "routing": ROUTING_V2_NAMES[self.routing],
            "composition": COMPOSITION_NAMES[self.composition],
            "quant": self.quant_name,
            "group_size": self.group_size,
            "zero_points": bool(self.zero_points),
            "norm_topk": bool(self.norm_topk),
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "group_score": GROUP_SCORE_NAMES[self.group_score],
            "router_bias": bool(self.router_bias),
            "correction_bias": bool(self.correction_bias),
            "num_shared_experts": self.num_shared_experts,
            "shared_intermediate_size": self.shared_intermediate_size,
            "shared_gate": bool(self.shared_gate),
            "expert_bias": bool(self.expert_bias),
            "activation": ACTIVATION_NAMES[self.activation],
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
            "num_model_layers": self.num_model_layers,
            "layer_map": list(self.layer_map),
        }
        return d

