"""One compiled shape of a Runtime: its backend, and the host buffers a call at that shape is padded into.

A bundle is compiled for one or more fixed shapes (batch, tokens) (docs/build.md, "Several shapes"). A call runs at
the first of the shapes (smallest first) whose batch and tokens are both at least the input's; the input is padded
with zeros into that shape's staging buffer and the unpadded corner of its result is returned. Tokens do not
interact in a MoE layer (routing is per token), so padding never changes the valid positions' values.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def check_finite(x3: np.ndarray, flags: np.ndarray | None = None, lengths=None) -> None:
    """Raise InputError naming the first valid (batch, token) of x3 (batch, tokens, hidden) that holds a NaN or
    Inf, and how many do. flags: bool scratch of x3's shape (no allocation), or None; lengths: (batch,) valid
    tokens per sequence (positions past them are not checked), or None: all."""
    finite = np.isfinite(x3, out=flags) if flags is not None else np.isfinite(x3)
    if not finite.all():
        rows = ~finite.all(axis=-1)  # (batch, tokens)
        if lengths is not None:
            rows &= np.arange(x3.shape[1])[None, :] < np.asarray(lengths)[:, None]
        if not rows.any():
            return
        bad = np.argwhere(rows)
        b, t = (int(v) for v in bad[0])
        raise InputError(
            f"input has non-finite values (NaN or Inf) at {len(bad)} valid position{'s' if len(bad) != 1 else ''}, "
            f"first at (batch {b}, token {t}); all values at valid positions must be finite"
        )


class ShapeRun:
    """One compiled shape of a Runtime: its backend and the host buffers a call at that shape pads into (allocated
    once, so a call allocates no activation-sized memory).

    Attributes:
        shape: (batch, tokens). backend: the backend built for it.
        staging, result: float32 (batch, tokens, hidden); finite: bool, the same shape; valid_mask: bool
            (batch, tokens); written: the (batch, tokens) corner of staging the last call wrote.
    """

    def __init__(self, shape: tuple[int, int], backend, hidden: int):
        self.shape = shape
        self.backend = backend
        self.staging = np.zeros(shape + (hidden,), dtype=np.float32)
        self.result = np.zeros(shape + (hidden,), dtype=np.float32)
        self.finite = np.zeros(shape + (hidden,), dtype=bool)
        self.valid_mask = np.zeros(shape, dtype=bool)
        self.written = (0, 0)
        self._corner = None  # (2, batch · tokens · hidden) float32, made on the first call that needs it

    def run_corner(self, batch: int, tokens: int, start: int, stop: int) -> None:
        """Layers start..stop-1 of a backend that takes any number of rows (the CPU backend) on the (batch, tokens)
        corner of the staged input only, into the same corner of `result` (the rest of `result` is not written).

        Without expert capacity tokens do not interact, so the padding rows' outputs are never needed: a call of a
        few tokens on a larger shape costs its own tokens (the demo bundle's 1 x 16 shape at one token: 4.5-7.1 ->
        1.1-1.3 ms a call, median; docs/runtime.md). A corner narrower than the shape's tokens is copied into
        contiguous buffers (made once) for the call."""
        if tokens == self.shape[1]:
            self.backend.run_layers(self.staging[:batch], self.result[:batch], start, stop)
            return
        if self._corner is None:
            self._corner = np.zeros((2, self.staging.size), dtype=np.float32)
        size = batch * tokens * self.staging.shape[2]
        xs = self._corner[0, :size].reshape(batch, tokens, -1)
        ys = self._corner[1, :size].reshape(batch, tokens, -1)
        np.copyto(xs, self.staging[:batch, :tokens])
        self.backend.run_layers(xs, ys, start, stop)
        np.copyto(self.result[:batch, :tokens], ys)

    def pad(self, x3: np.ndarray, lengths: list[int] | None) -> np.ndarray:
        """Copy x3 (batch, tokens, hidden) into the staging buffer (float32), zeros elsewhere; check the copied
        values; return the staging buffer.

        Only the corner the previous call at this shape wrote is cleared, and only the corner this call writes is
        checked, so the cost follows the input's size, not the shape's.

        Raises:
            InputError: NaN/Inf at a valid position, naming the first.
        """
        staging = self.staging
        last_batch, last_tokens = self.written
        staging[:last_batch, :last_tokens] = 0.0
        batch, tokens, _ = x3.shape
        self.written = (batch, tokens)
        if lengths is None:
            staging[:batch, :tokens] = x3
        else:
            for b, n in enumerate(lengths):
                staging[b, :n] = x3[b, :n]
        corner = staging[:batch, :tokens]
        check_finite(corner, self.finite[:batch, :tokens])
        return staging

    def valid_counts(self, x3, lengths) -> list[int]:
        """(the shape's batch,) valid tokens per sequence of the padded input: the input's tokens (or its lengths),
        0 for the padding sequences."""
        batch, tokens, _ = x3.shape
        counts = [tokens] * batch if lengths is None else list(lengths)
        return counts + [0] * (self.shape[0] - batch)

    def valid_rows(self, x3, lengths) -> np.ndarray:
        """(the shape's batch * tokens,) bool: the rows of the padded input that are real tokens."""
        mask = self.valid_mask
        mask[:] = False
        batch, tokens, _ = x3.shape
        for b in range(batch):
            mask[b, : tokens if lengths is None else lengths[b]] = True
        return mask.reshape(-1)

