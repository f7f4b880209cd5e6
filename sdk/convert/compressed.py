"""compressed-tensors "pack-quantized" checkpoints (W4A16 / W8A16, the format vLLM serves): scheme and unpacking.

A quantized Linear `<name>` is stored as (compressed-tensors `PackedQuantizationCompressor`, `pack_to_int32`):
- `<name>.weight_packed` int32 (rows, ceil(cols·bits/32)): 32/bits codes per word, element i of a row at bit
  offset bits·(i mod 32/bits) of word i·bits/32, each code stored as q + 2^(bits−1) (offset binary). On a
  little-endian host the bytes of a row of 4-bit codes are therefore column 2j in the low nibble and 2j+1 in the
  high nibble of byte j — exactly the int4 row of .colibri v2, so the bytes are copied, not re-packed;
- `<name>.weight_scale` (rows, groups) in the checkpoint's float dtype (bf16, fp16 or fp32);
- `<name>.weight_zero_point` int32 (ceil(rows·bits/32), groups), packed the same way along the rows (asymmetric
  schemes only);
- `<name>.weight_shape` int64 (2,) = (rows, cols).
Dequantization (compressed-tensors `dequantize`): w = (q − zero) · scale, computed in the scale's dtype. Here it
is computed in float32, where it is exact (|q − zero| ≤ 255 times a scale of ≤ 24 significant bits); rounding that
to the scale's dtype gives the library's own result bit for bit.

The unpacking is NumPy (no torch at conversion time); tests check it bit for bit against the library's
`unpack_from_int32` and `dequantize`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ConvertError

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
BITS = (4, 8)
STRATEGIES = ("group", "channel")


@dataclasses.dataclass(frozen=True)
class PackScheme:
    """The weight scheme of a pack-quantized checkpoint. group_size 0: one group per row (strategy channel)."""

    bits: int
    symmetric: bool
    group_size: int


def _refuse(family: str, what: str, hint: str) -> ConvertError:
    return ConvertError(f"{family}: config.json quantization_config {what}; {hint}")


DEQUANT_HINT = "allowed: compressed-tensors pack-quantized int4/int8 weight-only schemes (W4A16, W8A16); " \
    "or convert a bf16/fp16 copy of the model"


def scheme(config: dict, family: str) -> PackScheme | None:
    """The pack-quantized weight scheme of config.json, or None for an unquantized checkpoint.

    Raises:
        ConvertError: another quant_method or format, activation quantization, a non-int type, bits other than 4
            or 8, a strategy other than group/channel, activation-ordered groups, or groups with different
            schemes — each naming the value and what converts.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise _refuse(family, f"= {quant!r}", "expected an object")
    method = quant.get("quant_method")
    if method == "mxfp4" and family == "gpt_oss":
        return None  # the MXFP4 expert blocks are read by name (layout.py, mxfp4.py)
    if method != QUANT_METHOD:
        raise _refuse(
            family, f"quant_method = {method!r} is not imported",
            f"allowed: {QUANT_METHOD!r} (format {PACK_FORMAT!r}), 'mxfp4' (gpt_oss); or convert a bf16/fp16 copy",
        )
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(family, "has no config_groups", DEQUANT_HINT)
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(family, f"config_groups.{name} = {group!r}", "expected an object")
        fmt = group.get("format") or quant.get("format")
        if fmt != PACK_FORMAT:
            raise _refuse(family, f"format = {fmt!r} is not imported", f"allowed: {PACK_FORMAT!r}; " + DEQUANT_HINT)
        if group.get("input_activations"):
            raise _refuse(
                family, f"config_groups.{name} quantizes activations",
                "allowed: weight-only schemes (input_activations null); .colibri keeps activations in float",
            )
        w = group.get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if kind != "int" or bits not in BITS:
            raise _refuse(family, f"config_groups.{name}.weights type {kind!r} num_bits {bits!r}",
                          "allowed: type 'int' with num_bits 4 or 8")
        if strategy not in STRATEGIES:
            raise _refuse(family, f"config_groups.{name}.weights.strategy = {strategy!r}",
                          f"allowed: {', '.join(STRATEGIES)}")
        if w.get("actorder") not in (None, "weight", False):
            raise _refuse(family, f"config_groups.{name}.weights.actorder = {w.get('actorder')!r} (permuted groups)",
                          "allowed: null or 'weight' (groups in column order)")
        if w.get("dynamic"):
            raise _refuse(family, f"config_groups.{name}.weights.dynamic = true", "allowed: false")
        size = 0 if strategy == "channel" else w.get("group_size")
        if not isinstance(size, int) or size < 0:
            raise _refuse(family, f"config_groups.{name}.weights.group_size = {size!r}", "allowed: a positive integer")
        schemes.add(PackScheme(bits, bool(w.get("symmetric", True)), size))
    if len(schemes) > 1:
        raise _refuse(family, f"mixes weight schemes {sorted(map(str, schemes))}",
                      "allowed: one scheme for every quantized Linear")
    return schemes.pop()


def unpack_codes(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """int32 (rows, words) → int8 codes (rows, cols), the inverse of compressed-tensors `pack_to_int32` (4 or 8
    bits: codes never straddle a byte)."""
    raw = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(packed.shape[0], -1)
    if bits == 8:
        return (raw[:, :cols].astype(np.int16) - 128).astype(np.int8)
    out = np.empty((raw.shape[0], raw.shape[1] * 2), np.int8)
    out[:, 0::2] = (raw & 0x0F).astype(np.int8) - 8
    out[:, 1::2] = (raw >> 4).astype(np.int8) - 8
    return out[:, :cols]


def int4_rows(packed: np.ndarray, cols: int) -> np.ndarray:
    """The uint8 (rows, ceil(cols/2)) int4 rows of .colibri v2, copied from the packed words (same nibble order);
    for odd `cols` the padding nibble is cleared."""
    raw = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(packed.shape[0], -1)
    rows = raw[:, : (cols + 1) // 2].copy()
    if cols % 2:
        rows[:, -1] &= 0x0F
    return rows


def unpack_zero_points(packed: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """int32 (ceil(rows·bits/32), groups), packed along dim 0 → int8 zero points (rows, groups)."""
    return np.ascontiguousarray(unpack_codes(np.ascontiguousarray(packed.T), bits, rows).T)


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group_size: int) -> np.ndarray:
    """float32 (rows, cols) = (q − zero) · scale, exact. scales/zeros (rows, groups); group_size 0 = per row."""
    rows, cols = codes.shape
    size = cols if group_size == 0 else group_size
    index = np.arange(cols) // size
    q = codes.astype(np.float32)
    if zeros is not None:
        q -= zeros.astype(np.float32)[:, index]
    return q * scales.astype(np.float32)[:, index]
