"""Where the build finds the .cu sources: the installed package's colibri_sdk/kernels, or a checkout's kernels/
beside sdk/ where colibri_sdk is the checkout's sdk/ itself (a setuptools editable install maps colibri_sdk to sdk/
but not its namespace subpackage colibri_sdk.kernels, so `from . import kernels` fails there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_sdk.kernel_table import checkout_kernel_dir

ROOT = Path(__file__).resolve().parents[2]


def test_colibri_sdk_as_the_checkouts_sdk_folder_finds_the_checkouts_kernels(tmp_path):
    """colibri_sdk imported from sdk/ itself (the layout of an editable install): kernels/ beside it."""
    (tmp_path / "colibri_sdk").symlink_to(ROOT / "sdk", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = ("import colibri_sdk, colibri_sdk.catalog as c; "
            "print(colibri_sdk.__file__); print(c.kernel_dir())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    package, folder = done.stdout.split()
    assert Path(package).resolve() == (ROOT / "sdk" / "__init__.py").resolve()  # the checkout's sdk/, not site-packages
    assert Path(folder).resolve() == (ROOT / "kernels").resolve()


def test_a_folder_without_kernel_sources_is_named(tmp_path):
    (tmp_path / "sdk").mkdir()
    (tmp_path / "kernels").mkdir()  # present but empty
    with pytest.raises(FileNotFoundError, match=r"kernels holds no common\.cuh"):
        checkout_kernel_dir(tmp_path / "sdk")
