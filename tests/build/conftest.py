"""Fixtures of tests/build: the shipped profiles built once per session with the real kernels."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colibri_sdk import catalog
from colibri_sdk.profile import load_profile, packaged_names

FIXTURES = Path(__file__).parent / "fixtures"
SHIPPED = ("a100", "h200", "orin", "rtx4090")


@pytest.fixture(scope="session")
def kernel_dir() -> Path:
    """The real kernel sources (kernels/*.cu)."""
    folder = catalog.kernel_dir()
    missing = [k.source for k in catalog.KERNELS if not (folder / k.source).is_file()]
    if missing:
        pytest.skip(f"kernel sources {missing} are not in {folder}")
    return folder


@pytest.fixture(scope="session")
def stub_kernels(tmp_path_factory) -> Path:
    """A writable copy of the stand-in kernels (tests/build/fixtures/kernels), for edits such as a spilling kernel."""
    folder = tmp_path_factory.mktemp("stub_kernels") / "kernels"
    shutil.copytree(FIXTURES / "kernels", folder)
    return folder


@pytest.fixture(scope="session")
def built(tmp_path_factory, kernel_dir):
    """{profile name: BuildResult} for every shipped profile, built from scratch with the demo model; orin also
    as an archive. Read-only: tests that change files copy the bundle first."""
    from colibri_sdk.bundle.writer import build_bundle

    assert sorted(packaged_names()) == sorted(SHIPPED)
    root = tmp_path_factory.mktemp("bundles")
    return {
        name: build_bundle(load_profile(name), root / name, kernel_dir=kernel_dir, archive=name == "orin")
        for name in SHIPPED
    }
