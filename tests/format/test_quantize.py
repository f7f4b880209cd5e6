"""colibri_sdk.quantize: the error report per tensor kind, quantize_file in file order, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, Header, HeaderV2, quantize_rtn, write_model
from colibri_sdk.quantize import Quantizer, quantize_file, quantized_header

from format_cases import SIZES, small_arrays


def test_report_per_kind_by_direct_computation(rng):
    h = HeaderV2(**SIZES, dtype=1, quant=2, group_size=32)  # fp16 scales
    q = Quantizer(h)
    ws = {k: [rng.standard_normal(h.shape(k)).astype(np.float32) for _ in range(3)] for k in ("gate_proj", "down_proj")}
    for kind, arrays in ws.items():
        for w in arrays:
            q(kind, w)
    for kind, arrays in ws.items():
        err = sum(float(((w.astype(np.float64) - quantize_rtn(w, 2, 32).dequantize()) ** 2).sum()) for w in arrays)
        ref = sum(float((w.astype(np.float64) ** 2).sum()) for w in arrays)
        k = q.report.kinds[kind]
        assert k.tensors == 3 and k.relative == pytest.approx(np.sqrt(err / ref), rel=1e-12)
    assert list(q.report.to_dict()) == ["gate_proj", "down_proj"]
    assert q.report.format().splitlines()[0].startswith("gate_proj               3 tensors  rel err ")


def test_quantize_file_from_v1(tmp_path):
    a = small_arrays()
    src = write_model(tmp_path / "m.colibri", Header(**SIZES, dtype=0, routing=1, composition=1),
                      a["gate_proj"], a["up_proj"], a["down_proj"], a["router"])
    report = quantize_file(src, tmp_path / "q.colibri", "int8", 0)
    assert sorted(report.kinds) == ["down_proj", "gate_proj", "up_proj"]
    with ColibriFile(tmp_path / "q.colibri") as f:
        h = f.header
        assert (h.quant, h.group_size, h.routing, h.composition, h.dtype) == (1, 0, 1, 1, 1)
        np.testing.assert_array_equal(f.router(1), a["router"][1])  # float32 router, not rounded
        np.testing.assert_array_equal(f.weight("up_proj", 1, 2),
                                      quantize_rtn(a["up_proj"][1, 2], 1, 0).dequantize())


@pytest.mark.parametrize(
    "args,match",
    [
        (("int3",), r"storage 'int3'; allowed: int8, int4"),
        (("int4", 0), r"group size 0 for int4; allowed: 32, 64, 128"),
        (("int8", 16), r"group size 16 for int8; allowed: 0, 32, 64, 128"),
        (("int8", 0, "bf16"), r"scale dtype 'bf16'; allowed: fp16, fp32"),
    ],
)
def test_quantized_header_refusals(args, match):
    with pytest.raises(FormatError, match=match):
        quantized_header(Header(**SIZES), *args)


def test_no_requantizing():
    with pytest.raises(FormatError, match=r"the weights are already int4; re-quantizing is refused"):
        quantized_header(HeaderV2(**SIZES, quant=2, group_size=32), "int8", 0)
