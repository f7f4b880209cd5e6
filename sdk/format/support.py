"""What each consumer of a .colibri file runs (docs/format.md, "What reads and runs v2").

The reader, the writer, the reference engine and the CPU backend run every v1 and v2 file. The CUDA kernels run
v1 files (fp16/fp32 SwiGLU experts, routing topk_softmax / softmax_topk) and v2 files whose experts are int8 or
int4 (any group size, zero points or not) and that need nothing else beyond v1, on the GEMV path
(kernels/small_batch.cu; docs/kernels.md, "Quantized weights"): the build refuses every other v2 file, naming the
features its kernels lack.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..errors import FormatError
from .constants import QUANT_FLOAT
from .header_v2 import HeaderV2
from .reader import ColibriFile


def kernel_gaps(header: HeaderV2) -> list[str]:
    """The features of a v2 header the CUDA kernels lack, as short phrases ([] = the kernels run it): everything
    `HeaderV2.v1_gaps` names but the int8/int4 storage of the experts."""
    return dataclasses.replace(header, quant=QUANT_FLOAT, group_size=0, zero_points=0).v1_gaps()


def check_kernel_support(path: str | os.PathLike, profile: str) -> None:
    """Refuse weights the CUDA kernels cannot run yet.

    Args:
        path: the .colibri file given to the build.
        profile: the profile's name, quoted in the error.

    Raises:
        FormatError: an unreadable file; or a v2 file naming the features the kernels do not support (shared
            experts, sigmoid routing, biases, ...) and that the CPU backend runs it, or, for a float v2 file holding
            only v1 features, that the kernels read such models as v1 files. int8/int4 storage runs on both paths
            (GEMV and tensor-core tiled), whatever the profile's shape.
    """
    path = Path(path)
    with ColibriFile(path) as f:
        header = f.header
    if not isinstance(header, HeaderV2):
        return
    gaps = kernel_gaps(header)
    if not gaps and header.quant == QUANT_FLOAT:
        raise FormatError(
            f"{path}: a v2 file; the CUDA kernels for profile {profile} read float weights from v1 files: it needs "
            f"nothing beyond v1, so write it as v1 (colibri_sdk.format.HeaderV2.as_v1 gives the header; "
            f"`colibri-sdk convert` writes v1 for such models)"
        )
    if gaps:
        raise FormatError(
            f"{path}: {'; '.join(gaps)}: the CUDA kernels for profile {profile} do not support "
            f"{'it' if len(gaps) == 1 else 'them'} yet; the CPU backend runs them: "
            f"colibri_sdk.reference.ReferenceEngine({str(path)!r})"
        )
