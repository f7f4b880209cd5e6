"""tests/gpu run against the fake driver, so the GPU tests' own logic (bundles built for "this GPU", the reference
comparison, graph vs eager, close, the Runtime self-test) is exercised where no GPU exists.

A subset: the cases whose emulated forward passes are fast. Left out (tens of seconds to minutes on the emulator):
the 1000 replays, the concurrency test, the largest GEMV cases, every shipped profile on the demo model, the
integrated-GPU memory test (a 400 MB model), all but one (tiled, int4) of the quantized bundles, and two of the
three tiled fp16 cases."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from fakecuda_support import HERE, ROOT, TESTS
from timeout_support import guard

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

SLOW = ["1000", "concurrent", "peak_memory", "shipped_profile", "gemv-many", "gemv-atomic", "t4-int4", "t64-int",
        # two more tiled fp16 cases (odd sizes, block_m 32): tests/kernels emulates those kernels on their own
        "t16-e64-k4-fp16-tiled-odd", "t33-e16-k2-fp16-tiled-bm32"]


def test_gpu_tests_pass_on_the_fake_driver(run_fake, tmp_path):
    selection = " and ".join(f"not {name}" for name in SLOW)
    cmd = [sys.executable, "-m", "pytest", str(TESTS / "gpu"), "-q", "-x", "-p", "fake_gpu_plugin", "-k", selection,
           "-p", "no:cacheprovider", f"--rootdir={ROOT}", f"--basetemp={tmp_path / 'gpu'}"]
    # about 130 s alone on 2 cores: the limit leaves room for a busy machine (another test worker, a cold cache)
    run = run_fake(args=["env", f"PYTHONPATH={HERE}{os.pathsep}{TESTS / 'kernels'}", *cmd], timeout=guard(2400))
    assert run.rc == 0, run
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 10, summary
