"""The combination rules of a v2 header (docs/format.md, v2 header table): each broken rule is its own
FormatError quoting the value and what is allowed. Called by HeaderV2.validate after the per-field range checks."""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from .constants import (
    ACTIVATION_CLAMPED_SWIGLU,
    ACTIVATION_NAMES,
    GROUP_SCORE_NAMES,
    GROUP_SCORE_NONE,
    GROUP_SCORE_TOP2_SUM,
    GROUP_SIZES,
    QUANT_FLOAT,
    QUANT_NAMES,
    ROUTING_SIGMOID_TOPK,
    ROUTING_TOPK_SOFTMAX,
    ROUTING_V2_NAMES,
    U16_MAX,
)


def check_storage(h) -> None:
    """quant, group_size, zero_points."""
    if h.quant not in QUANT_NAMES:
        raise FormatError(f"quant code {h.quant} (bytes 22-23); allowed: {QUANT_NAMES}")
    allowed = GROUP_SIZES[h.quant]
    if h.group_size not in allowed:
        per_row = " (0 = one group per row)" if 0 in allowed and h.quant != QUANT_FLOAT else ""
        raise FormatError(
            f"group_size {h.group_size} for {QUANT_NAMES[h.quant]} weights; allowed: "
            f"{', '.join(map(str, allowed))}{per_row}"
        )
    if h.zero_points and h.quant == QUANT_FLOAT:
        raise FormatError("zero_points = 1 with float weights; allowed: zero points only for int8 or int4")


def check_routing(h) -> None:
    """norm_topk, correction_bias, n_group, topk_group, group_score, routed_scaling_factor against routing."""
    if h.routing == ROUTING_TOPK_SOFTMAX and h.norm_topk:
        raise FormatError(
            "norm_topk = 1 with routing topk_softmax (already normalised over the k); allowed: 0, or routing "
            "softmax_topk / sigmoid_topk"
        )
    if h.correction_bias and h.routing != ROUTING_SIGMOID_TOPK:
        raise FormatError(
            f"correction_bias = 1 with routing {ROUTING_V2_NAMES[h.routing]}; allowed only with sigmoid_topk"
        )
    e, n, k = h.num_experts, h.n_group, h.topk_group
    if not 1 <= n <= e or e % n:
        raise FormatError(f"n_group = {n}; allowed: a divisor of num_experts = {e}")
    if not 1 <= k <= n:
        raise FormatError(f"topk_group = {k}; allowed: 1..n_group = {n}")
    if h.group_score not in GROUP_SCORE_NAMES:
        raise FormatError(f"group_score code {h.group_score} (bytes 34-35); allowed: {GROUP_SCORE_NAMES}")
    if n == 1:
        if k != 1 or h.group_score != GROUP_SCORE_NONE:
            raise FormatError(
                f"n_group = 1 with topk_group = {k}, group_score = {GROUP_SCORE_NAMES[h.group_score]}; "
                "allowed with one group: topk_group 1, group_score none"
            )
    else:
        if h.routing == ROUTING_TOPK_SOFTMAX:
            raise FormatError(
                f"n_group = {n} with routing topk_softmax; allowed: group-limited selection with softmax_topk "
                "or sigmoid_topk"
            )
        if h.group_score == GROUP_SCORE_NONE:
            raise FormatError(f"group_score none with n_group = {n}; allowed: max (1) or top2_sum (2)")
        if h.group_score == GROUP_SCORE_TOP2_SUM and e // n < 2:
            raise FormatError(
                f"group_score top2_sum with {e // n} expert per group; allowed: at least 2 experts per group"
            )
        if h.top_k > k * (e // n):
            raise FormatError(
                f"top_k = {h.top_k} exceeds the {k * (e // n)} experts of topk_group = {k} groups of "
                f"{e // n}; allowed: top_k <= topk_group * num_experts / n_group"
            )
    if not h.routed_scaling_factor > 0:
        raise FormatError(f"routed_scaling_factor = {h.routed_scaling_factor!r}; allowed: a finite float > 0")


def check_experts(h) -> None:
    """Shared experts, their gate, the activation and its constants."""
    s, i = h.num_shared_experts, h.shared_intermediate_size
    if (s == 0) != (i == 0):
        raise FormatError(
            f"num_shared_experts = {s} with shared_intermediate_size = {i}; allowed: both 0, or both >= 1"
        )
    if h.shared_gate and s == 0:
        raise FormatError("shared_gate = 1 without shared experts; allowed: 0, or num_shared_experts >= 1")
    if h.activation not in ACTIVATION_NAMES:
        raise FormatError(f"activation code {h.activation} (bytes 48-49); allowed: {ACTIVATION_NAMES}")
    if h.activation == ACTIVATION_CLAMPED_SWIGLU:
        for name in ("swiglu_limit", "swiglu_alpha"):
            if not getattr(h, name) > 0:
                raise FormatError(f"{name} = {getattr(h, name)!r} with clamped_swiglu; allowed: a finite float > 0")
    else:
        for name in ("swiglu_limit", "swiglu_alpha"):
            if getattr(h, name) != 0.0:
                raise FormatError(f"{name} = {getattr(h, name)!r} with activation swiglu; allowed: 0.0")


def check_layer_map(h) -> None:
    """num_model_layers and the layer map."""
    m = h.num_model_layers
    if m < h.num_layers:
        raise FormatError(f"num_model_layers = {m}; allowed: num_layers ({h.num_layers})..{U16_MAX}")
    lm = h.layer_map
    if not isinstance(lm, tuple) or len(lm) != h.num_layers:
        count = len(lm) if isinstance(lm, tuple) else lm
        raise FormatError(f"layer_map has {count!r} entries; allowed: one per file layer ({h.num_layers})")
    for index, value in enumerate(lm):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < m:
            raise FormatError(f"layer_map[{index}] = {value!r}; allowed: 0..num_model_layers-1 ({m - 1})")
        if index and value <= lm[index - 1]:
            raise FormatError(
                f"layer_map[{index}] = {value} after {lm[index - 1]}; allowed: strictly increasing model layers"
            )
