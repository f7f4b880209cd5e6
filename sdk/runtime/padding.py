"""Padded tokens: the valid-token counts a backend takes with each fixed-shape input.

A bundle runs at a fixed (batch, tokens); a shorter input is padded. `valid_tokens[b]` is the number of valid (first)
tokens of sequence b. On the GPU the counts travel inside the captured graph (`catalog.io_buffers`
"valid_tokens"): padded tokens select no expert and cost no expert weight traffic; their output rows are their
input rows (residual composition) or zeros, on every backend (docs/kernels.md, "Padded tokens").
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def check_valid_tokens(valid_tokens, batch: int, tokens: int) -> np.ndarray:
    """valid_tokens (None: every token) → (batch,) int32 counts in 0..tokens.

    Raises:
        InputError: another shape, non-integers, or a count outside 0..tokens.
    """
    if valid_tokens is None:
        return np.full(batch, tokens, dtype=np.int32)
    arr = np.asarray(valid_tokens)
    if arr.shape != (batch,) or arr.dtype.kind not in "iu":
        raise InputError(f"valid_tokens {arr.dtype} {arr.shape}; expected ({batch},) integers, one per sequence")
    if ((arr < 0) | (arr > tokens)).any():
        raise InputError(f"valid_tokens {arr.tolist()}; allowed: 0..{tokens} per sequence")
    return arr.astype(np.int32)
