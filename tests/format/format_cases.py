"""Helpers for tests/format: the sizes and contents of a small .colibri file."""

from __future__ import annotations

import numpy as np

SIZES = dict(num_layers=2, num_experts=3, top_k=2, hidden_size=4, intermediate_size=5)


def small_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    L, E, H, I = 2, 3, 4, 5
    return {
        "gate_proj": rng.standard_normal((L, E, I, H)).astype(np.float32),
        "up_proj": rng.standard_normal((L, E, I, H)).astype(np.float32),
        "down_proj": rng.standard_normal((L, E, H, I)).astype(np.float32),
        "router": rng.standard_normal((L, H, E)).astype(np.float32),
    }
