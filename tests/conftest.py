"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import numpy as np
import nvrtc_cache_support
import pytest

from colibri_sdk.demo import write_demo_model

# Bundle builds and the kernels' compile checks go through a content-keyed NVRTC cache (tests/nvrtc_cache_support.py);
# the tests of NVRTC itself do not.
nvrtc_cache_support.install()

# Full-size cases that cost minutes of CPU emulation carry the `full` marker: the default run checks the same
# behaviour at a small size, `bash scripts/test_full.sh` (COLIBRI_TEST_FULL=1) runs them too.
ENV_FULL = "COLIBRI_TEST_FULL"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENV_FULL) == "1":
        return
    skip = pytest.mark.skip(reason=f"full-size case: bash scripts/test_full.sh runs it ({ENV_FULL}=1); the default run "
                                   "checks the same behaviour at a small size")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_model_path(tmp_path_factory):
    """The embedded demo model written once as fp16 .colibri."""
    return write_demo_model(tmp_path_factory.mktemp("demo") / "demo.colibri", dtype="fp16")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

