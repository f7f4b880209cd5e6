"""The int4 products in integers (sdk/runtime/cpu_q4_integer.py): the input's pieces and lane sums against the layout
the module documents, the generic LLVM IR form against the AVX2 one, and `_project_direct` against the float64
product of the exact dequantization at the integer bounds, near overflow, with non-finite and tiny inputs."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.runtime import cpu_direct, cpu_kernels, cpu_q4_integer as qi

AVX2 = qi.avx2_target()
TOL = dict(rtol=1e-5)  # and atol 1e-5 of the largest |output|, as the direct-product test in test_cpu_engine.py


def stored(codes, scales, zeros, group):
    """The float64 matrix an int4 matrix stands for: scale * (nibble - 8 - zero point), nibbles low first."""
    nibbles = np.empty((codes.shape[0], codes.shape[1] * 2), np.float64)
    nibbles[:, 0::2], nibbles[:, 1::2] = codes & 15, codes >> 4
    per_column = np.repeat(np.arange(scales.shape[1]), group)
    return scales.astype(np.float64)[:, per_column] * (nibbles - 8 - zeros.astype(np.float64)[:, per_column])


def project(codes, scales, zeros, group, x):
    """`_project_direct` on int4 codes (rows, cols / 2), scales (rows, groups) float16 / float32, zeros (rows,
    groups) int8 or None; x (n, cols) float32, n <= DIRECT_TOKENS. Returns (n, rows) float32."""
    n, cols = x.shape
    rows = codes.shape[0]
    out = np.full((n, rows), np.nan, np.float32)
    z = zeros if zeros is not None else np.zeros((rows, 1), np.int8)
    cpu_kernels._project_direct(cpu_kernels.STORE_Q4, codes, np.ascontiguousarray(scales).view(np.uint8),
                                scales.dtype == np.float16, z, zeros is not None, group, x,
                                np.arange(n, dtype=np.int64), n, out, np.zeros(n * 2 * (cols + 1), np.float32),
                                np.zeros(n * cols, np.float32), np.zeros(rows * cols, np.float32))
    return out


def check(out, want):
    np.testing.assert_allclose(out, want, atol=1e-5 * np.abs(want).max(), **TOL)


def prepare(x, group):
    n, cols = x.shape
    groups = cols // group
    pieces = np.full((n, cols * qi.PIECES), 99, np.int8)
    lane_sums = np.full((n, groups * qi.SUM_VECTORS * qi.LANES), -7, np.int32)
    steps = np.full((n, groups), np.nan, np.float32)
    ok = qi._prepare_pieces(x, np.arange(n, dtype=np.int64), n, cols, group, pieces, lane_sums, steps) == 0
    return ok, pieces, lane_sums, steps


@pytest.mark.parametrize("group", [64, 128])
def test_pieces_hold_each_value_to_24_bits_of_its_group_and_lane_sums_follow_the_layout(group):
    """Decoded by the module docstring's layout: X = q0 2^16 + q1 2^8 + q2 per column, |X d_g - x| <= d_g / 2 (plus
    float32 rounding of x / d_g), d_g = max |x| of the group / X_MAX; the lane sums are the sums L0 of q0 and L12 of
    (q1 << 8) + q2 over bytes 4i..4i+3 of every 32, both nibbles, then the offset term 8 (L0 2^16 + L12). Groups:
    random, an outlier, all zero, all -m."""
    rng = np.random.default_rng(1)
    cols = 4 * group
    x = rng.standard_normal((2, cols)).astype(np.float32)
    x[0, 5] = 15.0  # an outlier within OUTLIER_RATIO
    x[1, group:2 * group] = 0
    x[1, 2 * group:3 * group] = -2.5
    ok, pieces, lane_sums, steps = prepare(x, group)
    assert ok
    half = group // 2
    for t in range(2):
        for g in range(cols // group):
            m = np.abs(x[t, g * group:(g + 1) * group]).max()
            d = np.float64(steps[t, g])
            assert d == np.float32(m / qi.X_MAX)
            part = pieces[t, g * 3 * group:(g + 1) * 3 * group].reshape(3, 2, half).astype(np.int64)  # piece, even/odd
            X = part[0] * 65536 + part[1] * 256 + part[2]  # (2, half): even columns, odd columns
            value = np.empty(group)
            value[0::2], value[1::2] = X[0], X[1]
            assert np.abs(value).max() <= qi.X_MAX
            assert np.all(np.abs(value * d - x[t, g * group:(g + 1) * group]) <= d * 0.5 + 1e-7 * m)
            lane = (np.arange(half) % 32) // 4
            high = np.bincount(lane, part[0].sum(axis=0), qi.LANES)
            low = np.bincount(lane, (part[1] * 256 + part[2]).sum(axis=0), qi.LANES)
            got = lane_sums[t, g * 3 * qi.LANES:(g + 1) * 3 * qi.LANES]
            np.testing.assert_array_equal(got, np.concatenate([high, low, 8 * (high * 65536 + low)]))


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_input_takes_the_float_kernel_and_stays_non_finite(value):
    """A non-finite input value: no pieces (`_prepare_pieces` cannot hold the row), and the float kernel's result,
    non-finite in every row, as the float64 product (the CPU engine raises NonFiniteOutputError on it)."""
    rng = np.random.default_rng(2)
    rows, cols, group = 12, 256, 128
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes[:3, 3] = 0x88  # weight 0 against column 6 and 7: 0 * Inf is NaN
    scales = (rng.random((rows, cols // group)) * 0.1 + 0.01).astype(np.float16)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    x[0, 6] = value
    assert not prepare(x, group)[0]
    with np.errstate(invalid="ignore"):  # Inf times a zero weight
        want = x.astype(np.float64) @ stored(codes, scales, np.zeros((rows, 2), np.int8), group).T
    out = project(codes, scales, None, group, x)
    assert not np.isfinite(want).any()
    assert not np.isfinite(out).any()


def test_tiny_and_zero_inputs_are_exact_enough():
    """A row below float32's normal range for d_g (max 1e-33: the float kernel serves it) and a row of zeros in one
    group (d_g = 0, pieces 0): both against float64."""
    rng = np.random.default_rng(3)
    rows, cols, group = 16, 256, 128
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = (rng.random((rows, cols // group)) + 0.5).astype(np.float32)
    w = stored(codes, scales, np.zeros((rows, 2), np.int8), group)
    tiny = (rng.standard_normal((1, cols)) * 1e-33).astype(np.float32)
    assert not prepare(tiny, group)[0]
    check(project(codes, scales, None, group, tiny), tiny.astype(np.float64) @ w.T)
    zero_group = rng.standard_normal((1, cols)).astype(np.float32)
    zero_group[0, :group] = 0
    ok, _, _, steps = prepare(zero_group, group)
    assert ok and steps[0, 0] == 0
    check(project(codes, scales, None, group, zero_group), zero_group.astype(np.float64) @ w.T)


@pytest.mark.parametrize("zero_point", [None, -128, 127, "random"])
@pytest.mark.parametrize("codes_kind", ["zeros", "ones", "random"])
@pytest.mark.parametrize("group", [64, 128])
def test_the_integer_bounds_hold_at_their_extremes(group, codes_kind, zero_point):
    """Every nibble 0 or 15 against inputs of one magnitude and sign (each piece at its extreme: X = +-X_MAX), zero
    points at the ends of int8, and random ones, g64 and g128: against float64 (an overflow or saturation of the
    16- or 32-bit sums would be far off). On an AVX2 target this is the integer path (asserted)."""
    rng = np.random.default_rng(4)
    rows, cols = 10, 4 * group
    fill = {"zeros": 0x00, "ones": 0xFF}
    codes = (np.full((rows, cols // 2), fill[codes_kind], np.uint8) if codes_kind in fill
             else rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
    scales = (rng.random((rows, cols // group)) + 0.5).astype(np.float16)
    if zero_point is None:
        zeros = None
    elif zero_point == "random":
        zeros = rng.integers(-128, 128, (rows, cols // group)).astype(np.int8)
    else:
        zeros = np.full((rows, cols // group), zero_point, np.int8)
    x = np.stack([np.full(cols, -3.0), np.full(cols, 7.0)]).astype(np.float32)
    x[1, ::3] = rng.standard_normal(len(x[1, ::3]))  # one row of mixed values
    assert cpu_direct._q4_integer_fit(np.uint64(group // 2), np.uint64(cols)) == AVX2
    z = zeros if zeros is not None else np.zeros((rows, cols // group), np.int8)
    want = x.astype(np.float64) @ stored(codes, scales, z, group).T
    check(project(codes, scales, zeros, group, x), want)


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("outlier", [20.0, 1e3, 1e6])
def test_an_outlier_on_a_column_of_zero_weights_keeps_the_others_exact(outlier, zero_points):
    """One large input value a row whose column weighs 0 in every row, so the outputs are the other values' sums
    alone: 20 x N(0, 1) stays in integers (within OUTLIER_RATIO of the others' mean |x|), larger ones take the
    float kernel (`_prepare_pieces` cannot hold the rows; in integers 1e3 erred by 2.5e-5 of the largest output).
    Without zero points the float kernel then makes each nibble exact first, as with zero points of 0 (its folded
    offset of 8 cancelled from outliers of about 1e3 here: 2.8e-5)."""
    rng = np.random.default_rng(5)
    rows, cols, group = 48, 256, 128
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes[:, 2] = (codes[:, 2] & 0xF0) | 8  # column 4: nibble 8, weight 0 (zero points 0)
    scales = (rng.random((rows, cols // group)) * 0.02 + 0.001).astype(np.float16)
    zeros = np.zeros((rows, cols // group), np.int8)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    x[:, 4] = [outlier, -outlier]
    assert prepare(x, group)[0] == (outlier < 100)
    want = x.astype(np.float64) @ stored(codes, scales, zeros, group).T
    check(project(codes, scales, zeros if zero_points else None, group, x), want)


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("group,count", [(32, 2), (32, 8), (64, 3), (64, 4), (64, 16), (128, 5), (128, 8), (128, 32)])
def test_several_equal_outliers_on_columns_of_zero_weights_take_the_float_kernel(group, count, zero_points):
    """count equal large values (1e5) in one group, on columns that weigh 0 in every row: measured against the mean
    of the group's other values they passed (127 x 1e5 / 4e5 < 32 for 5 of 128), and against the values at most 16
    times the group's mean 4 of 64 and 8 of 128 did; the others' sums erred by 108-204x the engine tests' tolerance.
    The ordinary values are those at most half the group's largest |x| (`_group_verdict`), so `_prepare_pieces`
    declines any number of them and the float kernel serves the product exactly; without zero points with exact
    nibbles (its folded offset of 8 cancelled from them: 167x at g32, which never takes the integer path)."""
    rng = np.random.default_rng(count)
    rows, cols = 24, 2 * group
    columns = 4 + 2 * np.arange(count)  # even columns: the low nibbles of bytes 2, 3, ...
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes[:, columns // 2] = (codes[:, columns // 2] & 0xF0) | 8  # nibble 8, zero point 0: weight 0
    scales = (rng.random((rows, cols // group)) * 0.02 + 0.001).astype(np.float16)
    zeros = np.zeros((rows, cols // group), np.int8)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    x[:, columns] = 1e5
    if group != 32:  # (the integer path takes groups of 64 and 128)
        assert not prepare(x, group)[0]
    assert qi.any_outlier_row(x, np.arange(2, dtype=np.int64), 2, cols, group)
    want = x.astype(np.float64) @ stored(codes, scales, zeros, group).T
    check(project(codes, scales, zeros if zero_points else None, group, x), want)


@pytest.mark.parametrize("cols", [320, 96], ids=["g128-partial", "g32"])
def test_the_float_kernel_without_zero_points_keeps_outlier_rows_exact(cols):
    """Matrices the integer path does not take (a partial last group of 128, or g32) run the float kernel whatever
    the input: one outlier of 1e5 on a column of zero weights made its folded offset of 8 cancel (up to 847x the
    tolerance); `any_outlier_row` finds it, and the nibbles are made exact first. A row without an outlier keeps
    the folded form (`any_outlier_row` False), also within tolerance."""
    group = 128 if cols == 320 else 32
    rng = np.random.default_rng(cols)
    rows = 20
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes[:, 3] = (codes[:, 3] & 0x0F) | 0x80  # column 7: weight 0
    scales = (rng.random((rows, -(-cols // group))) * 0.02 + 0.001).astype(np.float16)
    zeros = np.zeros(scales.shape, np.int8)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    assert not qi.any_outlier_row(x, np.arange(3, dtype=np.int64), 3, cols, group)
    x[1, 7] = 1e5
    assert qi.any_outlier_row(x, np.arange(3, dtype=np.int64), 3, cols, group)
    full = stored(codes, scales, zeros, group) if cols % group == 0 else stored(
        np.pad(codes, ((0, 0), (0, (-cols // 2) % (group // 2)))), scales, zeros, group)[:, :cols]
    want = x.astype(np.float64) @ full.T
    check(project(codes, scales, None, group, x), want)


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("n,outlier_rows", [(7, (1,)), (7, (0, 3, 5)), (7, (0, 1, 2, 4, 6)), (3, (1,)), (12, (5,))],
                         ids=["1-of-7", "3-of-7", "5-of-7", "1-of-3", "1-of-12"])
def test_rows_the_integer_path_cannot_hold_take_the_float_kernel_alone(n, outlier_rows, zero_points):
    """Input rows, some with an outlier of 1e5 on a column of zero weights: `_prepare_pieces` counts them and marks
    each (steps[t, 0] = -1). Above Q4_FLOAT_TOKENS rows, up to MIXED_TOKENS, `_project_direct` keeps the others in
    integers and runs the float kernel on those rows alone, up to Q4_FLOAT_TOKENS of them (PREPARED_NONE: the
    scratch holds neither layout whole); with more of them, or any above MIXED_TOKENS rows, it declines where asked
    (DECLINED, out untouched) and else runs the float kernel on every row, as it does at up to Q4_FLOAT_TOKENS rows
    (PREPARED_FLOAT). Every result against float64."""
    rng = np.random.default_rng(len(outlier_rows) + n)
    rows, cols, group = 40, 256, 128
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes[:, 5] = (codes[:, 5] & 0x0F) | 0x80  # column 11: high nibble 8, weight 0 (zero points 0)
    scales = (rng.random((rows, cols // group)) * 0.02 + 0.001).astype(np.float16)
    zeros = np.zeros((rows, cols // group), np.int8)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[list(outlier_rows), 11] = 1e5
    pieces = np.zeros((n, cols * qi.PIECES), np.int8)
    lane_sums = np.zeros((n, 2 * qi.SUM_VECTORS * qi.LANES), np.int32)
    steps = np.zeros((n, 2), np.float32)
    assert qi._prepare_pieces(x, np.arange(n, dtype=np.int64), n, cols, group, pieces, lane_sums, steps) == len(
        outlier_rows)
    assert np.flatnonzero(steps[:, 0] < 0).tolist() == list(outlier_rows)
    want = x.astype(np.float64) @ stored(codes, scales, zeros, group).T
    many = len(outlier_rows) > cpu_direct.Q4_FLOAT_TOKENS or n > cpu_direct.MIXED_TOKENS
    mixed = AVX2 and n > cpu_direct.Q4_FLOAT_TOKENS and not many
    for decline in (False, True):
        out = np.full((n, rows), np.nan, np.float32)
        got = cpu_kernels._project_direct(
            cpu_kernels.STORE_Q4, codes, scales.view(np.uint8), True, zeros if zero_points else zeros[:, :1],
            zero_points, group, x, np.arange(n, dtype=np.int64), n, out, np.zeros(n * 2 * (cols + 1), np.float32),
            np.zeros(n * cols, np.float32), np.zeros(rows * cols, np.float32), cpu_direct.PREPARED_NONE, decline)
        if many and decline and AVX2:  # (elsewhere the float kernel serves every int4 product)
            assert got == cpu_direct.DECLINED and np.isnan(out).all()
            continue
        assert got == (cpu_direct.PREPARED_NONE if mixed else cpu_direct.PREPARED_FLOAT)
        check(out, want)


@pytest.mark.parametrize("group", [64, 128])
def test_an_odd_column_count_keeps_the_float_kernel_whatever_the_scratch_holds(group):
    """cols = 2 groups - 1: the last byte holds one column, and the groups are not whole in columns, so the float
    kernel serves it (it pads the odd column); stale values in the scratch do not reach the output."""
    rng = np.random.default_rng(7)
    rows, cols = 6, 2 * group - 1
    codes = rng.integers(0, 256, (rows, group), dtype=np.uint8)
    scales = np.full((rows, 2), 0.05, np.float16)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    assert not cpu_direct._q4_integer_fit(np.uint64(group // 2), np.uint64(cols))
    out = np.full((2, rows), np.nan, np.float32)
    cpu_kernels._project_direct(cpu_kernels.STORE_Q4, codes, scales.view(np.uint8), True, np.zeros((rows, 1), np.int8),
                                False, group, x, np.arange(2, dtype=np.int64), 2, out,
                                np.full(2 * 2 * (cols + 1), 1e3, np.float32), np.full(2 * cols, 0.5, np.float32),
                                np.full(rows * cols, 7.0, np.float32))
    want = x.astype(np.float64) @ stored(codes, scales, np.zeros((rows, 2), np.int8), group)[:, :cols].T
    check(out, want)


@pytest.mark.parametrize("scale", [1e-38, 1e-40], ids=["1e-38", "1e-40"])
def test_small_scales_do_not_underflow_with_the_step(scale):
    """float32 group scales of 1e-38 and 1e-40 (subnormal) against inputs of N(0, 1): the step d_g (about 4e-7 here)
    multiplies the group's integer sum before the scale does, so the subnormal or zero product s d_g is never formed
    (it was, once: 10 % off at 1e-38, 0 at 1e-40)."""
    rng = np.random.default_rng(8)
    rows, cols, group = 8, 256, 128
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = np.full((rows, cols // group), scale, np.float32)
    zeros = np.zeros((rows, cols // group), np.int8)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    assert prepare(x, group)[0]
    want = x.astype(np.float64) @ stored(codes, scales, zeros, group).T
    out = project(codes, scales, zeros, group, x)
    np.testing.assert_allclose(out, want, rtol=1e-5 if scale >= 1e-38 else 1e-3)  # 1e-40: subnormal sums


def _sums_wrapper(sums):
    from numba import njit

    @njit
    def rows_of(codes, scales, zeros, has_zero, pieces, lane_sums, steps, out):
        rows = codes.shape[0]
        half = np.uint64(codes.shape[1] // scales.shape[1])
        for i in range(rows):
            if has_zero:
                out[i] = sums(codes[i], pieces, lane_sums, steps, scales[i], zeros[i], scales.shape[1], half)
            else:
                out[i] = sums(codes[i], pieces, lane_sums, steps, scales[i], None, scales.shape[1], half)

    return rows_of


@pytest.mark.parametrize("with_zeros", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32], ids=["f16-scales", "f32-scales"])
@pytest.mark.parametrize("group", [64, 128])
def test_the_generic_ir_form_matches_float64_and_the_avx2_form(group, scale_dtype, with_zeros):
    """`make_q4_integer_sums(avx2=False)` (generic LLVM IR: what a target without AVX2 would compile) against the
    float64 product, and bit for bit against the AVX2 form where this CPU has AVX2 (the same integers, the same
    float operations)."""
    rng = np.random.default_rng(6)
    rows, cols = 8, 3 * group
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = (rng.random((rows, cols // group)) * 0.1 + 0.01).astype(scale_dtype)
    zeros = rng.integers(-8, 8, (rows, cols // group)).astype(np.int8)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    ok, pieces, lane_sums, steps = prepare(x, group)
    assert ok
    stored_scales = scales.view(np.uint16) if scale_dtype == np.float16 else scales
    want = x[0].astype(np.float64) @ stored(codes, scales, zeros if with_zeros else 0 * zeros, group).T
    results = {}
    for avx2 in ([False, True] if AVX2 else [False]):
        out = np.full(rows, np.nan, np.float32)
        _sums_wrapper(qi.make_q4_integer_sums(avx2=avx2))(codes, stored_scales, zeros, with_zeros, pieces[0],
                                                            lane_sums[0], steps[0], out)
        results[avx2] = out
        check(out[None], want[None])
    if AVX2:
        np.testing.assert_array_equal(results[False], results[True])
