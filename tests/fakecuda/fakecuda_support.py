"""Paths and sizes shared by the fake-driver tests, importable by name (a conftest.py is not: with several test
folders, which `conftest` module a plain import finds depends on the order pytest loaded them)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent
# The bundle of most tests: the Orin profile (sm_87, min_driver 12.2) at 4 tokens, a 2-layer model small enough that
# one emulated forward pass takes well under a second.
TOKENS, HIDDEN, INTER = 4, 64, 32
