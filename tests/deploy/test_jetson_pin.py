"""JetPack 6's driver (540, CUDA 12.2/12.6) cannot run cuda-bindings 13 (driver >= 580): the `jetson` extra pins
12.x, and the runtime names that pin when the installed bindings are too new for the driver."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from colibri_sdk.runtime.driver import bindings_driver_mismatch

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_jetson_extra_pins_cuda_bindings_12():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["jetson"]]
    assert req.name == "cuda-bindings"
    assert [v for v in ("12.0.0", "12.6.2", "12.9.10", "13.0.0", "13.1.1") if req.specifier.contains(v)] == [
        "12.0.0", "12.6.2", "12.9.10"]


def test_bindings_13_on_the_jetpack_6_driver_names_the_pin():
    assert bindings_driver_mismatch("13.0.1", 12060) == (
        "cuda-bindings 13.0.1 needs a driver for CUDA 13.0 or newer (>= 580 for 13.x), but this driver supports "
        "CUDA 12.6: install cuda-bindings 12.x, pip install 'cuda-bindings>=12,<13' (the extra colibri-sdk[jetson])")


def test_matching_bindings_pass():
    assert bindings_driver_mismatch("12.9.10", 12020) is None  # 12.x on JetPack 6.0
    assert bindings_driver_mismatch("13.0.1", 13000) is None  # 13.x on driver 580
    assert bindings_driver_mismatch("", 12020) is None  # version unknown: nothing to say
