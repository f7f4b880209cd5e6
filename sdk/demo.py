"""The embedded demo model: small, deterministic, generated from a fixed seed (no file shipped).

4 layers, 8 experts, top-2, hidden 256, intermediate 512, residual composition, Mixtral-style routing.
Weights are N(0, 1/fan_in) from NumPy's PCG64 generator, which gives the same numbers on every platform.
`colibri-sdk build` uses it when no `--weights` are given.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .format import Header, write_model
from .format.constants import COMPOSITION_RESIDUAL, DTYPE_CODES, ROUTING_TOPK_SOFTMAX

DEMO_SEED = 20261129
DEMO_SIZES = {"num_layers": 4, "num_experts": 8, "top_k": 2, "hidden_size": 256, "intermediate_size": 512}


def demo_header(dtype: str = "fp16") -> Header:
    """Header of the demo model. dtype: "fp16" | "fp32"."""
    return Header(
        **DEMO_SIZES,
        dtype=DTYPE_CODES[dtype],
        routing=ROUTING_TOPK_SOFTMAX,
        composition=COMPOSITION_RESIDUAL,
    )


def demo_arrays(seed: int = DEMO_SEED) -> dict[str, np.ndarray]:
    """float32 arrays: gate/up (L, E, I, H), down (L, E, H, I), router (L, H, E)."""
    rng = np.random.default_rng(seed)
    s = DEMO_SIZES
    L, E, H, I = s["num_layers"], s["num_experts"], s["hidden_size"], s["intermediate_size"]
    f32 = np.float32
    return {
        "gate": (rng.standard_normal((L, E, I, H)) / np.sqrt(H)).astype(f32),
        "up": (rng.standard_normal((L, E, I, H)) / np.sqrt(H)).astype(f32),
        "down": (rng.standard_normal((L, E, H, I)) / np.sqrt(I)).astype(f32),
        "router": (rng.standard_normal((L, H, E)) / np.sqrt(H)).astype(f32),
    }


def write_demo_model(path: str | os.PathLike, dtype: str = "fp16") -> Path:
    """Write the demo model as a .colibri file and return its path."""
    a = demo_arrays()
    return write_model(path, demo_header(dtype), a["gate"], a["up"], a["down"], a["router"])
