"""The CPU backend's compiled routing (sdk/runtime/cpu_routing.py) against the NumPy routing of the reference
(colibri_sdk.reference.topk_route, route_v2): the same experts in the same order for every scheme, ties towards the
lower index, weights within the last bits of the exponential (8 units in the last place), sums in NumPy's own order, the pairs grouped as
`cpu_kernels.group_pairs` groups them, a non-finite logit handed back; and an engine whose scheme has no expert
groups, with every v2 routing feature, against the float64 reference engine.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from numba import njit

from colibri_sdk.reference import route_v2, topk_route
from colibri_sdk.runtime import cpu_kernels, cpu_routing

from test_cpu_engine import BASE, TOKENS, assert_matches_reference, write_v2


def route(logits, scheme, v1, top_k, norm=False, scale=1.0, correction=None, router_bias=None):
    """cpu_routing.route_grouped on logits (an identity router); returns (m, most, pair weights, pair experts,
    used experts, starts, order)."""
    tokens, experts = logits.shape
    pair_w, order = np.zeros(tokens * top_k, np.float32), np.zeros(tokens * top_k, np.int64)
    starts, used = np.zeros(experts + 1, np.int64), np.zeros(experts, np.int64)
    ones = np.ones(experts, np.float32)
    m, most = cpu_routing.route_grouped(
        logits, np.eye(experts, dtype=np.float32), ones if router_bias is None else router_bias,
        router_bias is not None, scheme, v1, top_k, norm, np.float32(scale), ones if correction is None else correction,
        correction is not None, np.zeros((tokens, experts), np.float32), pair_w, starts, order, used)
    chosen = np.full(tokens * top_k, -1)
    for e in range(experts):
        chosen[order[starts[e]:starts[e + 1]]] = e
    return m, most, pair_w, chosen.reshape(tokens, top_k), used[:max(m, 0)], starts, order


def header(scheme, top_k, norm=False, scale=1.0):
    return types.SimpleNamespace(routing=scheme, top_k=top_k, n_group=1, topk_group=1, group_score=0,
                                 norm_topk=norm, routed_scaling_factor=scale)


CASES = [(8, 2), (16, 16), (64, 8), (128, 8), (200, 6), (512, 10)]  # (experts, top_k)


SCHEMES = [(True, 0), (True, 1), (False, 0), (False, 1), (False, 2)]  # (v1, routing): v1 has no sigmoid routing


@pytest.mark.parametrize("experts,top_k", CASES)
@pytest.mark.parametrize("v1,scheme", SCHEMES,
                         ids=[f"{'v1' if v else 'v2'}-{('topk_softmax', 'softmax_topk', 'sigmoid_topk')[s]}"
                              for v, s in SCHEMES])
def test_the_same_experts_and_weights_as_the_numpy_routing(experts, top_k, v1, scheme):
    rng = np.random.default_rng(experts * 10 + scheme)
    tokens = 9
    logits = (rng.standard_normal((tokens, experts)) * 3).astype(np.float32)
    logits[0, 1] = logits[0, 4] = logits[0].max() + 1  # a tie at the top: the lower expert first
    logits[1, :] = 0.5  # every expert tied
    correction = None if v1 else (rng.standard_normal(experts) * 0.1).astype(np.float32)
    if correction is not None:  # experts 1 and 4 stay tied at the top of token 0's selection scores
        correction[1] = correction[4] = correction.max() + 1
    norm, scale = (False, 1.0) if v1 else (True, 2.5)
    m, most, pair_w, chosen, used, starts, order = route(logits, scheme, v1, top_k, norm, scale, correction)
    if v1:
        ids, weights = topk_route(logits, top_k, scheme)
    else:
        ids, weights = route_v2(logits, header(scheme, top_k, norm, scale), correction)
    np.testing.assert_array_equal(chosen, ids)
    assert chosen[0, 0] == 1 and chosen[0, 1] == 4, chosen[0]
    if correction is None or scheme == 0:  # the correction bias orders tied scores by itself
        assert list(chosen[1]) == list(range(top_k)), chosen[1]
    ulps = np.abs(pair_w.view(np.int32).astype(np.int64) - weights.astype(np.float32).reshape(-1).view(np.int32))
    assert ulps.max() <= 8, ulps.max()  # libm's expf against NumPy's vectorised exp, then a sum and a division
    # the grouping: cpu_kernels.group_pairs on the same experts
    want_starts, want_order = np.zeros(experts + 1, np.int64), np.zeros(tokens * top_k, np.int64)
    cpu_kernels.group_pairs(ids.astype(np.int64), experts, want_starts, want_order)
    np.testing.assert_array_equal(starts, want_starts)
    np.testing.assert_array_equal(order, want_order)
    counts = np.diff(want_starts)
    np.testing.assert_array_equal(used, np.flatnonzero(counts))
    assert (m, most) == (np.count_nonzero(counts), counts.max())


def test_the_router_product_and_bias_are_the_logits():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    router = rng.standard_normal((40, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    logits = np.zeros((3, 8), np.float32)
    pair_w, order = np.zeros(6, np.float32), np.zeros(6, np.int64)
    for stored in (router, router.astype(np.float16).view(np.uint16)):
        cpu_routing.route_grouped(x, stored, bias, True, 0, False, 2, False, np.float32(1), bias, False, logits,
                                  pair_w, np.zeros(9, np.int64), order, np.zeros(8, np.int64))
        widened = router if stored.dtype == np.float32 else router.astype(np.float16).astype(np.float64)
        want = x.astype(np.float64) @ widened + bias
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_logit_is_handed_back(bad):
    logits = np.arange(16, dtype=np.float32).reshape(2, 8)
    logits[1, 5] = bad
    assert route(logits, 0, True, 2)[:2] == (-1, 0)


def test_sums_in_numpys_order():
    """`_sum` (n <= 968, NumPy's pairwise split) gives NumPy's float32 sum bit for bit, where another order
    would not (values of mixed magnitudes)."""
    add = njit(lambda v, n: cpu_routing._sum(v, n))
    rng = np.random.default_rng(5)
    v = (rng.standard_normal(968) * 10.0 ** rng.integers(-4, 5, 968)).astype(np.float32)
    differs = 0
    for n in list(range(1, 300)) + [383, 384, 500, 511, 512, 513, 767, 768, 900, 968]:
        want = v[:n].sum()
        assert np.float32(add(v, n)).view(np.int32) == want.view(np.int32), n
        differs += np.float32(np.cumsum(v[:n], dtype=np.float32)[-1]) != want
    assert differs > 0  # the test can tell NumPy's order from one by one
    assert cpu_routing.MAX_EXPERTS <= 968


@pytest.mark.parametrize("routing", [0, 1, 2], ids=["topk_softmax", "softmax_topk", "sigmoid_topk"])
def test_an_engine_without_expert_groups_matches_the_float64_reference(tmp_path, routing):
    """Every v2 routing feature but groups (router and correction biases, renormalisation, routed scaling): the
    compiled routing, against the reference engine in float64."""
    rng = np.random.default_rng(routing)
    fields = dict(BASE, dtype=0, routing=routing, norm_topk=int(routing != 0), router_bias=1,
                  correction_bias=int(routing == 2), routed_scaling_factor=2.5, num_experts=6, top_k=3)
    path = write_v2(tmp_path / "m.colibri", fields, rng)
    for tokens in TOKENS:
        assert_matches_reference(path, rng.standard_normal((tokens, BASE["hidden_size"])).astype(np.float32))


def test_a_stored_router_value_widens_the_same_compiled_and_interpreted():
    """`_router_value` (float16 bits or float32 to float32) gives the same value from Python as from numba."""
    widen = njit(lambda v: cpu_routing._router_value(v))
    bits = np.array([0x0000, 0x0001, 0x3C00, 0xBC00, 0x7BFF, 0x7C00, 0x3555], np.uint16)
    for b in bits:
        want = bits[b == bits].view(np.float16).astype(np.float32)[0]
        assert cpu_routing._router_value(b) == want == widen(b), hex(int(b))
    assert cpu_routing._router_value(np.float32(2.5)) == widen(np.float32(2.5)) == np.float32(2.5)
