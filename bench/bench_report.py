"""The report lines the CPU-backend benches share: the machine line, and the report printed and written to
bench/results/."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_line() -> str:
    """`machine: x86_64, 2 CPUs, load average 3.1`: where the numbers above it were measured."""
    return f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"


def write_report(lines: list[str], out: Path) -> str:
    """Print the report's lines and write them to `out` (its folder made if missing); returns the text."""
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return text
