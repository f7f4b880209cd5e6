"""The top-k override of a build (`colibri-sdk build --top-k K`, or `top_k: K` in the profile).

The bundle's model.colibri is the source weights byte for byte except the header's `top_k` field, which becomes K;
every later stage (the kernels' COLI_TOPK, the launch plan's sizes, the self-test's reference output, both
backends) reads K from there. The manifest records the model's own k as `weights.model_top_k` and K as
`profile.top_k`; `inspect` and `run` print both.

Routing with the new K is the model's routing rule applied to K experts (docs/format.md, "Semantics"):
    topk_softmax (Mixtral; OLMoE/Qwen-MoE with norm_topk_prob=True): the K largest logits, weights softmax over
        those K — renormalised over K, as the model renormalises over its k;
    softmax_topk (OLMoE/Qwen-MoE with norm_topk_prob=False): softmax over all experts, the K largest
        probabilities taken as they are — not renormalised, as the model does not renormalise.
This is what transformers computes for the same model with `num_experts_per_tok = K`.
"""

from __future__ import annotations

from pathlib import Path

from .. import catalog
from ..errors import ProfileError

MAX_TOP_K: int = catalog.MAX_TOP_K  # the kernels' limit on experts per token (common.cuh: COLI_MAX_TOP_K)


def check_top_k(k, header, source: str = "the profile") -> int:
    """Validate an override K against the model and the kernels.

    Raises:
        ProfileError: K not an int, below 1, above the model's experts or above MAX_TOP_K; the message names K,
            the model's experts and k, and the allowed range.
    """
    top = min(int(header.num_experts), MAX_TOP_K)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= top:
        why = "the model's experts" if header.num_experts <= MAX_TOP_K else "the kernels' limit MAX_TOP_K"
        raise ProfileError(
            f"{source}: top_k = {k!r}; allowed: 1..{top} ({why}; the model has {header.num_experts} experts and "
            f"routes to {header.top_k})"
        )
    return k


def apply_top_k(weights: Path, header, k: int | None, source: str = "the profile"):
    """Rewrite the header of the bundle's copy of the weights with top_k = K; returns the header in force.

    Args:
        weights: the bundle's model.colibri (already a private copy).
        header: its current header (the model's own k).
        k: the override, or None (the header is returned unchanged).

    Raises:
        ProfileError: K refused by `check_top_k`, or weights whose header cannot take an override.
    """
    if k is None or k == header.top_k:
        return header
    check_top_k(k, header, source)
    import dataclasses

    if not dataclasses.is_dataclass(header) or not hasattr(header, "pack"):
        raise ProfileError(f"{source}: top_k = {k}: this weights format cannot take a top-k override")
    new = dataclasses.replace(header, top_k=k)
    packed = new.pack()
    with open(weights, "r+b") as fh:
        fh.write(packed)
    return new
