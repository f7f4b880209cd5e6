"""The reference engine computes what docs/format.md ("Semantics") says a .colibri file means."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_sdk.errors import InputError
from colibri_sdk.format import Header, write_model
from colibri_sdk.reference import ReferenceEngine, topk_route

from format_cases import SIZES, small_arrays


def test_ties_go_to_the_lower_expert():
    indices, weights = topk_route(np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), 2, routing=0)
    assert indices.tolist() == [[1, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_routing_modes_by_hand():
    z = np.array([[1.0, 3.0, 2.0]])
    idx, w0 = topk_route(z, 2, routing=0)
    assert idx.tolist() == [[1, 2]]
    np.testing.assert_allclose(w0, [[math.e / (math.e + 1), 1 / (math.e + 1)]], rtol=1e-15)
    _, w1 = topk_route(z, 2, routing=1)
    total = math.e + math.e**3 + math.e**2
    np.testing.assert_allclose(w1, [[math.e**3 / total, math.e**2 / total]], rtol=1e-15)


def test_one_expert_by_hand(tmp_path):
    """hidden 1, intermediate 1, 2 experts, top-1: x=2 → logits (2, -2) → expert 0 with weight 1 →
    down * silu(gate*x) * (up*x) = 1 * silu(2) * 2 = 4 / (1 + e^-2)."""
    h = Header(num_layers=1, num_experts=2, top_k=1, hidden_size=1, intermediate_size=1)
    w = np.array([1.0, 5.0], np.float32).reshape(1, 2, 1, 1)
    path = write_model(tmp_path / "m.colibri", h, w, w, w, np.array([[[1.0, -1.0]]], np.float32))
    y = ReferenceEngine(path, compute_dtype=np.float64)(np.array([[2.0]]))
    assert y[0, 0] == pytest.approx(4 / (1 + math.exp(-2)), rel=1e-15)


def loop_reference(a: dict, header: Header, x: np.ndarray) -> np.ndarray:
    """An independent, per-token float64 implementation of docs/format.md "Semantics"."""
    out = []
    for token in x.reshape(-1, header.hidden_size).astype(np.float64):
        h = token
        for layer in range(header.num_layers):
            z = h @ a["router"][layer].astype(np.float64)
            chosen = sorted(range(len(z)), key=lambda e: (-z[e], e))[: header.top_k]
            if header.routing == 0:
                p = np.exp(z[chosen] - max(z[chosen]))
                p = p / p.sum()
            else:
                p = (np.exp(z - z.max()) / np.exp(z - z.max()).sum())[chosen]
            y = np.zeros_like(h)
            for weight, e in zip(p, chosen):
                g = a["gate_proj"][layer, e].astype(np.float64) @ h
                u = a["up_proj"][layer, e].astype(np.float64) @ h
                y += weight * (a["down_proj"][layer, e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
            h = h + y if header.composition == 1 else y
        out.append(h)
    return np.array(out).reshape(x.shape)


@pytest.mark.parametrize("routing", [0, 1])
@pytest.mark.parametrize("composition", [0, 1])
def test_engine_matches_loop_reference(tmp_path, rng, routing, composition):
    header = Header(**SIZES, dtype=0, routing=routing, composition=composition)
    a = small_arrays(seed=routing + 2 * composition)
    path = write_model(tmp_path / "m.colibri", header, a["gate_proj"], a["up_proj"], a["down_proj"], a["router"])
    x = rng.standard_normal((3, 7, 4))
    expected = loop_reference(a, header, x)
    np.testing.assert_allclose(ReferenceEngine(path, compute_dtype=np.float64)(x), expected, rtol=1e-12, atol=1e-12)
    y32 = ReferenceEngine(path)(x.astype(np.float32))
    assert y32.dtype == np.float32 and y32.shape == (3, 7, 4)
    np.testing.assert_allclose(y32, expected, rtol=1e-4, atol=1e-5)
    y2d = ReferenceEngine(path)(x[0].astype(np.float32))
    np.testing.assert_array_equal(y2d, y32[0])


@pytest.mark.parametrize(
    "x,match",
    [
        (np.zeros((2, 5), np.float32), r"input shape \(2, 5\); expected \(batch, tokens, 4\) or \(tokens, 4\)"),
        (np.zeros(4, np.float32), r"input shape \(4,\)"),
        (np.zeros((1, 1, 2, 4), np.float32), r"input shape \(1, 1, 2, 4\)"),
        (np.zeros((2, 4), np.int32), r"input dtype int32; allowed: float16, float32, float64"),
        (np.array([[0, np.nan, 0, np.inf]], np.float32), r"input has 2 non-finite values"),
    ],
)
def test_input_errors(small_file, x, match):
    with pytest.raises(InputError, match=match):
        ReferenceEngine(small_file[0])(x)
