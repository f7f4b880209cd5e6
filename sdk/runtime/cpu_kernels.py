"""The CPU backend's compiled loops (numba): expert matrices read as they are stored, fused with the products.

Every expert matrix reaches these kernels as the raw bytes of the file's mmap'ed block, (experts, rows, row bytes)
uint8, with a storage code:

    STORE_F32  float32 rows                       used in place
    STORE_F16  float16 rows                       up to 3 tokens: widened in registers (`_f16_dots4`); else row by row
    STORE_Q8   int8 codes + scales (+ zero points) dequantized one row at a time (docs/format.md, "Dequantization")
    STORE_Q4   packed int4 codes + scales (+ zeros) the same, two columns per byte (colibri_sdk.format.quant)

A product `y[t, r] = sum_c W[r, c] * x[t, c]` decodes row r once into `buf` (cols,) float32 — exactly the values of
`colibri_sdk.format.quant.dequantize` and of NumPy's float16 → float32 cast — and multiplies it with every token
routed to the expert while it is in L1: each expert's rows are read once per call at any token count, and no
widened copy of a matrix is ever made. Sums are in float32 (the order of the additions is the compiler's, vectorised
with `fastmath` reassociation only: no flush of subnormals, no finite-math assumptions).

An int8 / int4 expert with at most `direct_tokens` tokens (every expert of this path for int8 and for int4 in
integers, 4 for other int4) is not decoded: `_project_direct` multiplies its codes as
stored against the input laid out once per call (int4: its even and odd columns, to meet a byte's low and high
nibble), four rows a pass a quarter of the matrix apart with each group's sum times its scale once (after llama.cpp's
ggml-cpu quantized dot products; docs/runtime.md, "int8 / int4 codes multiplied as stored"); on x86-64 with AVX2,
int4 g64 / g128 in integers (`cpu_q4_integer`).

`experts_into` runs one layer's routed experts (or a layer's shared experts) for the pairs grouped per expert
(`group_pairs`), adding `weight * expert(x)` to each token's output row in increasing expert order, as the
reference engine does (colibri_sdk.reference).

Compilation: `cache=True` writes the machine code next to this file (`__pycache__`) or, where the install is
read-only, under NUMBA_CACHE_DIR / the user's cache folder (numba's own rule); `warm_up()` compiles every kernel
once with the argument types the engine passes, which the CPU backend calls at load so that no call pays for it.
"""

from __future__ import annotations

import numpy as np

from .cpu_direct import (  # noqa: F401 - DIRECT_TOKENS: part of this module's interface
    DECLINED, DIRECT_TOKENS, PREPARED_NONE, _project_direct, direct_tokens,
)
from .cpu_jit import (  # noqa: F401 - the storage codes and the float16 widening are part of this module's interface
    _JIT, ACT_CLAMPED, ACT_SWIGLU, STORE_F16, STORE_F32, STORE_Q4, STORE_Q8, U, _f16_into, _f16_value,
    _prefetch_ahead, drop_stale_cache, f16_hardware, make_f16_value, njit,
)


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
def _project_streamed(store, codes, x, rows_of_x, n, out):
    """out[t, r] = sum_c W[r, c] * x[rows_of_x[t], c] for t < n (fewer than 4 tokens), every row r of a float32 or
    float16 matrix W (rows, row bytes) read in place, in four long streams: pass i reads rows i, i + q, i + 2q and
    i + 3q (q = rows // 4; `_dots4`, `_f16_dots4`: float16 widened in registers, no widened row written), so each
    quarter of the matrix is read front to back, one sequential stream the hardware prefetcher follows across
    pages. Rows side by side (eight a pass) start eight new 4 KiB pages every pass of a float32 row of 1024 columns,
    each met by a demand miss before the prefetcher catches up: one token, 2 x 2816 x 1024 float32 with the caches
    cold, 1 thread, median of 30: 10.0-10.3 GB/s eight side by side, 12.1-12.7 in quarters, 13.1-13.5 a read-only
    BLAS sdot of as many bytes (2-core EPYC host, 2026-12-07). The last rows % 4 rows one at a time."""
    rows = codes.shape[0]
    q = rows // 4
    for i in range(q):
        _prefetch_ahead(codes[i], codes[i + q], codes[i + 2 * q], codes[i + 3 * q])
        if store == STORE_F32:
            _dots4(codes[i].view(np.float32), codes[i + q].view(np.float32), codes[i + 2 * q].view(np.float32),
                   codes[i + 3 * q].view(np.float32), x, rows_of_x, n, out, i, q)
        else:
            _f16_dots4(codes[i].view(np.uint16), codes[i + q].view(np.uint16), codes[i + 2 * q].view(np.uint16),
                       codes[i + 3 * q].view(np.uint16), x, rows_of_x, n, out, i, q)
    for r in range(4 * q, rows):
        if store == STORE_F32:
            _dots(codes[r].view(np.float32), x, rows_of_x, n, out, r)
            continue
        h = codes[r].view(np.uint16)
        for t in range(n):
            xt = x[rows_of_x[t]]
            acc = np.float32(0.0)
            for c in range(U(xt.shape[0])):
                acc += _f16_value(h[c]) * xt[c]
            out[t, r] = acc


@njit(inline="always", **_JIT)
def _f16_dots4(h0, h1, h2, h3, x, rows_of_x, n, out, r, step):
    """out[t, r], out[t, r + step], out[t, r + 2 step], out[t, r + 3 step] for four float16 rows h0..h3 (cols,)
    uint16 and t < n: each value widened in registers (`_f16_value`) as it is multiplied."""
    cols = U(x.shape[1])
    for t in range(n):
        xt = x[rows_of_x[t]]
        a = b = c2 = d = np.float32(0.0)
        for c in range(cols):
            v = xt[c]
            a += _f16_value(h0[c]) * v
            b += _f16_value(h1[c]) * v
            c2 += _f16_value(h2[c]) * v
            d += _f16_value(h3[c]) * v
        out[t, r], out[t, r + step], out[t, r + 2 * step], out[t, r + 3 * step] = a, b, c2, d


@njit(**_JIT)
def _project(store, codes, scales, scale_f16, zeros, has_zero, group, x, rows_of_x, n, out, buf, sbuf):
    """out[t, r] = sum_c W[r, c] * x[rows_of_x[t], c] for t < n, every row r of W (rows, row bytes)."""
    cols = x.shape[1]
    if store <= STORE_F16 and n < 4:
        _project_streamed(store, codes, x, rows_of_x, n, out)
        return
    rows = codes.shape[0]
    # the other rows of a block (four rows only from 4 tokens on: `_row_block`)
    b1, b2, b3 = (np.empty_like(buf), np.empty_like(buf), np.empty_like(buf)) if n >= 4 else (buf, buf, buf)
    r = 0
    while r < rows:
        r += _row_block(store, codes, scales, scale_f16, zeros, has_zero, group, cols, r, x, rows_of_x, n, out, r,
                        buf, b1, b2, b3, sbuf)


@njit(**_JIT)  # not inlined: compiled once for both callers (it holds the largest loops)
def _row_block(store, codes, scales, scale_f16, zeros, has_zero, group, cols, r, x, rows_of_x, n, out, col, b0, b1,
               b2, b3, sbuf):
    """Rows r, r + 1, ... of W decoded (into b0..b3) and multiplied with the n tokens into out[:, col], out[:, col
    + 1], ...: four rows at a time from 4 tokens on (`_dots4`), else (fewer tokens, or the last rows of W) one
    (`_dots`). Returns the rows done."""
    w0 = _decode_row(store, codes[r], scales[r], scale_f16, zeros[r], has_zero, group, cols, b0, sbuf)
    if n < 4 or codes.shape[0] - r < 4:
        _dots(w0, x, rows_of_x, n, out, col)
        return 1
    w1 = _decode_row(store, codes[r + 1], scales[r + 1], scale_f16, zeros[r + 1], has_zero, group, cols, b1, sbuf)
    w2 = _decode_row(store, codes[r + 2], scales[r + 2], scale_f16, zeros[r + 2], has_zero, group, cols, b2, sbuf)
    w3 = _decode_row(store, codes[r + 3], scales[r + 3], scale_f16, zeros[r + 3], has_zero, group, cols, b3, sbuf)
    _dots4(w0, w1, w2, w3, x, rows_of_x, n, out, col, 1)
    return 4


@njit(inline="always", **_JIT)
def _dots4(w0, w1, w2, w3, x, rows_of_x, n, out, r, step):
    """out[t, r + j step] for rows wj (j = 0..3) and t < n: four rows times four tokens per pass (0.5 loads per
    multiply-add, sixteen sums in flight: in cache 50 G multiply-adds per second on one Zen 4 core, against 40 for
    two rows), the last n % 4 tokens four rows times one."""
    cols = U(w0.shape[0])
    t = 0
    while t + 4 <= n:
        x0, x1, x2, x3 = x[rows_of_x[t]], x[rows_of_x[t + 1]], x[rows_of_x[t + 2]], x[rows_of_x[t + 3]]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
        for c in range(cols):
            p0, p1, p2, p3 = x0[c], x1[c], x2[c], x3[c]
            u = w0[c]
            a0 += u * p0
            a1 += u * p1
            a2 += u * p2
            a3 += u * p3
            u = w1[c]
            b0 += u * p0
            b1 += u * p1
            b2 += u * p2
            b3 += u * p3
            u = w2[c]
            c0 += u * p0
            c1 += u * p1
            c2 += u * p2
            c3 += u * p3
            u = w3[c]
            d0 += u * p0
            d1 += u * p1
            d2 += u * p2
            d3 += u * p3
        r1, r2, r3 = r + step, r + 2 * step, r + 3 * step
        out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a0, a1, a2, a3
        out[t, r1], out[t + 1, r1], out[t + 2, r1], out[t + 3, r1] = b0, b1, b2, b3
        out[t, r2], out[t + 1, r2], out[t + 2, r2], out[t + 3, r2] = c0, c1, c2, c3
        out[t, r3], out[t + 1, r3], out[t + 2, r3], out[t + 3, r3] = d0, d1, d2, d3
        t += 4
    while t < n:
        xt = x[rows_of_x[t]]
        a = b = c2 = d = np.float32(0.0)
        for c in range(cols):
            v = xt[c]
            a += w0[c] * v
            b += w1[c] * v
            c2 += w2[c] * v
            d += w3[c] * v
        out[t, r], out[t, r + step], out[t, r + 2 * step], out[t, r + 3 * step] = a, b, c2, d
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
            experts with at most `direct_tokens` tokens), for min(tokens, DIRECT_TOKENS) rows.
    """
    hidden = x.shape[1]
    o1, o2, o3 = np.empty_like(buf_i), np.empty_like(buf_i), np.empty_like(buf_i)  # a block's other rows
    most_direct = direct_tokens(store, group, hidden, gate.shape[1])  # the same for every expert of the call
    for m in range(chosen.shape[0]):
        e = chosen[m]
        p0, p1 = starts[e], starts[e + 1]
        n = p1 - p0
        if n == 0:
            continue
        for i in range(n):
            tok[i] = order[p0 + i] // top_k
        direct = store >= STORE_Q8 and n <= most_direct
        streamed = store <= STORE_F16 and n < 4  # fp32 / fp16 read in place, in four streams (_project_streamed)
        inputs_direct = direct
        if direct:
            prepared = _project_direct(store, gate_w[e], gate_s[e], scale_f16, gate_z[e], has_zero, group, x, tok,
                                       n, gate, xq, xsum, s32, PREPARED_NONE, True)  # DECLINED: decoded rows
            if prepared == DECLINED:
                inputs_direct = False
            else:
                _project_direct(store, up_w[e], up_s[e], scale_f16, up_z[e], has_zero, group, x, tok, n, up, xq,
                                xsum, s32, prepared)  # the same input, laid out once
        if not inputs_direct:
            _project(store, gate_w[e], gate_s[e], scale_f16, gate_z[e], has_zero, group, x, tok, n, gate, buf_h,
                     sbuf_h)
            _project(store, up_w[e], up_s[e], scale_f16, up_z[e], has_zero, group, x, tok, n, up, buf_h, sbuf_h)
        if has_bias:
            for i in range(n):
                for c in range(gate.shape[1]):
                    gate[i, c] += gate_b[e, c]
                    up[i, c] += up_b[e, c]
        _activate(gate, up, n, act, limit, alpha)
        done = streamed
        if direct:
            done = _project_direct(store, down_w[e], down_s[e], scale_f16, down_z[e], has_zero, group, gate, ident,
                                   n, y, xq, xsum, s32, PREPARED_NONE, True) != DECLINED
        elif streamed:
            _project_streamed(store, down_w[e], gate, ident, n, y)
        if done:
            for i in range(n):
                w, dst, src = pair_weights[order[p0 + i]], out[tok[i]], y[i]
                for r in range(hidden):
                    bias = down_b[e, r] if has_bias else np.float32(0.0)
                    dst[r] += w * (src[r] + bias)
            continue
        # Down projection fused with the weighted sum: row r of W_down gives column r of every pair's output.
        codes, scales, zeros = down_w[e], down_s[e], down_z[e]
        inter = gate.shape[1]
        r0 = 0
        while r0 < hidden:
            done = _row_block(store, codes, scales, scale_f16, zeros, has_zero, group, inter, r0, gate, ident, n, y, 0,
                              buf_i, o1, o2, o3, sbuf_i)
            for r in range(r0, r0 + done):
                bias = down_b[e, r] if has_bias else np.float32(0.0)
                for i in range(n):
                    out[tok[i], r] += pair_weights[order[p0 + i]] * (y[i, r - r0] + bias)
            r0 += done
    return _all_finite(out)


@njit(inline="always", **_JIT)
def _all_finite(a):
    """True where every value of the 2-D float32 array a is finite (no Inf, no NaN)."""
    for t in range(a.shape[0]):
        row = a[t]
        for c in range(row.shape[0]):
            if not np.isfinite(row[c]):
                return False
    return True


@njit(**_JIT)
def scatter_add(out, tok, pair_w, y, n, bias, has_bias):
    """out[tok[i]] += pair_w[i] * (y[i] + bias) for i < n (the BLAS path's weighted sum, bias (hidden,))."""
    for i in range(n):
        dst, src, w = out[tok[i]], y[i], pair_w[i]
        for c in range(dst.shape[0]):
            b = bias[c] if has_bias else np.float32(0.0)
            dst[c] += w * (src[c] + b)


drop_stale_cache(experts_into)  # before any kernel of this module loads its cached machine code (cpu_jit)
