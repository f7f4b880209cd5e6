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

v2 files (docs/format.md, "Semantics v2") add: sigmoid scores, a router bias, a selection-only correction bias,
group-limited selection, renormalisation, routed_scaling_factor; expert biases and the clamped SwiGLU of gpt-oss;
shared experts (optionally sigmoid-gated); int8/int4 matrices, dequantized exactly (colibri_sdk.format.quant) for
the selected experts only.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import FormatError, InputError
from .format import ColibriFile, Header, HeaderV2
from .format.constants import (
    ACTIVATION_CLAMPED_SWIGLU,
    COMPOSITION_RESIDUAL,
    GROUP_SCORE_MAX,
    ROUTING_SIGMOID_TOPK,
    ROUTING_SOFTMAX_TOPK,
    ROUTING_TOPK_SOFTMAX,
)


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


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)); exp overflow for very negative x gives the exact 0 limit."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (max-shifted)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def select_topk(
    scores: np.ndarray, top_k: int, n_group: int = 1, topk_group: int = 1, group_score: int = 0
) -> np.ndarray:
    """The top_k experts per token, optionally limited to the best topk_group of n_group expert groups.

    Args:
        scores: (tokens, num_experts) selection scores.
        top_k: experts per token.
        n_group, topk_group: groups of num_experts / n_group consecutive experts; 1, 1 = no limit.
        group_score: 1 = a group's score is its largest score (DeepSeek-V2 `group_limited_greedy`); 2 = the sum of
            its two largest (DeepSeek-V3 `noaux_tc`).

    Returns:
        (tokens, top_k) int64 indices, larger score first, ties towards the lower expert (and group) index; the
        experts of the groups not kept are excluded (transformers masks them, at -inf in DeepSeek-V3).
    """
    if n_group > 1:
        tokens, experts = scores.shape
        grouped = scores.reshape(tokens, n_group, experts // n_group)
        if group_score == GROUP_SCORE_MAX:
            gscore = grouped.max(axis=-1)
        else:
            top2 = -np.sort(-grouped, axis=-1)[:, :, :2]
            gscore = top2[:, :, 0] + top2[:, :, 1]
        keep = np.argsort(-gscore, axis=-1, kind="stable")[:, :topk_group]
        mask = np.zeros((tokens, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        scores = np.where(np.repeat(mask, experts // n_group, axis=1), scores, -np.inf)
    # A stable sort of -score keeps equal scores in index order: ties go to the lower expert index.
    return np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]


def route_v2(
    logits: np.ndarray, header: HeaderV2, correction_bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Routing of a v2 file (docs/format.md, "Semantics v2").

    Args:
        logits: (tokens, num_experts) router logits z = x @ R (+ router bias), float32 or float64.
        header: the file's HeaderV2 (routing, norm_topk, n_group, topk_group, group_score, routed_scaling_factor).
        correction_bias: (num_experts,) added to the sigmoid scores for selection only (DeepSeek-V3
            `e_score_correction_bias`), or None.

    Returns:
        indices (tokens, top_k) int64 and weights (tokens, top_k) in the logits' dtype.
    """
    if header.routing == ROUTING_TOPK_SOFTMAX:
        indices = select_topk(logits, header.top_k)
        weights = softmax(np.take_along_axis(logits, indices, axis=-1))
    else:
        scores = softmax(logits) if header.routing == ROUTING_SOFTMAX_TOPK else sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(scores.dtype)
        indices = select_topk(choice, header.top_k, header.n_group, header.topk_group, header.group_score)
        weights = np.take_along_axis(scores, indices, axis=-1)
        if header.norm_topk:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    if header.routed_scaling_factor != 1.0:
        weights = weights * weights.dtype.type(header.routed_scaling_factor)
    return indices, weights


def selection_margin(
    logits: np.ndarray, header: HeaderV2, correction_bias: np.ndarray | None = None
) -> np.ndarray:
    """The smallest gap, per token, at the boundaries the selection of `route_v2` decides: between the
    topk_group-th and the next group score (group-limited routing), and between the k-th and the next selection
    score among the eligible experts. A backend whose scores differ from these by less than half the gap selects
    the same experts (the build's self-test and the kernel tests use it to avoid near-ties).

    Args:
        logits, header, correction_bias: as `route_v2`.

    Returns:
        (tokens,) gaps in the logits' dtype; inf where a boundary does not exist (k = every eligible expert).
    """
    if header.routing == ROUTING_TOPK_SOFTMAX:
        choice = logits
    else:
        scores = softmax(logits) if header.routing == ROUTING_SOFTMAX_TOPK else sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(scores.dtype)
    tokens, experts = choice.shape
    margin = np.full(tokens, np.inf, dtype=choice.dtype)
    if header.n_group > 1:
        grouped = choice.reshape(tokens, header.n_group, experts // header.n_group)
        top2 = -np.sort(-grouped, axis=-1)[:, :, :2]
        gscore = top2[:, :, 0] if header.group_score == GROUP_SCORE_MAX else top2[:, :, 0] + top2[:, :, 1]
        ordered = -np.sort(-gscore, axis=-1)
        if header.topk_group < header.n_group:
            margin = np.minimum(margin, ordered[:, header.topk_group - 1] - ordered[:, header.topk_group])
        keep = np.argsort(-gscore, axis=-1, kind="stable")[:, : header.topk_group]
        mask = np.zeros((tokens, header.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, experts // header.n_group, axis=1), choice, -np.inf)
    ordered = -np.sort(-choice, axis=-1)
    if header.top_k < experts and np.isfinite(ordered[:, header.top_k]).all():
        margin = np.minimum(margin, ordered[:, header.top_k - 1] - ordered[:, header.top_k])
    return margin


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's activation (transformers `GptOssExperts._apply_gate`): gate = min(gate, limit),
    up = clip(up, -limit, limit), gate · sigmoid(alpha · gate) · (up + 1)."""
    gate = np.minimum(gate, gate.dtype.type(limit))
    up = np.clip(up, -up.dtype.type(limit), up.dtype.type(limit))
    return gate * sigmoid(gate * gate.dtype.type(alpha)) * (up + 1)


def _check_overflow(values: np.ndarray, layer: int, what: str) -> None:
    """InputError if `values` (tokens, hidden), computed from finite input and weights, overflowed."""
    if np.isfinite(values).all():
        return
    bad = int(np.count_nonzero((~np.isfinite(values)).any(axis=-1)))
    dtype = values.dtype.name
    raise InputError(
        f"layer {layer}: {what} overflows {dtype} on {bad} token{'s' if bad != 1 else ''} (finite input and weights, "
        f"non-finite result); allowed: inputs whose products with the weights stay within {dtype} (scale the input "
        f"down, or use compute_dtype float64)"
    )


class ReferenceEngine:
    """Runs a .colibri model with NumPy.

    Args:
        model: a ColibriFile, or a path to one (opened with mmap; nothing is read eagerly).
        compute_dtype: np.float32 (default, the runtime's CPU backend) or np.float64 (tests).
        check_overflow: raise InputError when a layer's output overflows (default). The runtime passes False: it
            checks the output of the whole call once and raises NonFiniteOutputError with the position and the
            first non-finite layer (colibri_sdk.runtime.Runtime.infer).

    Usage::

        engine = ReferenceEngine("model.colibri")
        y = engine(x)            # x (batch, tokens, hidden) or (tokens, hidden) → same shape, compute_dtype

    Raises:
        InputError: wrong rank, hidden size or dtype, or non-finite input; a layer whose output overflows the
            compute dtype (finite input and weights, but too large for float32), unless check_overflow is False.
        FormatError: a tensor of the file that holds NaN or Inf (a router, a float expert matrix, the scales of a
            quantized one, a bias, the shared gate), found when a forward pass first uses it (the writer never
            writes one, so the file was corrupted or written by something else).
    """

    def __init__(
        self, model: ColibriFile | str | os.PathLike, compute_dtype=np.float32, capacity=None,
        check_overflow: bool = True,
    ):
        self.check_overflow = check_overflow
        self.file = model if isinstance(model, ColibriFile) else ColibriFile(model)
        # Expert capacity (colibri_sdk.capacity.Capacity, None = dropless): `valid` (tokens,) bool marks the rows
        # that are real tokens; `dropped` counts the pairs dropped since the last `run`.
        self.capacity, self.valid, self.dropped = capacity, None, 0
        self.header: Header = self.file.header
        try:
            self.compute_dtype = np.dtype(compute_dtype)
        except TypeError:
            raise InputError(f"compute_dtype {compute_dtype!r}; allowed: float32, float64") from None
        if self.compute_dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise InputError(f"compute_dtype {self.compute_dtype}; allowed: float32, float64")
        self.v2 = isinstance(self.header, HeaderV2)
        self._finite: set[tuple] = set()  # (kind, layer, index) whose stored values were checked finite

    def _checked(self, values: np.ndarray, kind: str, layer: int, index: int | None = None) -> np.ndarray:
        """`values` (read from the file) unchanged; FormatError if they hold NaN or Inf. Each tensor is checked
        once, on first use."""
        key = (kind, layer, index)
        if key in self._finite:
            return values
        if not np.isfinite(values).all():
            bad = int(np.count_nonzero(~np.isfinite(values)))
            where = f"layer {layer}" + ("" if index is None else f", expert {index}")
            how = " once dequantized" if self.v2 and self.header.quantized and self.header.is_matrix(kind) else ""
            raise FormatError(
                f"{self.file.path}: {kind} ({where}) holds {bad} non-finite value{'s' if bad != 1 else ''} (NaN or "
                f"Inf){how}; allowed: finite values (the file is corrupted)"
            )
        self._finite.add(key)
        return values

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
            if residual:
                with np.errstate(over="ignore"):
                    h = h + y
                if self.check_overflow:
                    _check_overflow(h, layer, "the residual sum")
            else:
                h = y
        return h

    def route(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Router logits → (indices, weights), each (tokens, top_k). x: (tokens, hidden) in the compute dtype."""
        dt = self.compute_dtype
        router = self._checked(self.file.router(layer), "router", layer).astype(dt, copy=False)
        logits = x @ router
        if not self.v2:
            return topk_route(logits, self.header.top_k, self.header.routing)
        h = self.header
        if h.router_bias:
            logits = logits + self._vector("router_bias", layer).astype(dt)
        correction = self._vector("correction_bias", layer) if h.correction_bias else None
        return route_v2(logits, h, correction)

    def _matrix(self, kind: str, layer: int, expert: int) -> np.ndarray:
        """One expert matrix in the compute dtype: exact dequantization of int8/int4, widening of fp16."""
        w = self._checked(self.file.weight(kind, layer, expert), kind, layer, expert)
        return w.astype(self.compute_dtype, copy=False)

    def _vector(self, kind: str, layer: int) -> np.ndarray:
        """A per-layer float32 tensor of a v2 file (biases, shared gate), checked finite."""
        return self._checked(self.file.vector(kind, layer), kind, layer)

    def expert(self, layer: int, expert: int, x: np.ndarray) -> np.ndarray:
        """One routed expert on x (tokens, hidden) → (tokens, hidden), with its biases and activation."""
        dt = self.compute_dtype
        gate = x @ self._matrix("gate_proj", layer, expert).T
        up = x @ self._matrix("up_proj", layer, expert).T
        v2 = self.v2
        if v2 and self.header.expert_bias:
            gate = gate + self._vector("gate_bias", layer)[expert].astype(dt)
            up = up + self._vector("up_bias", layer)[expert].astype(dt)
        if v2 and self.header.activation == ACTIVATION_CLAMPED_SWIGLU:
            hidden = clamped_swiglu(gate, up, self.header.swiglu_limit, self.header.swiglu_alpha)
        else:
            hidden = silu(gate) * up
        y = hidden @ self._matrix("down_proj", layer, expert).T
        if v2 and self.header.expert_bias:
            y = y + self._vector("down_bias", layer)[expert].astype(dt)
        return y

    def shared(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The shared experts' output on x (tokens, hidden) (zeros when the file has none), gate applied."""
        h = self.header
        out = np.zeros_like(x)
        if not self.v2 or not h.num_shared_experts:
            return out
        for s in range(h.num_shared_experts):
            gate = x @ self._matrix("shared_gate_proj", layer, s).T
            up = x @ self._matrix("shared_up_proj", layer, s).T
            out += (silu(gate) * up) @ self._matrix("shared_down_proj", layer, s).T
        if h.shared_gate:
            g = x @ self._vector("shared_expert_gate", layer).astype(self.compute_dtype)
            out *= sigmoid(g)[:, None]
        return out

    def layer(self, layer: int, x: np.ndarray) -> np.ndarray:
        """One MoE block on x (tokens, hidden) in the compute dtype → (tokens, hidden): the block's output alone,
        not composed with x (a residual file's layer output is x + this, as `run` composes it; `Runtime.layer`
        returns the composed value)."""
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is raised below, with its layer
            indices, weights = self.route(layer, x)
            if self.capacity is not None:
                from .capacity import apply_capacity

                indices, dropped = apply_capacity(
                    indices, weights, self.header.num_experts, self.capacity, self.valid
                )
                self.dropped += dropped
            out = np.zeros_like(x)
            for expert in np.unique(indices[indices >= 0]):  # a pair dropped by capacity has expert -1
                tokens, slots = np.nonzero(indices == expert)
                y = self.expert(layer, int(expert), x[tokens])
                # Each (token, expert) pair occurs once, so this scatter has no duplicate indices.
                out[tokens] += weights[tokens, slots][:, None] * y
            if self.v2 and self.header.num_shared_experts:
                out += self.shared(layer, x)
        if self.check_overflow:
            _check_overflow(out, layer, "the output")
        return out

    def close(self) -> None:
        self.file.close()
