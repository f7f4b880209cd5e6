"""The README's CMake build of libcolibri (no build type, so no optimisation): the shared library links on its own,
an application needs only -lcolibri."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

APP = r"""
#include <stdio.h>
#include "colibri.h"
int main(void) {
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    colibri_ctx *ctx;
    cfg.bundle_dir = "no-such-bundle";
    if (colibri_init(&cfg, &ctx) != COLIBRI_OK) { fprintf(stderr, "%s\n", colibri_last_error(NULL)); return 1; }
    colibri_free(ctx);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_default_cmake_build_links_an_app_with_only_lcolibri(tmp_path):
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT / "sdk/libcolibri"), "-B", str(build)], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "colibri"], check=True, capture_output=True)
    (tmp_path / "app.c").write_text(APP)
    link = subprocess.run(["cc", "-std=c11", str(tmp_path / "app.c"), f"-I{ROOT / 'sdk/libcolibri/include'}",
                           f"-L{build}", f"-Wl,-rpath,{build}", "-lcolibri", "-o", str(tmp_path / "app")],
                          capture_output=True, text=True)
    assert link.returncode == 0, link.stderr
    run = subprocess.run([str(tmp_path / "app")], capture_output=True, text=True, env={"LD_LIBRARY_PATH": ""})
    assert run.returncode == 1 and run.stderr.strip(), run
