"""Fixtures of the runtime tests: bundles built by `colibri-sdk build` (helpers in runtime_bundles.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_sdk.format import write_model
from runtime_bundles import ORIN, SMALL, build, profile_with_shape


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory) -> Path:
    """A small random fp16 model (2 layers, 6 experts, top-2, hidden 64, intermediate 96, routing softmax→top-k,
    sequential layers) at fixed shape batch 2, tokens 8."""
    folder = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(11)
    h = SMALL
    L, E, H, I = h.num_layers, h.num_experts, h.hidden_size, h.intermediate_size
    path = write_model(
        folder / "small.colibri",
        h,
        rng.standard_normal((L, E, I, H)) / np.sqrt(H),
        rng.standard_normal((L, E, I, H)) / np.sqrt(H),
        rng.standard_normal((L, E, H, I)) / np.sqrt(I) * 2,
        rng.standard_normal((L, H, E)),
    )
    return build(folder / "bundle", profile_with_shape(folder, batch=2, tokens=8), path)


@pytest.fixture(scope="session")
def demo_bundle(tmp_path_factory) -> Path:
    """`colibri-sdk build --profile profiles/orin.yaml --demo`: the demo model, fp16, batch 1 x tokens 16."""
    return build(tmp_path_factory.mktemp("demo") / "bundle", ORIN)


@pytest.fixture
def fresh_bundle(tmp_path, small_bundle) -> Path:
    """A private copy of small_bundle that a test may tamper with."""
    return Path(shutil.copytree(small_bundle, tmp_path / "bundle"))
