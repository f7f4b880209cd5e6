"""Fixtures for tests/format: small .colibri files with known contents."""

from __future__ import annotations

import pytest

from colibri_sdk.format import Header, write_model
from format_cases import SIZES, small_arrays


@pytest.fixture
def small_file(tmp_path):
    """(path, header, arrays) of a small fp16 file."""
    header = Header(**SIZES, dtype=1)
    a = small_arrays()
    path = write_model(tmp_path / "small.colibri", header, a["gate_proj"], a["up_proj"], a["down_proj"], a["router"])
    return path, header, a
