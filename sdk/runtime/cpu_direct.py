"""The CPU backend's int8 / int4 products multiplied as stored, for an expert with at most DIRECT_TOKENS tokens in
a call (after llama.cpp's ggml-cpu quantized dot products; docs/runtime.md, "int8 / int4 codes multiplied as
stored"): the input laid out once per call to meet the packing (int4: its even and odd columns against a byte's
low and high nibble), each row one loop over its codes with its group scales expanded to one per byte or code, no
decoded row. `cpu_kernels.experts_into` calls `_project_direct`.
"""

from __future__ import annotations

import numpy as np

from .cpu_jit import _JIT, STORE_Q4, U, _f16_into, njit


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


@njit(inline="always", **_JIT)
def _span_q8(q, x, start, count):
    """sum_j q[start + j] * x[start + j] for j < count, int8 codes q."""
    acc = np.float32(0.0)
    for j in range(count):
        c = start + U(j)
        acc += np.float32(q[c]) * x[c]
    return acc


@njit(inline="always", **_JIT)  # inlined into the row loop: a call per row cost a fifth (0.26 -> 0.22 ms a projection)
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
