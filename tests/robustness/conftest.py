"""Fixtures of tests/robustness: one small bundle built per session (a private copy per test)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from robustness_helpers import write_small_model


@pytest.fixture(scope="session")
def small_bundle_dir(tmp_path_factory) -> Path:
    """`build_bundle(orin, small model)`: read-only, tests that change files use `bundle`."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import load_profile

    root = tmp_path_factory.mktemp("robust_bundle")
    weights = write_small_model(root / "small.colibri")
    return build_bundle(load_profile("orin"), root / "bundle", weights).path


@pytest.fixture
def bundle(small_bundle_dir, tmp_path) -> Path:
    """A private copy of the small bundle that a test may tamper with."""
    return Path(shutil.copytree(small_bundle_dir, tmp_path / "bundle"))
