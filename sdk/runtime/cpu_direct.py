"""The CPU backend's int8 / int4 products multiplied as stored, for an expert with at most `direct_tokens` tokens in
a call (after llama.cpp's ggml-cpu quantized dot products; docs/runtime.md, "int8 / int4 codes multiplied as
stored"): the input laid out once per call to meet the packing (int4: its even and odd columns against a byte's
low and high nibble), four rows a pass over their codes (each loaded input value serves the four), each group's
sum times its scale once, no decoded row. The four rows of a pass lie a quarter of the matrix apart (`_quarter_rows`),
so that each quarter is read front to back: four sequential streams, which the hardware prefetcher follows across
pages. On x86-64 with AVX2, int4 g64 / g128 is multiplied in integers instead (`cpu_q4_integer`, one row at a
time, in two streams half the matrix apart). `cpu_kernels.experts_into` calls `_project_direct`.
"""

from __future__ import annotations

import numpy as np

from .cpu_jit import _JIT, STORE_Q4, U, _f16_into, _nibble_high, _nibble_low, njit
from .cpu_q4_integer import (
    LANES, PIECES, SUM_VECTORS, _prepare_pieces, _q4_integer_fit, _q4_integer_sums, any_outlier_row,
)


# The most tokens of an expert that multiplies its codes as stored (`direct_tokens`), not through decoded rows: every
# expert of the compiled path (fewer than cpu_engine.BLAS_PAIRS = 64 pairs) for int8 and for int4 in integers;
# Q4_FLOAT_TOKENS for int4 through the float kernels, whose cost grows with the tokens faster than a decoded row's.
# Shape A (hidden 1024, intermediate 2816, 8 experts, top-2), one layer, 1 thread, caches cold, the medians of
# 3-4 interleaved rounds side by side with a limit of 2 tokens for both: int4 g128 0.93 / 0.55 / 0.86 of the time
# at T = 4 / 16 / 64, int8 0.94 / 0.66 / 0.79 / 0.87 at T = 4 / 16 / 32 / 64; int4 g32 0.78 at T = 16 (with every
# expert direct: 1.18 / 1.21 / 1.40 at T = 24 / 32 / 64) (2-core EPYC host, 2026-12-07).
DIRECT_TOKENS = 63
Q4_FLOAT_TOKENS = 4
# The most rows of a call where the rows the integer path cannot hold take the float kernel each alone, the others
# in integers (`_project_direct`); above, one such row sends the call to the decoded rows. Shape A's 1024 x 2816 int4
# g128 projection with the caches cold, one row not held, median of 9 (2-core Intel Xeon host, 2026-12-07): mixed
# against decoded rows 0.98 / 1.15 / 1.43 / 2.68 ms against 1.03 / 1.19 / 1.15 / 1.74 at 5 / 6 / 8 / 16 rows (every
# row held in integers: 0.79 / 1.04 / 1.24 / 2.36); on the EPYC host where the integer path was measured faster
# than decoded rows up to 63 rows (DIRECT_TOKENS) the crossing lies further on.
MIXED_TOKENS = 8
Q4_LANES = 8  # float32 lanes of `_q4_scaled_sums`' vectors: one AVX2 register, two NEON registers


def make_q4_scaled_sums(lanes: int = Q4_LANES, hardware_f16: bool | None = None):
    """A numba intrinsic q4_scaled_sums(q0, q1, q2, q3, even, odd, s0, s1, s2, s3, z0, z1, z2, z3, xs, groups,
    half) -> 4 float32: for four packed int4 rows q0..q3 (uint8, groups · half bytes each), the products
    sum_g s_k[g] sum_j (lo_j - 8 - z_k[g]) even[j] + (hi_j - 8 - z_k[g]) odd[j] over group g's bytes j (lo / hi a
    byte's nibbles 0..15), s0..s3 the rows' group scales as stored (float32, or float16 bits as uint16, widened
    exactly: `cpu_jit.f16_widen_ir`; hardware_f16 None: `cpu_jit.f16_hardware()`), z0..z3 the rows' zero points
    (groups,) int8, or None for none, xs (groups,) float32 the sums of x over each group (used without zero
    points). half (bytes a group) must be a multiple of `lanes`.

    Written in LLVM IR with explicit `lanes`-wide vectors, because the loop vectorizer, given the same loop in
    numba, reduces every group's vector sums to a scalar before the scale (8 horizontal sums a group of four rows,
    about a fifth of the work at g128): here each lane keeps its running sum across groups (one vector
    multiply-add by the broadcast scale per group and row), and only the row's total is reduced. Without zero
    points the offset of 8 is folded once per row (8 sum_g s_g xs[g], in scalars); per `lanes` bytes and row: a
    widening load, an `and 15`, an `lshr 4`, two `uitofp` and two multiply-adds (on AVX2 `vpmovzxbd`, `vpand`,
    `vpsrld`, 2 `vcvtdq2ps`, 2 `vfmadd231ps`), the nibble products in separate sums (no chain of two dependent
    multiply-adds a step). With zero points each nibble is made exact first, 8 + z subtracted in 32-bit integers
    before the convert (folding it into xs cancelled beyond the reference tests' tolerance: `_rows_q4`), two more
    operations a step, and a row keeps one sum (its chain of two multiply-adds is shorter than the step's work).
    The scales are read as stored, with no float32 copy of the matrix's scales. Fast-math flags as the kernels'
    (`cpu_jit._FASTMATH`: reassociation and contraction, Inf and NaN kept). On an AVX2 target the int4 matrices it
    fits (g64, g128) go through `cpu_q4_integer` instead; this kernel keeps g32, and every int4 group size on other
    targets (aarch64)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    from .cpu_jit import f16_hardware, f16_widen_ir
    from .cpu_jit import ir_fast as fast, ir_horizontal_sum as horizontal_sum, ir_splat as splat
    from .cpu_jit import ir_vector_load as load

    hardware = f16_hardware() if hardware_f16 is None else hardware_f16
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vf, vi, vb = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes), ir.VectorType(ir.IntType(8), lanes)

    @intrinsic
    def q4_scaled_sums(typingctx, q0, q1, q2, q3, even, odd, s0, s1, s2, s3, z0, z1, z2, z3, xs, groups, half):
        sig = types.UniTuple(types.float32, 4)(q0, q1, q2, q3, even, odd, s0, s1, s2, s3, z0, z1, z2, z3, xs, groups,
                                               half)
        scale_f16 = s0.dtype == types.uint16
        with_zeros = isinstance(z0, types.Array)

        def codegen(context, builder, sig, args):
            arrays = list(range(10)) + ([10, 11, 12, 13] if with_zeros else []) + [14]
            data = {i: context.make_array(sig.args[i])(context, builder, args[i]).data for i in arrays}
            rows, ev, od = [data[i] for i in range(4)], data[4], data[5]
            scales, sums_x = [data[i] for i in range(6, 10)], data[14]
            n_groups, step = args[15], args[16]
            zero = ir.Constant(vf, [0.0] * lanes)
            total = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
            low = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
            high = low if with_zeros else [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
            offset = [cgutils.alloca_once_value(builder, f32(0.0)) for _ in range(4)]
            fifteen, four = ir.Constant(vi, [15] * lanes), ir.Constant(vi, [4] * lanes)
            with cgutils.for_range(builder, n_groups, intp=i64) as group_loop:
                g = group_loop.index
                base = builder.mul(g, step)
                codes_offset = []  # with zero points: 8 + z_k[g] per row, subtracted from each nibble exactly
                for k in range(4):
                    builder.store(zero, low[k])
                    builder.store(zero, high[k])
                    if with_zeros:
                        z = builder.sext(builder.load(builder.gep(data[10 + k], [g])), i32)
                        codes_offset.append(splat(builder, builder.add(z, i32(8)), vi))
                with cgutils.for_range_slice(builder, i64(0), step, i64(lanes), intp=i64) as (j, _):
                    c = builder.add(base, j)
                    e, o = load(builder, ev, c, vf, 4), load(builder, od, c, vf, 4)
                    for k in range(4):
                        b = builder.zext(load(builder, rows[k], c, vb, 1), vi)
                        if with_zeros:  # one sum a row: its two multiply-adds a step are not the loop's bound here
                            lo = builder.sitofp(builder.sub(builder.and_(b, fifteen), codes_offset[k]), vf)
                            hi = builder.sitofp(builder.sub(builder.lshr(b, four), codes_offset[k]), vf)
                            acc = fast(builder.fadd(builder.load(low[k]), fast(builder.fmul(lo, e))))
                            builder.store(fast(builder.fadd(acc, fast(builder.fmul(hi, o)))), low[k])
                            continue
                        lo = builder.uitofp(builder.and_(b, fifteen), vf)
                        hi = builder.uitofp(builder.lshr(b, four), vf)
                        builder.store(fast(builder.fadd(builder.load(low[k]), fast(builder.fmul(lo, e)))), low[k])
                        builder.store(fast(builder.fadd(builder.load(high[k]), fast(builder.fmul(hi, o)))), high[k])
                x_sum = None if with_zeros else builder.load(builder.gep(sums_x, [g]))
                for k in range(4):
                    s = builder.load(builder.gep(scales[k], [g]))
                    if scale_f16:
                        s = f16_widen_ir(builder, s, hardware)
                    p = builder.load(low[k]) if with_zeros else fast(builder.fadd(builder.load(low[k]),
                                                                                  builder.load(high[k])))
                    scaled = fast(builder.fmul(splat(builder, s, vf), p))
                    builder.store(fast(builder.fadd(builder.load(total[k]), scaled)), total[k])
                    if not with_zeros:
                        builder.store(fast(builder.fadd(builder.load(offset[k]), fast(builder.fmul(s, x_sum)))),
                                      offset[k])
            sums = [fast(builder.fsub(horizontal_sum(builder, builder.load(total[k])),
                                      fast(builder.fmul(f32(8.0), builder.load(offset[k]))))) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    return q4_scaled_sums


_q4_scaled_sums = make_q4_scaled_sums()


@njit(inline="always", **_JIT)
def _quarter_rows(i, q, rows):
    """The rows of pass i < q = ceil(rows / 4): i, i + q, i + 2q, i + 3q, those past the last row replaced by it
    (computed again, stored once by `_store_quarters`). Four rows side by side, as before, left one stream that
    changed pages every few passes under software prefetch: shape A at one token, gate/up/down of two experts with
    the caches cold, 1 thread, median of 20, int8 6.6 -> 11.3 GB/s, int4 g128 4.7 -> 5.3-5.5 GB/s of stored bytes,
    the same sums; prefetching each stream 2-8 rows ahead on top made both slower (2-core EPYC host,
    2026-12-07)."""
    last = rows - 1
    return i, min(i + q, last), min(i + 2 * q, last), min(i + 3 * q, last)


@njit(inline="always", **_JIT)
def _store_quarters(dst, i, q, a0, a1, a2, a3):
    """dst[i + j q] = aj for the rows of pass i that exist (`_quarter_rows`)."""
    rows = dst.shape[0]
    dst[i] = a0
    if i + q < rows:
        dst[i + q] = a1
    if i + 2 * q < rows:
        dst[i + 2 * q] = a2
    if i + 3 * q < rows:
        dst[i + 3 * q] = a3


@njit(**_JIT)
def _prepare_direct(store, src, rows_of_src, n, cols, size, xq, xsum):
    """The n input rows src[rows_of_src[t]] laid out for `_rows_q8` / `_rows_q4`, once per input and call (gate
    and up share it).

    xq (n, 2, half) float32: int8, xq[t, 0, :cols] = the row; int4, the row's even columns in xq[t, 0] and its odd
    ones in xq[t, 1] (half = ceil(cols / 2); an odd row's last odd entry 0), so that byte j's low and high nibbles
    meet xq[t, 0, j] and xq[t, 1, j] in one contiguous loop. xsum (n, groups) float32: the sum of each group's
    columns of the row (int8: the zero point's term; int4 without zero points: the offset of 8's; each applied once
    per group)."""
    half = xq.shape[2]
    groups = xsum.shape[1]
    for t in range(n):
        x = src[rows_of_src[t]]
        even, odd = xq[t, 0], xq[t, 1]
        if store == STORE_Q4:
            for j in range(cols // 2):
                even[j] = x[2 * j]
                odd[j] = x[2 * j + 1]
            if cols % 2:
                even[half - 1] = x[cols - 1]
                odd[half - 1] = np.float32(0.0)
        else:
            for c in range(cols):
                even[c] = x[c]
        for g in range(groups):
            acc = np.float32(0.0)
            for c in range(g * size, min(cols, (g + 1) * size)):
                acc += x[c]
            xsum[t, g] = acc


@njit(inline="always", **_JIT)
def _sums_q4(q0, q1, q2, q3, start, count, even, odd, o0, o1, o2, o3):
    """For four packed int4 rows q0..q3: sum_j (lo_j - o) even[j] + (hi_j - o) odd[j] over bytes j = start ..
    start + count - 1, lo / hi a byte's nibbles 0..15 (`_nibble_low`, `_nibble_high`), o the row's offset (o0..o3).
    One pass: each loaded even / odd value serves the four rows, four sums in flight."""
    p0 = p1 = p2 = p3 = np.float32(0.0)
    for j in range(count):
        c = start + U(j)
        e, o = even[c], odd[c]
        b = q0[c]
        p0 += (_nibble_low(b) - o0) * e + (_nibble_high(b) - o0) * o
        b = q1[c]
        p1 += (_nibble_low(b) - o1) * e + (_nibble_high(b) - o1) * o
        b = q2[c]
        p2 += (_nibble_low(b) - o2) * e + (_nibble_high(b) - o2) * o
        b = q3[c]
        p3 += (_nibble_low(b) - o3) * e + (_nibble_high(b) - o3) * o
    return p0, p1, p2, p3


@njit(inline="always", **_JIT)
def _sums_q8(q0, q1, q2, q3, start, count, x):
    """For four int8 rows q0..q3: sum_j q[j] x[j] over codes j = start .. start + count - 1, one pass (each loaded
    x value serves the four rows)."""
    p0 = p1 = p2 = p3 = np.float32(0.0)
    for j in range(count):
        c = start + U(j)
        v = x[c]
        p0 += np.float32(q0[c]) * v
        p1 += np.float32(q1[c]) * v
        p2 += np.float32(q2[c]) * v
        p3 += np.float32(q3[c]) * v
    return p0, p1, p2, p3


@njit(**_JIT)
def _matrix_scales(scales, scale_f16, out):
    """out (rows, groups) float32 = one matrix's group scales (rows, groups · scale bytes) as stored, in one pass
    (float16 widened exactly)."""
    rows, groups = out.shape
    flat = out.reshape(rows * groups)
    if scale_f16:
        _f16_into(scales.view(np.uint16).reshape(rows * groups), flat)
    else:
        src = scales.view(np.float32).reshape(rows * groups)
        for i in range(rows * groups):
            flat[i] = src[i]


@njit(inline="always", **_JIT)
def _q4_vectors_fit(half, size):
    """True where `_rows_q4_vectors` serves an int4 matrix: group bytes half a multiple of Q4_LANES, every group
    whole (row bytes size a multiple of half)."""
    return half % U(Q4_LANES) == 0 and size % half == 0


@njit(inline="always", **_JIT)
def _rows_q4_vectors(codes, scales, zeros, has_zero, half, xq3, xs2, n, out):
    """`_rows_q4` for whole groups of a multiple of Q4_LANES bytes: out[t, r] = sum_g s_g P_g by `_q4_scaled_sums`
    (four rows a pass, `_quarter_rows`), scales (rows, groups) float32 or float16 bits (uint16) as stored, zeros
    (rows, groups) int8 where has_zero. The same terms as `_rows_q4` in another association: shape A's
    2816 x 1024 int4 g128 projection at T = 1 in cache, 1 thread, 0.24-0.27 -> 0.19-0.21 ms without zero points
    (2-core EPYC host, 2026-12-07, median of 15 interleaved rounds, three runs)."""
    rows, groups = codes.shape[0], scales.shape[1]
    q = (rows + 3) // 4
    for i in range(q):
        r, i1, i2, i3 = _quarter_rows(i, q, rows)
        q0, q1, q2, q3 = codes[r], codes[i1], codes[i2], codes[i3]
        s0, s1, s2, s3 = scales[r], scales[i1], scales[i2], scales[i3]
        for t in range(n):
            if has_zero:
                p0, p1, p2, p3 = _q4_scaled_sums(q0, q1, q2, q3, xq3[t, 0], xq3[t, 1], s0, s1, s2, s3, zeros[r],
                                                 zeros[i1], zeros[i2], zeros[i3], xs2[t], groups, half)
            else:
                p0, p1, p2, p3 = _q4_scaled_sums(q0, q1, q2, q3, xq3[t, 0], xq3[t, 1], s0, s1, s2, s3, None, None,
                                                 None, None, xs2[t], groups, half)
            _store_quarters(out[t], i, q, p0, p1, p2, p3)


@njit(inline="always", **_JIT)
def direct_tokens(store, group, hidden, inter):
    """The most tokens of an int8 / int4 expert that `cpu_kernels.experts_into` multiplies as stored
    (`_project_direct`): DIRECT_TOKENS for int8, and for int4 whose gate / up (hidden columns) and down (inter
    columns) products both fit the integer path (`_q4_integer_fit`); Q4_FLOAT_TOKENS for other int4."""
    if store != STORE_Q4:
        return DIRECT_TOKENS
    half = U(group // 2)
    if _q4_integer_fit(half, U(hidden)) and _q4_integer_fit(half, U(inter)):
        return DIRECT_TOKENS
    return Q4_FLOAT_TOKENS


@njit(inline="always", **_JIT)
def _rows_q4_integer(codes, scales, zeros, has_zero, half, pieces, lane_sums, steps, n, out):
    """out[t, r] = W[r] . x_t for every int4 row r and prepared input t < n (`cpu_q4_integer._prepare_pieces`), by
    `cpu_q4_integer.make_q4_integer_sums`, one row at a time; pass i takes row i, then row i + ceil(rows / 2): two
    sequential streams, as `_quarter_rows`' four (one stream, or three, or four, measured no faster with the caches
    cold). scales (rows, groups) float32 or float16 bits (uint16) as stored, zeros (rows, groups) int8 where
    has_zero. Speed: docs/runtime.md, "int4 in integers"."""
    rows, groups = codes.shape[0], scales.shape[1]
    q = (rows + 1) // 2
    for i in range(q):
        for r in (i, i + q):
            if r < rows:
                for t in range(n):
                    if has_zero:
                        out[t, r] = _q4_integer_sums(codes[r], pieces[t], lane_sums[t], steps[t], scales[r], zeros[r],
                                                     groups, half)
                    else:
                        out[t, r] = _q4_integer_sums(codes[r], pieces[t], lane_sums[t], steps[t], scales[r], None,
                                                     groups, half)


@njit(inline="always", **_JIT)
def _rows_q4(codes, s2, zeros, has_zero, half, xq3, xs2, n, out):
    """out[t, r] = W[r] . x_t for every row r and prepared input t < n (half: bytes a group), four rows a pass
    (`_sums_q4`, `_quarter_rows`). Per group g of a row:
    s_g (P_g - 8 X_g) without zero points, P_g the sum of the stored nibbles 0..15 times x and X_g the group's sum of
    x (the offset of 8 folded into X_g, once per group); with zero points s_g P_g with each nibble made exact first
    (u - 8 - z_g: folding an offset of 8 + z up to 15 next to codes near it cancelled beyond the float32 tolerance
    of the reference tests). Each group's scale multiplies its sum once. With whole groups of a multiple of
    Q4_LANES bytes (int4 g16 and up) `_project_direct` runs `_rows_q4_vectors` instead."""
    rows, size = codes.shape[0], U(codes.shape[1])
    zero = np.float32(0.0)
    q = (rows + 3) // 4
    for i in range(q):
        r, i1, i2, i3 = _quarter_rows(i, q, rows)
        q0, q1, q2, q3 = codes[r], codes[i1], codes[i2], codes[i3]
        for t in range(n):
            even, odd = xq3[t, 0], xq3[t, 1]
            a0 = a1 = a2 = a3 = zero
            for g in range(s2.shape[1]):
                start = U(g) * half
                count = min(half, size - start)
                if has_zero:
                    eight = np.float32(8.0)
                    p0, p1, p2, p3 = _sums_q4(q0, q1, q2, q3, start, count, even, odd, eight + zeros[r, g],
                                              eight + zeros[i1, g], eight + zeros[i2, g], eight + zeros[i3, g])
                else:
                    p0, p1, p2, p3 = _sums_q4(q0, q1, q2, q3, start, count, even, odd, zero, zero, zero, zero)
                    folded = np.float32(8.0) * xs2[t, g]
                    p0, p1, p2, p3 = p0 - folded, p1 - folded, p2 - folded, p3 - folded
                a0 += s2[r, g] * p0
                a1 += s2[i1, g] * p1
                a2 += s2[i2, g] * p2
                a3 += s2[i3, g] * p3
            _store_quarters(out[t], i, q, a0, a1, a2, a3)


@njit(inline="always", **_JIT)
def _rows_q8(codes, s2, zeros, has_zero, size, xq3, xs2, n, out):
    """out[t, r] = W[r] . x_t for every int8 row r and prepared input t < n (size: codes a group), four rows a pass
    (`_sums_q8`, `_quarter_rows`): per group g, s_g (P_g - z_g X_g), P_g the sum of the codes times
    x, X_g the group's sum of x (the zero point folded, once per group: codes -128..127 dwarf it)."""
    rows, cols = codes.shape[0], U(codes.shape[1])
    zero = np.float32(0.0)
    q = (rows + 3) // 4
    for i in range(q):
        r, i1, i2, i3 = _quarter_rows(i, q, rows)
        q0, q1, q2, q3 = codes[r].view(np.int8), codes[i1].view(np.int8), codes[i2].view(np.int8), codes[i3].view(
            np.int8)
        for t in range(n):
            x = xq3[t, 0]
            a0 = a1 = a2 = a3 = zero
            for g in range(s2.shape[1]):
                start = U(g) * size
                count = min(size, cols - start)
                p0, p1, p2, p3 = _sums_q8(q0, q1, q2, q3, start, count, x)
                if has_zero:
                    xs = xs2[t, g]
                    p0 -= np.float32(zeros[r, g]) * xs
                    p1 -= np.float32(zeros[i1, g]) * xs
                    p2 -= np.float32(zeros[i2, g]) * xs
                    p3 -= np.float32(zeros[i3, g]) * xs
                a0 += s2[r, g] * p0
                a1 += s2[i1, g] * p1
                a2 += s2[i2, g] * p2
                a3 += s2[i3, g] * p3
            _store_quarters(out[t], i, q, a0, a1, a2, a3)


PREPARED_NONE, PREPARED_INTEGER, PREPARED_FLOAT = 0, 1, 2  # what `_project_direct`'s xq / xsum hold
DECLINED = 3  # `_project_direct` computed nothing: the caller decodes rows instead


@njit(**_JIT)
def _project_direct(store, codes, scales, scale_f16, zeros, has_zero, group, src, rows_of_src, n, out, xq, xsum,
                    s32, prepared=PREPARED_NONE, decline=False):
    """out[t, r] = sum_c W[r, c] * src[rows_of_src[t], c] for t < n, every row r of an int8 / int4 matrix (rows,
    row bytes): the codes multiplied as stored (`_rows_q4_integer`, `_rows_q4_vectors`, `_rows_q4`, `_rows_q8`);
    no decoded row. int4 of whole groups of 64 or 128 columns on an AVX2 target goes through integers
    (`cpu_q4_integer`); an input row the integer path cannot hold (a group's largest |x| not finite, too small for
    its step, or an outlier against the group's other values: `cpu_q4_integer.OUTLIER_RATIO`) takes the float
    kernel (which keeps Inf and NaN): with every row of the call up to Q4_FLOAT_TOKENS rows; alone up to
    MIXED_TOKENS rows, up to Q4_FLOAT_TOKENS such rows, the others staying in integers; else with every row.

    xq (>= n · 2 · cols + 2,), xsum (>= n · groups,), s32 (>= 5/4 · rows · groups,): float32 scratch (the integer
    path's pieces and lane sums in xq, its steps in xsum; the float32 scales and zero points of 0 in s32).
    prepared: what xq / xsum already hold for these src, rows_of_src and n (the value the call before on the same
    input returned: the gate projection's, for the up projection), so that the input is laid out once; returns what
    they hold afterwards (a PREPARED_* value).
    decline: where more than Q4_FLOAT_TOKENS rows leave the integer path, or any above MIXED_TOKENS rows (above
    Q4_FLOAT_TOKENS tokens, where the float kernel is slower than decoded rows), compute nothing and return
    DECLINED instead of running the float kernel on every row (`experts_into` asks: it decodes rows then)."""
    rows, cols = codes.shape[0], src.shape[1]
    size = cols if group == 0 else group
    groups = (cols + size - 1) // size
    xs2 = xsum[: n * groups].reshape((n, groups))
    integer = store == STORE_Q4 and _q4_integer_fit(U(size // 2), U(cols))
    if integer and prepared != PREPARED_FLOAT:
        span = groups * PIECES * size  # int8 pieces a row: groups x PIECES x (even, odd) x size / 2
        pieces = xq.view(np.int8)[: n * span].reshape((n, span))
        start = (n * span + 3) // 4  # the lane sums after the pieces, 4-byte aligned
        width = groups * SUM_VECTORS * LANES  # lane sums a row
        lane_sums = xq[start: start + n * width].view(np.int32).reshape((n, width))
        # rows it cannot hold: up to Q4_FLOAT_TOKENS tokens the float kernel serves every row (one pass over the
        # codes, as fast as the integer pass plus one for those rows); above, up to MIXED_TOKENS tokens, up to
        # Q4_FLOAT_TOKENS such rows take the float kernel each alone, the others staying in integers (not the
        # decoded rows); with more tokens one such row makes the call the float kernel's or the decoded rows'
        mixed = Q4_FLOAT_TOKENS < n <= MIXED_TOKENS
        failed = 0 if prepared == PREPARED_INTEGER else _prepare_pieces(
            src, rows_of_src, n, cols, size, pieces, lane_sums, xs2, Q4_FLOAT_TOKENS if mixed else 0)
        if failed == 0 or (mixed and failed <= Q4_FLOAT_TOKENS):
            if scale_f16:  # (a row not held gives an unspecified value here, replaced below)
                _rows_q4_integer(codes, scales.view(np.uint16), zeros, has_zero, U(size // 2), pieces, lane_sums,
                                 xs2, n, out)
            else:
                _rows_q4_integer(codes, scales.view(np.float32), zeros, has_zero, U(size // 2), pieces, lane_sums,
                                 xs2, n, out)
            if failed == 0:
                return PREPARED_INTEGER
            # the rows not held (steps[t, 0] < 0), one at a time through the float kernel; in increasing t, since
            # each such call lays its row out over the scratch of row 0, after reading row 0's mark
            for t in range(n):
                if xs2[t, 0] < 0:
                    _project_float(store, codes, scales, scale_f16, zeros, has_zero, size, True, src,
                                   rows_of_src[t: t + 1], 1, out[t: t + 1], xq, xsum, s32, PREPARED_NONE)
            return PREPARED_NONE  # the scratch now holds neither layout whole
        if decline and (failed > Q4_FLOAT_TOKENS or n > MIXED_TOKENS):
            return DECLINED
        return _project_float(store, codes, scales, scale_f16, zeros, has_zero, size, True, src, rows_of_src, n, out,
                              xq, xsum, s32, PREPARED_NONE)
    return _project_float(store, codes, scales, scale_f16, zeros, has_zero, size, integer, src, rows_of_src, n, out,
                          xq, xsum, s32, prepared)


@njit(**_JIT)
def _project_float(store, codes, scales, scale_f16, zeros, has_zero, size, declined, src, rows_of_src, n, out, xq,
                   xsum, s32, prepared):
    """`_project_direct`'s float kernels (`_rows_q4_vectors`, `_rows_q4`, `_rows_q8`) on n input rows, groups of
    size columns. int4 without zero points folds the offset of 8 into the group sums of x, which cancels from an
    outlier group (a large x against zero weights): where the rows hold one (declined: rows the integer path
    could not hold; else `cpu_q4_integer.any_outlier_row`), each nibble is made exact first instead, as with zero
    points of 0 (written into s32's bytes after the float32 scales). Returns PREPARED_FLOAT (xq / xsum hold the
    float layout of these rows)."""
    rows, cols = codes.shape[0], src.shape[1]
    groups = (cols + size - 1) // size
    half = (cols + 1) // 2 if store == STORE_Q4 else cols
    xs2 = xsum[: n * groups].reshape((n, groups))
    xq3 = xq[: n * 2 * half].reshape((n, 2, half))
    s2 = s32[: rows * groups].reshape((rows, groups))
    if prepared != PREPARED_FLOAT:
        _prepare_direct(store, src, rows_of_src, n, cols, size, xq3, xs2)
    exact = store == STORE_Q4 and not has_zero and (declined or any_outlier_row(src, rows_of_src, n, cols, size))
    if exact:
        z = s32.view(np.int8)[4 * rows * groups: 5 * rows * groups].reshape((rows, groups))
        z[:] = 0
    if store == STORE_Q4 and _q4_vectors_fit(U(size // 2), U(codes.shape[1])):
        if exact:
            if scale_f16:
                _rows_q4_vectors(codes, scales.view(np.uint16), z, True, U(size // 2), xq3, xs2, n, out)
            else:
                _rows_q4_vectors(codes, scales.view(np.float32), z, True, U(size // 2), xq3, xs2, n, out)
        elif scale_f16:  # the scales as stored: no float32 copy of the matrix's scales
            _rows_q4_vectors(codes, scales.view(np.uint16), zeros, has_zero, U(size // 2), xq3, xs2, n, out)
        else:
            _rows_q4_vectors(codes, scales.view(np.float32), zeros, has_zero, U(size // 2), xq3, xs2, n, out)
        return PREPARED_FLOAT
    _matrix_scales(scales, scale_f16, s2)
    # One call per storage: the group size is a loop bound, so no branch per group size is compiled.
    if store == STORE_Q4:
        if exact:
            _rows_q4(codes, s2, z, True, U(size // 2), xq3, xs2, n, out)
        else:
            _rows_q4(codes, s2, zeros, has_zero, U(size // 2), xq3, xs2, n, out)
    else:
        _rows_q8(codes, s2, zeros, has_zero, U(size), xq3, xs2, n, out)
    return PREPARED_FLOAT
