"""Fixtures for the CUDA backend against a fake CUDA driver on the CPU (driver/*.cpp, docs/runtime-cuda.md).

The fake libcuda.so.1 is built with g++ into a temp folder once per session. Every test runs its Python code in a
SUBPROCESS whose LD_LIBRARY_PATH starts with that folder, so cuda-bindings (through cuda.pathfinder's system search)
and the ctypes probe load the fake, the probe's cache is fresh, and the test process itself never loads it.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

sys.path.insert(0, str(Path(__file__).parent))
from fakecuda_support import (  # noqa: E402,F401
    DRIVER_SOURCES, HERE, HIDDEN, INTER, ROOT, TESTS, TOKENS, FakeRun, emulation_library, fake_env)

CXX = shutil.which("g++")

sys.path.insert(0, str(TESTS / "kernels"))
sys.path.insert(0, str(TESTS / "gpu"))

from gpu_support import random_model



@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> Path:
    """Folder holding the fake libcuda.so.1."""
    out = tmp_path_factory.mktemp("fakecuda")
    lib = out / "libcuda.so.1"
    cmd = [CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra",
           "-Wno-unused-parameter", "-Werror", *map(str, DRIVER_SOURCES), "-o", str(lib), "-ldl", "-pthread"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr}"
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """A bundle built by the SDK's build (NVRTC) from a random float32 model with the Orin profile at 4 tokens."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    root = tmp_path_factory.mktemp("tiny")
    weights = random_model(root / "model.colibri", layers=2, experts=8, top_k=2, hidden=HIDDEN, inter=INTER, seed=3)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": TOKENS}
    return build_bundle(Profile.from_dict(data), root / "bundle", weights, workers=2).path


@pytest.fixture(scope="session")
def kernels_lib(tiny_bundle) -> Path:
    """The kernel emulation library (tests/kernels/emulator.py) for the tiny bundle's compile-time constants."""
    from colibri_sdk.bundle import Bundle

    return emulation_library(Bundle.open(tiny_bundle).manifest["kernels"])


PRELUDE = """
import ctypes, json, sys
import numpy as np
def live():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.colibri_fake_cuda_live.restype = ctypes.c_char_p
    return dict(kv.split("=") for kv in lib.colibri_fake_cuda_live().decode().split())
def emit(**values):
    print(json.dumps(values))
"""


@pytest.fixture
def run_fake(fake_driver, kernels_lib, tmp_path):
    """run_fake(code, timeout=guard(600), args=None, **settings) -> FakeRun: run Python `code` (or, with `args`, that
    command) in a subprocess on the fake driver. `settings` become COLIBRI_FAKE_CUDA_<NAME> variables (cc="9.0",
    driver=12060, integrated=1, fail="cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY", kernels=path)."""
    count = [0]

    def run(code: str = "", *, timeout: float | None = None, args: list[str] | None = None, **settings) -> FakeRun:
        count[0] += 1
        timeout = guard(600) if timeout is None else timeout
        log = tmp_path / f"calls{count[0]}.log"
        env = fake_env(fake_driver, log, kernels_lib, settings)
        cmd = args or [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(tmp_path),
                              check=False)
        return FakeRun(done, log)

    return run


@pytest.fixture(scope="session")
def reference_output(tiny_bundle):
    """(x, float64 reference output) for a fixed N(0, 1) input of shape (1, TOKENS, HIDDEN)."""
    from colibri_sdk.bundle import Bundle
    from gpu_support import reference

    x = np.random.default_rng(11).standard_normal((1, TOKENS, HIDDEN)).astype(np.float32)
    expected, stable = reference(Bundle.open(tiny_bundle).weights_path, x)
    assert stable.all(), "the fixed input has a router near-tie; pick another seed"
    return x, expected


def pytest_report_header(config):
    return ("tests/fakecuda: the CUDA backend against a FAKE libcuda.so.1 on the CPU with emulated kernels "
            "(docs/runtime-cuda.md) — not a GPU run")
