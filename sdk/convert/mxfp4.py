"""gpt-oss MXFP4 expert weights: blocks of 32 FP4 (E2M1) values sharing one E8M0 exponent.

Layout (the gpt-oss checkpoints; transformers `integrations/mxfp4.py`, `_convert_moe_packed_tensors`):
`<proj>_blocks` uint8 (experts, rows, cols/32, 16) — byte j of a block holds column 2j in its low nibble and
column 2j+1 in its high nibble; `<proj>_scales` uint8 (experts, rows, cols/32) — the block's exponent + 127.
A nibble n is the FP4 value FP4_VALUES[n] (sign bit 3); the weight is FP4_VALUES[n] · 2^(scale − 127).
transformers dequantizes each expert to (rows, cols) and then transposes the stack for its in-memory
`gate_up_proj` (E, H, 2I); a per-expert (rows, cols) matrix is already the nn.Linear orientation used here.

Exactness: every FP4 value has at most two significant bits, so value · 2^e is exact in float32 for every scale
byte 0..254 (the smallest, 0.5 · 2^-127, is a float32 subnormal). The same weights are exactly int8 codes
2·FP4 ∈ {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} times a per-32-column scale 2^(scale − 128): the int8 group-32 storage of
.colibri v2 holds them without re-quantizing (fp16 scales when every exponent is in float16's range, else
float32 scales). Only the sign of a negative zero (nibble 8) is not kept by the int8 code.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConvertError

# E2M1 code → value (OCP Microscaling spec; transformers FP4_VALUES, same order).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
FP4_TIMES_2 = (FP4_VALUES * 2).astype(np.int8)  # exact integers -12..12
BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """uint8 (rows, groups, 16) → uint8 codes (rows, groups·32): low nibble first, as transformers."""
    rows, groups, half = blocks.shape
    out = np.empty((rows, groups, 2 * half), np.uint8)
    out[..., 0::2] = blocks & 0x0F
    out[..., 1::2] = blocks >> 4
    return out.reshape(rows, groups * 2 * half)


def _check(blocks: np.ndarray, scales: np.ndarray, label: str) -> None:
    if blocks.ndim != 3 or blocks.shape[2] != BLOCK // 2 or scales.shape != blocks.shape[:2]:
        raise ConvertError(
            f"{label}: MXFP4 blocks {blocks.shape} / scales {scales.shape}; expected (rows, groups, 16) / (rows, groups)"
        )
    if scales.size and int(scales.max()) == E8M0_NAN:
        raise ConvertError(f"{label}: MXFP4 scale byte 255 (NaN in E8M0); allowed: 0..254")


def dequantize(blocks: np.ndarray, scales: np.ndarray, label: str = "mxfp4") -> np.ndarray:
    """float32 (rows, groups·32) = FP4_VALUES[nibble] · 2^(scale − 127), exact.

    Args:
        blocks: uint8 (rows, groups, 16); scales: uint8 (rows, groups).

    Raises:
        ConvertError: wrong shapes, or a scale byte of 255 (NaN).
    """
    _check(blocks, scales, label)
    values = FP4_VALUES[_nibbles(blocks)]
    exponent = np.repeat(scales.astype(np.int32) - E8M0_BIAS, BLOCK, axis=1)
    return np.ldexp(values, exponent).astype(np.float32, copy=False)


def to_int8(blocks: np.ndarray, scales: np.ndarray, label: str = "mxfp4") -> tuple[np.ndarray, np.ndarray]:
    """The same weights as int8 codes (rows, cols) = 2·FP4 and float32 scales (rows, groups) = 2^(scale − 128),
    so that codes · scales == dequantize(blocks, scales) exactly (up to the sign of zero).

    Raises:
        ConvertError: as dequantize.
    """
    _check(blocks, scales, label)
    codes = FP4_TIMES_2[_nibbles(blocks)]
    group_scales = np.ldexp(np.float32(1.0), scales.astype(np.int32) - E8M0_BIAS - 1).astype(np.float32)
    return codes, group_scales
