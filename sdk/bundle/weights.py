"""The weights of a bundle: copied into it (hashed on the way) or converted tensor by tensor to the profile's
dtype, and the top-k and expert-count limits the kernels are compiled for, checked before anything is built.

Memory does not grow with the weights: copies go in CHUNK_BYTES pieces through one buffer, conversions one tensor at
a time, each source tensor mapped only while it is converted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Callable

from .. import catalog
from ..errors import CompileError, FormatError
from ..format import ColibriFile, ColibriWriter, Header
from ..format.constants import DTYPE_CODES
from ..format.writer import tensor_order

log = logging.getLogger(__name__)

PROFILE_DTYPE = {code: name for name, code in DTYPE_CODES.items()}  # header dtype code -> "fp16" | "fp32"
CHUNK_BYTES = 8 << 20  # the most bytes of weights (copy) or of float64 weights (self-test) held at a time

Progress = Callable[[str, int, int], None]
"""`progress(step, done, total)`: `done` of `total` bytes of the build step `step` ("weights", "sha256",
"self-test") are finished. Called repeatedly with `done` growing; a step starts again at 0 under a new name."""


def no_progress(step: str, done: int, total: int) -> None:
    pass


def _read_hashing(src, path: Path, progress: Progress, step: str, sink=None) -> str:
    """Read the open file `src` (of `path`) in CHUNK_BYTES pieces (one buffer, reused), hand each to `sink` if
    given, and return the sha256 (hex) of what was read, reporting progress."""
    total = path.stat().st_size
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    done = 0
    progress(step, 0, total)
    while n := src.readinto(buffer):
        digest.update(view[:n])
        if sink is not None:
            sink(view[:n])
        done += n
        progress(step, done, total)
    return digest.hexdigest()


def copy_with_sha256(source: Path, target: Path, progress: Progress = no_progress, step: str = "weights") -> str:
    """Copy `source` to `target` in CHUNK_BYTES pieces (one buffer, reused) and return the sha256 (hex) of what
    was written, so the bundle's largest file is read once for both.

    Raises:
        OSError: reading or writing failed.
    """
    with open(source, "rb") as src, open(target, "wb") as dst:
        return _read_hashing(src, source, progress, step, dst.write)


def sha256_with_progress(path: Path, progress: Progress = no_progress, step: str = "sha256") -> str:
    """sha256 (hex) of a file, read in CHUNK_BYTES pieces, reporting progress.

    Raises:
        OSError: reading failed.
    """
    with open(path, "rb") as f:
        return _read_hashing(f, path, progress, step)


def prepare_weights(source: Path, dtype: str, target: Path, progress: Progress = no_progress) -> tuple[Header, str]:
    """Put the weights into the bundle in the profile's dtype: copied when the dtype matches, else converted
    tensor by tensor (each source tensor mapped only while it is converted).

    Returns:
        (the header of the bundle's weights, the sha256 of the copied file or "" when converted).

    Raises:
        FormatError: the source is not a valid .colibri file, or converting to fp16 overflows (|x| > 65504).
    """
    with ColibriFile(source) as src:
        header = src.header
    code = DTYPE_CODES[dtype]
    # v2 weights are copied as they are: the kernels follow the file's storage (fp16/fp32 matrices, int8/int4 codes
    # with fp16 or fp32 scales); the profile's dtype applies to v1 weights (docs/kernels.md, "Quantized weights",
    # "Model features").
    if header.dtype == code or catalog.is_v2(header):
        try:
            digest = copy_with_sha256(source, target, progress)
        except OSError as exc:
            raise FormatError(f"cannot copy {source} into the bundle: {exc.strerror or exc}") from exc
        with ColibriFile(target) as copied:  # what was copied, checked again (the source may have changed)
            return copied.header, digest
    out = dataclasses.replace(header, dtype=code)
    log.debug("converting %s from %s to the profile's %s", source, PROFILE_DTYPE[header.dtype], dtype)
    total, done = header.data_size, 0
    progress("weights", 0, total)
    try:
        with ColibriWriter(target, out) as writer:
            for kind, layer, expert in tensor_order(out):
                # A fresh mapping per tensor: the source's pages leave the resident set when it is closed.
                with ColibriFile(source) as src:
                    writer.write(kind, layer, expert, src.tensor(kind, layer, expert))
                rows, cols = header.shape(kind)
                done += rows * cols * header.itemsize
                progress("weights", done, total)
    except FormatError as exc:
        raise FormatError(f"{source} → {dtype} for the profile: {exc}; use a profile with dtype: fp32") from None
    return out, ""


def check_top_k(weights: Path) -> None:
    """Refuse weights whose top-k exceeds what the kernels are compiled for, before anything is copied or compiled.

    Raises:
        CompileError: top_k > catalog.MAX_TOP_K, or num_experts > catalog.MAX_EXPERTS, naming the value and the limit.
        FormatError: the file is not a valid .colibri file.
    """
    with ColibriFile(weights) as f:
        top_k, experts = f.header.top_k, f.header.num_experts
    if experts > catalog.MAX_EXPERTS:
        raise CompileError(
            f"{weights}: num_experts = {experts}; allowed: 1..{catalog.MAX_EXPERTS} (MAX_EXPERTS, the most experts per "
            "layer the kernels are compiled for)"
        )
    if top_k > catalog.MAX_TOP_K:
        raise CompileError(
            f"{weights}: top_k = {top_k}; allowed: 1..{catalog.MAX_TOP_K} (MAX_TOP_K, the most experts per token the "
            "kernels are compiled for)"
        )
