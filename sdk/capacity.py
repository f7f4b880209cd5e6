"""Expert capacity: how many (token, expert) pairs one expert takes per call, and which pairs are dropped.

Semantics (docs/runtime.md, "Expert capacity"; the source design's hard_capacity / soft_capacity, GShard and the
Switch Transformer's capacity factor). Per layer and call, with T the call's valid tokens (padding excluded), k the
experts per token, E the experts and f the factor:

    C = ceil(T * k * f / E)                           the capacity of every expert

The pairs routed to one expert are put in priority order:
    policy "score":    by routing weight, larger first; ties by token index, lower first
    policy "position": by token index, lower first (a token routes to an expert at most once)
and then
    mode "hard":  the first C pairs are kept;
    mode "soft":  the first C pairs are kept, and beyond them the pairs that are their token's first choice (slot 0,
                  the largest logit) in the same order, up to 2C pairs in all: a bounded overflow that drops a
                  token's first expert only where that expert already holds 2C pairs.
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
NO_EXPERT = -1  # the expert index a dropped pair gets


@dataclasses.dataclass(frozen=True)
class Capacity:
    """factor (> 0, at most 64), mode "hard" | "soft", policy "score" | "position"."""

    factor: float
    mode: str = "hard"
    policy: str = "score"

    @classmethod
    def from_dict(cls, data, source: str = "capacity") -> "Capacity":
        """From a profile's `capacity` mapping {factor, mode?, policy?}.

        Raises:
            ProfileError: a missing or bad factor, an unknown mode or policy, an unknown key.
        """
        if not isinstance(data, dict):
            raise ProfileError(f"{source} = {data!r}; allowed: a mapping {{factor, mode, policy}}")
        unknown = sorted(set(data) - {"factor", "mode", "policy"})
        if unknown:
            raise ProfileError(f"{source}: unknown keys {unknown}; allowed: factor, mode, policy")
        factor = data.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 64:
            raise ProfileError(f"{source}.factor = {factor!r}; allowed: a number in (0, 64]")
        mode, policy = data.get("mode", "hard"), data.get("policy", "score")
        if mode not in MODES:
            raise ProfileError(f"{source}.mode = {mode!r}; allowed: {', '.join(MODES)}")
        if policy not in POLICIES:
            raise ProfileError(f"{source}.policy = {policy!r}; allowed: {', '.join(POLICIES)}")
        return cls(float(factor), mode, policy)

    def to_dict(self) -> dict:
        return {"factor": self.factor, "mode": self.mode, "policy": self.policy}

    def limit(self, tokens: int, top_k: int, experts: int) -> int:
        """C = ceil(tokens * top_k * factor / experts); 0 for no tokens. At least 1 with tokens, as the exact value
        is for any factor > 0 (a tiny factor's product underflows to 0 in double)."""
        return max(1, math.ceil(tokens * top_k * self.factor / experts)) if tokens else 0


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
        if capacity.policy == "score":
            order = np.lexsort((rows, -weights[rows, slots]))  # weight descending, then token ascending
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
