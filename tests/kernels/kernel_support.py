"""Helpers for the kernel tests."""

from __future__ import annotations

import numpy as np

from colibri_sdk.format import Header


def make_header(hidden=256, inter=512, experts=8, top_k=2, dtype="fp16", routing=0, composition=1, layers=1):
    """A .colibri header with the given sizes (the weights themselves are not needed to compile or plan)."""
    return Header(layers, experts, top_k, hidden, inter, dtype=1 if dtype == "fp16" else 0, routing=routing,
                  composition=composition)


def expected_pair_order(ids, experts: int):
    """The GEMV path's `pair_order` buffer (kernels/common.cuh PairOrder, docs/kernels.md "Pair order (GEMV path)")
    from the (tokens, k) selected experts (NO_EXPERT = experts for padded or dropped pairs): int32 (1 + 3 * experts +
    pairs,) = nused, counts, offsets, used (-1 after the used experts), the pairs sorted by expert in increasing
    index (-1 after the last)."""
    flat = np.asarray(ids).ravel()
    counts = np.bincount(flat[flat < experts], minlength=experts)[:experts]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    used = np.flatnonzero(counts)
    order = np.full(1 + 3 * experts + len(flat), -1, dtype=np.int32)
    order[0] = len(used)
    order[1 : 1 + experts] = counts
    order[1 + experts : 1 + 2 * experts] = offsets
    order[1 + 2 * experts : 1 + 2 * experts + len(used)] = used
    pairs = np.concatenate([np.flatnonzero(flat == e) for e in range(experts)] + [np.zeros(0, dtype=np.int64)])
    order[1 + 3 * experts : 1 + 3 * experts + len(pairs)] = pairs
    return order
