"""CUDA driver versions as the driver API encodes them (cuDriverGetVersion: 1000*major + 10*minor)."""

from __future__ import annotations


def format_driver_version(version: int) -> str:
    """cuDriverGetVersion's encoding (1000*major + 10*minor, e.g. 12020) as "12.2"."""
    return f"{version // 1000}.{(version % 1000) // 10}"
