"""The CPU backend's int4 products in integers, for an expert with fewer than 64 tokens (`cpu_direct.direct_tokens`),
on x86-64 with AVX2: the input split into three int8 pieces a group, each piece multiplied by the stored nibbles in
8-bit integer multiply-adds (`vpmaddubsw`, as llama.cpp's ggml-cpu Q4_0 x Q8_0 dot product), the sums exact in
integers until one conversion a group. Unlike llama.cpp, the input is not rounded to 8 bits: its three pieces hold
24 bits of each value relative to its group's largest |x| (float32 holds 24 bits relative to the value itself), so
the outputs stay within the reference tests' float32 tolerance; an input row with an outlier group
(OUTLIER_RATIO, ORDINARY), an Inf or NaN, or values below ~1e-31 takes the float kernel or decoded rows instead
(`cpu_direct._project_direct`, `decline`). docs/runtime.md, "int4 in integers".

A prepared input row (`_prepare_pieces`), per group g of `size` columns (half = size / 2 bytes of codes a row):
- pieces, int8: for each piece p < PIECES, the group's even columns (against a byte's low nibble), then its odd ones
  (high nibble), half values each; X = round(x / d_g) = q0 2^16 + q1 2^8 + q2, each q in -128..127 (balanced
  base-256 digits), |X| <= X_MAX.
- steps, float32: d_g = (the group's largest |x|) / X_MAX, rounded to float32 (X then rounded against that value).
- lane sums, int32: SUM_VECTORS vectors of LANES: the sums L0 of q0 and L12 of (q1 << 8) + q2 over each lane's
  bytes (bytes 4i..4i+3 of every VECTOR_BYTES, both nibbles: `vpmaddwd`'s lanes), and the offset term
  8 ((L0 << 16) + L12) (below 2^31: |q0| <= 127), so that the nibbles' offset 8 + z is subtracted exactly, in
  integers.

int4 groups are of 32, 64 or 128 columns (format/quant.py); this path serves 64 and 128 (16-bit sums of one group:
2 steps x 2 nibbles x 2 products x 15 x 128 < 2^15).
"""

from __future__ import annotations

import platform

import numpy as np

from .cpu_jit import _JIT, U, njit


PIECES = 3  # int8 pieces of a prepared input value: 24 bits relative to its group's largest |x|
X_MAX = 127 * 65536 + 127 * 256 + 127  # the largest |X| three balanced int8 pieces hold (0x7F7F7F)
VECTOR_BYTES = 32  # code bytes a step: one AVX2 register (64 int4 weights)
LANES = VECTOR_BYTES // 4  # 32-bit sums a row and group (`vpmaddwd`'s lanes)
# Code bytes ahead of the group being multiplied that each group's prefetch hint names (llvm.prefetch: x86
# `prefetcht0`, aarch64 `prfm`): shape A's g128 projections at T = 1 with the caches cold, fastest / median of 30,
# 0.221 / 0.284 -> 0.184 / 0.244 ms (2816 x 1024) and 0.211 / 0.263 -> 0.211 / 0.241 ms (1024 x 2816); 512, 1024
# and 4096 bytes no better, no change in cache (2-core EPYC host, 2026-12-07).
PREFETCH_BYTES = 2048
SUM_VECTORS = 3  # int32 vectors of LANES a group of a prepared row: the lane sums of the pieces, the offset term
SMALLEST_SCALE = np.float32(2.0**-126)  # d_g below float32's smallest normal: the float kernel serves the row
# A group's largest |x| above this many times the mean |x| of its ordinary values (an outlier, as LLMs' massive
# activations): the integer path declines the row. Every value keeps 24 bits of the largest, so the others keep
# fewer of their own; where the outlier meets zero weights in every row, the output is the others' sum alone
# (outliers of 1e3 x N(0, 1) erred by 2.5e-5 of the largest output with zero points, the float kernel by 1e-7).
OUTLIER_RATIO = 32.0
# The ordinary values of a group: those at most ORDINARY times its largest |x|, so that any number of equal outliers
# is left out of the mean they are measured against (measured against the mean of all the others, 5 channels of 1e5
# among N(0, 1) in a group of 128 passed and erred by 148x the engine tests' tolerance on a column of zero weights;
# against the values at most 16 times the group's mean, 4 of 64 and 8 of 128 still passed, 108-204x). Of groups of
# heavy-tailed inputs (silu(g) u, silu(3 g) 3 u, Student's t with 2 or 3 degrees of freedom; 20,000 groups each of 64
# and 128) it declines 0.07-7.1 % of the groups, against 0.07-6.9 % with that mean of 16.
ORDINARY = 0.5


def avx2_target() -> bool:
    """True where numba compiles for an x86-64 CPU with AVX2 (its host, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES
    where set): there `make_q4_integer_sums` uses `vpmaddubsw` / `vpmaddwd`, and the CPU backend's int4 products of
    whole groups of 64 and 128 columns take this path. Elsewhere (aarch64, the Jetson's CPU included) the float
    kernel `cpu_direct._rows_q4_vectors` serves them."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from numba.core import config

    if config.CPU_NAME:  # a named target: its listed features only
        return "+avx2" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx2", False))


def make_q4_integer_sums(avx2: bool | None = None, hardware_f16: bool | None = None):
    """A numba intrinsic q4_integer_sums(codes, pieces, lane_sums, steps, scales, zeros, groups, half) -> float32:
    for one packed int4 row codes (uint8, groups · half bytes), sum_g s[g] d_g sum_j (lo_j - 8 - z[g]) X_even[j] +
    (hi_j - 8 - z[g]) X_odd[j] over group g's bytes j (lo / hi a byte's nibbles), with pieces, lane_sums and steps
    one input row as `_prepare_pieces` lays them out (the module's layout), scales the row's group scales as stored
    ((groups,) float32, or float16 bits as uint16, widened exactly: `cpu_jit.f16_widen_ir`), zeros its zero points
    ((groups,) int8) or None. half: VECTOR_BYTES or twice that (g64, g128).

    Per VECTOR_BYTES code bytes: an `and 15` and a shift for the two nibbles, and per piece two 8-bit multiply-adds
    into 16-bit sums (unsigned nibble x signed piece, pairs added: `vpmaddubsw`), the group's steps unrolled, the
    pieces read as memory operands. Per group: the sums widened to 32 bits (`vpmaddwd` by ones, by 256 for the
    middle piece). Without zero points the group's whole sum over a lane, sum (u - 8) X, is formed in 32-bit
    integers ((high << 16) + middle + low, minus the offset term `_prepare_pieces` wrote: no more than 16 x 8 x
    X_MAX < 2^31 in magnitude; the steps between may wrap, the sum is exact) and converted once; with zero points
    (8 + z up to 135 for any int8 z) the high and low parts are converted apart, (8 + z) times the lane sums
    subtracted from each. Then times d_g and one multiply-add by s[g] into LANES float32 sums kept across groups;
    the lanes are added at the end. No 16-bit sum saturates and no result overflows, whatever the codes, pieces
    and zero points.

    One row a pass: two rows side by side (each loaded piece serving both) needed 12 16-bit sums and 6 pieces in
    registers, more than AVX2's 16, and the spills cost more than the loads saved (shape A's 2816 x 1024 g128
    projection in cache, 1 thread, fastest of 300 interleaved: 0.170 ms with two rows, 0.150 ms with one; with the
    integer combination and the prepared offset term, 0.146; 2-core EPYC host, 2026-12-07).

    avx2 None: `avx2_target()`. Without AVX2 the same operations are written in generic LLVM IR (widen, multiply, add
    pairs), which every target compiles, with the same results; the CPU backend takes this path only on an AVX2
    target (`_q4_integer_fit`), the tests run the generic form against it."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    from .cpu_jit import f16_hardware, f16_widen_ir
    from .cpu_jit import ir_fast as fast, ir_horizontal_sum as horizontal_sum, ir_splat as splat
    from .cpu_jit import ir_prefetch as prefetch, ir_vector_load as load

    use_avx2 = avx2_target() if avx2 is None else avx2
    hardware = f16_hardware() if hardware_f16 is None else hardware_f16
    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    vb = ir.VectorType(i8, VECTOR_BYTES)
    vh = ir.VectorType(i16, VECTOR_BYTES // 2)
    vi = ir.VectorType(i32, LANES)
    vf = ir.VectorType(f32, LANES)

    def pairs(builder, v, count):
        """(v[0] + v[1], v[2] + v[3], ...) of a vector of 2 count elements."""
        even = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, count), list(range(0, 2 * count, 2))))
        odd = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, count), list(range(1, 2 * count, 2))))
        return builder.add(even, odd)

    def multiply_add_bytes(builder, unsigned, signed):
        """<16 x i16>: unsigned[2i] signed[2i] + unsigned[2i+1] signed[2i+1] (no saturation is reached here)."""
        if use_avx2:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vh, [vb, vb]),
                                                "llvm.x86.avx2.pmadd.ub.sw")
            return builder.call(fn, [unsigned, signed])
        wide = ir.VectorType(i16, VECTOR_BYTES)
        return pairs(builder, builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide)),
                     VECTOR_BYTES // 2)

    def widen_pairs(builder, v, factor=1):
        """<8 x i32>: (v[2i] + v[2i+1]) factor of a <16 x i16> (factor < 2^15)."""
        if use_avx2:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vh, vh]),
                                                "llvm.x86.avx2.pmadd.wd")
            return builder.call(fn, [v, ir.Constant(vh, [factor] * (VECTOR_BYTES // 2))])
        widened = pairs(builder, builder.sext(v, ir.VectorType(i32, VECTOR_BYTES // 2)), LANES)
        return widened if factor == 1 else builder.mul(widened, ir.Constant(vi, [factor] * LANES))

    @intrinsic
    def q4_integer_sums(typingctx, codes_t, pieces, lane_sums, steps, scales_t, zeros_t, groups, half):
        sig = types.float32(codes_t, pieces, lane_sums, steps, scales_t, zeros_t, groups, half)
        scale_f16 = scales_t.dtype == types.uint16
        with_zeros = isinstance(zeros_t, types.Array)

        def codegen(context, builder, sig, args):
            def data(i):  # the data pointer of argument i
                return context.make_array(sig.args[i])(context, builder, args[i]).data

            row, xp, offs, dsc, scales = data(0), data(1), data(2), data(3), data(4)
            zeros = data(5) if with_zeros else None
            n_groups, step = args[6], args[7]
            fzero = ir.Constant(vf, [0.0] * LANES)
            low4, shift4 = ir.Constant(vb, [15] * VECTOR_BYTES), ir.Constant(vb, [4] * VECTOR_BYTES)
            sixteen = ir.Constant(vi, [16] * LANES)
            two16 = ir.Constant(vf, [65536.0] * LANES)
            total = cgutils.alloca_once_value(builder, fzero)
            piece_span = builder.mul(step, i64(2))  # bytes of one piece of a group: even columns, then odd
            with cgutils.for_range(builder, n_groups, intp=i64) as group_loop:
                g = group_loop.index
                codes_base = builder.mul(g, step)
                # a hint for the code line PREFETCH_BYTES ahead (the rows after this one: a stream's next rows); a
                # hint past the matrix's end does not fault
                prefetch(builder, builder.gep(row, [builder.add(codes_base, i64(PREFETCH_BYTES))]))
                pieces_base = builder.mul(g, builder.mul(piece_span, i64(PIECES)))
                d = splat(builder, builder.load(builder.gep(dsc, [g])), vf)
                s = builder.load(builder.gep(scales, [g]))
                scale = splat(builder, f16_widen_ir(builder, s, hardware) if scale_f16 else s, vf)

                def emit_group(size):
                    """The group's sums, its size bytes of codes unrolled."""
                    narrow = [None] * PIECES  # 16-bit sums a piece
                    for j in range(0, size, VECTOR_BYTES):
                        b = load(builder, row, builder.add(codes_base, i64(j)), vb, 1)
                        lo, hi = builder.and_(b, low4), builder.lshr(b, shift4)
                        for p in range(PIECES):
                            at = builder.add(builder.add(pieces_base, builder.mul(piece_span, i64(p))), i64(j))
                            both = builder.add(multiply_add_bytes(builder, lo, load(builder, xp, at, vb, 1)),
                                               multiply_add_bytes(builder, hi, load(builder, xp, builder.add(at, step),
                                                                                    vb, 1)))
                            narrow[p] = both if narrow[p] is None else builder.add(narrow[p], both)
                    at = builder.mul(g, i64(SUM_VECTORS * LANES))
                    high, middle, low = (widen_pairs(builder, narrow[0]), widen_pairs(builder, narrow[1], 256),
                                         widen_pairs(builder, narrow[2]))
                    if with_zeros:
                        o = builder.add(builder.sext(builder.load(builder.gep(zeros, [g])), i32), i32(8))
                        offset = splat(builder, o, vi)
                        high = builder.sub(high, builder.mul(offset, load(builder, offs, at, vi, 4)))
                        low = builder.sub(builder.add(middle, low),
                                          builder.mul(offset, load(builder, offs, builder.add(at, i64(LANES)), vi, 4)))
                        f = fast(builder.fadd(fast(builder.fmul(builder.sitofp(high, vf), two16)),
                                              builder.sitofp(low, vf)))
                    else:  # the whole sum in 32 bits, wrapping in between (no nsw flags): exact at the end
                        whole = builder.add(builder.add(builder.shl(high, sixteen), middle), low)
                        offset_term = load(builder, offs, builder.add(at, i64(2 * LANES)), vi, 4)
                        f = builder.sitofp(builder.sub(whole, offset_term), vf)
                    # (f d_g) s[g], in this order (no reassociation flag on the two products): f d_g is the group's
                    # sum in x's units, as the float kernel's, so the product s d_g, which can leave float32's
                    # range where the result does not, is never formed
                    scaled = builder.fmul(builder.fmul(f, d), scale)
                    scaled.flags.append("contract")
                    acc = builder.fadd(builder.load(total), scaled)
                    acc.flags.append("contract")
                    builder.store(acc, total)

                with builder.if_else(builder.icmp_unsigned("==", step, i64(2 * VECTOR_BYTES))) as (g128, g64):
                    with g128:
                        emit_group(2 * VECTOR_BYTES)
                    with g64:
                        emit_group(VECTOR_BYTES)
            return horizontal_sum(builder, builder.load(total))

        return sig, codegen

    return q4_integer_sums


AVX2 = avx2_target()
_q4_integer_sums = make_q4_integer_sums()


@njit(inline="always", **_JIT)
def _q4_integer_fit(half, cols):
    """True where `_rows_q4_integer` may serve an int4 matrix of cols columns: on an AVX2 target, group bytes half
    VECTOR_BYTES or twice that (g64, g128), every group whole (cols a multiple of 2 half: an odd column count, whose
    last byte holds one column, keeps the float kernel)."""
    return AVX2 and (half == U(VECTOR_BYTES) or half == U(2 * VECTOR_BYTES)) and cols % (2 * half) == 0


GROUP_HELD, GROUP_NOT_FINITE, GROUP_OUTLIER = 0, 1, 2  # `_group_verdict`


@njit(inline="always", **_JIT)
def _group_verdict(x, start, size):
    """(the largest |x| of x[start:start + size] float32, GROUP_HELD / GROUP_NOT_FINITE / GROUP_OUTLIER): an
    outlier group where the largest |x| is above OUTLIER_RATIO times the mean |x| of the group's ordinary values,
    those at most ORDINARY times the largest (a group without any holds only values near its largest: held)."""
    m = np.float32(0.0)
    finite = True
    for c in range(start, start + size):
        v = x[c]
        finite &= np.isfinite(v)
        m = max(m, abs(v))
    if not finite:
        return m, GROUP_NOT_FINITE
    cut = ORDINARY * np.float64(m)
    ordinary, count = 0.0, 0
    for c in range(start, start + size):
        a = abs(np.float64(x[c]))
        if a <= cut:
            ordinary += a
            count += 1
    if count and m > OUTLIER_RATIO * ordinary / count:
        return m, GROUP_OUTLIER
    return m, GROUP_HELD


@njit(**_JIT)
def any_outlier_row(src, rows_of_src, n, cols, size):
    """True where an input row src[rows_of_src[t]] (t < n; groups of size columns, the last one partial where cols
    is not a multiple) has an outlier group (`_group_verdict`; non-finite groups are not counted): the float
    kernel without zero points then makes each nibble exact instead of folding the offset of 8, which cancels from
    such a group (`cpu_direct._project_float`)."""
    for t in range(n):
        x = src[rows_of_src[t]]
        for start in range(0, cols, size):
            if _group_verdict(x, start, min(size, cols - start))[1] == GROUP_OUTLIER:
                return True
    return False


@njit(**_JIT)
def _prepare_pieces(src, rows_of_src, n, cols, size, pieces, lane_sums, steps, most=-1):
    """The n input rows src[rows_of_src[t]] (src (rows, cols) float32) laid out for `make_q4_integer_sums` (the
    module's layout), once per input and call (gate and up share it): pieces (n, >= cols · PIECES) int8, lane_sums
    (n, >= groups · SUM_VECTORS · LANES) int32, steps (n, >= groups) float32 = d_g. Whole groups of size columns (64
    or 128; cols a multiple). Returns how many rows it could not hold: those with a group whose largest |x| is not
    finite, or above OUTLIER_RATIO times the mean |x| of the group's ordinary values (`_group_verdict`), or whose
    d_g is below float32's smallest normal (inputs below ~1e-31). Such a row is marked by
    steps[t, 0] = -1 (a step is never negative), and its pieces and lane sums are left unspecified: the float
    kernel serves it (`cpu_direct._project_direct`), which keeps Inf and NaN as they are. most >= 0: stop at the
    first row past `most` such rows (returning most + 1: the caller then serves the call another way)."""
    half = size // 2
    groups = cols // size
    span = PIECES * 2 * half
    failed = 0
    for t in range(n):
        x = src[rows_of_src[t]]
        held = True
        for g in range(groups):
            m, verdict = _group_verdict(x, g * size, size)
            if verdict != GROUP_HELD:
                held = False
                break
            d = np.float32(np.float64(m) / X_MAX)
            if m > 0 and d < SMALLEST_SCALE:
                held = False
                break
            steps[t, g] = d
            inverse = 1.0 / np.float64(d) if d > 0 else 0.0
            base = g * span
            lanes = lane_sums[t, g * SUM_VECTORS * LANES:(g + 1) * SUM_VECTORS * LANES]
            lanes[:] = 0
            for local in range(size):
                v = np.int64(np.rint(np.float64(x[g * size + local]) * inverse))
                v = min(max(v, -X_MAX), X_MAX)  # d rounded to float32 may leave |x| / d a hair above X_MAX
                byte = local // 2
                at = base + (local % 2) * half + byte
                lane = (byte % VECTOR_BYTES) // 4
                for p in range(PIECES - 1, -1, -1):  # balanced base-256 digits, the last piece first
                    q = ((v + 128) & 255) - 128
                    pieces[t, at + p * 2 * half] = q
                    lanes[(p > 0) * LANES + lane] += q << (8 * (p == 1))
                    v = (v - q) >> 8
            for lane in range(LANES):
                lanes[2 * LANES + lane] = 8 * ((np.int64(lanes[lane]) << 16) + lanes[LANES + lane])
        if not held:
            steps[t, 0] = -1.0
            failed += 1
            if failed == most + 1:
                return failed
    return failed
