"""v2 routing by hand (docs/format.md, "Semantics v2"): group-limited selection, ties, sigmoid, scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_sdk.format import HeaderV2
from colibri_sdk.reference import route_v2, select_topk


def test_group_max_keeps_the_best_groups():
    # 3 groups of 2: max scores 0.9, 0.8, 0.7 -> keep groups 0 and 1 (topk_group 2); top-3 among experts 0..3
    s = np.array([[0.9, 0.1, 0.8, 0.2, 0.7, 0.6]])
    assert select_topk(s, 3, n_group=3, topk_group=2, group_score=1).tolist() == [[0, 2, 3]]
    # plain top-3 would take expert 4 (0.7)
    assert select_topk(s, 3).tolist() == [[0, 2, 4]]


def test_group_top2_sum():
    # group sums of the two largest: g0 0.9+0.1 = 1.0, g1 0.6+0.5 = 1.1, g2 0.95+0.0 = 0.95 -> keep g1 only
    s = np.array([[0.9, 0.1, 0.6, 0.5, 0.95, 0.0]])
    assert select_topk(s, 2, n_group=3, topk_group=1, group_score=2).tolist() == [[2, 3]]


def test_ties_go_to_the_lower_group_and_expert():
    s = np.array([[0.5, 0.5, 0.5, 0.5]])
    assert select_topk(s, 1, n_group=2, topk_group=1, group_score=1).tolist() == [[0]]
    assert select_topk(np.array([[0.1, 0.5, 0.5, 0.1]]), 2, n_group=2, topk_group=1, group_score=1).tolist() == [[1, 0]]


def test_sigmoid_with_correction_bias_renormalised_and_scaled():
    """DeepSeek-V3 by hand: the bias moves expert 2 (sigmoid 0.62 + 0.5) ahead of experts 0 (0.88) and 1 (0.73)
    for selection, larger selection score first; the weights are the sigmoid scores of the chosen experts (the bias
    left out), renormalised, times 2.5."""
    h = HeaderV2(num_layers=1, num_experts=4, top_k=2, hidden_size=1, intermediate_size=1, routing=2, norm_topk=1,
                 correction_bias=1, routed_scaling_factor=2.5)
    z = np.array([[2.0, 1.0, 0.5, -1.0]])
    idx, w = route_v2(z, h, np.array([0.0, 0.0, 0.5, 0.0]))
    assert idx.tolist() == [[2, 0]]
    s0, s2 = 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-0.5))
    np.testing.assert_allclose(w, [[2.5 * s2 / (s0 + s2), 2.5 * s0 / (s0 + s2)]], rtol=1e-15)


def test_softmax_topk_without_renormalisation_scaled():
    """DeepSeek-V2: softmax over all, top-k, not renormalised, times routed_scaling_factor."""
    h = HeaderV2(num_layers=1, num_experts=3, top_k=1, hidden_size=1, intermediate_size=1, routing=1,
                 routed_scaling_factor=16.0)
    idx, w = route_v2(np.array([[0.0, 1.0, 0.0]]), h)
    assert idx.tolist() == [[1]]
    assert w[0, 0] == pytest.approx(16.0 * math.e / (math.e + 2), rel=1e-15)
