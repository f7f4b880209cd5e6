"""Test modules are imported by their base name (the test folders have no __init__.py, so helpers import by plain
name from sys.path): two test files with one base name fail collection of the whole suite. Catch that here, naming
both files."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_python_module_under_tests_has_a_unique_base_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" in path.parts or path.name in ("conftest.py", "__init__.py"):
            continue
        seen[path.stem].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a base name: {clashes}"
