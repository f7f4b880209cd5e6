"""The CPU backend's routing in one compiled call (numba): top-k selection, routing weights and the pairs grouped
by expert, from the router logits, for every routing scheme without expert groups.

Formulas: `colibri_sdk.reference.topk_route` (v1) and `route_v2` (v2; docs/format.md, "Semantics" and "Semantics
v2"), in float32, token by token:

    topk_softmax   S = top-k of z; w = exp(z[S] - z[S_0]) / sum                      (Mixtral)
    softmax_topk   p = exp(z - max z) / sum; S = top-k of p (+ correction); w = p[S]  (OLMoE, Qwen-MoE)
    sigmoid_topk   p = 1 / (1 + exp(-z)); S = top-k of p (+ correction); w = p[S]     (DeepSeek-V3 without groups)

then, v2 only, w /= sum(w) + 1e-20 where norm_topk (not for topk_softmax), and w *= routed_scaling_factor where it
is not 1. Top-k is stable: larger first, ties towards the lower expert index. Sums over experts are added in NumPy's
order (`_sum`: its pairwise summation with eight partial sums), so a weight differs from the NumPy path's at most
by the exponential's last bit (libm's `expf` here, NumPy's own vectorised one there).

Why compiled: at one token the NumPy path is about fifteen array operations (sort, exponentials, gathers, the pair
grouping), 0.35 ms per layer with the caches cold (a layer of shape A, bench/runtime_cpu_bench.py) against
0.05-0.1 ms for this call; a MoE forward pass at decode sizes pays it once per layer. The helpers are compiled
as functions of their own, not inlined: inlined, the sum's split levels made route_grouped take 67 s to compile
(4.9 s now, once per install; numba's cache keeps it).

Group-limited selection (n_group > 1), more than MAX_EXPERTS experts and logits that are not all finite take the NumPy path
(`colibri_sdk.runtime.cpu_engine`): `route_grouped` then returns -1 and writes nothing the caller reads.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .cpu_jit import _f16_value, drop_stale_cache, njit

SCHEME_TOPK_SOFTMAX, SCHEME_SOFTMAX_TOPK, SCHEME_SIGMOID_TOPK = 0, 1, 2  # ROUTING_* of the format's header
MAX_EXPERTS = 768  # `_sum` adds up to 968 values in NumPy's order (three levels of its pairwise split)
# No fastmath: the additions stay in the order written (NumPy's), which reassociation would let LLVM change.
_EXACT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**_EXACT)
def _sum8(v, start, n):
    """NumPy's pairwise sum of v[start:start + n], 8 <= n <= 128: eight partial sums over i % 8, combined
    ((0+1)+(2+3))+((4+5)+(6+7)), then the rest one by one."""
    r0, r1, r2, r3 = v[start], v[start + 1], v[start + 2], v[start + 3]
    r4, r5, r6, r7 = v[start + 4], v[start + 5], v[start + 6], v[start + 7]
    i = 8
    while i < n - n % 8:
        r0 += v[start + i]
        r1 += v[start + i + 1]
        r2 += v[start + i + 2]
        r3 += v[start + i + 3]
        r4 += v[start + i + 4]
        r5 += v[start + i + 5]
        r6 += v[start + i + 6]
        r7 += v[start + i + 7]
        i += 8
    acc = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        acc += v[start + i]
        i += 1
    return acc


@njit(**_EXACT)
def _half(n):
    """Where NumPy's pairwise sum splits n > 128 values: n // 2 rounded down to a multiple of 8."""
    h = n // 2
    return h - h % 8


@njit(**_EXACT)
def _split1(v, start, n):  # n <= 256
    if n <= 128:
        return _sum8(v, start, n)
    h = _half(n)
    return _sum8(v, start, h) + _sum8(v, start + h, n - h)


@njit(**_EXACT)
def _split2(v, start, n):  # n <= 512
    if n <= 128:
        return _sum8(v, start, n)
    h = _half(n)
    return _split1(v, start, h) + _split1(v, start + h, n - h)


@njit(**_EXACT)
def _sum(v, n):
    """sum(v[:n]) (n <= MAX_EXPERTS) in NumPy's order for float32 (pairwise_sum,
    numpy/_core/src/umath/loops_utils.h.src): n < 8 one by one; n <= 128 `_sum8`; above, the two halves (the first
    a multiple of 8 long) summed so and added."""
    if n < 8:
        acc = np.float32(0.0)
        for i in range(n):
            acc += v[i]
        return acc
    if n <= 128:
        return _sum8(v, 0, n)
    h = _half(n)
    return _split2(v, 0, h) + _split2(v, h, n - h)


@njit(**_EXACT)
def _top_k(choice, k, picked):
    """picked[:k] = the k largest of choice (experts,), larger first, ties towards the lower index (NumPy's stable
    argsort of -choice)."""
    filled = 0
    for e in range(choice.shape[0]):
        v = choice[e]
        if filled < k:
            j = filled
            filled += 1
        elif v > choice[picked[k - 1]]:
            j = k - 1
        else:
            continue
        while j > 0 and v > choice[picked[j - 1]]:
            picked[j] = picked[j - 1]
            j -= 1
        picked[j] = e


def _router_value(v):
    """A stored router value as float32: float16 bits (uint16) widened exactly (`_f16_value` when compiled),
    float32 as is."""
    if isinstance(v, (np.integer, int)):
        return np.float32(np.array(v, np.uint16).view(np.float16))
    return np.float32(v)


@overload(_router_value)
def _router_value_typed(v):
    if isinstance(v, types.Integer):
        return lambda v: _f16_value(v)
    return lambda v: v


@njit(**_EXACT)
def logits_into(x, router, router_bias, has_router_bias, logits):
    """logits (tokens, experts) = x (tokens, hidden) float32 @ router (hidden, experts) (float32, or float16 bits
    as uint16, widened exactly), the sums over hidden in increasing order, + router_bias (experts,) where
    has_router_bias."""
    tokens, hidden = x.shape
    experts = router.shape[1]
    for t in range(tokens):
        z = logits[t]
        for e in range(experts):
            z[e] = np.float32(0.0)
        for h in range(hidden):
            v = x[t, h]
            row = router[h]
            for e in range(experts):
                z[e] += v * _router_value(row[e])
        if has_router_bias:
            for e in range(experts):
                z[e] += router_bias[e]


@njit(**_EXACT)
def route_grouped(x, router, router_bias, has_router_bias, scheme, by_logits, top_k, norm_topk, scale, correction,
                  has_correction, logits, pair_w, starts, order, used):
    """Route every token of x (tokens, hidden) float32 and group the pairs by expert.

    Args:
        router: (hidden, experts) float32, or float16 bits (uint16: a v1 fp16 file's router); router_bias
            (experts,) float32, added to the logits where has_router_bias.
        scheme: SCHEME_* (the header's routing); by_logits: select on the logits, not the scores (v1's
            softmax_topk, `topk_route`; the same experts but for ties the scores' rounding makes); norm_topk:
            renormalise the k weights (v2, not topk_softmax); scale: float32 routed_scaling_factor (1 for v1);
            correction (experts,) float32, added to the scores for the selection only where has_correction.

    Writes:
        logits (>= tokens, experts) float32: the router logits, summed over hidden in increasing order (the NumPy
            path uses BLAS's order: the same within float32 rounding).
        pair_w (tokens * top_k,) float32: pair p = token * top_k + slot's weight.
        starts (experts + 1,), order (tokens * top_k,) int64: as `cpu_kernels.group_pairs`.
        used (experts,) int64: its first m entries the experts with pairs, increasing.

    Returns:
        (m, the most pairs of one expert), or (-1, 0) where a logit is not finite (the caller routes with NumPy).
    """
    logits_into(x, router, router_bias, has_router_bias, logits)
    tokens, experts = x.shape[0], logits.shape[1]
    scores = np.empty(experts, np.float32)
    choice = np.empty(experts, np.float32)
    picked = np.empty(top_k, np.int64)
    sel = np.empty(top_k, np.float32)
    ids = np.empty(tokens * top_k, np.int64)
    one = np.float32(1.0)
    for t in range(tokens):
        z = logits[t]
        for e in range(experts):
            if not np.isfinite(z[e]):
                return -1, 0
        if scheme == SCHEME_TOPK_SOFTMAX:
            _top_k(z, top_k, picked)
            first = z[picked[0]]
            for j in range(top_k):
                sel[j] = np.exp(z[picked[j]] - first)
            total = _sum(sel, top_k)
            for j in range(top_k):
                sel[j] = sel[j] / total
        else:
            if scheme == SCHEME_SOFTMAX_TOPK:
                top = z[0]
                for e in range(1, experts):
                    top = max(top, z[e])
                for e in range(experts):
                    scores[e] = np.exp(z[e] - top)
                total = _sum(scores, experts)
                for e in range(experts):
                    scores[e] = scores[e] / total
            else:
                for e in range(experts):
                    scores[e] = one / (one + np.exp(-z[e]))
            for e in range(experts):
                choice[e] = scores[e] + correction[e] if has_correction else scores[e]
            _top_k(z if by_logits else choice, top_k, picked)
            for j in range(top_k):
                sel[j] = scores[picked[j]]
            if norm_topk:
                total = _sum(sel, top_k) + np.float32(1e-20)
                for j in range(top_k):
                    sel[j] = sel[j] / total
        for j in range(top_k):
            pair_w[t * top_k + j] = sel[j] * scale if scale != one else sel[j]
            ids[t * top_k + j] = picked[j]
    # the pairs grouped by expert, tokens increasing (cpu_kernels.group_pairs)
    for e in range(experts + 1):
        starts[e] = 0
    for p in range(tokens * top_k):
        starts[ids[p] + 1] += 1
    m, most = 0, 0
    for e in range(experts):
        count = starts[e + 1]
        if count:
            used[m] = e
            m += 1
            most = max(most, count)
        starts[e + 1] += starts[e]
    fill = starts[:experts].copy()
    for p in range(tokens * top_k):
        e = ids[p]
        order[fill[e]] = p
        fill[e] += 1
    return m, most


drop_stale_cache(route_grouped)  # before any kernel of this module loads its cached machine code (cpu_jit)
