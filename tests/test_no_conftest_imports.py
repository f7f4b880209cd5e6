"""No test module imports a conftest: pytest loads each folder's conftest as a module named `conftest`, so with
several test folders on one command line `from conftest import X` picks up whichever was loaded first. Shared
helpers live in uniquely named *_support.py modules."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_module_imports_a_conftest():
    pattern = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest\b)", re.MULTILINE)
    offenders = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py")) if pattern.search(p.read_text())]
    assert offenders == [], f"import from a *_support module instead: {offenders}"
