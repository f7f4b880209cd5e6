"""Timeouts of the tests: each one only turns a hang into a failure, so it is set well above what a busy machine
(2 cores, load average ~20) takes, and every one is multiplied by `COLIBRI_TEST_TIMEOUT_SCALE` (default 1; e.g. 4
on a slower or busier machine). No test fails on time alone.

    subprocess.run(cmd, timeout=guard(600))
"""

from __future__ import annotations

import math
import os

ENV_SCALE = "COLIBRI_TEST_TIMEOUT_SCALE"


def scale() -> float:
    """The factor from COLIBRI_TEST_TIMEOUT_SCALE (a finite number > 0; default 1)."""
    text = os.environ.get(ENV_SCALE, "1")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV_SCALE} = {text!r}; allowed: a finite number > 0 (e.g. 4)")
    return value


def guard(seconds: float) -> float:
    """`seconds` times the scale: the timeout of a wait that only guards against a hang."""
    return seconds * scale()


def guard_whole(seconds: float) -> int:
    """guard(seconds) rounded up to whole seconds (signal.alarm)."""
    return math.ceil(guard(seconds))
