"""Runtime.infer on the CPU backend: shapes, padding, per-sequence lengths, and every bad input."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.errors import InputError
from colibri_sdk.format import ColibriFile
from colibri_sdk.runtime import Runtime

HIDDEN = 64  # small_bundle's hidden size; its fixed shape is batch 2, tokens 8


def oracle(model_path, x: np.ndarray) -> np.ndarray:
    """Token-by-token float64 MoE forward (docs/format.md "Semantics"), written apart from the reference engine:
    router logits → the top-k by value (ties to the lower index) → softmax over the selected logits (routing 0) or
    over all experts (routing 1) → Σ w · down(silu(gate x) * up x) → sequential or residual layers."""
    with ColibriFile(model_path) as f:
        h = f.header
        layers = [
            (
                f.router(layer).astype(np.float64),
                [
                    tuple(f.tensor(kind, layer, e).astype(np.float64) for kind in ("gate_proj", "up_proj", "down_proj"))
                    for e in range(h.num_experts)
                ],
            )
            for layer in range(h.num_layers)
        ]
    flat = x.reshape(-1, h.hidden_size).astype(np.float64)
    out = np.empty_like(flat)
    for t, v in enumerate(flat):
        for router, experts in layers:
            z = v @ router
            chosen = sorted(range(h.num_experts), key=lambda e: (-z[e], e))[: h.top_k]
            if h.routing == 0:
                p = np.exp(z[chosen] - z[chosen].max())
                w = p / p.sum()
            else:
                p = np.exp(z - z.max())
                w = (p / p.sum())[chosen]
            y = np.zeros_like(v)
            for wj, e in zip(w, chosen):
                gate, up, down = experts[e]
                g = gate @ v
                y += wj * (down @ ((g / (1.0 + np.exp(-g))) * (up @ v)))
            v = v + y if h.composition == 1 else y
        out[t] = v
    return out.reshape(x.shape)


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def rt(small_bundle):
    with Runtime.load(small_bundle, backend="cpu") as runtime:
        yield runtime


@pytest.fixture(scope="module")
def weights(small_bundle):
    return small_bundle / "model.colibri"


# ---- shapes and padding -------------------------------------------------------------------------------------------
def test_full_shape_matches_oracle(rt, weights, rng):
    x = rng.standard_normal((2, 8, HIDDEN)).astype(np.float32)
    y = rt.infer(x)
    assert y.shape == (2, 8, HIDDEN) and y.dtype == np.float32
    close(y, oracle(weights, x))


@pytest.mark.parametrize("shape", [(1, 1, HIDDEN), (1, 8, HIDDEN), (2, 3, HIDDEN), (5, HIDDEN), (8, HIDDEN)])
def test_smaller_inputs_are_padded(rt, weights, rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    y = rt.infer(x)
    assert y.shape == shape and y.dtype == np.float32
    close(y, oracle(weights, x))


def test_fp16_input(rt, weights, rng):
    x = rng.standard_normal((2, 4, HIDDEN)).astype(np.float16)
    y = rt.infer(x)
    assert y.dtype == np.float32
    close(y, oracle(weights, x.astype(np.float32)))


def test_lengths_zero_the_padding(rt, weights, rng):
    x = rng.standard_normal((2, 6, HIDDEN)).astype(np.float32)
    x[0, 4:] = np.nan  # past sequence 0's length: ignored
    x[1, 1:] = 1e30
    y = rt.infer(x, input_lengths=np.array([4, 1]))
    assert np.all(y[0, 4:] == 0) and np.all(y[1, 1:] == 0)
    close(y[0, :4], oracle(weights, x[0, :4]))
    close(y[1, :1], oracle(weights, x[1, :1]))


def test_lengths_for_one_sequence(rt, weights, rng):
    x = rng.standard_normal((8, HIDDEN)).astype(np.float32)
    for lengths in (3, [3], np.int64(3)):
        y = rt.infer(x, input_lengths=lengths)
        assert y.shape == (8, HIDDEN)
        assert np.all(y[3:] == 0)
        close(y[:3], oracle(weights, x[:3]))


def test_zero_length_gives_zeros(rt, rng):
    x = rng.standard_normal((2, 8, HIDDEN)).astype(np.float32)
    y = rt.infer(x, input_lengths=[0, 8])
    assert np.all(y[0] == 0) and np.any(y[1] != 0)


def test_output_is_owned_by_the_caller(rt, rng):
    x = rng.standard_normal((2, 8, HIDDEN)).astype(np.float32)
    y1 = rt.infer(x)
    keep = y1.copy()
    y1[...] = 0
    y2 = rt.infer(x)
    np.testing.assert_array_equal(y2, keep)
    assert not np.shares_memory(y1, y2)


# ---- bad input ------------------------------------------------------------------------------------------------
def _noncontiguous():
    return np.zeros((2, 8, 2 * HIDDEN), dtype=np.float32)[:, :, ::2]


BAD_INPUTS = [
    ("list", lambda: [[0.0] * HIDDEN], None, r"input is a list; expected a numpy.ndarray \(batch <= 2, tokens <= 8, 64\)"),
    ("float64", lambda: np.zeros((1, 8, HIDDEN)), None, r"input dtype float64; allowed: float32, float16"),
    ("int32", lambda: np.zeros((1, 8, HIDDEN), np.int32), None, r"input dtype int32; allowed: float32, float16"),
    ("rank1", lambda: np.zeros(HIDDEN, np.float32), None, r"input shape \(64,\); expected \(batch <= 2, tokens <= 8, 64\) or \(tokens <= 8, 64\)"),
    ("rank4", lambda: np.zeros((1, 1, 8, HIDDEN), np.float32), None, r"input shape \(1, 1, 8, 64\); expected"),
    ("hidden", lambda: np.zeros((1, 8, 255), np.float32), None, r"input hidden size 255 \(shape \(1, 8, 255\)\); expected 64$"),
    ("transposed", lambda: np.zeros((HIDDEN, 8), np.float32), None, r"input hidden size 8 \(shape \(64, 8\)\); expected 64: the hidden size goes last \(a transposed array\?\)$"),
    ("batch", lambda: np.zeros((3, 8, HIDDEN), np.float32), None, r"input batch 3 \(shape \(3, 8, 64\)\); allowed: 1\.\.2, the bundle's fixed batch"),
    ("tokens", lambda: np.zeros((1, 9, HIDDEN), np.float32), None, r"input tokens 9 \(shape \(1, 9, 64\)\); allowed: 1\.\.8, the bundle's fixed tokens"),
    ("tokens2d", lambda: np.zeros((9, HIDDEN), np.float32), None, r"input tokens 9 \(shape \(9, 64\)\); allowed: 1\.\.8"),
    ("no tokens", lambda: np.zeros((1, 0, HIDDEN), np.float32), None, r"input tokens 0 \(shape \(1, 0, 64\)\); allowed: 1\.\.8"),
    ("strided", _noncontiguous, None, r"input is not C-contiguous \(shape \(2, 8, 64\), strides \(4096, 512, 8\)\); pass np\.ascontiguousarray\(x\)"),
    ("nan", lambda: np.full((1, 2, HIDDEN), np.nan, np.float32), None, r"input has non-finite values \(NaN or Inf\) at 2 valid positions, first at \(batch 0, token 0\)"),
    ("inf16", lambda: np.pad(np.full((1, 1, HIDDEN), np.inf, np.float16), ((1, 0), (2, 0), (0, 0))), None, r"non-finite values \(NaN or Inf\) at 1 valid position, first at \(batch 1, token 2\)"),
    ("lengths shape", lambda: np.zeros((2, 4, HIDDEN), np.float32), [1, 2, 3], r"input_lengths shape \(3,\); expected \(2,\), one length per sequence"),
    ("lengths float", lambda: np.zeros((2, 4, HIDDEN), np.float32), [1.0, 2.0], r"input_lengths dtype float64; allowed: integers"),
    ("lengths negative", lambda: np.zeros((2, 4, HIDDEN), np.float32), [-1, 2], r"input_lengths\[0\] = -1; allowed: 0\.\.4 \(the input's tokens; the bundle's fixed tokens are 8\)"),
    ("lengths over input", lambda: np.zeros((2, 4, HIDDEN), np.float32), [1, 5], r"input_lengths\[1\] = 5; allowed: 0\.\.4"),
    ("lengths over fixed", lambda: np.zeros((2, 8, HIDDEN), np.float32), [9, 1], r"input_lengths\[0\] = 9; allowed: 0\.\.8 \(the input's tokens; the bundle's fixed tokens are 8\)"),
]


@pytest.mark.parametrize("make, lengths, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_an_input_error(rt, make, lengths, message):
    with pytest.raises(InputError, match=message):
        rt.infer(make(), input_lengths=lengths)


def test_a_bound_of_one_is_named_as_one():
    """A bundle of batch 1 (or tokens 1) names the one allowed count, not a range "1..1"."""
    from colibri_sdk.runtime.checks import check_input

    with pytest.raises(InputError, match=r"^input batch 2 \(shape \(2, 3, 64\)\); allowed: 1, the bundle's fixed batch$"):
        check_input(np.zeros((2, 3, HIDDEN), np.float32), None, (1, 4), HIDDEN)
    with pytest.raises(InputError, match=r"^input tokens 3 \(shape \(3, 64\)\); allowed: 1, the bundle's fixed tokens$"):
        check_input(np.zeros((3, HIDDEN), np.float32), None, (2, 1), HIDDEN)


def test_runtime_still_works_after_bad_input(rt, weights, rng):
    with pytest.raises(InputError):
        rt.infer(np.full((2, 8, HIDDEN), np.nan, np.float32))
    x = rng.standard_normal((1, 2, HIDDEN)).astype(np.float32)
    close(rt.infer(x), oracle(weights, x))
