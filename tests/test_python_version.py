"""The package runs on Python 3.10 (`requires-python`; a Jetson with JetPack 6 has 3.10): vermin, which reads the
syntax tree and knows in which version each module, member and construct appeared, finds nothing newer in sdk/ or
examples/ (https://github.com/netromdk/vermin)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from timeout_support import guard

ROOT = Path(__file__).resolve().parents[1]
# vermin's command line (its console script, run by this interpreter): violations of the 3.10 target only
VERMIN = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--target=3.10-", "--no-tips",
          "--violations", "-q"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vermin") is None,
                                reason="vermin is not installed (the test extra: pip install '.[test]')")


def vermin(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([*VERMIN, *map(str, paths)], capture_output=True, text=True, timeout=guard(120))


def test_sdk_and_examples_need_nothing_newer_than_python_3_10():
    done = vermin(ROOT / "sdk", ROOT / "examples")
    assert done.returncode == 0, f"constructs newer than Python 3.10:\n{done.stdout}{done.stderr}"


def test_the_check_refuses_a_python_3_11_construct(tmp_path):
    (tmp_path / "newer.py").write_text("import tomllib\n\ntry:\n    pass\nexcept* ValueError:\n    pass\n")
    done = vermin(tmp_path)
    assert done.returncode != 0 and "'tomllib' module requires" in done.stdout and "`except*` requires" in done.stdout, \
        done.stdout + done.stderr
