"""Read a .colibri file through mmap: every tensor is a zero-copy, read-only NumPy view.

Opening a file reads only its 64-byte header and its size; tensor bytes are paged in by the OS when touched, so
opening time does not grow with the file.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .constants import HEADER_SIZE, KINDS
from .header import Header


class ColibriFile:
    """A .colibri file mapped read-only into memory.

    Usage::

        with ColibriFile("model.colibri") as f:
            w = f.tensor("gate_proj", layer=0, expert=3)   # (intermediate, hidden), file dtype, zero-copy
            r = f.router(0)                                # (hidden, num_experts)

    Raises:
        FormatError: the file is missing, not a regular file, has a bad header, or its size differs from the size
            the header implies (shorter: truncated; longer: trailing bytes).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mmap = None
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below as not a regular file).
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise FormatError(f"cannot open {self.path}: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FormatError(f"{self.path} is not a regular file")
            size = info.st_size
            head = os.pread(fd, HEADER_SIZE, 0)
            self.header = Header.unpack(head)
            expected = self.header.file_size
            if size < expected:
                raise FormatError(
                    f"{self.path} is truncated: {size} bytes, the header implies {expected} "
                    f"({HEADER_SIZE} header + {self.header.data_size} data)"
                )
            if size > expected:
                raise FormatError(
                    f"{self.path} has {size - expected} trailing bytes: {size} bytes, the header implies {expected}"
                )
            self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._mmap, dtype=np.uint8)

    # ---- tensors ----------------------------------------------------------------------------------------------
    def tensor(self, kind: str, layer: int, expert: int | None = None) -> np.ndarray:
        """Zero-copy view of one tensor.

        Args:
            kind: "gate_proj" | "up_proj" | "down_proj" | "router".
            layer: 0..num_layers-1.
            expert: 0..num_experts-1 for gate/up/down; None for the router.

        Returns:
            Read-only array in the file dtype: gate/up (intermediate, hidden), down (hidden, intermediate),
            router (hidden, num_experts).
        """
        h = self.header
        offset = h.tensor_offset(kind, layer, expert)
        rows, cols = h.shape(kind)
        return self._view(offset, (rows, cols))

    def experts(self, kind: str, layer: int) -> np.ndarray:
        """Zero-copy view of all experts of one layer: gate/up (experts, intermediate, hidden),
        down (experts, hidden, intermediate). They are contiguous in the file."""
        if kind == "router":
            raise FormatError("experts() takes gate_proj, up_proj or down_proj; use router(layer) for the router")
        h = self.header
        offset = h.tensor_offset(kind, layer, 0)
        rows, cols = h.shape(kind)
        return self._view(offset, (h.num_experts, rows, cols))

    def router(self, layer: int) -> np.ndarray:
        """Zero-copy view of one layer's router, (hidden, num_experts)."""
        return self.tensor("router", layer)

    def block(self, kind: str) -> np.ndarray:
        """Zero-copy view of a whole block: gate/up/down (layers, experts, rows, cols); router (layers, hidden,
        num_experts)."""
        h = self.header
        rows, cols = h.shape(kind)
        lead = (h.num_layers,) if kind == "router" else (h.num_layers, h.num_experts)
        return self._view(h.block_offset(kind), lead + (rows, cols))

    def data(self) -> np.ndarray:
        """Zero-copy uint8 view of all tensor bytes after the header (for a one-shot device upload)."""
        self._check_open()
        return self._buffer[HEADER_SIZE:]

    def _view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        self._check_open()
        dtype = self.header.np_dtype
        count = int(np.prod(shape))
        view = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)
        return view.reshape(shape)

    def _check_open(self) -> None:
        if self._mmap is None or self._mmap.closed:
            raise FormatError(f"{self.path} is closed")

    # ---- lifetime ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the file. Views handed out earlier keep the mapping alive until they are released."""
        if self._mmap is not None:
            self._buffer = None
            try:
                self._mmap.close()
            except BufferError:
                # Views still reference the mapping; it is released with the last of them.
                pass
            self._mmap = None

    def __enter__(self) -> "ColibriFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.header
        return (
            f"ColibriFile({str(self.path)!r}, layers={h.num_layers}, experts={h.num_experts}, top_k={h.top_k}, "
            f"hidden={h.hidden_size}, intermediate={h.intermediate_size}, dtype={h.dtype_name})"
        )

    def layout(self) -> list[dict]:
        """Per-block offsets and sizes in bytes (for `colibri-sdk inspect`)."""
        h = self.header
        rows = [{"block": "header", "offset": 0, "bytes": HEADER_SIZE, "shape": None}]
        for kind in KINDS:
            r, c = h.shape(kind)
            lead = [h.num_layers] if kind == "router" else [h.num_layers, h.num_experts]
            rows.append(
                {
                    "block": kind,
                    "offset": h.block_offset(kind),
                    "bytes": h.block_elements(kind) * h.itemsize,
                    "shape": lead + [r, c],
                }
            )
        return rows
