"""Fixtures shared by every test folder."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.demo import write_demo_model


@pytest.fixture(scope="session")
def demo_model_path(tmp_path_factory):
    """The embedded demo model written once as fp16 .colibri."""
    return write_demo_model(tmp_path_factory.mktemp("demo") / "demo.colibri", dtype="fp16")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
