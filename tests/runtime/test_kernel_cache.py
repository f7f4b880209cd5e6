"""The CPU kernels' numba cache (sdk/runtime/cpu_jit.py, `drop_stale_cache`): numba keys a cached kernel by its own
source file only, so entries compiled from other sources of the kernel modules are removed before any is loaded,
and entries of the installed sources are kept."""

from __future__ import annotations

import types
from pathlib import Path

from colibri_sdk.runtime import cpu_jit

ENTRIES = ["cpu_kernels.experts_into-362.py311.nbi", "cpu_kernels.experts_into-362.py311.0.nbc",
           "cpu_direct._project_direct-213.py311.nbi", "cpu_routing.route_grouped-150.py311.nbi"]
OTHERS = ["mymodel.f-3.py311.nbi", "cpu_kernels.py", "notes.txt"]  # not kernel cache entries


def fake_dispatcher(folder):
    return types.SimpleNamespace(_cache=types.SimpleNamespace(_cache_path=str(folder)))


def populate(folder, stamp=None):
    folder.mkdir()
    for name in ENTRIES + OTHERS:
        (folder / name).write_bytes(b"x")
    if stamp is not None:
        (folder / cpu_jit.STAMP_NAME).write_text(stamp)


def test_entries_of_other_sources_are_removed_once(tmp_path):
    folder = tmp_path / "stale"
    populate(folder, stamp="0" * 64)
    cpu_jit.drop_stale_cache(fake_dispatcher(folder))
    assert sorted(p.name for p in folder.iterdir()) == sorted(OTHERS + [cpu_jit.STAMP_NAME])
    assert (folder / cpu_jit.STAMP_NAME).read_text() == cpu_jit.sources_digest()
    (folder / ENTRIES[0]).write_bytes(b"new")  # compiled after the check: kept for the rest of the process
    cpu_jit.drop_stale_cache(fake_dispatcher(folder))
    assert (folder / ENTRIES[0]).exists()


def test_entries_without_a_stamp_are_removed(tmp_path):
    folder = tmp_path / "unknown"
    populate(folder)
    cpu_jit.drop_stale_cache(fake_dispatcher(folder))
    assert not any((folder / name).exists() for name in ENTRIES)


def test_entries_of_the_installed_sources_are_kept(tmp_path):
    folder = tmp_path / "current"
    populate(folder, stamp=cpu_jit.sources_digest())
    cpu_jit.drop_stale_cache(fake_dispatcher(folder))
    assert all((folder / name).exists() for name in ENTRIES + OTHERS)


def test_the_digest_covers_every_kernel_module(tmp_path, monkeypatch):
    """A change in any one kernel module (here cpu_direct, which cpu_kernels inlines) changes the digest."""
    here = tmp_path / "pkg"
    here.mkdir()
    for name in cpu_jit.KERNEL_MODULES:
        (here / f"{name}.py").write_text(f"# {name}\n")
    monkeypatch.setattr(cpu_jit, "__file__", str(here / "cpu_jit.py"))
    before = cpu_jit.sources_digest()
    (here / "cpu_direct.py").write_text("# cpu_direct, edited\n")
    assert cpu_jit.sources_digest() != before


def test_a_folder_that_cannot_be_written_raises_nothing(tmp_path):
    folder = tmp_path / "readonly"
    populate(folder, stamp="0" * 64)
    folder.chmod(0o500)
    try:
        cpu_jit.drop_stale_cache(fake_dispatcher(folder))  # no error; root may still write there
    finally:
        folder.chmod(0o700)
    assert all((folder / name).exists() for name in OTHERS)


def test_a_damaged_stamp_is_replaced(tmp_path):
    """Bytes that are no text, a stamp that is a link to a file elsewhere (that file untouched), an entry name
    held by a folder: no error, the entries dropped, a regular stamp of the installed sources written."""
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("keep me")
    for case in ("binary", "link", "folder-entry"):
        folder = tmp_path / case
        populate(folder)
        stamp = folder / cpu_jit.STAMP_NAME
        if case == "binary":
            stamp.write_bytes(b"\xff\xfe\x00")
        elif case == "link":
            stamp.symlink_to(outside)
        else:
            (folder / "cpu_kernels.odd-1.py311.nbi").mkdir()
        cpu_jit.drop_stale_cache(fake_dispatcher(folder))
        assert not any((folder / name).exists() for name in ENTRIES), case
        assert not stamp.is_symlink() and stamp.read_text() == cpu_jit.sources_digest(), case
        assert not list(folder.glob("*.tmp")), case
    assert outside.read_text() == "keep me"


def test_the_installed_kernels_checked_their_folder():
    from colibri_sdk.runtime import cpu_kernels

    folder = Path(cpu_kernels.experts_into._cache._cache_path)
    assert (folder / cpu_jit.STAMP_NAME).read_text() == cpu_jit.sources_digest()
