"""The tests' NVRTC cache: the product's (`colibri_sdk.aot.cache.NvrtcCache`), kept under the temp folder.

`install` (called by tests/conftest.py before any test runs) points `COLIBRI_CACHE_DIR` at
`$TMPDIR/colibri-nvrtc-cache`, so that every bundle build of the tests, in this process and in the subprocesses it
starts (which inherit the variable), reuses NVRTC output by content and never reads or writes the user's
`~/.cache`. `colibri_sdk.aot.nvrtc.compile_source` itself is not cached: the tests that call it
(tests/build/test_nvrtc.py, tests/kernels/test_compile*.py) always run NVRTC, and the reproducibility and cache
tests (tests/build/test_bundle_build.py, tests/build/test_nvrtc_cache.py) build with `nvrtc_cache=False` or with a
cache folder of their own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from colibri_sdk.aot.cache import ENV_DIR

CACHE = Path(tempfile.gettempdir()) / "colibri-nvrtc-cache"


def install() -> None:
    """Make every bundle build of the test session use the NVRTC cache under the temp folder."""
    os.environ[ENV_DIR] = str(CACHE)
