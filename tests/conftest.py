"""Fixtures shared by every test folder."""

from __future__ import annotations

import numpy as np
import nvrtc_cache_support
import pytest

from colibri_sdk.demo import write_demo_model

# Bundle builds compile through a content-keyed NVRTC cache (tests/nvrtc_cache_support.py); the NVRTC tests do not.
nvrtc_cache_support.install()


@pytest.fixture(scope="session")
def demo_model_path(tmp_path_factory):
    """The embedded demo model written once as fp16 .colibri."""
    return write_demo_model(tmp_path_factory.mktemp("demo") / "demo.colibri", dtype="fp16")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

