"""v2 files: exact bytes of int8/int4 storage (nibble order, scales, zero points, padding), the exact
dequantization, round-to-nearest bounds, writer refusals, and a reader that survives any corrupted prefix."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.errors import FormatError
from colibri_sdk.format import (
    ColibriFile,
    ColibriWriter,
    Header,
    HeaderV2,
    QuantizedTensor,
    dequantize,
    pack_int4,
    quantize_rtn,
    unpack_int4,
    write_arrays,
)

TINY = dict(num_layers=1, num_experts=2, top_k=1, hidden_size=3, intermediate_size=5)


def qt(codes, scales, zeros=None, group=32, quant=2):
    codes = np.asarray(codes, np.int8)
    return QuantizedTensor(codes, np.asarray(scales, np.float32), None if zeros is None else np.asarray(zeros, np.int8),
                           codes.shape[1], group, quant)


def test_int4_nibble_order_by_hand():
    # columns (-8, 7, 1): byte 0 = (-8+8) | (7+8) << 4 = 0xF0; byte 1 = (1+8) | padding 0 << 4 = 0x09
    assert pack_int4(np.array([[-8, 7, 1]])).tolist() == [[0xF0, 0x09]]
    assert pack_int4(np.array([[0, -1, 3, -4]])).tolist() == [[0x78, 0x4B]]
    assert unpack_int4(np.array([[0xF0, 0x09]], np.uint8), 3).tolist() == [[-8, 7, 1]]
    with pytest.raises(FormatError, match=r"int4 codes in -9\.\.0; allowed: -8\.\.7"):
        pack_int4(np.array([[-9, 0]]))


def test_dequantize_by_hand():
    # scale 0.5, zero 1: 0.5 * (q - 1)
    t = qt([[-8, 7, 1]], [[0.5]], [[1]])
    assert dequantize(t).tolist() == [[-4.5, 3.0, 0.0]]


def test_partial_last_group_by_hand():
    """int8, group 32, 40 columns: columns 0..31 use scale 0.25, columns 32..39 (the partial group) scale 2."""
    codes = np.arange(40, dtype=np.int8)[None]
    w = dequantize(qt(codes, [[0.25, 2.0]], group=32, quant=1))
    assert w[0, :32].tolist() == [0.25 * c for c in range(32)]
    assert w[0, 32:].tolist() == [2.0 * c for c in range(32, 40)]
    assert dequantize(qt(codes, [[0.25, 2.0]], group=32, quant=1), rows=np.array([0])).tolist() == w.tolist()


@pytest.mark.parametrize("quant,group,cols", [(1, 0, 70), (1, 32, 70), (2, 32, 70), (2, 64, 33), (2, 128, 129)])
def test_rtn_error_is_at_most_half_a_step(quant, group, cols, rng):
    """|w - ŵ| <= |scale|/2 except where a code clamps (int4's +8 side: then under one step); each group's value of
    largest magnitude maps to ±127 (int8) or to -8 (int4, llama.cpp Q4_0's scale = m / -8)."""
    w = rng.standard_normal((6, cols)).astype(np.float32) * 3
    w[2, :5] = 0.0
    t = quantize_rtn(w, quant, group, np.float16)
    size = cols if group == 0 else group
    index = np.arange(cols) // size
    scale = np.abs(t.scales.astype(np.float32))[:, index]
    err = np.abs(w - t.dequantize())
    # the stored fp16 scale may be rounded below the exact one by 2^-11 relative
    clamped = t.codes == 7 if quant == 2 else np.zeros_like(w, bool)
    assert (err[~clamped] <= scale[~clamped] * 0.5 * (1 + 2e-3) + 1e-7).all()
    assert (err[clamped] <= scale[clamped] * (1 + 2e-3)).all()
    for r in range(6):
        for g in range(index.max() + 1):
            cols_g = np.nonzero(index == g)[0]
            top = cols_g[np.argmax(np.abs(w[r, cols_g]))]
            if quant == 1:
                assert abs(int(t.codes[r, top])) == 127
            else:
                assert t.codes[r, top] == -8
    assert t.codes.min() >= (-127 if quant == 1 else -8)


def test_rtn_refuses_fp16_overflowing_scales():
    with pytest.raises(FormatError, match=r"1 group scales exceed float16 .*; allowed: scales <= 65504, or float32 scales"):
        quantize_rtn(np.full((1, 32), 1e6, np.float32), 2, 32, np.float16)
    t = quantize_rtn(np.full((1, 32), 1e6, np.float32), 2, 32, np.float32)
    assert t.dequantize()[0, 0] == pytest.approx(1e6, rel=1e-6)


def tiny_int4_header(**kw):
    return HeaderV2(**TINY, dtype=1, quant=2, group_size=32, zero_points=1, **kw)


def test_int4_file_exact_bytes(tmp_path):
    """Every byte of a tiny int4 file, from the block table of docs/format.md (offsets as in test_header_v2)."""
    h = tiny_int4_header()
    g_codes = np.array([[-8, 7, 1]] * 5, np.int8)
    path = tmp_path / "t.colibri"
    with ColibriWriter(path, h) as w:
        for kind, layer, e in w.pending():
            if kind == "router":
                w.write(kind, layer, e, np.full((3, 2), 0.5, np.float32))
            else:
                cols = 3 if kind != "down_proj" else 5
                rows = 5 if kind != "down_proj" else 3
                codes = g_codes if cols == 3 else np.zeros((rows, cols), np.int8)
                w.write(kind, layer, e, qt(codes, np.full((rows, 1), 0.5), np.full((rows, 1), 1 + e)))
    data = path.read_bytes()
    assert len(data) == 728
    assert data[128:148] == bytes([0xF0, 0x09]) * 10  # gate codes, 2 experts × 5 rows × 2 bytes
    assert data[148:192] == bytes(44)  # padding
    assert data[192:212] == b"\x00\x38" * 10  # fp16 0.5
    assert data[256:266] == b"\x01" * 5 + b"\x02" * 5  # zero points, expert 0 then 1
    assert data[512:530] == bytes([0x88, 0x88, 0x08]) * 6  # down: code 0 = nibble 8, odd row's padding nibble 0
    assert data[704:728] == np.full(6, 0.5, "<f4").tobytes()
    with ColibriFile(path) as f:
        assert f.weight("gate_proj", 0, 0).tolist() == [[-4.5, 3.0, 0.0]] * 5  # 0.5 * (q - 1)
        assert f.weight("gate_proj", 0, 1).tolist() == [[-5.0, 2.5, -0.5]] * 5  # 0.5 * (q - 2)


def test_zero_points_per_expert(tmp_path):
    h = tiny_int4_header()
    path = tmp_path / "z.colibri"
    with ColibriWriter(path, h) as w:
        for kind, layer, e in w.pending():
            if kind == "router":
                w.write(kind, layer, e, np.zeros((3, 2), np.float32))
            else:
                rows, cols = h.shape(kind)
                w.write(kind, layer, e, qt(np.full((rows, cols), -8), np.full((rows, 1), 0.5), np.full((rows, 1), e)))
    with ColibriFile(path) as f:
        assert f.weight("up_proj", 0, 0)[0].tolist() == [-4.0] * 3
        assert f.weight("up_proj", 0, 1)[0].tolist() == [-4.5] * 3
        q = f.quantized("up_proj", 0, 1)
        assert q.packed and q.codes.dtype == np.uint8 and q.codes.shape == (5, 2) and not q.codes.flags.writeable
        assert np.shares_memory(q.codes, f.data())


def full_v2_header(**kw):
    fields = dict(
        num_layers=2, num_experts=4, top_k=2, hidden_size=6, intermediate_size=5, dtype=1, routing=2, composition=1,
        norm_topk=1, n_group=2, topk_group=1, group_score=2, router_bias=1, correction_bias=1, num_shared_experts=2,
        shared_intermediate_size=3, shared_gate=1, expert_bias=1, activation=1, swiglu_limit=7.0, swiglu_alpha=1.702,
        routed_scaling_factor=2.5, num_model_layers=4, layer_map=(1, 3),
    )
    fields.update(kw)
    return HeaderV2(**fields)


def random_arrays(h, rng):
    arrays = {}
    for kind in h.kinds:
        lead = (h.num_layers, h.count(kind)) if h.is_matrix(kind) else (h.num_layers,)
        arrays[kind] = rng.standard_normal(lead + h.shape(kind)).astype(np.float32)
    return arrays


@pytest.mark.parametrize("quant,group", [(0, 0), (1, 0), (1, 32), (2, 32)])
def test_round_trip_every_kind(tmp_path, rng, quant, group):
    h = full_v2_header(quant=quant, group_size=group)
    a = random_arrays(h, rng)
    path = write_arrays(tmp_path / "m.colibri", h, a)
    assert path.stat().st_size == h.file_size
    with ColibriFile(path) as f:
        assert f.header == h and f.layer_map == (1, 3)
        for kind in h.kinds:
            for layer in range(2):
                if h.is_matrix(kind):
                    for e in range(h.count(kind)):
                        got, want = f.weight(kind, layer, e), a[kind][layer, e]
                        if quant == 0:
                            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
                        else:
                            t = quantize_rtn(want, quant, group, np.float16)
                            np.testing.assert_array_equal(got, t.dequantize())
                else:
                    np.testing.assert_array_equal(f.vector(kind, layer), a[kind][layer])
        rows = f.layout()
        assert rows[1] == {"block": "layer_map", "offset": 64, "bytes": 4, "shape": [2]}
        assert [r["block"] for r in rows[2:]] == [b.name for b in h.blocks()]


def test_weight_rows_dequantizes_only_those_rows(tmp_path, rng):
    h = full_v2_header(quant=2, group_size=32)
    path = write_arrays(tmp_path / "m.colibri", h, random_arrays(h, rng))
    with ColibriFile(path) as f:
        full = f.weight("down_proj", 1, 3)
        np.testing.assert_array_equal(f.weight("down_proj", 1, 3, rows=np.array([4, 0])), full[[4, 0]])


@pytest.mark.parametrize(
    "array,match",
    [
        (qt(np.zeros((5, 3)), [[1 / 3]] * 5), r"gate_proj\[layer=0, expert=0\]: 5 scales are not exactly float16 \(e\.g\. 0\.333"),
        (qt(np.zeros((5, 3)), [[np.inf]] * 5), r"5 non-finite scales"),
        (qt(np.zeros((5, 3)), [[1.0]] * 4), r"scales of shape \(4, 1\); must be \(5, 1\)"),
        (qt(np.full((5, 3), 8), [[1.0]] * 5), r"int4 codes in 8\.\.8; allowed: -8\.\.7"),
        (qt(np.zeros((5, 3)), [[1.0]] * 5, group=64), r"a int4 tensor with group size 64; this file holds int4 with group size 32"),
        (qt(np.zeros((5, 3)), [[1.0]] * 5, quant=1), r"a int8 tensor with group size 32; this file holds int4"),
        (qt(np.zeros((5, 4)), [[1.0]] * 5), r"codes of shape \(5, 4\); must be \(5, 3\)"),
        (qt(np.zeros((5, 3)), [[1.0]] * 5, [[9]] * 5), r"zero points in 9\.\.9; allowed: -8\.\.7"),
        (np.full((5, 3), np.nan, np.float32), r"gate_proj\[layer=0, expert=0\]: weight has 15 non-finite values"),
        (np.zeros((5, 3), np.int32), r"dtype int32; allowed: a floating-point dtype"),
    ],
)
def test_writer_refusals(tmp_path, array, match):
    h = tiny_int4_header()
    with pytest.raises(FormatError, match=match):
        with ColibriWriter(tmp_path / "bad.colibri", h) as w:
            w.write("gate_proj", 0, 0, array)
    assert not (tmp_path / "bad.colibri").exists() and not (tmp_path / "bad.colibri.partial").exists()


def test_zero_points_refused_in_a_symmetric_file(tmp_path):
    h = HeaderV2(**TINY, dtype=1, quant=2, group_size=32)
    with pytest.raises(FormatError, match=r"zero points given; this file is symmetric"):
        with ColibriWriter(tmp_path / "s.colibri", h) as w:
            w.write("gate_proj", 0, 0, qt(np.zeros((5, 3)), [[1.0]] * 5, [[0]] * 5))


def test_float32_scales_hold_bf16_scales_exactly(tmp_path):
    """A bf16 scale below float16's normal range is not exact in fp16 (refused) but is in a float32-scale file."""
    scale = np.float32(2.0**-20 * (1 + 2.0**-7))  # exact in bf16 and fp32; fp16 subnormals step by 2^-24
    t = qt(np.ones((5, 3)), [[scale]] * 5, [[0]] * 5)
    with pytest.raises(FormatError, match=r"not exactly float16"):
        with ColibriWriter(tmp_path / "a.colibri", tiny_int4_header()) as w:
            w.write("gate_proj", 0, 0, t)
    h = HeaderV2(**TINY, dtype=0, quant=2, group_size=32, zero_points=1)
    with ColibriWriter(tmp_path / "b.colibri", h) as w:
        for kind, layer, e in w.pending():
            w.write(kind, layer, e, t if h.is_matrix(kind) and kind != "down_proj" else
                    (qt(np.ones((3, 5)), [[scale]] * 3, [[0]] * 3) if kind == "down_proj" else np.zeros((3, 2), np.float32)))
    with ColibriFile(tmp_path / "b.colibri") as f:
        assert f.weight("gate_proj", 0, 0)[0, 0] == scale


def test_v1_writer_refuses_quantized_tensors(tmp_path):
    with pytest.raises(FormatError, match=r"a quantized tensor; a v1 file holds float weights only"):
        with ColibriWriter(tmp_path / "v1.colibri", Header(**TINY)) as w:
            w.write("gate_proj", 0, 0, qt(np.zeros((5, 3)), [[1.0]] * 5))


def test_reader_refuses_nonzero_padding_between_blocks(tmp_path, rng):
    h = tiny_int4_header()
    path = write_arrays(tmp_path / "p.colibri", h, random_arrays(h, rng))
    data = bytearray(path.read_bytes())
    data[150] = 0x11  # inside the gap after gate_proj (128 + 20 .. 191)
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"padding byte 150 before block gate_proj\.scales is 0x11; allowed: 0"):
        ColibriFile(path)


def test_truncated_and_extended_v2(tmp_path, rng):
    h = tiny_int4_header()
    path = write_arrays(tmp_path / "t.colibri", h, random_arrays(h, rng))
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(FormatError, match=r"truncated: 727 bytes, the header implies 728"):
        ColibriFile(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(FormatError, match=r"1 trailing bytes"):
        ColibriFile(path)


def test_every_prefix_bit_flip_is_caught_or_harmless(tmp_path, rng):
    """Flip each bit of the header and the layer map, and the low bit of every padding byte up to 128: the reader
    raises FormatError or opens a file whose size matches its (other, valid) header; nothing else escapes."""
    h = full_v2_header(quant=2, group_size=32)
    path = write_arrays(tmp_path / "f.colibri", h, random_arrays(h, rng))
    data = bytearray(path.read_bytes())
    opened = refused = 0
    bits = list(range(68 * 8)) + [byte * 8 for byte in range(68, h.prefix_size)]
    for bit in bits:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(flipped)
        try:
            with ColibriFile(path) as f:
                assert f.header.file_size == len(data)
                opened += 1
        except FormatError:
            refused += 1
    assert opened + refused == len(bits) and refused > 0.75 * len(bits)


def test_random_v2_prefixes_never_escape(tmp_path):
    """400 random v2 prefixes (small random fields, random floats, random tails): FormatError or open, no hang."""
    rng = np.random.default_rng(7)
    path = tmp_path / "fuzz.colibri"
    outcomes = {"refused": 0, "opened": 0}
    for _ in range(400):
        ints = rng.integers(0, 4, 23).astype("<u2")
        ints[0] = rng.integers(1, 3)  # layers
        floats = rng.choice([0.0, 1.0, 7.0, -1.0, np.nan], 3).astype("<f4")
        tail = rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8)
        tail[: rng.integers(0, 64)] = 0
        data = b"COLI\x00\x02" + ints.tobytes() + floats.tobytes() + tail.tobytes()
        path.write_bytes(data[: int(rng.integers(0, 2200))])
        try:
            ColibriFile(path).close()
            outcomes["opened"] += 1
        except FormatError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 300


def test_cpu_backend_runs_int4(tmp_path, rng):
    """The runtime's CPU backend on an int4 v2 file gives the float64 reference engine's output (float32 sums)."""
    from colibri_sdk.reference import ReferenceEngine
    from colibri_sdk.runtime.cpu_backend import CpuBackend

    h = full_v2_header(quant=2, group_size=32)
    path = write_arrays(tmp_path / "m.colibri", h, random_arrays(h, rng))

    class Weights:  # the part of colibri_sdk.bundle.Bundle the backend uses
        shape = (1, 3)

        def open_weights(self):
            return ColibriFile(path)

    backend = CpuBackend(Weights())
    x = rng.standard_normal((1, 3, 6)).astype(np.float32)
    want = ReferenceEngine(path, compute_dtype=np.float64)(x)
    np.testing.assert_allclose(backend.infer_padded(x), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    backend.close()


def test_largest_v2_header_is_a_truncated_file_not_an_overflow(tmp_path):
    """Every size at 65535 (65535 layers, each mapped; 65535 shared experts of 65535): the reader computes the
    implied size with Python integers and refuses the short file quickly."""
    import time

    h = HeaderV2(num_layers=65535, num_experts=65535, top_k=65535, hidden_size=65535, intermediate_size=65535,
                 dtype=0, quant=1, group_size=32, zero_points=1, num_shared_experts=65535,
                 shared_intermediate_size=65535, expert_bias=1, router_bias=1, num_model_layers=65535)
    path = tmp_path / "huge.colibri"
    path.write_bytes(h.pack_prefix())
    start = time.perf_counter()
    with pytest.raises(FormatError, match=r"truncated: 131136 bytes, the header implies \d{21,} "):
        ColibriFile(path)
    assert time.perf_counter() - start < 1.0


def test_v2_header_without_its_layer_map(tmp_path):
    path = tmp_path / "short.colibri"
    path.write_bytes(HeaderV2(**TINY).pack())
    with pytest.raises(FormatError, match=r"file is 64 bytes; a v2 file with 1 layers starts with 128 bytes"):
        ColibriFile(path)
