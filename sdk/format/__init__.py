"""The .colibri v1 weight format: header, mmap reader, streaming writer. Spec: docs/format.md."""

from .constants import (
    COMPOSITION_RESIDUAL,
    COMPOSITION_SEQUENTIAL,
    HEADER_SIZE,
    KINDS,
    MAGIC,
    ROUTING_SOFTMAX_TOPK,
    ROUTING_TOPK_SOFTMAX,
    VERSION,
)
from .header import Header
from .reader import ColibriFile
from .writer import ColibriWriter, write_model

__all__ = [
    "COMPOSITION_RESIDUAL",
    "COMPOSITION_SEQUENTIAL",
    "HEADER_SIZE",
    "KINDS",
    "MAGIC",
    "ROUTING_SOFTMAX_TOPK",
    "ROUTING_TOPK_SOFTMAX",
    "VERSION",
    "ColibriFile",
    "ColibriWriter",
    "Header",
    "write_model",
]
