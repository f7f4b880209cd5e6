"""Read a .colibri file (v1 or v2) through mmap: every tensor is a zero-copy, read-only NumPy view.

Opening a file reads only its 64-byte header (v2: also the layer map and the few padding bytes between blocks) and
its size; tensor bytes are paged in by the OS when touched, so opening time does not grow with the file.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .constants import HEADER_SIZE, KINDS, MATRIX_KINDS, QUANT_INT4, SCALES_SUFFIX, SHARED_KINDS, ZEROS_SUFFIX
from .header import Header
from .header_v2 import HeaderV2
from .pages import advise_huge_pages, mapped_bytes
from .quant import QuantizedTensor


def _check_gaps(fd: int, header: HeaderV2, path: Path) -> None:
    """The padding bytes between v2 blocks (at most 63 each) must be zero."""
    end = header.prefix_size
    for b in header.blocks():
        if b.offset > end:
            gap = os.pread(fd, b.offset - end, end)
            if any(gap):
                first = end + next(i for i, x in enumerate(gap) if x)
                raise FormatError(
                    f"{path}: padding byte {first} before block {b.name} is 0x{gap[first - end]:02x}; allowed: 0"
                )
        end = b.offset + b.nbytes


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
            if len(head) == HEADER_SIZE:
                head = os.pread(fd, max(HEADER_SIZE, Header.prefix_size_of(head)), 0)
            try:
                self.header = Header.unpack(head)
            except FormatError as exc:  # the header's own message, with the file it was read from
                raise FormatError(f"{self.path}: {exc}") from None
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
            if self.is_v2:
                _check_gaps(fd, self.header, self.path)
            self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def is_v2(self) -> bool:
        return isinstance(self.header, HeaderV2)

    @property
    def layer_map(self) -> tuple[int, ...]:
        """For each file layer, the source model's layer (v1: 0..num_layers-1)."""
        return self.header.layer_map if self.is_v2 else tuple(range(self.header.num_layers))

    # ---- tensors ----------------------------------------------------------------------------------------------
    def tensor(self, kind: str, layer: int, expert: int | None = None) -> np.ndarray:
        """Zero-copy view of one stored tensor.

        Args:
            kind: v1: "gate_proj" | "up_proj" | "down_proj" | "router". v2: any block name of the file
                (`header.blocks()`: also "gate_proj.scales", "shared_up_proj", "router_bias", ...).
            layer: 0..num_layers-1.
            expert: 0..count-1 for expert matrices and their scales/zeros (routed or shared); None otherwise.

        Returns:
            Read-only array as stored: gate/up (intermediate, hidden), down (hidden, intermediate), router (hidden,
            num_experts); v2 int8 codes (rows, cols) int8, int4 codes (rows, ceil(cols/2)) uint8, scales
            (rows, groups) in the file dtype, vectors float32 (docs/format.md, v2 "Blocks").
        """
        h = self.header
        offset = h.tensor_offset(kind, layer, expert)
        if self.is_v2:
            b = h.block(kind)
            return self._view(offset, b.shape, b.dtype)
        rows, cols = h.shape(kind)
        return self._view(offset, (rows, cols))

    # ---- v2 -----------------------------------------------------------------------------------------------------
    def quantized(self, kind: str, layer: int, expert: int) -> QuantizedTensor:
        """Zero-copy views of one quantized matrix (v2, quant int8/int4): codes (int8 (rows, cols), or the packed
        uint8 (rows, ceil(cols/2)) for int4), scales (rows, groups) in the file dtype, zeros int8 or None.

        Raises:
            FormatError: a float file, or a kind that is not an expert matrix.
        """
        h = self.header
        if not self.is_v2 or not h.quantized:
            raise FormatError(f"{self.path} holds float weights; quantized() reads int8/int4 files")
        if not h.is_matrix(kind):
            raise FormatError(f"{kind!r} is not an expert matrix; allowed: {MATRIX_KINDS + SHARED_KINDS}")
        zeros = self.tensor(kind + ZEROS_SUFFIX, layer, expert) if h.zero_points else None
        return QuantizedTensor(
            codes=self.tensor(kind, layer, expert),
            scales=self.tensor(kind + SCALES_SUFFIX, layer, expert),
            zeros=zeros,
            cols=h.shape(kind)[1],
            group_size=h.group_size,
            quant=h.quant,
            packed=h.quant == QUANT_INT4,
        )

    def weight(self, kind: str, layer: int, expert: int | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """One tensor as float32 values: float blocks widened, quantized matrices dequantized exactly
        (colibri_sdk.format.quant.dequantize). `rows` (int array) selects rows of a matrix first.

        Returns:
            float32, the kind's logical shape (docs/format.md), or (len(rows), cols); a new array, except for a
            float32 block without `rows`, which is the read-only view itself.
        """
        h = self.header
        if self.is_v2 and h.quantized and h.is_matrix(kind):
            return self.quantized(kind, layer, expert).dequantize(rows)
        view = self.tensor(kind, layer, expert)
        if rows is not None:
            view = view[rows]
        return view.astype(np.float32, copy=False)

    def vector(self, kind: str, layer: int) -> np.ndarray:
        """Zero-copy float32 view of a per-layer tensor of a v2 file: router_bias, correction_bias (experts,),
        gate_bias / up_bias (experts, intermediate), down_bias (experts, hidden), shared_expert_gate (hidden,)."""
        return self.tensor(kind, layer)

    def experts(self, kind: str, layer: int) -> np.ndarray:
        """Zero-copy view of all experts of one layer: gate/up (experts, intermediate, hidden),
        down (experts, hidden, intermediate). They are contiguous in the file."""
        if kind == "router":
            raise FormatError("experts() takes gate_proj, up_proj or down_proj; use router(layer) for the router")
        h = self.header
        offset = h.tensor_offset(kind, layer, 0)
        if self.is_v2:
            b = h.block(kind)
            if not h.is_matrix(b.tensor):
                raise FormatError(f"experts() takes an expert matrix block; {kind!r} is per layer")
            return self._view(offset, (b.count,) + b.shape, b.dtype)
        rows, cols = h.shape(kind)
        return self._view(offset, (h.num_experts, rows, cols))

    def router(self, layer: int) -> np.ndarray:
        """Zero-copy view of one layer's router, (hidden, num_experts)."""
        return self.tensor("router", layer)

    def block(self, kind: str) -> np.ndarray:
        """Zero-copy view of a whole block: gate/up/down (layers, experts, rows, cols); router (layers, hidden,
        num_experts)."""
        h = self.header
        if self.is_v2:
            b = h.block(kind)
            lead = (h.num_layers, b.count) if h.is_matrix(b.tensor) else (h.num_layers,)
            return self._view(b.offset, lead + b.shape, b.dtype)
        rows, cols = h.shape(kind)
        lead = (h.num_layers,) if kind == "router" else (h.num_layers, h.num_experts)
        return self._view(h.block_offset(kind), lead + (rows, cols))

    def data(self) -> np.ndarray:
        """Zero-copy uint8 view of all tensor bytes after the header (for a one-shot device upload)."""
        self._check_open()
        return self._buffer[HEADER_SIZE:]

    def advise_huge_pages(self) -> bool:
        """Ask the kernel to map the file in 2 MiB pages (madvise MADV_HUGEPAGE; colibri_sdk.format.pages: when
        it can, and what it gains). Returns whether the kernel accepted the advice (False where it refused it or
        the platform has none).

        Raises:
            FormatError: the file is closed.
        """
        self._check_open()
        return advise_huge_pages(self._mmap)

    def mapped_bytes(self) -> tuple[int, int] | None:
        """(resident, of which in 2 MiB pages) bytes of the file's mapping now (/proc/self/smaps; a page is
        resident once touched through this mapping), or None where that cannot be read (not Linux).

        Raises:
            FormatError: the file is closed.
        """
        self._check_open()
        return mapped_bytes(self._buffer.ctypes.data, self._buffer.size)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype | None = None) -> np.ndarray:
        self._check_open()
        dtype = self.header.np_dtype if dtype is None else dtype
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
            f"hidden={h.hidden_size}, intermediate={h.intermediate_size}, dtype={h.dtype_name}"
            + (f", quant={h.quant_name}" if self.is_v2 else "") + ")"
        )

    def layout(self) -> list[dict]:
        """Per-block offsets and sizes in bytes (for `colibri-sdk inspect`)."""
        h = self.header
        rows = [{"block": "header", "offset": 0, "bytes": HEADER_SIZE, "shape": None}]
        if self.is_v2:
            rows.append({"block": "layer_map", "offset": HEADER_SIZE, "bytes": 2 * h.num_layers, "shape": [h.num_layers]})
            for b in h.blocks():
                lead = [h.num_layers, b.count] if h.is_matrix(b.tensor) else [h.num_layers]
                rows.append({"block": b.name, "offset": b.offset, "bytes": b.nbytes, "shape": lead + list(b.shape),
                             "dtype": str(b.dtype.name)})
            return rows
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
