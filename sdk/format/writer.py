"""Stream tensors into a .colibri file in file order.

The writer is a small state machine: it knows the one tensor that must come next and refuses anything else, so a
file it finishes is complete and in order by construction. It writes to `<path>.partial` and renames into place on
`close()`, so an interrupted conversion never leaves a file that looks finished.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import FormatError
from .constants import FP16_MAX, KINDS, QUANT_INT4, QUANT_NAMES, SCALES_SUFFIX, ZEROS_SUFFIX
from .header import Header
from .header_v2 import HeaderV2
from .quant import QuantizedTensor, check_codes, pack_int4, quantize_rtn


def _refuse_non_regular(path: Path) -> None:
    """The writer replaces `path` by renaming onto it: refuse anything but a regular file or a symlink there (a
    folder, a device such as /dev/null, a FIFO, a socket), which the rename would destroy or fail on."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FormatError(f"cannot write {path}: {exc.strerror}") from exc
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise FormatError(f"cannot write {path}: it exists and is {kind}; allowed: a new path or an existing file")


def tensor_order(header: Header) -> Iterator[tuple[str, int, int | None]]:
    """(kind, layer, expert) of every tensor in file order (docs/format.md, "Data"; v2: the logical tensors in
    block order, a quantized matrix's scales and zero points written with it)."""
    if isinstance(header, HeaderV2):
        for kind in header.kinds:
            for layer in range(header.num_layers):
                if header.is_matrix(kind):
                    for index in range(header.count(kind)):
                        yield kind, layer, index
                else:
                    yield kind, layer, None
        return
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
        FormatError: a tensor out of order, of the wrong shape, non-finite, overflowing fp16 (or float32), or
            `close()` before every tensor was written (the partial file is then removed); a path that cannot be
            created, or that exists as a folder or a special file (device, FIFO), which is never replaced.
    """

    def __init__(self, path: str | os.PathLike, header: Header, *, clamp_fp16: bool = False):
        self.path = Path(path)
        self.header = header
        self.clamp_fp16 = clamp_fp16
        self._order = list(tensor_order(header))
        self._next = 0
        if not self.path.name or self.path.name in (".", ".."):
            raise FormatError(f"cannot write {self.path}: not a file path")
        self._file = None
        _refuse_non_regular(self.path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        _refuse_non_regular(self._partial)
        try:
            self._file = open(self._partial, "wb")
        except OSError as exc:
            raise FormatError(f"cannot write {self._partial}: {exc.strerror}") from exc
        self._v2 = isinstance(header, HeaderV2)
        if self._v2:
            # Every offset is known from the header: size the file once (zero-filled, so the padding between
            # blocks is zero) and write each tensor, its scales and zero points at their own offsets.
            self._file.write(header.pack_prefix())
            self._file.truncate(header.file_size)
        else:
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
        if self._v2:
            self._write_v2(kind, layer, expert, array, label)
            self._next += 1
            return
        if isinstance(array, QuantizedTensor):
            raise FormatError(f"{label}: a quantized tensor; a v1 file holds float weights only (write a HeaderV2)")
        array = np.asarray(array)
        shape = self.header.shape(kind)
        if array.shape != shape:
            raise FormatError(f"{label}: shape {array.shape}; {kind} must be {shape}")
        if array.dtype.kind != "f":
            raise FormatError(f"{label}: dtype {array.dtype}; allowed: a floating-point dtype")
        self._file.write(self._encode(array, label).tobytes(order="C"))
        self._next += 1

    def _write_v2(self, kind: str, layer: int, expert: int | None, array, label: str) -> None:
        h: HeaderV2 = self.header
        shape = h.shape(kind)
        if h.is_matrix(kind) and h.quantized:
            t = array if isinstance(array, QuantizedTensor) else None
            if t is None:
                array = self._float_array(array, shape, kind, label)
                try:
                    t = quantize_rtn(array, h.quant, h.group_size, h.np_dtype)
                except FormatError as exc:
                    raise FormatError(f"{label}: {exc}") from None
            self._put(kind, layer, expert, self._codes_bytes(t, shape, label))
            self._put(kind + SCALES_SUFFIX, layer, expert, self._scales_bytes(t, shape, label))
            if h.zero_points:
                zeros = np.zeros((shape[0], h.groups(kind)), np.int8) if t.zeros is None else t.zeros
                self._put(kind + ZEROS_SUFFIX, layer, expert, np.asarray(zeros, dtype=np.int8).tobytes())
            return
        if isinstance(array, QuantizedTensor):
            what = "float weights" if h.is_matrix(kind) else "float32"
            raise FormatError(f"{label}: a quantized tensor; {kind} in this file is {what}")
        array = self._float_array(array, shape, kind, label)
        if h.is_matrix(kind):
            data = self._encode(array, label)
        else:
            data = self._encode(array, label, np.dtype("<f4"))
        self._put(kind, layer, expert, data.tobytes(order="C"))

    def _float_array(self, array, shape, kind: str, label: str) -> np.ndarray:
        array = np.asarray(array)
        if array.shape != shape:
            raise FormatError(f"{label}: shape {array.shape}; {kind} must be {shape}")
        if array.dtype.kind != "f":
            raise FormatError(f"{label}: dtype {array.dtype}; allowed: a floating-point dtype")
        return array

    def _codes_bytes(self, t: QuantizedTensor, shape, label: str) -> bytes:
        h: HeaderV2 = self.header
        if t.quant != h.quant or t.group_size != h.group_size:
            raise FormatError(
                f"{label}: a {QUANT_NAMES.get(t.quant, t.quant)} tensor with group size {t.group_size}; this file "
                f"holds {h.quant_name} with group size {h.group_size}"
            )
        codes = t.unpacked_codes() if t.packed else np.asarray(t.codes)
        if codes.shape != shape:
            raise FormatError(f"{label}: codes of shape {codes.shape}; must be {shape}")
        if (t.zeros is not None) and not h.zero_points:
            raise FormatError(f"{label}: zero points given; this file is symmetric (zero_points 0)")
        if t.zeros is not None and np.shape(t.zeros) != (shape[0], h.groups_for(shape[1])):
            raise FormatError(f"{label}: zero points of shape {np.shape(t.zeros)}; must be {(shape[0], h.groups_for(shape[1]))}")
        check_codes(dataclasses.replace(t, codes=codes, packed=False), label)
        if h.quant == QUANT_INT4:
            return pack_int4(codes).tobytes()
        return codes.astype(np.int8).tobytes()

    def _scales_bytes(self, t: QuantizedTensor, shape, label: str) -> bytes:
        h: HeaderV2 = self.header
        scales = np.asarray(t.scales)
        want = (shape[0], h.groups_for(shape[1]))
        if scales.shape != want:
            raise FormatError(f"{label}: scales of shape {scales.shape}; must be {want}")
        if scales.dtype.kind != "f":
            raise FormatError(f"{label}: scales of dtype {scales.dtype}; allowed: a floating-point dtype")
        if not np.isfinite(scales).all():
            raise FormatError(f"{label}: {int((~np.isfinite(scales)).sum())} non-finite scales")
        target = h.np_dtype
        with np.errstate(over="ignore"):
            stored = scales.astype(target)
        inexact = stored.astype(np.float64) != scales.astype(np.float64)
        if inexact.any():
            bad = scales[inexact].flat[0]
            raise FormatError(
                f"{label}: {int(inexact.sum())} scales are not exactly {target.name} (e.g. {float(bad)!r}); "
                f"allowed: exact {target.name} scales, or a file with float32 scales (dtype float32)"
            )
        return np.ascontiguousarray(stored).tobytes()

    def _put(self, block: str, layer: int, expert: int | None, data: bytes) -> None:
        offset = self.header.tensor_offset(block, layer, expert)
        self._file.seek(offset)
        self._file.write(data)

    def _encode(self, array: np.ndarray, label: str, target: np.dtype | None = None) -> np.ndarray:
        bad = ~np.isfinite(array)
        if bad.any():
            raise FormatError(f"{label}: {int(bad.sum())} non-finite values (NaN or Inf)")
        with np.errstate(over="ignore"):
            as32 = array.astype(np.float32, copy=False)
        over32 = ~np.isfinite(as32)
        if over32.any():
            raise FormatError(
                f"{label}: {int(over32.sum())} values overflow float32 (max |x| = {float(np.abs(array).max()):g}); "
                f"allowed: |x| <= {float(np.finfo(np.float32).max):g}"
            )
        target = self.header.np_dtype if target is None else target
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
        try:
            _refuse_non_regular(self.path)  # it may have appeared while the file was written
            os.replace(self._partial, self.path)
        except (OSError, FormatError) as exc:
            self._partial.unlink(missing_ok=True)
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

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


def write_arrays(path: str | os.PathLike, header: Header, arrays: dict, *, clamp_fp16: bool = False) -> Path:
    """Write whole arrays as a .colibri file (v1 or v2).

    Args:
        arrays: kind → array: expert matrices (layers, count, rows, cols) float (quantized by round-to-nearest in
            an int8/int4 file) or a list per layer of lists of QuantizedTensor; per-layer tensors (layers, ...).
            Kinds as `header.kinds` (v2) or KINDS (v1); the router is (layers, hidden, experts).

    Returns:
        The path written.

    Raises:
        FormatError: a missing kind, or anything ColibriWriter refuses.
    """
    with ColibriWriter(path, header, clamp_fp16=clamp_fp16) as w:
        for kind, layer, expert in w.pending():
            if kind not in arrays:
                raise FormatError(f"no array for {kind!r}; this file needs {sorted({k for k, _, _ in w.pending()})}")
            a = arrays[kind][layer]
            w.write(kind, layer, expert, a if expert is None else a[expert])
    return Path(path)
