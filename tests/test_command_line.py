"""The command line as a whole: missing optional dependencies and closed pipes give one line, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run the CLI in a fresh interpreter in which importing `module` fails as if the package were not installed.
RUN_WITHOUT = """
import sys
sys.modules[{module!r}] = None  # `import {module}` now raises ModuleNotFoundError(name={module!r})
from colibri_sdk.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "module, extra, argv",
    [
        ("paramiko", "deploy", ["deploy", "--status", "--host", "user@127.0.0.1"]),
        ("yaml", "build", ["build", "--profile", "orin", "-o", "unused-bundle"]),
    ],
)
def test_missing_optional_dependency_names_the_extra(tmp_path, module, extra, argv):
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT.format(module=module, argv=argv)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().endswith(
        f"needs the Python package {module!r} (extra \"{extra}\"): pip install \"colibri-sdk[{extra}]\" "
        f"(in a source checkout: pip install \".[{extra}]\")"
    ), result.stderr


def test_closed_stdout_is_not_an_error(demo_model_path):
    cmd = f"{sys.executable} -m colibri_sdk inspect --json {demo_model_path} | head -c 10"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert result.stdout == '{\n  "path"'
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
