"""Reading one planned source (layout.Source) from a checkpoint: float tensors with their transform, and the
quantized sources (gpt-oss MXFP4, compressed-tensors pack-quantized) either dequantized exactly or as their codes
and scales, without re-quantizing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ConvertError
from . import compressed, mxfp4
from .checkpoint import Checkpoint
from .layout import Source

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class Codes:
    """A quantized matrix as imported: codes int8 (rows, cols) (or `int4_rows`, the packed uint8 rows of .colibri
    v2), scales float32 (rows, groups) holding the source's values exactly, zeros int8 (rows, groups) or None,
    group_size (0: per row), bits (4 or 8)."""

    codes: np.ndarray | None
    scales: np.ndarray
    zeros: np.ndarray | None
    group_size: int
    bits: int
    cols: int
    int4_rows: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        codes = self.codes
        if codes is None:
            codes = _unpack_rows(self.int4_rows, self.cols)
        return compressed.dequantize(codes, self.scales, self.zeros, self.group_size)


def _unpack_rows(rows: np.ndarray, cols: int) -> np.ndarray:
    out = np.empty((rows.shape[0], rows.shape[1] * 2), np.int8)
    out[:, 0::2] = (rows & 0x0F).astype(np.int8) - 8
    out[:, 1::2] = (rows >> 4).astype(np.int8) - 8
    return out[:, :cols]


def _transform(array: np.ndarray, transform: str | None) -> np.ndarray:
    if transform is None:
        return array
    if transform == "T":
        return array.T
    if transform == "first_rows":
        return array[: array.shape[0] // 2]
    if transform == "last_rows":
        return array[array.shape[0] // 2:]
    if transform == "even_rows":
        return array[0::2]
    if transform == "odd_rows":
        return array[1::2]
    if transform == "even_cols_T":
        return array[:, 0::2].T
    if transform == "odd_cols_T":
        return array[:, 1::2].T
    if transform == "even_cols":
        return array[:, 0::2]
    if transform == "odd_cols":
        return array[:, 1::2]
    if transform == "even":
        return array[0::2]
    if transform == "odd":
        return array[1::2]
    if transform == "flat":
        return array.reshape(-1)
    raise AssertionError(transform)


def read_float(checkpoint: Checkpoint, source: Source, scheme=None) -> np.ndarray:
    """The source as float32, exactly (quantized sources dequantized in float32; see mxfp4.py, compressed.py).

    Raises:
        ConvertError: see Checkpoint.read / read_raw, and the quantized readers.
    """
    if source.quant is None:
        array = checkpoint.read(source.name, source.index)
    else:
        array = read_codes(checkpoint, Source(source.name, source.index, None, source.quant, source.aux), scheme)
        array = array.dequantize()
    return np.ascontiguousarray(_transform(array, source.transform))


def read_codes(checkpoint: Checkpoint, source: Source, scheme=None) -> Codes:
    """A quantized source as its codes and scales (the transform applied to rows).

    Raises:
        ConvertError: a float source, a shape that does not match its companions, a NaN MXFP4 scale.
    """
    if source.quant == "mxfp4":
        blocks = checkpoint.read_raw(source.name, source.index)
        scales = checkpoint.read_raw(source.aux[0], source.index)
        codes, group_scales = mxfp4.to_int8(blocks, scales, source.label)
        codes, group_scales = _transform(codes, source.transform), _transform(group_scales, source.transform)
        return Codes(np.ascontiguousarray(codes), np.ascontiguousarray(group_scales), None, mxfp4.BLOCK, 8,
                     codes.shape[1])
    if source.quant == "pack_quantized":
        return _read_packed(checkpoint, source, scheme)
    raise ConvertError(f"tensor {source.label!r} is not quantized")


def _read_packed(checkpoint: Checkpoint, source: Source, scheme) -> Codes:
    if scheme is None:
        raise ConvertError(
            f"tensor {source.name!r} is pack-quantized, but config.json has no compressed-tensors quantization_config"
        )
    scale_name, zero_name, shape_name = source.aux
    if not scale_name:
        raise ConvertError(f"tensor {source.name!r} has no {source.name.removesuffix('_packed')}_scale")
    packed = checkpoint.read_raw(source.name, source.index, allowed=("I32",))
    if shape_name:
        shape = checkpoint.read_raw(shape_name, allowed=("I64", "I32")).reshape(-1)
        if shape.size != 2 or (shape < 1).any() or (shape > 1 << 20).any():
            raise ConvertError(f"tensor {shape_name!r} = {shape.tolist()[:4]}; expected (rows, cols), each 1..{1 << 20}")
        rows, cols = int(shape[0]), int(shape[1])
    else:
        rows, cols = packed.shape[0], packed.shape[1] * 32 // scheme.bits
    if packed.shape != (rows, -(-cols * scheme.bits // 32)):
        raise ConvertError(
            f"tensor {source.name!r} has shape {packed.shape}; expected ({rows}, {-(-cols * scheme.bits // 32)}) "
            f"for weight_shape ({rows}, {cols}) at {scheme.bits} bits"
        )
    scales = checkpoint.read(scale_name)
    groups = 1 if scheme.group_size == 0 else -(-cols // scheme.group_size)
    if scales.shape != (rows, groups):
        raise ConvertError(f"tensor {scale_name!r} has shape {scales.shape}; expected ({rows}, {groups})")
    zeros = None
    if not scheme.symmetric:
        if not zero_name:
            raise ConvertError(f"tensor {source.name!r}: asymmetric scheme but no weight_zero_point")
        zp = checkpoint.read_raw(zero_name, allowed=("I32",))
        zeros = compressed.unpack_zero_points(zp, scheme.bits, rows)
        if zeros.shape != (rows, groups):
            raise ConvertError(f"tensor {zero_name!r} unpacks to {zeros.shape}; expected ({rows}, {groups})")
    if scheme.bits == 4:
        return Codes(None, scales, zeros, scheme.group_size, 4, cols, compressed.int4_rows(packed, cols))
    return Codes(compressed.unpack_codes(packed, 8, cols), scales, zeros, scheme.group_size, 8, cols)


def fp16_exact(values: np.ndarray) -> bool:
    """True if every float32 value survives a round trip through float16 unchanged."""
    values = np.asarray(values, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))
