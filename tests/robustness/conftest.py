"""Fixtures of tests/robustness: one small bundle built per session (a private copy per test), and `alarm`."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from robustness_helpers import write_small_model
from timeout_support import guard_whole


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


@pytest.fixture
def alarm(request):
    """Turn a hang into a test failure: TimeoutError after the test module's ALARM_S seconds (default 120) times
    COLIBRI_TEST_TIMEOUT_SCALE (tests/timeout_support.py). Far above a busy run: on 2 loaded cores the first CPU
    run of a bundle (numba compiling its kernels into an empty cache) took more than 20 s."""
    seconds = guard_whole(getattr(request.module, "ALARM_S", 120))

    def on_alarm(signum, frame):
        raise TimeoutError(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
