"""The interface every conversion source gives the converter (`source.HFModel`, `gguf_model.GGUFModel`): a
ModelSpec, a Layout (kind, file layer, index) → Source, and readers for a source as exact float32 or, for
pre-quantized sources, as their codes and scales (tensors.Codes).
"""

from __future__ import annotations

import abc
from pathlib import Path

import numpy as np

from . import tensors
from .layout import Layout, Source

MATRIX_KINDS = ("gate_proj", "up_proj", "down_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj")


class Model(abc.ABC):
    """Interface of a conversion source (see HFModel, gguf_model.GGUFModel)."""

    spec = None
    layout: Layout

    @abc.abstractmethod
    def read_float(self, source: Source) -> np.ndarray:
        """The source tensor as exact float32 (rows, cols), dequantized if it is stored quantized."""

    @abc.abstractmethod
    def read_codes(self, source: Source) -> tensors.Codes:
        """A pre-quantized source's codes and scales as stored (tensors.Codes), for copying without re-quantizing."""

    def is_quantized(self, source: Source) -> bool:
        return source.quant is not None

    def quantized_sources(self) -> list[Source]:
        """The quantized sources of expert matrices, in layout order."""
        return [s for (kind, _, _), s in self.layout.sources.items() if kind in MATRIX_KINDS and self.is_quantized(s)]

    @abc.abstractmethod
    def native_storage(self) -> tuple[int, int, bool] | None:
        """(quant code, group size, zero points) of a pre-quantized model's own layout, or None for floats."""

    @abc.abstractmethod
    def scales_fit_fp16(self) -> bool:
        """True when every pre-quantized scale is exactly an fp16 value (else fp32 scales are written)."""

    @abc.abstractmethod
    def source_dtypes(self) -> tuple[str, ...]:
        """The source's dtypes, for the report (e.g. ("bf16",) or ("int4", "bf16"))."""

    @abc.abstractmethod
    def files(self) -> set[Path]:
        """The files the conversion reads (an output path among them is refused)."""

    def close(self) -> None:
        pass
