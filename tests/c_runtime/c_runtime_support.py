"""Constants and small helpers of the C runtime tests, importable by name (a conftest.py is not: with several test
folders, which `conftest` module a plain import finds depends on the order pytest loaded them)."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED = ("orin", "a100", "rtx4090", "h200")


def manifest(bundle: Path) -> dict:
    """The bundle's manifest.json as a dict."""
    return json.loads((bundle / "manifest.json").read_text())
