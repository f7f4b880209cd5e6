"""What each consumer of a .colibri file runs (docs/format.md, "What reads and runs v2").

The reader, the writer, the reference engine and the CPU backend run every v1 and v2 file. The CUDA kernels run
every v1 file and every v2 file: float (fp16/fp32) or int8/int4 experts, the routing variants (softmax or sigmoid
scores, top-k order, renormalisation, correction bias, group-limited top-k, routed scaling, router bias), expert
biases, the clamped SwiGLU and shared experts (docs/kernels.md, "Model features"), on the GEMV path and on the
tiled path (tensor cores for fp16 and for int8/int4). A v2 file is copied into the bundle as it is (its own
storage; the profile's dtype applies to v1 files).
"""

from __future__ import annotations

import os
from pathlib import Path

from .header_v2 import HeaderV2
from .reader import ColibriFile


def kernel_gaps(header: HeaderV2) -> list[str]:
    """The features of a v2 header the CUDA kernels lack, as short phrases ([] = the kernels run it).

    Every feature of the v2 format has kernels now (docs/kernels.md, "Model features"), so this is [] for every
    valid header; it stays the one place a future format feature without kernels is named.
    """
    return []


def check_kernel_support(path: str | os.PathLike, profile: str) -> None:
    """Refuse weights the CUDA kernels cannot run.

    Args:
        path: the .colibri file given to the build.
        profile: the profile's name, quoted in the error.

    Raises:
        FormatError: an unreadable file; or a v2 file naming the features the kernels do not support
            (`kernel_gaps`; none today). int8/int4 storage runs on both paths (GEMV and tensor-core tiled), whatever
            the profile's shape.
    """
    path = Path(path)
    with ColibriFile(path) as f:
        header = f.header
    if not isinstance(header, HeaderV2):
        return
    gaps = kernel_gaps(header)
    if gaps:
        from ..errors import FormatError

        raise FormatError(
            f"{path}: {'; '.join(gaps)}: the CUDA kernels for profile {profile} do not support "
            f"{'it' if len(gaps) == 1 else 'them'} yet; the CPU backend runs them: "
            f"colibri_sdk.reference.ReferenceEngine({str(path)!r})"
        )
