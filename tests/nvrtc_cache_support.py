"""The tests' NVRTC cache: the product's (`colibri_sdk.aot.cache.NvrtcCache`), kept under the temp folder.

`install` (called by tests/conftest.py before any test runs) points `COLIBRI_CACHE_DIR` at
`$TMPDIR/colibri-nvrtc-cache`, so that every bundle build of the tests, in this process and in the subprocesses it
starts (which inherit the variable), reuses NVRTC output by content and never reads or writes the user's
`~/.cache`. The kernels' compile checks (tests/kernels/test_compile*.py: spills, registers, the cubin's SM) take
NVRTC's output through the same cache (`compile_source` below): an entry is keyed by every byte NVRTC reads and
holds what it wrote, so a check reads the same cubin and ptxas report either way, and a compilation a bundle build
of the suite (or an earlier run) already made is not made again. `colibri_sdk.aot.nvrtc.compile_source` itself is
not cached: the tests of it (tests/build/test_nvrtc.py) always run NVRTC, and the reproducibility and cache tests
(tests/build/test_bundle_build.py, tests/build/test_nvrtc_cache.py) build with `nvrtc_cache=False` or with a cache
folder of their own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from colibri_sdk.aot.cache import ENV_DIR, NvrtcCache

CACHE = Path(tempfile.gettempdir()) / "colibri-nvrtc-cache"


def install() -> None:
    """Make every bundle build of the test session use the NVRTC cache under the temp folder."""
    os.environ[ENV_DIR] = str(CACHE)


def compile_source(source: str, name: str, arch: str, defines: dict | None = None, include_dirs=None,
                   toolkit: int | None = None):
    """`colibri_sdk.aot.nvrtc.compile_source` answered from the tests' cache (module docstring); a failure raises
    CompileError every time, as NVRTC's does."""
    return NvrtcCache(CACHE).compile_source(source, name, arch, defines, include_dirs, toolkit)
