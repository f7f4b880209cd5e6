"""The .colibri weight format (v1 0x0100, v2 0x0200): header, mmap reader, streaming writer, quantized matrices.
Spec: docs/format.md."""

from .constants import (
    ACTIVATION_CLAMPED_SWIGLU,
    ACTIVATION_SWIGLU,
    COMPOSITION_RESIDUAL,
    COMPOSITION_SEQUENTIAL,
    GROUP_SCORE_MAX,
    GROUP_SCORE_NONE,
    GROUP_SCORE_TOP2_SUM,
    HEADER_SIZE,
    KINDS,
    MAGIC,
    QUANT_FLOAT,
    QUANT_INT4,
    QUANT_INT8,
    ROUTING_SIGMOID_TOPK,
    ROUTING_SOFTMAX_TOPK,
    ROUTING_TOPK_SOFTMAX,
    VERSION,
    VERSION_1,
    VERSION_2,
)
from .header import Header
from .header_v2 import Block, HeaderV2
from .quant import QuantizedTensor, dequantize, pack_int4, quantize_rtn, unpack_int4
from .reader import ColibriFile
from .writer import ColibriWriter, write_arrays, write_model

__all__ = [
    "ACTIVATION_CLAMPED_SWIGLU",
    "ACTIVATION_SWIGLU",
    "COMPOSITION_RESIDUAL",
    "COMPOSITION_SEQUENTIAL",
    "GROUP_SCORE_MAX",
    "GROUP_SCORE_NONE",
    "GROUP_SCORE_TOP2_SUM",
    "HEADER_SIZE",
    "KINDS",
    "MAGIC",
    "QUANT_FLOAT",
    "QUANT_INT4",
    "QUANT_INT8",
    "ROUTING_SIGMOID_TOPK",
    "ROUTING_SOFTMAX_TOPK",
    "ROUTING_TOPK_SOFTMAX",
    "VERSION",
    "VERSION_1",
    "VERSION_2",
    "Block",
    "ColibriFile",
    "ColibriWriter",
    "Header",
    "HeaderV2",
    "QuantizedTensor",
    "dequantize",
    "pack_int4",
    "quantize_rtn",
    "unpack_int4",
    "write_arrays",
    "write_model",
]
