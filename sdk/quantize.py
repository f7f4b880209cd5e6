"""Round-to-nearest weight quantization for .colibri v2 files, in constant memory, with the error per tensor kind.

The converter (`colibri-sdk convert --dtype int8|int4 [--group-size N]`) and `quantize_file` call this one tensor at
a time: peak memory is a few copies of the largest tensor, whatever the model's size. The quantizer itself is
`colibri_sdk.format.quant.quantize_rtn` (symmetric, one fp16 scale per group along the reduction dimension,
docs/format.md "v2"); this module adds the bookkeeping:

    q = Quantizer(header)                      # a HeaderV2 with quant int8/int4
    t = q("gate_proj", w)                      # QuantizedTensor; the error of w is recorded under "gate_proj"
    print(q.report.format())                   # per kind: tensors, relative Frobenius error, max |error|
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from .errors import FormatError
from .format import ColibriFile, ColibriWriter, Header, HeaderV2, QuantizedTensor, quantize_rtn
from .format.constants import GROUP_SIZES, QUANT_CODES, QUANT_FLOAT, QUANT_NAMES
from .format.writer import tensor_order


@dataclasses.dataclass
class KindError:
    """Accumulated error of one tensor kind: sums over its tensors of |w|², |w − ŵ|², the largest |w − ŵ| and the
    largest relative error of one tensor (Frobenius)."""

    tensors: int = 0
    sum_sq: float = 0.0
    err_sq: float = 0.0
    max_abs: float = 0.0
    worst_rel: float = 0.0

    @property
    def relative(self) -> float:
        """‖W − Ŵ‖_F / ‖W‖_F over every tensor of the kind (0 for all-zero weights)."""
        return float(np.sqrt(self.err_sq / self.sum_sq)) if self.sum_sq > 0 else 0.0


@dataclasses.dataclass
class QuantReport:
    """Quantization error per tensor kind (gate_proj, up_proj, down_proj, shared_*)."""

    kinds: dict[str, KindError] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, weight: np.ndarray, restored: np.ndarray) -> None:
        w = np.asarray(weight, dtype=np.float64)
        d = w - restored
        s, e = float(np.sum(w * w)), float(np.sum(d * d))
        k = self.kinds.setdefault(kind, KindError())
        k.tensors += 1
        k.sum_sq += s
        k.err_sq += e
        k.max_abs = max(k.max_abs, float(np.abs(d).max()) if d.size else 0.0)
        k.worst_rel = max(k.worst_rel, float(np.sqrt(e / s)) if s > 0 else 0.0)

    def to_dict(self) -> dict:
        return {
            kind: {"tensors": k.tensors, "relative_error": k.relative, "worst_tensor_relative_error": k.worst_rel,
                   "max_abs_error": k.max_abs}
            for kind, k in self.kinds.items()
        }

    def format(self) -> str:
        """One line per kind: `gate_proj  96 tensors  rel err 1.23e-02 (worst 1.50e-02)  max |err| 3.1e-03`."""
        lines = []
        for kind, k in self.kinds.items():
            lines.append(
                f"{kind:<18} {k.tensors:>6} tensors  rel err {k.relative:.2e} (worst tensor {k.worst_rel:.2e})  "
                f"max |err| {k.max_abs:.2e}"
            )
        return "\n".join(lines)


class Quantizer:
    """Quantizes expert matrices for one v2 header and records the error per kind.

    Args:
        header: a HeaderV2 with quant 1 (int8) or 2 (int4); its group_size and dtype (the scale dtype) are used.

    Raises:
        FormatError: a float header.
    """

    def __init__(self, header: HeaderV2):
        if not isinstance(header, HeaderV2) or header.quant == QUANT_FLOAT:
            raise FormatError("Quantizer needs a HeaderV2 with quant int8 or int4")
        self.header = header
        self.report = QuantReport()

    def __call__(self, kind: str, weight: np.ndarray) -> QuantizedTensor:
        """Quantize one (rows, cols) matrix of `kind` (routed or shared gate/up/down).

        Raises:
            FormatError: non-finite weights, or a scale beyond float16 (then quantize with float32 scales).
        """
        h = self.header
        t = quantize_rtn(weight, h.quant, h.group_size, h.np_dtype)
        self.report.add(kind, weight, t.dequantize())
        return t


# The group size when none is asked for (docs/convert.md, "Storage"): int8 per row, one scale per output row (W8A16
# as TensorRT-LLM's and compressed-tensors' W8A16 presets store it: 8 bits leave little for groups to gain, 1.3 %
# relative error on the quant bench, and the smallest int8 file); int4 per group of 128 (GPTQ's / AWQ's / llm-
# compressor's W4A16 default: 4 bits need the finer scales).
DEFAULT_GROUP_SIZE = {"int8": 0, "int4": 128}


def group_text(group_size: int) -> str:
    """How summaries name a group size: "per row" (0) or "g128"."""
    return "per row" if group_size == 0 else f"g{group_size}"


def quantized_header(header: Header, storage: str, group_size: int | None = None,
                     scale_dtype: str = "fp16") -> HeaderV2:
    """The v2 header of `header`'s model with int8/int4 experts.

    Args:
        header: a v1 Header or a float HeaderV2.
        storage: "int8" | "int4".
        group_size: 0 (per row, int8 only), 32, 64, 128; None: DEFAULT_GROUP_SIZE[storage] (int8 per row, int4 128).
        scale_dtype: "fp16" | "fp32".

    Raises:
        FormatError: an unknown storage, group size or scale dtype, or an already quantized header.
    """
    if storage not in ("int8", "int4"):
        raise FormatError(f"storage {storage!r}; allowed: int8, int4")
    quant = QUANT_CODES[storage]
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE[storage]
    if group_size not in GROUP_SIZES[quant]:
        raise FormatError(f"group size {group_size!r} for {storage}; allowed: {', '.join(map(str, GROUP_SIZES[quant]))}")
    if scale_dtype not in ("fp16", "fp32"):
        raise FormatError(f"scale dtype {scale_dtype!r}; allowed: fp16, fp32")
    dtype = 1 if scale_dtype == "fp16" else 0
    if isinstance(header, HeaderV2):
        if header.quant != QUANT_FLOAT:
            raise FormatError(f"the weights are already {QUANT_NAMES[header.quant]}; re-quantizing is refused")
        return dataclasses.replace(header, quant=quant, group_size=group_size, dtype=dtype)
    return HeaderV2(
        header.num_layers, header.num_experts, header.top_k, header.hidden_size, header.intermediate_size,
        dtype=dtype, routing=header.routing, composition=header.composition, quant=quant, group_size=group_size,
    )


def quantize_file(
    source: str | os.PathLike, target: str | os.PathLike, storage: str, group_size: int | None = None,
    scale_dtype: str = "fp16",
) -> QuantReport:
    """Rewrite a float .colibri file (v1 or v2) with int8/int4 experts, tensor by tensor (constant memory).

    Returns:
        The error per tensor kind.

    Raises:
        FormatError: see quantized_header, ColibriFile, ColibriWriter.
    """
    with ColibriFile(source) as src:
        header = quantized_header(src.header, storage, group_size, scale_dtype)
        q = Quantizer(header)
        v1 = not isinstance(src.header, HeaderV2)
        with ColibriWriter(Path(target), header) as w:
            for kind, layer, index in tensor_order(header):
                if v1:
                    array = src.weight(kind, layer, index)
                else:
                    array = src.weight(kind, layer, index) if header.is_matrix(kind) else src.tensor(kind, layer)
                w.write(kind, layer, index, q(kind, array) if header.is_matrix(kind) else array)
    return q.report
