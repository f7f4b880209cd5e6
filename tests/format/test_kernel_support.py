"""The build refuses v2 weights the CUDA kernels cannot run yet, naming what, before compiling anything."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.errors import FormatError
from colibri_sdk.format import HeaderV2, write_arrays
from colibri_sdk.profile import load_profile

SIZES = dict(num_layers=1, num_experts=4, top_k=2, hidden_size=8, intermediate_size=6)


def v2_file(tmp_path, **fields):
    h = HeaderV2(**SIZES, **fields)
    rng = np.random.default_rng(0)
    arrays = {}
    for kind in h.kinds:
        lead = (1, h.count(kind)) if h.is_matrix(kind) else (1,)
        arrays[kind] = rng.standard_normal(lead + h.shape(kind)).astype(np.float32)
    return write_arrays(tmp_path / "w.colibri", h, arrays)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(dtype=1, quant=2, group_size=128),
         r"w\.colibri: int4 weights \(group size 128\): the CUDA kernels for profile \S+ do not support it yet; "
         r"the CPU backend runs them: colibri_sdk\.reference\.ReferenceEngine\("),
        (dict(quant=1, num_shared_experts=1, shared_intermediate_size=4),
         r"int8 weights \(per row\); shared experts \(1 × 4\): the CUDA kernels for profile \S+ do not support them yet"),
        (dict(routing=2, norm_topk=1), r"sigmoid routing: the CUDA kernels"),
        (dict(routing=0, router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0, swiglu_alpha=1.702),
         r"a router bias; expert biases; the clamped_swiglu activation: the CUDA kernels"),
        (dict(), r"a v2 file; the CUDA kernels for profile \S+ read v1 files: it needs nothing beyond v1"),
    ],
)
def test_build_refuses_what_the_kernels_lack(tmp_path, fields, match):
    path = v2_file(tmp_path, **fields)
    with pytest.raises(FormatError, match=match):
        build_bundle(load_profile("orin", toolchain=False), tmp_path / "bundle", weights=path)
    assert not (tmp_path / "bundle").exists()
