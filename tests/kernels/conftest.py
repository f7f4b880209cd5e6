"""Fixtures for the kernel tests: NVRTC compilation of the catalogue sources for a profile dict and a header."""

from __future__ import annotations

import copy

import pytest

from colibri_sdk.profile import load_profile


@pytest.fixture(scope="session")
def orin_profile() -> dict:
    """The shipped Orin profile as a plain dict (validated by the profile loader, toolchain not checked), at its one
    compiled shape batch 1 x tokens 16 (the catalogue's functions take one scalar shape)."""
    return copy.deepcopy(load_profile("orin", toolchain=False).for_shape(1, 16).data)



def pytest_report_header(config):
    return ("tests/kernels: NVRTC compiles the kernels (no GPU); test_emulated.py runs them on a CPU emulation "
            "(docs/kernels.md, 'Emulated on the CPU') — not a GPU run")
