"""ColibriWriter: file order, refusals, and the partial file."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, ColibriWriter, Header
from colibri_sdk.format.writer import tensor_order

from format_cases import SIZES, small_arrays


def header(dtype: int = 0) -> Header:
    return Header(**SIZES, dtype=dtype)


def test_tensor_order_is_block_by_block():
    order = list(tensor_order(header()))
    # 2 layers x 3 experts per expert block, then 2 routers.
    assert order[:4] == [("gate_proj", 0, 0), ("gate_proj", 0, 1), ("gate_proj", 0, 2), ("gate_proj", 1, 0)]
    assert order[6] == ("up_proj", 0, 0) and order[12] == ("down_proj", 0, 0)
    assert order[18:] == [("router", 0, None), ("router", 1, None)]


def test_round_trip_and_exact_size(tmp_path):
    a = small_arrays()
    path = tmp_path / "m.colibri"
    with ColibriWriter(path, header()) as w:
        for kind, layer, expert in w.pending():
            w.write(kind, layer, expert, a[kind][layer] if expert is None else a[kind][layer, expert])
    assert not (tmp_path / "m.colibri.partial").exists()
    assert path.stat().st_size == 64 + 4 * (3 * 2 * 3 * 5 * 4 + 2 * 4 * 3)
    with ColibriFile(path) as f:
        for kind in a:
            np.testing.assert_array_equal(f.block(kind), a[kind])


def test_out_of_order_write(tmp_path):
    with ColibriWriter(tmp_path / "m.colibri", header()) as w:
        w.write("gate_proj", 0, 0, np.zeros((5, 4), np.float32))
        with pytest.raises(FormatError, match=r"out-of-order write: got \(kind='up_proj', layer=0, expert=0\); "
                                              r"the next tensor must be \(kind='gate_proj', layer=0, expert=1\)"):
            w.write("up_proj", 0, 0, np.zeros((5, 4), np.float32))
        with pytest.raises(FormatError, match=r"got \(kind='gate_proj', layer=0, expert=0\)"):
            w.write("gate_proj", 0, 0, np.zeros((5, 4), np.float32))
        w.abort()


@pytest.mark.parametrize(
    "array,match",
    [
        (np.zeros((4, 5), np.float32), r"gate_proj\[layer=0, expert=0\]: shape \(4, 5\); gate_proj must be \(5, 4\)"),
        (np.zeros((5, 4, 1), np.float32), r"shape \(5, 4, 1\)"),
        (np.zeros((5, 4), np.int32), r"dtype int32; allowed: a floating-point dtype"),
        (np.full((5, 4), np.inf, np.float32), r"20 non-finite values"),
    ],
)
def test_refused_arrays(tmp_path, array, match):
    w = ColibriWriter(tmp_path / "m.colibri", header())
    with pytest.raises(FormatError, match=match):
        w.write("gate_proj", 0, 0, array)
    w.abort()
    assert not list(tmp_path.iterdir())


def test_fp16_overflow_names_the_source(tmp_path):
    w = ColibriWriter(tmp_path / "m.colibri", header(dtype=1))
    bad = np.zeros((5, 4), np.float32)
    bad[0, :3] = [65504.0, 65505.0, -1e6]
    with pytest.raises(FormatError, match=r"src\.w1: 2 values overflow float16 \(\|x\| > 65504, max \|x\| = 1e\+06\)"):
        w.write("gate_proj", 0, 0, bad, name="src.w1")
    w.abort()


def test_fp16_clamp(tmp_path):
    a = small_arrays()
    a["router"][1, 0, 0] = -1e9
    path = tmp_path / "m.colibri"
    with ColibriWriter(path, header(dtype=1), clamp_fp16=True) as w:
        for kind, layer, expert in w.pending():
            w.write(kind, layer, expert, a[kind][layer] if expert is None else a[kind][layer, expert])
    assert ColibriFile(path).router(1)[0, 0] == -65504.0


def test_incomplete_close_removes_partial(tmp_path):
    w = ColibriWriter(tmp_path / "m.colibri", header())
    w.write("gate_proj", 0, 0, np.zeros((5, 4), np.float32))
    assert (tmp_path / "m.colibri.partial").exists()
    with pytest.raises(FormatError, match=r"closed after 1 of 20 tensors; missing from \(kind='gate_proj', layer=0, expert=1\) on"):
        w.close()
    assert not list(tmp_path.iterdir())


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ColibriWriter(tmp_path / "m.colibri", header()) as w:
            w.write("gate_proj", 0, 0, np.zeros((5, 4), np.float32))
            raise RuntimeError("interrupted")
    assert not list(tmp_path.iterdir())


def test_write_after_last_and_after_close(tmp_path):
    a = small_arrays()
    w = ColibriWriter(tmp_path / "m.colibri", header())
    for kind, layer, expert in w.pending():
        w.write(kind, layer, expert, a[kind][layer] if expert is None else a[kind][layer, expert])
    with pytest.raises(FormatError, match=r"all 20 tensors are written; got another \(router, 0, None\)"):
        w.write("router", 0, None, a["router"][0])
    w.close()
    with pytest.raises(FormatError, match=r"write after close"):
        w.write("router", 0, None, a["router"][0])
