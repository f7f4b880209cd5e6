"""Quantized expert matrices of a v2 file: the code/scale/zero-point triple, int4 nibble packing, and the exact
dequantization that is the oracle for every backend (docs/format.md, v2 "Matrix storage", "Dequantization").

    w[r, c] = float32(scale[r, c // group_size]) * float32(q[r, c] - zero[r, c // group_size])

int8 codes are two's complement (-128..127); an int4 code q (-8..7) is stored as the nibble q + 8, column 2j in
the low nibble of byte j of its row and column 2j+1 in the high nibble (GGUF Q4_0's and compressed-tensors'
offset-binary convention; the column order is this format's own).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import FormatError
from .constants import INT4_OFFSET, QUANT_INT4, QUANT_INT8, QUANT_NAMES, QUANT_RANGE


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """One quantized matrix (rows, cols).

    Attributes:
        codes: int8 (rows, cols) codes in the storage's range (int8 -128..127, int4 -8..7); or, as read from a file
            for int4, the packed uint8 (rows, ceil(cols/2)) nibbles (then `packed` is True).
        scales: (rows, groups) float16 or float32.
        zeros: (rows, groups) int8 zero points, or None (symmetric).
        cols: the number of columns (the reduction dimension).
        group_size: 0 (one group per row), 32, 64 or 128.
        quant: 1 int8, 2 int4 (format codes).
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    cols: int
    group_size: int
    quant: int
    packed: bool = False

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def unpacked_codes(self) -> np.ndarray:
        """int8 (rows, cols) codes."""
        return unpack_int4(self.codes, self.cols) if self.packed else np.asarray(self.codes, dtype=np.int8)

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 (rows, cols), exact (see module docstring); `rows` selects rows first."""
        return dequantize(self, rows)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int4 codes (rows, cols), values -8..7 → uint8 (rows, ceil(cols/2)): byte j = (q[2j]+8) | (q[2j+1]+8) << 4;
    an odd row's last high nibble is 0.

    Raises:
        FormatError: a code outside -8..7.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise FormatError(f"int4 codes of shape {codes.shape}; allowed: (rows, cols)")
    lo, hi = QUANT_RANGE[QUANT_INT4]
    if codes.size and (codes.min() < lo or codes.max() > hi):
        raise FormatError(f"int4 codes in {int(codes.min())}..{int(codes.max())}; allowed: {lo}..{hi}")
    rows, cols = codes.shape
    u = (codes.astype(np.int16) + INT4_OFFSET).astype(np.uint8)
    if cols % 2:  # the padding nibble is written as 0
        u = np.concatenate([u, np.zeros((rows, 1), np.uint8)], axis=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """uint8 (rows, ceil(cols/2)) → int8 codes (rows, cols), the inverse of pack_int4 (padding nibble dropped)."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.int8)
    out[:, 0::2] = (packed & 0x0F).astype(np.int8) - INT4_OFFSET
    out[:, 1::2] = (packed >> 4).astype(np.int8) - INT4_OFFSET
    return np.ascontiguousarray(out[:, :cols])


# Byte → its two int4 codes as two int8 in one little-endian uint16 (low nibble's code first): one vectorised
# gather (np.take) turns packed rows into int8 codes, measured faster than nibble shifts or a float table.
_BYTE = np.arange(256)
_INT4_PAIRS = (((_BYTE & 0x0F) - INT4_OFFSET) & 0xFF | ((((_BYTE >> 4) - INT4_OFFSET) & 0xFF) << 8)).astype("<u2")


def dequantize(t: QuantizedTensor, rows: np.ndarray | None = None) -> np.ndarray:
    """Exact float32 values of a quantized matrix.

    Args:
        t: the tensor (packed or not).
        rows: optional int array of row indices; only those rows are dequantized (the CPU backend's selected
            experts' rows).

    Returns:
        float32 (len(rows) or rows, cols), a new array.
    """
    codes, scales, zeros = t.codes, t.scales, t.zeros
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
        zeros = None if zeros is None else zeros[rows]
    n, cols = codes.shape[0], t.cols
    if t.packed:
        pairs = np.take(_INT4_PAIRS, codes)  # (n, ceil(cols/2)) uint16
        q = pairs.view(np.int8).reshape(n, -1)[:, :cols].astype(np.float32)  # exact integers
    else:
        q = codes.astype(np.float32)
    g = scales.shape[1]
    size = cols if t.group_size == 0 else t.group_size
    s = scales.astype(np.float32)
    if zeros is not None:
        z = zeros.astype(np.float32)
    if g * size == cols:
        q = q.reshape(n, g, size)
        if zeros is not None:
            q -= z[:, :, None]
        q *= s[:, :, None]
        return q.reshape(n, cols)
    # The last group is partial: expand the per-group values to columns.
    index = np.arange(cols) // size
    if zeros is not None:
        q -= z[:, index]
    q *= s[:, index]
    return q


def check_codes(t: QuantizedTensor, label: str) -> None:
    """Raise FormatError unless the codes, scales and zero points of `t` fit its storage (unpacked codes)."""
    lo, hi = QUANT_RANGE[t.quant]
    codes = np.asarray(t.codes)
    if codes.dtype.kind not in "iu":
        raise FormatError(f"{label}: codes of dtype {codes.dtype}; allowed: an integer dtype")
    if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise FormatError(
            f"{label}: {QUANT_NAMES[t.quant]} codes in {int(codes.min())}..{int(codes.max())}; allowed: {lo}..{hi}"
        )
    if t.zeros is not None:
        zeros = np.asarray(t.zeros)
        if zeros.dtype.kind not in "iu":
            raise FormatError(f"{label}: zero points of dtype {zeros.dtype}; allowed: an integer dtype")
        if zeros.size and (int(zeros.min()) < lo or int(zeros.max()) > hi):
            raise FormatError(
                f"{label}: zero points in {int(zeros.min())}..{int(zeros.max())}; allowed: {lo}..{hi}"
            )




def quantize_rtn(
    weight: np.ndarray, quant: int, group_size: int, scale_dtype: np.dtype | type = np.float16
) -> QuantizedTensor:
    """Symmetric round-to-nearest quantization of one matrix, group by group along its columns.

    Per group, with m the group's value of largest magnitude (the first on ties): int8 `scale = |m| / 127`; int4
    `scale = m / -8` (llama.cpp Q4_0's choice: m itself maps to the code -8, so the whole -8..7 range is used and the
    scale may be negative). The scale is rounded to `scale_dtype`, then `q = clip(rint(w / scale), lo, hi)` with the
    stored scale (ties to even; q = 0 where the scale is 0). The last group is partial when group_size does not
    divide cols (docs/format.md, "Groups"). Works on one tensor at a time: memory is a few copies of `weight`,
    whatever the model's size.

    Args:
        weight: (rows, cols) finite floats; cols is the reduction dimension.
        quant: 1 int8, 2 int4.
        group_size: 0 (one group per row, int8 only), 32, 64, 128.
        scale_dtype: float16 (default) or float32.

    Returns:
        A QuantizedTensor with unpacked int8 codes and scales of `scale_dtype`.

    Raises:
        FormatError: non-finite weights, a bad shape, or a scale beyond float16's range (use float32 scales).
    """
    w = np.asarray(weight)
    if w.ndim != 2 or w.dtype.kind != "f":
        raise FormatError(f"weight of shape {w.shape}, dtype {w.dtype}; allowed: a 2-D float array (rows, cols)")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        raise FormatError(f"weight has {int((~np.isfinite(w)).sum())} non-finite values (NaN or Inf)")
    lo, hi = QUANT_RANGE[quant]
    rows, cols = w.shape
    size = cols if group_size == 0 else group_size
    g = -(-cols // size)
    pad = g * size - cols
    padded = np.pad(w, ((0, 0), (0, pad))) if pad else w
    grouped = padded.reshape(rows, g, size)
    where = np.abs(grouped).argmax(axis=2)
    m = np.take_along_axis(grouped, where[:, :, None], axis=2)[:, :, 0]
    amax = np.abs(m)
    scales = (m / np.float32(lo) if quant == QUANT_INT4 else amax / np.float32(hi)).astype(np.float32)
    dtype = np.dtype(scale_dtype)
    if dtype == np.float16:
        big = np.abs(scales) > 65504.0
        if big.any():
            raise FormatError(
                f"{int(big.sum())} group scales exceed float16 (max {float(np.abs(scales).max()):g}, |w| up to "
                f"{float(amax.max()):g}); allowed: scales <= 65504, or float32 scales (dtype float32)"
            )
    stored = scales.astype(dtype)
    s32 = stored.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(grouped / s32[:, :, None])
    q = np.where(s32[:, :, None] != 0, q, 0.0)
    codes = np.clip(q, lo, hi).astype(np.int8).reshape(rows, g * size)[:, :cols]
    return QuantizedTensor(np.ascontiguousarray(codes), stored, None, cols, group_size, quant)
