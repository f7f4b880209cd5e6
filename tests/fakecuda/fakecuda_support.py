"""Paths and sizes shared by the fake-driver tests, importable by name (a conftest.py is not: with several test
folders, which `conftest` module a plain import finds depends on the order pytest loaded them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent
# The fake driver's sources (driver/fake_cuda.h describes it): compiled together into one libcuda.so.1.
DRIVER_SOURCES = sorted((HERE / "driver").glob("*.cpp"))
# The bundle of most tests: the Orin profile (sm_87, min_driver 12.2) at 4 tokens, a 2-layer model small enough that
# one emulated forward pass takes well under a second.
TOKENS, HIDDEN, INTER = 4, 64, 32


def fake_env(driver: Path, log: Path, kernels: str | Path, settings: dict) -> dict[str, str]:
    """The environment of a subprocess on the fake driver: this process's, less its COLIBRI_FAKE_CUDA_* variables,
    with LD_LIBRARY_PATH starting at `driver` (the folder of the fake libcuda.so.1), the fake's call log at `log`,
    the kernel emulation library `kernels`, and each of `settings` as COLIBRI_FAKE_CUDA_<NAME> (cc="9.0",
    fail="cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY", ...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLIBRI_FAKE_CUDA_")}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(driver), env.get("LD_LIBRARY_PATH")) if p)
    env["COLIBRI_FAKE_CUDA_LOG"] = str(log)
    env["COLIBRI_FAKE_CUDA_KERNELS"] = str(kernels)
    for key, value in settings.items():
        env[f"COLIBRI_FAKE_CUDA_{key.upper()}"] = str(value)
    return env


class FakeRun:
    """What one subprocess on the fake driver gave: its exit code, output, the JSON of its last stdout line (if
    any) and the fake's call log (one line per driver call; lines starting with "!" are the fake's complaints)."""

    def __init__(self, done: subprocess.CompletedProcess, log: Path):
        self.rc, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        lines = self.stdout.strip().splitlines()
        try:
            self.result = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            self.result = None
        self.log = log.read_text().splitlines() if log.exists() else []

    def calls(self, name: str) -> list[str]:
        """Log lines of driver call `name` (exact name, e.g. "cuMemcpyHtoD")."""
        return [line for line in self.log if line.split(" ", 1)[0] == name]

    def __repr__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def log_sections(run: FakeRun) -> dict[str, list[str]]:
    """The fake's call log split at the test's '# name' marks (written into the same file); "load" before the
    first."""
    sections, name = {"load": []}, "load"
    for line in run.log:
        if line.startswith("# "):
            name = line[2:]
            sections[name] = []
        else:
            sections[name].append(line)
    return sections


def emulation_library(kernels: list[dict]) -> Path:
    """The kernel emulation library (tests/kernels/emulator.py, cached) for a manifest's `kernels` list (the top
    level's or one shape's): its compile-time constants, and the units of the kernels it lists only (a bundle without
    the capacity kernel costs no capacity.cu compile)."""
    from emulator import build_library

    from colibri_sdk import catalog

    names = {kernel["name"] for kernel in kernels}
    units = [(spec.source, spec.symbols) for spec in catalog.KERNELS if spec.name in names]
    return build_library(kernels[0]["defines"], units=units)


def orin_profile_data(tokens: int, batch: int = 1) -> dict:
    """The shipped Orin profile as a dict (a copy), at batch x tokens."""
    import copy

    from colibri_sdk.profile import load_profile

    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": batch, "tokens": tokens}
    return data


def run_bundle_on_fake(run_fake, bundle: Path, kernels: Path, tokens: int, hidden: int, seed: int):
    """One call of the CUDA backend on the fake driver (kernels: the emulation library for the bundle's constants)
    on an N(0, 1) (tokens, hidden) float32 input of `seed`, and the bundle's self-test there; asserts that it ran on
    "cuda" and that the self-test passed.

    Returns:
        (x, y): the input and the backend's output, (tokens, hidden) float32 each.
    """
    import numpy as np

    code = f"""
    from colibri_sdk.runtime import Runtime
    x = np.random.default_rng({seed}).standard_normal(({tokens}, {hidden})).astype(np.float32)
    with Runtime.load({str(bundle)!r}, backend="cuda") as rt:
        y = rt.infer(x)
        emit(y=y.tolist(), selftest=bool(rt.self_test().passed), backend=rt.backend_name)
    """
    run = run_fake(code, kernels=kernels)
    assert run.rc == 0 and run.result, run
    assert run.result["backend"] == "cuda" and run.result["selftest"] is True
    x = np.random.default_rng(seed).standard_normal((tokens, hidden)).astype(np.float32)
    return x, np.asarray(run.result["y"], dtype=np.float32)
