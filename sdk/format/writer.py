"""Stream tensors into a .colibri file in file order.

The writer is a small state machine: it knows the one tensor that must come next and refuses anything else, so a
file it finishes is complete and in order by construction. It writes to `<path>.partial` and renames into place on
`close()`, so an interrupted conversion never leaves a file that looks finished.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import FormatError
from .constants import FP16_MAX, KINDS
from .header import Header


def tensor_order(header: Header) -> Iterator[tuple[str, int, int | None]]:
    """(kind, layer, expert) of every tensor in file order (docs/format.md, "Data")."""
    for kind in KINDS:
        for layer in range(header.num_layers):
            if kind == "router":
                yield kind, layer, None
            else:
                for expert in range(header.num_experts):
                    yield kind, layer, expert


class ColibriWriter:
    """Write a .colibri file tensor by tensor.

    Usage::

        with ColibriWriter("model.colibri", header) as w:
            for kind, layer, expert in w.pending():
                w.write(kind, layer, expert, array)

    Arrays may be any float dtype; they are cast to the header's dtype (little-endian). Casting to float16 refuses
    values that overflow (|x| > 65504) unless `clamp_fp16=True`, which clamps them to ±65504.

    Raises:
        FormatError: a tensor out of order, of the wrong shape, non-finite, overflowing fp16, or `close()` before
            every tensor was written (the partial file is then removed).
    """

    def __init__(self, path: str | os.PathLike, header: Header, *, clamp_fp16: bool = False):
        self.path = Path(path)
        self.header = header
        self.clamp_fp16 = clamp_fp16
        self._order = list(tensor_order(header))
        self._next = 0
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "wb")
        self._file.write(header.pack())

    def pending(self) -> list[tuple[str, int, int | None]]:
        """The tensors still to write, in order."""
        return self._order[self._next :]

    def write(self, kind: str, layer: int, expert: int | None, array: np.ndarray, *, name: str | None = None) -> None:
        """Append one tensor. `name` (e.g. the source checkpoint tensor) is quoted in errors."""
        if self._file is None:
            raise FormatError(f"{self.path}: write after close")
        if self._next >= len(self._order):
            raise FormatError(f"{self.path}: all {len(self._order)} tensors are written; got another ({kind}, {layer}, {expert})")
        expected = self._order[self._next]
        if (kind, layer, expert) != expected:
            raise FormatError(
                f"out-of-order write: got (kind={kind!r}, layer={layer}, expert={expert}); "
                f"the next tensor must be (kind={expected[0]!r}, layer={expected[1]}, expert={expected[2]})"
            )
        label = name or f"{kind}[layer={layer}" + (f", expert={expert}]" if expert is not None else "]")
        array = np.asarray(array)
        shape = self.header.shape(kind)
        if array.shape != shape:
            raise FormatError(f"{label}: shape {array.shape}; {kind} must be {shape}")
        if array.dtype.kind != "f":
            raise FormatError(f"{label}: dtype {array.dtype}; allowed: a floating-point dtype")
        self._file.write(self._encode(array, label).tobytes(order="C"))
        self._next += 1

    def _encode(self, array: np.ndarray, label: str) -> np.ndarray:
        as32 = array.astype(np.float32, copy=False)
        bad = ~np.isfinite(as32)
        if bad.any():
            raise FormatError(f"{label}: {int(bad.sum())} non-finite values (NaN or Inf)")
        target = self.header.np_dtype
        if target.itemsize == 2:
            over = np.abs(as32) > FP16_MAX
            count = int(over.sum())
            if count:
                if not self.clamp_fp16:
                    raise FormatError(
                        f"{label}: {count} values overflow float16 (|x| > {FP16_MAX:g}, max |x| = "
                        f"{float(np.abs(as32).max()):g}); store as fp32 or allow clamping explicitly"
                    )
                as32 = np.clip(as32, -FP16_MAX, FP16_MAX)
        return np.ascontiguousarray(as32, dtype=target)

    def close(self) -> None:
        """Finish the file: rename it into place if complete, else delete the partial file and raise."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._next != len(self._order):
            self._partial.unlink(missing_ok=True)
            kind, layer, expert = self._order[self._next]
            raise FormatError(
                f"{self.path}: closed after {self._next} of {len(self._order)} tensors; "
                f"missing from (kind={kind!r}, layer={layer}, expert={expert}) on"
            )
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        """Drop the partial file without raising."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> "ColibriWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def write_model(
    path: str | os.PathLike,
    header: Header,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    router: np.ndarray,
    *,
    clamp_fp16: bool = False,
) -> Path:
    """Write whole arrays as a .colibri file.

    Args:
        gate, up: (layers, experts, intermediate, hidden).
        down: (layers, experts, hidden, intermediate).
        router: (layers, hidden, experts) — note: transposed from the Hugging Face (experts, hidden) layout.

    Returns:
        The path written.
    """
    blocks = {"gate_proj": gate, "up_proj": up, "down_proj": down, "router": router}
    with ColibriWriter(path, header, clamp_fp16=clamp_fp16) as w:
        for kind, layer, expert in w.pending():
            array = blocks[kind][layer] if expert is None else blocks[kind][layer, expert]
            w.write(kind, layer, expert, array)
    return Path(path)
