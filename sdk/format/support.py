"""What each consumer of a .colibri file runs (docs/format.md, "What reads and runs v2").

The reader, the writer, the reference engine and the CPU backend run every v1 and v2 file. The CUDA kernels run
v1 files only (fp16/fp32 SwiGLU experts, routing topk_softmax / softmax_topk): the build refuses a v2 file with
the features its kernels lack, named.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FormatError
from .header_v2 import HeaderV2
from .reader import ColibriFile


def check_kernel_support(path: str | os.PathLike, profile: str) -> None:
    """Refuse weights the CUDA kernels cannot run yet.

    Args:
        path: the .colibri file given to the build.
        profile: the profile's name, quoted in the error.

    Raises:
        FormatError: an unreadable file; or a v2 file, naming the features the kernels do not support (int4
            weights, shared experts, ...) and that the CPU backend runs it, or, for a v2 file holding only v1
            features, that the kernels read v1 files.
    """
    path = Path(path)
    with ColibriFile(path) as f:
        header = f.header
    if not isinstance(header, HeaderV2):
        return
    gaps = header.v1_gaps()
    if not gaps:
        raise FormatError(
            f"{path}: a v2 file; the CUDA kernels for profile {profile} read v1 files: it needs nothing beyond v1, "
            f"so write it as v1 (colibri_sdk.format.HeaderV2.as_v1 gives the header; `colibri-sdk convert` writes "
            f"v1 for such models)"
        )
    raise FormatError(
        f"{path}: {'; '.join(gaps)}: the CUDA kernels for profile {profile} do not support "
        f"{'it' if len(gaps) == 1 else 'them'} yet; the CPU backend runs them: "
        f"colibri_sdk.reference.ReferenceEngine({str(path)!r})"
    )
