"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

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


# Parallel runs (`pytest -n auto --dist loadgroup`, pytest-xdist): each test file runs on one worker, so module
# fixtures are made once; these folders run whole on one worker because their session fixtures are costly to make
# twice (tests/c_runtime: the sanitizer builds of libcolibri; tests/examples: the example's bundle, built by the CLI
# in a subprocess). Without -n the marks change nothing.
WHOLE_FOLDER_GROUPS = ("c_runtime", "examples")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        try:
            parts = item.path.relative_to(tests).parts
        except ValueError:
            continue
        group = parts[0] if parts[0] in WHOLE_FOLDER_GROUPS else "/".join(parts)
        item.add_marker(pytest.mark.xdist_group(group))
