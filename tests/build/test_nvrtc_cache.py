"""The NVRTC cache of the build (colibri_sdk.aot.cache, docs/build.md "NVRTC cache"): bundles bit-identical with a
cold cache, a warm one and none; damaged entries ignored and rebuilt; the key covers every input of NVRTC; the
location variables; `build --no-cache`."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest

from colibri_sdk import catalog, cli
from colibri_sdk.aot import cache as nvrtc_cache
from colibri_sdk.aot import nvrtc
from colibri_sdk.aot.cache import NvrtcCache, cache_key, decode_entry, default_cache_dir
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.format import Header
from colibri_sdk.profile import Profile, load_profile


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def small_profile() -> Profile:
    data = copy.deepcopy(load_profile("orin").data)
    data["shape"] = {"batch": 1, "tokens": 2}
    return Profile.from_dict(data, "orin 1x2")


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The demo model at orin 1 x 2, built once through an empty cache folder and once without any cache."""
    root = tmp_path_factory.mktemp("nvrtc-cache")
    cache = NvrtcCache(root / "cache")
    built = build_bundle(small_profile(), root / "cold", nvrtc_cache=cache, workers=2)
    plain = build_bundle(small_profile(), root / "plain", nvrtc_cache=False, workers=2)
    return root, cache, built.path, plain.path


def test_cold_warm_and_no_cache_bundles_are_bit_identical(cold, tmp_path):
    root, cache, cold_path, plain_path = cold
    entries = sorted((root / "cache").glob("*.nvrtc"))
    assert cache.hits == 0 and cache.misses == len(entries) > 0
    warm = NvrtcCache(root / "cache")
    again = build_bundle(small_profile(), tmp_path / "warm", nvrtc_cache=warm, workers=2).path
    assert warm.hits == len(entries) and warm.misses == 0
    assert tree_bytes(cold_path) == tree_bytes(plain_path) == tree_bytes(again)
    assert not list((root / "cache").glob("*.tmp"))  # written through a temporary file renamed into place


def test_damaged_entries_are_ignored_and_rebuilt(cold, tmp_path):
    root, _, cold_path, _ = cold
    folder = tmp_path / "cache"
    shutil.copytree(root / "cache", folder)
    entries = sorted(folder.glob("*.nvrtc"))
    assert len(entries) >= 3
    data = entries[0].read_bytes()
    entries[0].write_bytes(data[: len(data) // 2])  # truncated
    data = bytearray(entries[1].read_bytes())
    data[-100] ^= 0x01  # one bit of the PTX or cubin flipped
    entries[1].write_bytes(bytes(data))
    entries[2].write_bytes(entries[3 % len(entries)].read_bytes())  # another key's (intact) entry
    for damaged in entries[:3]:
        assert decode_entry(damaged.read_bytes(), damaged.stem) is None
    cache = NvrtcCache(folder)
    again = build_bundle(small_profile(), tmp_path / "b", nvrtc_cache=cache, workers=2).path
    assert cache.misses == 3 and cache.hits == len(entries) - 3
    assert tree_bytes(again) == tree_bytes(cold_path)
    for repaired in entries[:3]:  # replaced by whole entries of their own key
        assert decode_entry(repaired.read_bytes(), repaired.stem) is not None


def test_key_covers_every_input_of_nvrtc(tmp_path, monkeypatch, kernel_dir):
    kernels = tmp_path / "kernels"
    shutil.copytree(kernel_dir, kernels)
    source = (kernels / "routing.cu").read_text()
    args = dict(source=source, name="routing.cu", arch="sm_87", defines={"A": 1, "B": 2}, include_dirs=[kernels],
                toolkit=12)
    base = cache_key(**args)
    assert cache_key(**{**args, "defines": {"B": 2, "A": 1}}) == base  # the order of a dict is no input
    changed = [
        {"source": source + "\n"}, {"name": "router.cu"}, {"arch": "sm_90"}, {"arch": "compute_87"},
        {"defines": {"A": 1, "B": 3}}, {"defines": {"A": 1}}, {"toolkit": 13}, {"include_dirs": []},
    ]
    keys = {cache_key(**{**args, **change}) for change in changed}
    assert base not in keys and len(keys) == len(changed)
    header = kernels / "common.cuh"
    header.write_text(header.read_text() + "\n// one more line\n")  # an included header: a new key
    assert cache_key(**args) != base
    (kernels / "common.cuh").unlink()
    assert cache_key(**args) != base
    real = nvrtc.nvrtc_version()
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (real[0], real[1] + 1))
    newer = cache_key(**args)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: real)
    assert cache_key(**args) != newer  # the NVRTC version is in the key


def test_the_same_kernels_in_another_folder_share_entries(tmp_path, kernel_dir):
    """The include folders are keyed by content, not path: NVRTC gives the same cubin and PTX for the same kernels in
    two folders, so a second checkout or venv reads the first one's entries; the answer names its own folder."""
    first, second = tmp_path / "a" / "kernels", tmp_path / "another" / "checkout" / "kernels"
    shutil.copytree(kernel_dir, first)
    shutil.copytree(kernel_dir, second)
    defines = catalog.compile_defines(small_profile().for_shape(1, 2).data, Header(2, 8, 2, 64, 32, dtype=1))
    source = (kernel_dir / "routing.cu").read_text()  # it includes common.cuh
    args = dict(source=source, name="routing.cu", arch="sm_87", defines=defines, toolkit=None)
    assert cache_key(**args, include_dirs=[first]) == cache_key(**args, include_dirs=[second])
    own = [nvrtc.compile_source(source, "routing.cu", "sm_87", defines, [folder]) for folder in (first, second)]
    assert own[0].cubin == own[1].cubin and own[0].ptx == own[1].ptx  # no path reaches NVRTC's output
    cache = NvrtcCache(tmp_path / "cache")
    cache.compile_source(source, "routing.cu", "sm_87", defines, [first])
    answer = cache.compile_source(source, "routing.cu", "sm_87", defines, [second])
    assert (cache.misses, cache.hits) == (1, 1)
    assert (answer.cubin, answer.ptx) == (own[1].cubin, own[1].ptx)
    assert answer.options == own[1].options and f"-I{second}" in answer.options and f"-I{first}" not in answer.options
    (second / "common.cuh").write_text((second / "common.cuh").read_text() + "\n// changed\n")
    assert cache_key(**args, include_dirs=[first]) != cache_key(**args, include_dirs=[second])  # content still counts


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("COLIBRI_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "colibri-sdk" / "nvrtc"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "colibri-sdk" / "nvrtc"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "colibri-sdk" / "nvrtc"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "xdg" / "colibri-sdk" / "nvrtc"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" == NvrtcCache().folder


def test_an_unwritable_cache_folder_warns_once_and_builds_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"x")
    cache = NvrtcCache(blocker / "nvrtc")
    out = nvrtc.CompiledSource(b"cubin", b"ptx", "", {}, ("-arch=sm_87",))
    with caplog.at_level(logging.WARNING, logger="colibri_sdk"):
        cache.put("a" * 64, out)
        cache.put("b" * 64, out)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"nvrtc cache: cannot write to {blocker / 'nvrtc'} (")
    assert cache.get("a" * 64) is None and cache.unwritable


def test_entry_round_trip_checks_key_and_sizes():
    out = nvrtc.CompiledSource(b"\x7fELF" + bytes(60), b".version 8.0\n", "ptxas info", {}, ("-arch=sm_87", "-DA=1"))
    data = nvrtc_cache.encode_entry("k" * 64, out)
    back = decode_entry(data, "k" * 64)
    assert (back.cubin, back.ptx, back.log, back.options) == (out.cubin, out.ptx, out.log, out.options)
    assert decode_entry(data, "j" * 64) is None
    assert decode_entry(data + b"\0", "k" * 64) is None
    assert decode_entry(b"", "k" * 64) is None


def test_cli_no_cache_reads_and_writes_nothing(tmp_path, monkeypatch, capsys, cold):
    root, _, cold_path, _ = cold
    folder = tmp_path / "cache"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(folder))
    args = ["build", "--profile", "orin", "--demo", "--batch", "1", "--tokens", "2"]
    assert cli.main(args + ["-o", str(tmp_path / "a"), "--no-cache"]) == 0
    assert "  nvrtc cache: not used (--no-cache)\n" in capsys.readouterr().out
    assert not folder.exists()
    shutil.copytree(root / "cache", folder)
    count = len(list(folder.glob("*.nvrtc")))
    assert cli.main(args + ["-o", str(tmp_path / "b")]) == 0
    assert f"  nvrtc cache: {count} of {count} compilations from the cache ({folder})\n" in capsys.readouterr().out
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_cli_summary_says_when_the_cache_could_not_be_written(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"x")
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(blocker / "nvrtc"))
    args = ["build", "--profile", "orin", "--demo", "--batch", "1", "--tokens", "2", "-o", str(tmp_path / "a")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"compilations from the cache ({blocker / 'nvrtc'}; not writable: nothing stored)\n" in out, out


def test_python_byte_code_beside_the_kernels_is_no_input(tmp_path, kernel_dir):
    # pip rewrites kernels/__pycache__/__init__.*.pyc (the source's time inside) on every install of the package:
    # it was part of the key, so each reinstall missed every entry.
    kernels = tmp_path / "kernels"
    shutil.copytree(kernel_dir, kernels, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    args = dict(source="int x;", name="routing.cu", arch="sm_87", defines={"A": 1}, include_dirs=[kernels], toolkit=12)
    base = cache_key(**args)
    (kernels / "__pycache__").mkdir()
    (kernels / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\x00byte code, stamped at install")
    (kernels / "stray.pyc").write_bytes(b"\x01")
    assert cache_key(**args) == base
    (kernels / "extra.cuh").write_text("// a header NVRTC could include\n")
    assert cache_key(**args) != base
