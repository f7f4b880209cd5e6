"""Fixtures for the examples/jetson_qc tests: the example's folder on sys.path, its bundle built once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from timeout_support import guard

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "jetson_qc"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))


@pytest.fixture(scope="session")
def qc_bundle(tmp_path_factory) -> Path:
    """The example's bundle, built from the shipped weights with the public command line
    (`colibri-sdk build --profile profiles/orin.yaml --weights weights/qc_moe.colibri -o DIR`)."""
    from qc.model import build_command

    out = tmp_path_factory.mktemp("qc") / "bundle"
    done = subprocess.run(build_command(out), capture_output=True, text=True, cwd=ROOT, timeout=guard(1200))
    assert done.returncode == 0, done.stderr + done.stdout
    return out


@pytest.fixture(scope="session")
def qc_classifier(qc_bundle):
    """The example's classifier on the CPU backend."""
    from qc.model import load_classifier

    classifier = load_classifier(qc_bundle, backend="cpu")
    yield classifier
    classifier.close()
