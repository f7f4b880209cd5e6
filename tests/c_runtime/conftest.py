"""Fixtures for the C runtime tests (libcolibri, docs/c_runtime.md) on the fake CUDA driver.

`scripts/c_runtime.sh build DIR` builds the library with AddressSanitizer + UBSan, the fake libcuda.so.1
(tests/fakecuda/driver/) and the C test program `colibri_test` (tests/c_runtime/colibri_test/). When
COLIBRI_C_BUILD names a folder already built that way (what `scripts/c_runtime.sh test` does), it is used as is.
Every C program runs in a subprocess whose LD_LIBRARY_PATH starts with that folder, so libcolibri's dlopen finds the
fake driver; the fake runs the kernels through the CPU emulation of tests/kernels/emulator.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from timeout_support import guard

sys.path.insert(0, str(Path(__file__).parent))
from c_runtime_support import SHIPPED, build_bundle_for, manifest  # noqa: E402,F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakecuda"))
# One run of colibri_test: exit code, output, the JSON of its last stdout line, the fake driver's call log.
from fakecuda_support import FakeRun as CRun  # noqa: E402
from fakecuda_support import emulation_library, fake_env  # noqa: E402

HERE = Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent
# A model small enough that one emulated forward pass takes well under a second; the shipped profiles keep their
# arch, dtype, shape (1 x 16), block sizes and aggregation.
HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 32, 8, 2, 2

sys.path.insert(0, str(TESTS / "kernels"))
sys.path.insert(0, str(TESTS / "gpu"))

TOOLS = [tool for tool in ("cc", "g++") if shutil.which(tool) is None]
if TOOLS:
    pytest.skip(f"the C runtime tests need {' and '.join(TOOLS)} (apt-get install build-essential)",
                allow_module_level=True)
if not Path("/usr/include/openssl/evp.h").exists() and not os.environ.get("COLIBRI_C_BUILD"):
    pytest.skip("libcolibri needs OpenSSL's libcrypto headers (apt-get install libssl-dev; scripts/test.sh does it "
                "as root)", allow_module_level=True)


# What `scripts/c_runtime.sh build` reads: the key of the shared build below.
C_SOURCES = ("scripts/c_runtime.sh", "sdk/libcolibri", "tests/fakecuda/driver", "tests/c_runtime/colibri_test",
             "examples/jetson_qc/c/qc_loop.c", "bench/c_runtime_bench.c", "bench/noop_kernels.cpp")
C_CACHE = Path(tempfile.gettempdir()) / "colibri-c-runtime"


def c_build_key() -> str:
    """sha256 of the compilers' versions, CC / COLIBRI_NO_CMAKE and every byte `scripts/c_runtime.sh build` reads."""
    digest = hashlib.sha256()
    for tool in (os.environ.get("CC", "cc"), "g++", "cmake"):
        found = shutil.which(tool)
        version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout if found else "-"
        digest.update(f"{tool}\0{version}\0".encode())
    digest.update(f"{os.environ.get('CC', '')}\0{os.environ.get('COLIBRI_NO_CMAKE', '')}\0".encode())
    for name in C_SOURCES:
        top = ROOT / name
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


@pytest.fixture(scope="session")
def c_build() -> Path:
    """The folder with colibri_test, libcuda.so.1 (fake) and the libraries.

    Built once per content (c_build_key) under $TMPDIR/colibri-c-runtime and shared by every test process (the
    pytest-xdist workers, later runs): one process builds a key at a time (a lock file beside it), the others then
    use what it built. The build stays where it was made (qc_loop's rpath names its folder); `built` marks it
    complete."""
    given = os.environ.get("COLIBRI_C_BUILD")
    if given and (Path(given) / "colibri_test").exists():
        return Path(given)
    out = C_CACHE / c_build_key()
    if (out / "built").exists():
        return out
    C_CACHE.mkdir(parents=True, exist_ok=True)
    with open(C_CACHE / f"{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "built").exists():
            return out
        shutil.rmtree(out, ignore_errors=True)  # an interrupted build
        done = subprocess.run(["bash", str(ROOT / "scripts" / "c_runtime.sh"), "build", str(out)], capture_output=True,
                              text=True, check=False, timeout=guard(2400))
        assert done.returncode == 0, f"scripts/c_runtime.sh build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        (out / "built").write_text("")
    return out


@pytest.fixture(scope="session")
def small_weights(tmp_path_factory) -> Path:
    from gpu_support import random_model

    root = tmp_path_factory.mktemp("c_weights")
    return random_model(root / "model.colibri", layers=LAYERS, experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN,
                        inter=INTER, seed=5)


class _Lazy(dict):
    """A dict whose values are made on first use by `make(key)` and kept: a test process builds only the bundles (and
    emulation libraries) its tests read, not every one of them."""

    def __init__(self, keys, make):
        super().__init__()
        self._keys, self._make = tuple(keys), make

    def __missing__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        self[key] = value = self._make(key)
        return value

    def __contains__(self, key):
        return key in self._keys


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, small_weights) -> dict[str, Path]:
    """Every shipped profile, plus "tiled": batch 2 x 8, fp32, atomic aggregation, the tiled (not GEMV) kernels, and
    "pdl": h200 with programmatic dependent launch; each built when a test first reads it."""
    root = tmp_path_factory.mktemp("c_bundles")

    def make(name: str) -> Path:
        if name == "tiled":
            return build_bundle_for("orin", root / "tiled", small_weights, dtype="fp32", aggregation="atomic",
                                    shape={"batch": 2, "tokens": 8}, kernels={"small_batch": {"max_pairs": 1}})
        if name == "pdl":  # h200 with programmatic dependent launch (a CUDA 12.3 driver); the GEMV path at 1 x 4, the
            # compile constants of tests/fakecuda/test_pdl_on_fake.py's bundle: one NVRTC build and emulation for both
            return build_bundle_for("h200", root / "pdl", small_weights, programmatic_dependent_launch=True,
                                    target={"min_driver": 12030}, shape={"batch": 1, "tokens": 4})
        return build_bundle_for(name, root / name, small_weights)

    return _Lazy((*SHIPPED, "tiled", "pdl"), make)


@pytest.fixture(scope="session")
def emu_libs(bundles) -> dict[str, Path]:
    """The kernel emulation library for each bundle's compile-time constants (built when first read)."""
    return _Lazy(tuple(bundles._keys), lambda name: emulation_library(manifest(bundles[name])["kernels"]))


@pytest.fixture
def run_c(c_build, emu_libs, tmp_path):
    """run_c(args, kernels="tiled", asan=True, **fake_settings) -> CRun: colibri_test ARGS on the fake driver, built
    with AddressSanitizer + UBSan (asan=False: the plain build, for the long emulated runs: the sanitizers' fiber
    support makes the emulated kernels several times slower; the library code they run is the same; `program`: another
    program of the build folder, e.g. "qc_loop"; `stdin`: bytes for its standard input). `fake_settings` become COLIBRI_FAKE_CUDA_<NAME> variables (cc="7.5", driver=12000, integrated=1,
    fail="cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY")."""
    count = [0]

    def run(args: list[str], kernels: str | Path = "tiled", timeout: float | None = None, asan: bool = True,
            program: str = "", stdin: bytes | None = None, **settings) -> CRun:
        count[0] += 1
        timeout = guard(900) if timeout is None else timeout
        log = tmp_path / f"calls{count[0]}.log"
        env = fake_env(c_build, log, emu_libs[kernels] if kernels in emu_libs else kernels, settings)
        env["ASAN_OPTIONS"] = "detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=0"
        env["LSAN_OPTIONS"] = f"suppressions={HERE / 'lsan.supp'}:print_suppressions=0"
        env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
        program = program or ("colibri_test" if asan else "colibri_test_plain")
        cmd = [str(c_build / program), *[str(a) for a in args]]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env, cwd=str(tmp_path), check=False,
                              input=stdin)
        done.stdout, done.stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        return CRun(done, log)

    return run


def pytest_report_header(config):
    return ("tests/c_runtime: libcolibri (C) against a FAKE libcuda.so.1 on the CPU with emulated kernels, under "
            "AddressSanitizer — not a GPU run")
