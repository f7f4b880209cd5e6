"""The NumPy reference engine: what a .colibri model computes, and the CPU backend of the runtime.

Per layer and token x (hidden,) — docs/format.md, "Semantics":

    z        = x @ R                                  router logits, (num_experts,), fp32 (fp64 in tests)
    S        = top-k indices of z, ties → lower index (stable order: the k largest, larger first)
    w        = softmax(z[S])                          routing 0 (Mixtral; norm_topk_prob=True)
             = softmax(z)[S]                          routing 1 (OLMoE, Qwen-MoE with norm_topk_prob=False)
    y        = Σ_{j<k} w_j · down_{S_j}( silu(gate_{S_j}(x)) * up_{S_j}(x) )     SwiGLU expert
    layers:    x_{l+1} = y_l (sequential) or x_l + y_l (residual)

`gate(x) = W_gate @ x` with W_gate (intermediate, hidden), as transformers' `nn.Linear` (no bias).
The computation is vectorised by expert: the tokens routed to one expert are gathered and multiplied together.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import InputError
from .format import ColibriFile, Header
from .format.constants import COMPOSITION_RESIDUAL, ROUTING_SOFTMAX_TOPK


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (swish): x · sigmoid(x) = x / (1 + exp(-x)); exp overflow for very negative x gives the exact 0 limit."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def topk_route(logits: np.ndarray, top_k: int, routing: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k selection and routing weights.

    Args:
        logits: (tokens, num_experts) router logits, float32 or float64.
        top_k: experts per token.
        routing: 0 = softmax over the k selected logits, 1 = softmax over all experts then select.

    Returns:
        indices (tokens, top_k) int64, the selected experts, largest logit first, ties towards the lower index;
        weights (tokens, top_k) in the logits' dtype.
    """
    # A stable sort of -z keeps equal logits in index order: ties go to the lower expert index.
    order = np.argsort(-logits, axis=-1, kind="stable")
    indices = order[:, :top_k]
    if routing == ROUTING_SOFTMAX_TOPK:
        shifted = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(shifted)
        probs /= probs.sum(axis=-1, keepdims=True)
        weights = np.take_along_axis(probs, indices, axis=-1)
    else:
        selected = np.take_along_axis(logits, indices, axis=-1)
        shifted = np.exp(selected - selected[:, :1])  # the first is the largest
        weights = shifted / shifted.sum(axis=-1, keepdims=True)
    return indices, weights


class ReferenceEngine:
    """Runs a .colibri model with NumPy.

    Args:
        model: a ColibriFile, or a path to one (opened with mmap; nothing is read eagerly).
        compute_dtype: np.float32 (default, the runtime's CPU backend) or np.float64 (tests).

    Usage::

        engine = ReferenceEngine("model.colibri")
        y = engine(x)            # x (batch, tokens, hidden) or (tokens, hidden) → same shape, float32

    Raises:
        InputError: wrong rank, hidden size or dtype, or non-finite input.
    """

    def __init__(self, model: ColibriFile | str | os.PathLike, compute_dtype=np.float32, capacity=None):
        self.file = model if isinstance(model, ColibriFile) else ColibriFile(model)
        # Expert capacity (colibri_sdk.capacity.Capacity, None = dropless): `valid` (tokens,) bool marks the rows
        # that are real tokens; `dropped` counts the pairs dropped since the last `run`.
        self.capacity, self.valid, self.dropped = capacity, None, 0
        self.header: Header = self.file.header
        self.compute_dtype = np.dtype(compute_dtype)
        if self.compute_dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise InputError(f"compute_dtype {self.compute_dtype}; allowed: float32, float64")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x)

    def check_input(self, x: np.ndarray) -> np.ndarray:
        """Validate x and return it as (tokens, hidden) in the compute dtype."""
        x = np.asarray(x)
        hidden = self.header.hidden_size
        if x.ndim not in (2, 3) or x.shape[-1] != hidden:
            raise InputError(f"input shape {x.shape}; expected (batch, tokens, {hidden}) or (tokens, {hidden})")
        if x.dtype.kind != "f":
            raise InputError(f"input dtype {x.dtype}; allowed: float16, float32, float64")
        flat = x.reshape(-1, hidden).astype(self.compute_dtype, copy=False)
        if not np.isfinite(flat).all():
            bad = int((~np.isfinite(flat)).sum())
            raise InputError(f"input has {bad} non-finite values (NaN or Inf); all values must be finite")
        return flat

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Run all layers.

        Args:
            x: (batch, tokens, hidden) or (tokens, hidden), any float dtype.

        Returns:
            Array of x's shape in the compute dtype (float32 by default).
        """
        return self.run(self.check_input(x)).reshape(np.shape(x))

    def run(self, h: np.ndarray) -> np.ndarray:
        """Run all layers on an input `check_input` has already validated.

        Args:
            h: (tokens, hidden) in the compute dtype, finite.

        Returns:
            (tokens, hidden) in the compute dtype, a new array.
        """
        residual = self.header.composition == COMPOSITION_RESIDUAL
        self.dropped = 0
        for layer in range(self.header.num_layers):
            y = self.layer(layer, h)
            h = h + y if residual else y
        return h

    def route(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Router logits → (indices, weights), each (tokens, top_k). x: (tokens, hidden) in the compute dtype."""
        router = self.file.router(layer).astype(self.compute_dtype, copy=False)
        logits = x @ router
        return topk_route(logits, self.header.top_k, self.header.routing)

    def layer(self, layer: int, x: np.ndarray) -> np.ndarray:
        """One MoE layer on x (tokens, hidden) in the compute dtype → (tokens, hidden)."""
        indices, weights = self.route(layer, x)
        if self.capacity is not None:
            from .capacity import apply_capacity

            indices, dropped = apply_capacity(indices, weights, self.header.num_experts, self.capacity, self.valid)
            self.dropped += dropped
        out = np.zeros_like(x)
        dt = self.compute_dtype
        for expert in np.unique(indices[indices >= 0]):
            tokens, slots = np.nonzero(indices == expert)
            xs = x[tokens]
            gate = self.file.tensor("gate_proj", layer, int(expert)).astype(dt, copy=False)
            up = self.file.tensor("up_proj", layer, int(expert)).astype(dt, copy=False)
            down = self.file.tensor("down_proj", layer, int(expert)).astype(dt, copy=False)
            hidden = silu(xs @ gate.T) * (xs @ up.T)
            y = hidden @ down.T
            # Each (token, expert) pair occurs once, so this scatter has no duplicate indices.
            out[tokens] += weights[tokens, slots][:, None] * y
        return out

    def close(self) -> None:
        self.file.close()
