"""The NVRTC cache (colibri_sdk.aot.cache, docs/build.md "NVRTC cache") against hostile folders: an entry that is a
FIFO, a device or an oversized file is not read (no hang, no unbounded read); an entry whose digest is right but
whose record is crafted is ignored (no crash); an empty or relative HOME never puts the cache under the current
folder."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import pytest

from colibri_sdk.aot import cache as nvrtc_cache
from colibri_sdk.aot.cache import FORMAT_LINE, NvrtcCache, decode_entry, default_cache_dir
from colibri_sdk.aot.nvrtc import CompiledSource

KEY = "c" * 64
OUT = CompiledSource(b"CUBIN", b"PTX\0", "", {}, ("-arch=sm_87",))


def test_an_entry_that_is_a_fifo_or_a_device_is_not_read_and_is_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / f"{KEY}.nvrtc")  # opening it for reading would block until a writer comes
    device = tmp_path / "device"
    device.mkdir()
    (device / f"{KEY}.nvrtc").symlink_to("/dev/zero")  # reading it to the end never ends
    for folder in (fifo, device):
        cache = NvrtcCache(folder)
        assert cache.get(KEY) is None
        cache.put(KEY, OUT)
        assert (folder / f"{KEY}.nvrtc").is_file() and not (folder / f"{KEY}.nvrtc").is_symlink()
        assert cache.get(KEY) == OUT
    assert Path("/dev/zero").is_char_device()  # the link was replaced, not written through


def test_an_entry_larger_than_the_cap_is_not_read(tmp_path, monkeypatch):
    cache = NvrtcCache(tmp_path)
    cache.put(KEY, OUT)
    assert cache.get(KEY) == OUT
    monkeypatch.setattr(nvrtc_cache, "MAX_ENTRY_BYTES", cache.path(KEY).stat().st_size - 1)
    assert cache.get(KEY) is None


def crafted(meta: bytes, payload: bytes = b"CUBINPTX") -> bytes:
    """An entry with a correct digest around `meta` (anyone can compute the sha256 of what they write)."""
    body = struct.pack("<Q", len(meta)) + meta + payload
    return FORMAT_LINE + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


@pytest.mark.parametrize("meta", [
    b'{"key": "KEY", "cubin_bytes": Infinity, "ptx_bytes": 3, "log": "", "options": []}',
    b'{"key": "KEY", "cubin_bytes": NaN, "ptx_bytes": 3, "log": "", "options": []}',
    b'{"key": "KEY", "cubin_bytes": 5.7, "ptx_bytes": 3, "log": "", "options": []}',
    b'{"key": "KEY", "cubin_bytes": true, "ptx_bytes": 7, "log": "", "options": []}',
    b'{"key": "KEY", "cubin_bytes": 5, "ptx_bytes": 3, "log": 7, "options": []}',
    b'{"key": "KEY", "cubin_bytes": 5, "ptx_bytes": 3, "log": "", "options": "-arch=sm_87"}',
    b'["KEY", 5, 3]',
    b"[" * 100_000 + b"]" * 100_000,
], ids=["infinity", "nan", "float", "bool", "log-not-text", "options-not-list", "not-a-record", "deep"])
def test_a_crafted_record_with_a_valid_digest_is_ignored(meta):
    assert decode_entry(crafted(meta.replace(b"KEY", KEY.encode())), KEY) is None


def test_the_crafted_form_is_accepted_when_well_formed():
    meta = b'{"key": "KEY", "cubin_bytes": 5, "ptx_bytes": 3, "log": "", "options": ["-arch=sm_87"]}'
    found = decode_entry(crafted(meta.replace(b"KEY", KEY.encode())), KEY)
    assert (found.cubin, found.ptx, found.options) == (b"CUBIN", b"PTX", ("-arch=sm_87",))


@pytest.mark.parametrize("home", ["", "relative/home", "."])
def test_an_empty_or_relative_home_is_not_used(home, monkeypatch, tmp_path):
    import pwd

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLIBRI_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", home)
    account = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert default_cache_dir() == account / ".cache" / "colibri-sdk" / "nvrtc"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", "~/mine")
    assert default_cache_dir() == account / "mine"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", f"~{pwd.getpwuid(os.getuid()).pw_name}/theirs")
    assert default_cache_dir() == account / "theirs"


def test_no_absolute_home_at_all_builds_without_the_cache(monkeypatch, tmp_path, caplog):
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLIBRI_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "relative")
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert default_cache_dir() is None
    cache = NvrtcCache()
    assert cache.folder is None and cache.get(KEY) is None
    with caplog.at_level(logging.WARNING, logger="colibri_sdk"):
        cache.put(KEY, OUT)
        cache.put("d" * 64, OUT)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["nvrtc cache: no cache folder: HOME = 'relative' is not an absolute path and this user has "
                        "no absolute home folder; set COLIBRI_CACHE_DIR; compiling without the cache"]
    assert list(tmp_path.iterdir()) == []  # nothing written under the current folder
