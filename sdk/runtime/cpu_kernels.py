"""The CPU backend's compiled loops (numba): expert matrices read as they are stored, fused with the products.

Every expert matrix reaches these kernels as the raw bytes of the file's mmap'ed block, (experts, rows, row bytes)
uint8, with a storage code:

    STORE_F32  float32 rows                       used in place
    STORE_F16  float16 rows                       one token: widened in registers (`_f16_fused`); else row by row
    STORE_Q8   int8 codes + scales (+ zero points) dequantized one row at a time (docs/format.md, "Dequantization")
    STORE_Q4   packed int4 codes + scales (+ zeros) the same, two columns per byte (colibri_sdk.format.quant)

A product `y[t, r] = sum_c W[r, c] * x[t, c]` decodes row r once into `buf` (cols,) float32 — exactly the values of
`colibri_sdk.format.quant.dequantize` and of NumPy's float16 → float32 cast — and multiplies it with every token
routed to the expert while it is in L1: each expert's rows are read once per call at any token count, and no
widened copy of a matrix is ever made. Sums are in float32 (the order of the additions is the compiler's, vectorised
with `fastmath` reassociation only: no flush of subnormals, no finite-math assumptions).

An int8 / int4 expert with at most DIRECT_TOKENS tokens is not decoded: `_project_direct` multiplies its codes as
stored against the input laid out once per call (int4: its even and odd columns, to meet a byte's low and high
nibble), one loop per row with the row's group scales expanded to one per byte (after llama.cpp's ggml-cpu quantized
dot products; docs/runtime.md, "int8 / int4 codes multiplied as stored").

`experts_into` runs one layer's routed experts (or a layer's shared experts) for the pairs grouped per expert
(`group_pairs`), adding `weight * expert(x)` to each token's output row in increasing expert order, as the
reference engine does (colibri_sdk.reference).

Compilation: `cache=True` writes the machine code next to this file (`__pycache__`) or, where the install is
read-only, under NUMBA_CACHE_DIR / the user's cache folder (numba's own rule); `warm_up()` compiles every kernel
once with the argument types the engine passes, which the CPU backend calls at load so that no call pays for it.
"""

from __future__ import annotations

import sys

import numpy as np


def _import_numba():
    """Import numba without PyYAML: numba imports yaml only to read an optional `.numba_config.yaml` in the working
    directory, which the runtime does not use (NUMBA_* environment variables still apply); the CPU runtime keeps
    its imports to NumPy, threadpoolctl and numba."""
    if "numba" in sys.modules or "yaml" in sys.modules:
        import numba
        return numba
    sys.modules["yaml"] = None  # `import yaml` raises ImportError while numba reads its configuration
    try:
        import numba
    finally:
        del sys.modules["yaml"]
    return numba


njit = _import_numba().njit


def f16_hardware() -> bool:
    """True where LLVM converts float16 to float32 in hardware: every aarch64 CPU (FCVT, the Jetson's Cortex-A78AE
    included) and x86 with F16C (VCVTPH2PS; Intel since 2012, AMD since 2012). Elsewhere LLVM would call
    compiler-rt's __extendhfsf2, which numba's JIT does not link, so the conversion is written in integer operations."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("f16c", False))


def make_f16_value(hardware: bool):
    """A numba intrinsic f16_value(h) -> float32: the exact value of the float16 whose bits are h (uint16), IEEE
    754 widening (subnormals exact, signed zeros, Inf and NaN kept), as NumPy's float16 → float32 cast.

    hardware: LLVM's `fpext half to float` (one vector instruction per 8 or 16 values, F16C / aarch64); else integer
    operations on 32-bit LLVM integers (numba's own integer operations widen to 64 bits, halving the vector width):
    the sign to bit 31, exponent and mantissa shifted by 13 and the float32 times 2^112 (exact, subnormals
    included), an all-ones exponent (Inf, NaN) moved to float32's all-ones exponent instead."""
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()

    @intrinsic
    def f16_value(typingctx, h):
        def codegen(context, builder, sig, args):
            if hardware:
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), f32)
            v = builder.zext(args[0], i32)
            rest = builder.shl(builder.and_(v, i32(0x7FFF)), i32(13))
            finite = builder.bitcast(builder.fmul(builder.bitcast(rest, f32), f32(2.0**112)), i32)
            special = builder.or_(rest, i32(0x70000000))  # exponent 31 -> 255, the mantissa kept (NaN stays NaN)
            is_special = builder.icmp_unsigned("==", builder.and_(v, i32(0x7C00)), i32(0x7C00))
            magnitude = builder.select(is_special, special, finite)
            sign = builder.shl(builder.and_(v, i32(0x8000)), i32(16))
            return builder.bitcast(builder.or_(sign, magnitude), f32)
        return types.float32(types.uint16), codegen
    return f16_value


_f16_value = make_f16_value(f16_hardware())

STORE_F32, STORE_F16, STORE_Q8, STORE_Q4 = 0, 1, 2, 3
ACT_SWIGLU, ACT_CLAMPED = 0, 1

# reassoc + contract let LLVM vectorise the float32 dot products (and use FMA); no nnan/ninf: silu's exp overflow
# must give the exact 0 limit, as in NumPy.
_FASTMATH = {"reassoc", "contract", "nsz"}
_JIT = dict(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")

U = np.uint64


@njit(**_JIT)
def _f16_into(src, buf):
    """buf[c] = float32(src[c]) for float16 bits src (n,) uint16 (`_f16_value`: exact, Inf and NaN kept, so a
    product with a non-finite stored value is non-finite and the CPU engine names the tensor: cpu_engine, "checked
    finite")."""
    for c in range(src.shape[0]):
        buf[c] = _f16_value(src[c])


@njit(**_JIT)
def _scales_into(scales_row, scale_f16, sbuf):
    """The row's group scales as float32 into sbuf (groups,); scales_row: the stored bytes of the row."""
    if scale_f16:
        _f16_into(scales_row.view(np.uint16), sbuf)
    else:
        src = scales_row.view(np.float32)
        for g in range(sbuf.shape[0]):
            sbuf[g] = src[g]


@njit(**_JIT)
def _decode_row(store, row, scales_row, scale_f16, zeros_row, has_zero, group, cols, buf, sbuf):
    """Row `row` (its stored bytes) as float32 values: a view for STORE_F32, else decoded into buf (cols,)."""
    if store == STORE_F32:
        return row.view(np.float32)
    if store == STORE_F16:
        _f16_into(row.view(np.uint16), buf)
        return buf
    _scales_into(scales_row, scale_f16, sbuf)
    # Unsigned indices: a signed one that LLVM cannot prove >= 0 keeps NumPy's negative-index wraparound in the
    # loop, which stops its vectorisation (measured 6-9x slower).
    size = U(cols if group == 0 else group)
    groups = sbuf.shape[0]
    if store == STORE_Q8:
        q = row.view(np.int8)
        for g in range(groups):
            s = sbuf[g]
            z = np.float32(zeros_row[g]) if has_zero else np.float32(0.0)
            start = U(g) * size
            count = min(size, U(cols) - start)
            for j in range(count):
                c = start + U(j)
                buf[c] = s * (np.float32(q[c]) - z)
        return buf
    # STORE_Q4: column 2j in the low nibble of byte j, 2j+1 in the high nibble, each code + 8; groups start at
    # even columns (group sizes 32, 64, 128).
    for g in range(groups):
        s = sbuf[g]
        z = np.float32(zeros_row[g]) if has_zero else np.float32(0.0)
        offset = np.float32(8.0) + z
        start = U(g) * size
        count = min(size, U(cols) - start)
        pairs = count // U(2)
        base = start // U(2)
        for j in range(pairs):
            b = row[base + U(j)]
            c = start + U(2) * U(j)
            buf[c] = s * (np.float32(b & np.uint8(15)) - offset)
            buf[c + U(1)] = s * (np.float32(b >> np.uint8(4)) - offset)
        if count % U(2):
            b = row[base + pairs]
            buf[start + count - U(1)] = s * (np.float32(b & np.uint8(15)) - offset)
    return buf


@njit(**_JIT)
def rows_into(store, codes, scales, scale_f16, zeros, has_zero, group, cols, start, stop, out, buf, sbuf):
    """Decode rows start..stop-1 of one matrix (rows, row bytes) into out (stop - start, cols) float32 (the
    tiles of the CPU backend's BLAS path for larger token counts)."""
    for r in range(start, stop):
        w = _decode_row(store, codes[r], scales[r], scale_f16, zeros[r], has_zero, group, cols, buf, sbuf)
        dst = out[r - start]
        for c in range(cols):
            dst[c] = w[c]


@njit(**_JIT)
def _f16_fused(codes, x, out):
    """out[0, r] = sum_c W[r, c] * x[c] for float16 bits W (rows, 2 · cols) uint8 read as stored: each value widened
    in registers (`_f16_value`), no widened row written."""
    cols = x.shape[0]
    for r in range(codes.shape[0]):
        h16 = codes[r].view(np.uint16)
        acc = np.float32(0.0)
        for c in range(cols):
            acc += _f16_value(h16[c]) * x[c]
        out[0, r] = acc


@njit(**_JIT)
def _project(store, codes, scales, scale_f16, zeros, has_zero, group, x, rows_of_x, n, out, buf, sbuf):
    """out[t, r] = sum_c W[r, c] * x[rows_of_x[t], c] for t < n, every row r of W (rows, row bytes)."""
    cols = x.shape[1]
    if store == STORE_F16 and n == 1:
        _f16_fused(codes, x[rows_of_x[0]], out)
        return
    rows = codes.shape[0]
    if n < 4:
        for r in range(rows):
            w = _decode_row(store, codes[r], scales[r], scale_f16, zeros[r], has_zero, group, cols, buf, sbuf)
            _dots(w, x, rows_of_x, n, out, r)
        return
    other = np.empty_like(buf)  # the second row of a pair
    for r in range(0, rows - 1, 2):
        w0 = _decode_row(store, codes[r], scales[r], scale_f16, zeros[r], has_zero, group, cols, buf, sbuf)
        w1 = _decode_row(store, codes[r + 1], scales[r + 1], scale_f16, zeros[r + 1], has_zero, group, cols, other,
                         sbuf)
        _dots2(w0, w1, x, rows_of_x, n, out, r)
    if rows % 2:
        w = _decode_row(store, codes[rows - 1], scales[rows - 1], scale_f16, zeros[rows - 1], has_zero, group, cols,
                        buf, sbuf)
        _dots(w, x, rows_of_x, n, out, rows - 1)


@njit(inline="always", **_JIT)
def _dots2(w0, w1, x, rows_of_x, n, out, r):
    """out[t, r] and out[t, r + 1] for rows w0, w1 and t < n: two rows times four tokens per pass (0.75 loads per
    multiply-add, eight sums in flight), the last n % 4 tokens by `_dots` on each row."""
    cols = U(w0.shape[0])
    t = 0
    while t + 4 <= n:
        x0, x1, x2, x3 = x[rows_of_x[t]], x[rows_of_x[t + 1]], x[rows_of_x[t + 2]], x[rows_of_x[t + 3]]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for c in range(cols):
            u, v = w0[c], w1[c]
            p0, p1, p2, p3 = x0[c], x1[c], x2[c], x3[c]
            a0 += u * p0
            a1 += u * p1
            a2 += u * p2
            a3 += u * p3
            b0 += v * p0
            b1 += v * p1
            b2 += v * p2
            b3 += v * p3
        out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a0, a1, a2, a3
        out[t, r + 1], out[t + 1, r + 1], out[t + 2, r + 1], out[t + 3, r + 1] = b0, b1, b2, b3
        t += 4
    while t < n:
        xt = x[rows_of_x[t]]
        a = b = np.float32(0.0)
        for c in range(cols):
            a += w0[c] * xt[c]
            b += w1[c] * xt[c]
        out[t, r], out[t, r + 1] = a, b
        t += 1


@njit(inline="always", **_JIT)
def _dots(w, x, rows_of_x, n, out, r):
    """out[t, r] = sum_c w[c] * x[rows_of_x[t], c] for t < n, four tokens per pass over w: each w[c] loaded once
    for four products (1.25 loads per multiply-add instead of 2), four sums in flight."""
    cols = U(w.shape[0])
    t = 0
    while t + 4 <= n:
        x0, x1, x2, x3 = x[rows_of_x[t]], x[rows_of_x[t + 1]], x[rows_of_x[t + 2]], x[rows_of_x[t + 3]]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for c in range(cols):
            v = w[c]
            a0 += v * x0[c]
            a1 += v * x1[c]
            a2 += v * x2[c]
            a3 += v * x3[c]
        out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a0, a1, a2, a3
        t += 4
    while t < n:
        xt = x[rows_of_x[t]]
        acc = np.float32(0.0)
        for c in range(cols):
            acc += w[c] * xt[c]
        out[t, r] = acc
        t += 1


# ---- int8 / int4 rows read as stored, for a few tokens (after llama.cpp's ggml-cpu dot products; docs/runtime.md)
DIRECT_TOKENS = 2  # an expert with at most this many tokens multiplies its int8 / int4 codes as stored


@njit(**_JIT)
def _prepare_direct(store, src, rows_of_src, n, cols, size, xq, xsum):
    """The n input rows src[rows_of_src[t]] laid out for `_dot_q8` / `_dot_q4`, once per projection and call.

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


@njit(**_JIT)
def _span_q8(q, x, start, count):
    """sum_j q[start + j] * x[start + j] for j < count, int8 codes q."""
    acc = np.float32(0.0)
    for j in range(count):
        c = start + U(j)
        acc += np.float32(q[c]) * x[c]
    return acc


@njit(**_JIT)
def _dot_q8(q, s, z, has_zero, size, x, xsum, expanded):
    """sum_c W[r, c] * x[c] for one int8 row r: per group g, s_g * (sum_c q_c x_c - z_g X_g), X_g = xsum[g]. One
    group (per-row scales): s_0 applied once to one long sum; groups: sum_c s_c q_c x_c with `expanded` the row's
    scales one per code (`_expand`), one loop over the row (a sum per group ends each group's few vector
    iterations with a horizontal reduction), the zero points' terms apart."""
    cols = U(q.shape[0])
    if s.shape[0] == 1:
        acc = _span_q8(q, x, U(0), cols)
        if has_zero:
            acc -= np.float32(z[0]) * xsum[0]
        return s[0] * acc
    acc = np.float32(0.0)
    for c in range(cols):
        acc += expanded[c] * (np.float32(q[c]) * x[c])
    if has_zero:
        for g in range(s.shape[0]):
            acc -= s[g] * (np.float32(z[g]) * xsum[g])
    return acc


@njit(inline="always", **_JIT)
def _expand(values, per, size, expanded, add):
    """expanded[c] = values[c // per] + add for c < size: a row's group scales (or offsets), one per packed byte
    (int4) or code (int8); per: bytes or codes a group."""
    for g in range(values.shape[0]):
        v = np.float32(values[g]) + add
        start = U(g) * per
        for j in range(min(per, size - start)):
            expanded[start + U(j)] = v


@njit(inline="always", **_JIT)
def _dot_q4_exact(row, expanded, offsets, even, odd):
    """sum_c W[r, c] * x[c] for one packed int4 row r with zero points: sum_c s_c ((u_c - o_c) x_c), u_c the stored
    nibble 0..15, o_c = 8 + z_g its group's offset (`offsets`, one per byte), s_c its group's scale: each code made
    exact in float32 before its product (folding the offset, up to 15, into a group sum of x next to codes near
    z_g cancelled beyond the float32 tolerance of the reference tests: 2e-5 of the token's largest value)."""
    acc = np.float32(0.0)
    for c in range(U(row.shape[0])):
        t = np.float32(row[c])
        high = np.floor(t * np.float32(0.0625))
        low = t - np.float32(16.0) * high
        o = offsets[c]
        acc += expanded[c] * ((low - o) * even[c] + (high - o) * odd[c])
    return acc


@njit(inline="always", **_JIT)
def _dot_q4_folded(row, expanded, s, even, odd, xsum):
    """sum_c W[r, c] * x[c] for one packed int4 row r without zero points: sum_c s_c u_c x_c - 8 sum_g s_g X_g, u_c
    the stored nibble 0..15, s_c its group's scale (`expanded`, one per byte: `_expand`), X_g = xsum[g] the
    sum of x over group g (`_prepare_direct`).

    One loop over the whole row: it vectorises with several accumulators, where a sum per group ends each group's
    few vector iterations with a horizontal reduction (measured 2.7x slower at g128)."""
    acc = np.float32(0.0)
    for c in range(U(row.shape[0])):
        t = np.float32(row[c])  # byte = 16 hi + lo; in float32 arithmetic (numba's integers are int64)
        high = np.floor(t * np.float32(0.0625))
        low = t - np.float32(16.0) * high
        acc += expanded[c] * (low * even[c] + high * odd[c])
    offset = np.float32(0.0)
    for g in range(s.shape[0]):
        offset += s[g] * xsum[g]
    return acc - np.float32(8.0) * offset


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
def _rows_q4(codes, s2, zeros, has_zero, half, xq3, xs2, n, out):
    """out[t, r] = W[r] . x_t for every row r and prepared input t < n (half: bytes a group): `_dot_q4_exact` with
    zero points, `_dot_q4_folded` without; a row's scales (and offsets) expanded to one per byte once per row."""
    size = U(codes.shape[1])
    expanded = np.empty(codes.shape[1], np.float32)
    offsets = np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        _expand(s2[r], half, size, expanded, np.float32(0.0))
        if has_zero:
            _expand(zeros[r], half, size, offsets, np.float32(8.0))
            for t in range(n):
                out[t, r] = _dot_q4_exact(codes[r], expanded, offsets, xq3[t, 0], xq3[t, 1])
        else:
            for t in range(n):
                out[t, r] = _dot_q4_folded(codes[r], expanded, s2[r], xq3[t, 0], xq3[t, 1], xs2[t])


@njit(inline="always", **_JIT)
def _rows_q8(codes, s2, zeros, has_zero, size, xq3, xs2, n, out):
    """out[t, r] = _dot_q8 of every row r and prepared input t < n (size: columns a group)."""
    cols = U(codes.shape[1])
    expanded = np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        q = codes[r].view(np.int8)
        if s2.shape[1] > 1:
            _expand(s2[r], size, cols, expanded, np.float32(0.0))
        for t in range(n):
            out[t, r] = _dot_q8(q, s2[r], zeros[r], has_zero, size, xq3[t, 0], xs2[t], expanded)


@njit(**_JIT)
def _project_direct(store, codes, scales, scale_f16, zeros, has_zero, group, src, rows_of_src, n, out, xq, xsum,
                    s32):
    """out[t, r] = sum_c W[r, c] * src[rows_of_src[t], c] for t < n, every row r of an int8 / int4 matrix (rows,
    row bytes): the codes multiplied as stored (`_rows_q4`, `_rows_q8`); no decoded row.

    xq (>= n · 2 · cols + 2,), xsum (>= n · groups,), s32 (>= rows · groups,): float32 scratch."""
    rows, cols = codes.shape[0], src.shape[1]
    size = cols if group == 0 else group
    groups = (cols + size - 1) // size
    half = (cols + 1) // 2 if store == STORE_Q4 else cols
    xq3 = xq[: n * 2 * half].reshape((n, 2, half))
    xs2 = xsum[: n * groups].reshape((n, groups))
    s2 = s32[: rows * groups].reshape((rows, groups))
    _prepare_direct(store, src, rows_of_src, n, cols, size, xq3, xs2)
    _matrix_scales(scales, scale_f16, s2)
    # One call per storage: the rows are one loop each at any group size (the group size only sets how far each
    # scale is expanded), so no branch per group size is compiled.
    if store == STORE_Q4:
        _rows_q4(codes, s2, zeros, has_zero, U(size // 2), xq3, xs2, n, out)
    else:
        _rows_q8(codes, s2, zeros, has_zero, U(size), xq3, xs2, n, out)


@njit(**_JIT)
def _activate(gate, up, n, act, limit, alpha):
    """gate[:n] = SwiGLU (silu(gate) * up) or gpt-oss's clamped SwiGLU of gate[:n], up[:n] (colibri_sdk.reference)."""
    one = np.float32(1.0)
    for t in range(n):
        g, u = gate[t], up[t]
        for c in range(g.shape[0]):
            a = g[c]
            if act == ACT_CLAMPED:
                a = min(a, limit)
                b = max(min(u[c], limit), -limit)
                g[c] = a * (one / (one + np.exp(-(a * alpha)))) * (b + one)
            else:
                g[c] = a / (one + np.exp(-a)) * u[c]


@njit(**_JIT)
def group_pairs(ids, num_experts, counts, order):
    """Group the (token, slot) pairs of ids (tokens, top_k) by expert: counts (experts + 1,) becomes the start of
    each expert's pairs in order (tokens * top_k,), each pair as token * top_k + slot, tokens increasing. A
    dropped pair (expert -1, expert capacity) is skipped. Returns the number of pairs kept."""
    tokens, k = ids.shape
    for e in range(num_experts + 1):
        counts[e] = 0
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j]
            if e >= 0:
                counts[e + 1] += 1
    for e in range(num_experts):
        counts[e + 1] += counts[e]
    fill = counts[:num_experts].copy()
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j]
            if e >= 0:
                order[fill[e]] = t * k + j
                fill[e] += 1
    return counts[num_experts]


@njit(**_JIT)
def experts_into(x, order, starts, pair_weights, top_k, chosen, store, scale_f16, has_zero, group,
                 gate_w, gate_s, gate_z, up_w, up_s, up_z, down_w, down_s, down_z,
                 has_bias, gate_b, up_b, down_b, act, limit, alpha, out, tok, gate, up, buf_h, buf_i, sbuf_h, sbuf_i,
                 ident, y, xq, xsum, s32):
    """out[token] += w_pair * expert(x[token]) for the pairs of each expert in `chosen` (increasing), SwiGLU
    experts (gate/up (experts, intermediate, bytes), down (experts, hidden, bytes), as stored).

    Args:
        x: (tokens, hidden) float32; out: (tokens, hidden) float32, added to.
        order, starts: the pairs grouped by expert (group_pairs); pair p = token * top_k + slot.
        pair_weights: (tokens * top_k,) float32 routing weights (pair p's weight at p).
        chosen: (m,) int64 experts to run here, increasing.
        gate_b, up_b (experts, intermediate), down_b (experts, hidden): float32 biases where has_bias.
        tok (tokens,) int64, gate/up (tokens, intermediate), buf_h (hidden,), buf_i (intermediate,), sbuf_*:
            scratch.
        ident (tokens,) int64 0, 1, 2, ...; y (tokens, hidden) float32: the down projection's sums (the direct
            path's, or column 0 of one row's); xq, xsum, s32: the scratch of `_project_direct` (int8 / int4
            experts with at most DIRECT_TOKENS tokens).
    """
    hidden = x.shape[1]
    other_i = np.empty_like(buf_i)  # the second decoded row of a pair (`_dots2`)
    for m in range(chosen.shape[0]):
        e = chosen[m]
        p0, p1 = starts[e], starts[e + 1]
        n = p1 - p0
        if n == 0:
            continue
        for i in range(n):
            tok[i] = order[p0 + i] // top_k
        direct = store >= STORE_Q8 and n <= DIRECT_TOKENS
        if direct:
            _project_direct(store, gate_w[e], gate_s[e], scale_f16, gate_z[e], has_zero, group, x, tok, n, gate, xq,
                            xsum, s32)
            _project_direct(store, up_w[e], up_s[e], scale_f16, up_z[e], has_zero, group, x, tok, n, up, xq, xsum,
                            s32)
        else:
            _project(store, gate_w[e], gate_s[e], scale_f16, gate_z[e], has_zero, group, x, tok, n, gate, buf_h,
                     sbuf_h)
            _project(store, up_w[e], up_s[e], scale_f16, up_z[e], has_zero, group, x, tok, n, up, buf_h, sbuf_h)
        if has_bias:
            for i in range(n):
                for c in range(gate.shape[1]):
                    gate[i, c] += gate_b[e, c]
                    up[i, c] += up_b[e, c]
        _activate(gate, up, n, act, limit, alpha)
        if direct:
            _project_direct(store, down_w[e], down_s[e], scale_f16, down_z[e], has_zero, group, gate, ident, n, y,
                            xq, xsum, s32)
            for i in range(n):
                w, dst, src = pair_weights[order[p0 + i]], out[tok[i]], y[i]
                for r in range(hidden):
                    bias = down_b[e, r] if has_bias else np.float32(0.0)
                    dst[r] += w * (src[r] + bias)
            continue
        # Down projection fused with the weighted sum: row r of W_down gives column r of every pair's output.
        codes, scales, zeros = down_w[e], down_s[e], down_z[e]
        inter = gate.shape[1]
        step = 2 if n >= 4 else 1  # two rows per pass from 4 tokens on (`_dots2`)
        for r0 in range(0, hidden, step):
            w = _decode_row(store, codes[r0], scales[r0], scale_f16, zeros[r0], has_zero, group, inter, buf_i,
                            sbuf_i)
            if step == 2 and r0 + 1 < hidden:
                w1 = _decode_row(store, codes[r0 + 1], scales[r0 + 1], scale_f16, zeros[r0 + 1], has_zero, group,
                                 inter, other_i, sbuf_i)
                _dots2(w, w1, gate, ident, n, y, 0)
            else:
                _dots(w, gate, ident, n, y, 0)
            for r in range(r0, min(r0 + step, hidden)):
                bias = down_b[e, r] if has_bias else np.float32(0.0)
                for i in range(n):
                    out[tok[i], r] += pair_weights[order[p0 + i]] * (y[i, r - r0] + bias)


@njit(**_JIT)
def scatter_add(out, tok, pair_w, y, n, bias, has_bias):
    """out[tok[i]] += pair_w[i] * (y[i] + bias) for i < n (the BLAS path's weighted sum, bias (hidden,))."""
    for i in range(n):
        dst, src, w = out[tok[i]], y[i], pair_w[i]
        for c in range(dst.shape[0]):
            b = bias[c] if has_bias else np.float32(0.0)
            dst[c] += w * (src[c] + b)


@njit(**_JIT)
def router_f16(x, router, logits):
    """logits (tokens, experts) = x (tokens, hidden) float32 @ router (hidden, experts) float16 bits (uint16), row
    by row of the router (each read once), summed in float32."""
    tokens, hidden = x.shape
    experts = router.shape[1]
    row = np.empty(experts, np.float32)
    logits[:tokens] = 0.0
    for h in range(hidden):
        _f16_into(router[h], row)
        for t in range(tokens):
            v = x[t, h]
            for e in range(experts):
                logits[t, e] += v * row[e]
