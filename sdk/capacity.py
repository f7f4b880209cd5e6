"""Expert capacity: how many (token, expert) pairs one expert takes per call, and which pairs are dropped.

Semantics (docs/runtime.md, "Expert capacity"; the source design's hard_capacity / soft_capacity, GShard and the
Switch Transformer's capacity factor). Per layer and call, with T the call's valid tokens (padding excluded), k the
experts per token, E the experts and f the factor:

    C = max(min_capacity, ceil(T * k * f / E))       the capacity of every expert (0 when T = 0)

min_capacity (default 1) is DeepSpeed's `min_capacity` (deepspeed/moe/sharded_moe.py, `_capacity`). The pairs
routed to one expert are put in priority order:
    policy "score":    by routing weight, larger first; ties by token index, lower first
    policy "position": by token index, lower first (a token routes to an expert at most once)
    order "choice":    by slot first (the token's choice rank: every first choice before any second choice, GShard
                       and DeepSpeed top2gating), then by the policy; order "policy" (the default) by the policy alone
and then
    mode "hard":  the first C pairs are kept;
    mode "soft":  the first C pairs are kept, and beyond them the pairs that are their token's first choice (slot 0,
                  the largest logit) in the same order, up to 2C pairs in all: a bounded overflow that drops a
                  token's first expert only where that expert already holds 2C pairs.
With order "choice", soft mode keeps the first C pairs in (slot, policy) order and then up to C more first choices:
an expert with n0 >= C first choices keeps min(n0, 2C) of them and no later choice; one with n0 < C keeps all of
them and C - n0 later choices (by slot, then policy).
A dropped pair contributes zero; the kept pairs' weights are not renormalised, so with residual composition a token
whose pairs are all dropped passes through unchanged. Without a capacity (the default) no pair is dropped, which is
what transformers computes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import ProfileError

MODES = ("hard", "soft")
POLICIES = ("score", "position")
ORDERS = ("policy", "choice")
MAX_MIN_CAPACITY = 1 << 20  # min_capacity's bound (a compile-time int of kernels/capacity.cu)
KEYS = ("factor", "mode", "policy", "min_capacity", "order")
NO_EXPERT = -1  # the expert index a dropped pair gets


@dataclasses.dataclass(frozen=True)
class Capacity:
    """factor (> 0, at most 64), mode "hard" | "soft", policy "score" | "position", min_capacity (an integer in
    1..2^20), order "policy" | "choice"."""

    factor: float
    mode: str = "hard"
    policy: str = "score"
    min_capacity: int = 1
    order: str = "policy"

    @classmethod
    def from_dict(cls, data, source: str = "capacity") -> "Capacity":
        """From a profile's `capacity` mapping {factor, mode?, policy?, min_capacity?, order?}.

        Raises:
            ProfileError: a missing or bad factor or min_capacity, an unknown mode, policy or order, an unknown key.
        """
        if not isinstance(data, dict):
            raise ProfileError(f"{source} = {data!r}; allowed: a mapping {{{', '.join(KEYS)}}}")
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ProfileError(f"{source}: unknown keys {unknown}; allowed: {', '.join(KEYS)}")
        factor = data.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 64:
            raise ProfileError(f"{source}.factor = {factor!r}; allowed: a number in (0, 64]")
        mode, policy = data.get("mode", "hard"), data.get("policy", "score")
        if mode not in MODES:
            raise ProfileError(f"{source}.mode = {mode!r}; allowed: {', '.join(MODES)}")
        if policy not in POLICIES:
            raise ProfileError(f"{source}.policy = {policy!r}; allowed: {', '.join(POLICIES)}")
        minimum, order = data.get("min_capacity", 1), data.get("order", "policy")
        if isinstance(minimum, bool) or not isinstance(minimum, int) or not 1 <= minimum <= MAX_MIN_CAPACITY:
            raise ProfileError(f"{source}.min_capacity = {minimum!r}; allowed: an integer in 1..{MAX_MIN_CAPACITY}")
        if order not in ORDERS:
            raise ProfileError(f"{source}.order = {order!r}; allowed: {', '.join(ORDERS)}")
        return cls(float(factor), mode, policy, minimum, order)

    def to_dict(self) -> dict:
        """The profile mapping; min_capacity and order only where they differ from the defaults (a profile without
        them gives the same mapping, manifest and kernel constants as before they existed)."""
        data = {"factor": self.factor, "mode": self.mode, "policy": self.policy}
        if self.min_capacity != 1:
            data["min_capacity"] = self.min_capacity
        if self.order != "policy":
            data["order"] = self.order
        return data

    def limit(self, tokens: int, top_k: int, experts: int) -> int:
        """C = max(min_capacity, ceil(tokens * top_k * factor / experts)); 0 for no tokens. At least 1 with tokens,
        as the exact value is for any factor > 0 (a tiny factor's product underflows to 0 in double)."""
        return max(self.min_capacity, 1, math.ceil(tokens * top_k * self.factor / experts)) if tokens else 0


def describe(spec: dict) -> str:
    """A profile `capacity` mapping as build, inspect and run print it: "factor 1.25, hard, policy score", plus
    ", min 8" and ", first choices first" where set."""
    text = f"factor {spec['factor']:g}, {spec.get('mode', 'hard')}, policy {spec.get('policy', 'score')}"
    if spec.get("min_capacity", 1) != 1:
        text += f", min {spec['min_capacity']}"
    if spec.get("order", "policy") == "choice":
        text += ", first choices first"
    return text


def apply_capacity(indices: np.ndarray, weights: np.ndarray, num_experts: int, capacity: Capacity,
                   valid: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Drop the pairs above capacity.

    Args:
        indices: (tokens, top_k) int, the selected experts (largest logit first).
        weights: (tokens, top_k) float, their routing weights.
        valid: optional (tokens,) bool: rows that are real tokens; padding rows take no capacity and are not
            counted as dropped.

    Returns:
        (indices with NO_EXPERT at every dropped pair and every padding row, number of dropped pairs).
    """
    tokens, top_k = indices.shape
    valid = np.ones(tokens, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    c = capacity.limit(int(valid.sum()), top_k, num_experts)
    kept = np.where(valid[:, None], indices, NO_EXPERT)
    dropped = 0
    for expert in range(num_experts):
        rows, slots = np.nonzero(kept == expert)  # token order, then slot
        n = len(rows)
        if n <= c:
            continue
        by_choice = capacity.order == "choice"
        if capacity.policy == "score":  # weight descending, then token ascending (slot ascending first: by choice)
            keys = (rows, -weights[rows, slots]) + ((slots,) if by_choice else ())
        else:  # token ascending (slot ascending first: by choice)
            keys = (rows, slots) if by_choice else (rows,)
        order = np.lexsort(keys)
        rows, slots = rows[order], slots[order]
        keep = np.zeros(n, dtype=bool)
        keep[:c] = True
        if capacity.mode == "soft":
            extra = np.nonzero(slots[c:] == 0)[0][:c] + c
            keep[extra] = True
        drop_rows, drop_slots = rows[~keep], slots[~keep]
        kept[drop_rows, drop_slots] = NO_EXPERT
        dropped += len(drop_rows)
    return kept, dropped
