"""colibri_sdk.format.pages: the advice for 2 MiB pages, what /proc/self/smaps says the kernel did, and the
bundle check's reading through such a mapping (so that a file read there first is cached in 2 MiB pages)."""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from colibri_sdk.bundle import reader as bundle_reader
from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, pages
from colibri_sdk.format.writer import write_arrays

import page_support

SMAPS = """\
7f0000000000-7f0000400000 r--s 00000000 fe:01 12 /data/model.colibri
Size:               4096 kB
Rss:                4096 kB
FilePmdMapped:      2048 kB
AnonHugePages:         0 kB
7f0000400000-7f0000600000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                1024 kB
AnonHugePages:      1024 kB
7f0000800000-7f0000a00000 r--p 00000000 fe:01 13 /usr/lib/other.so
Size:               2048 kB
Rss:                 512 kB
FilePmdMapped:         0 kB
"""


def test_mapped_bytes_sums_the_overlapping_mappings_only(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    # the file mapping alone; then it and the anonymous one after it; then nothing mapped there
    assert pages.mapped_bytes(0x7F0000000000, 0x400000, str(smaps)) == (4096 << 10, 2048 << 10)
    assert pages.mapped_bytes(0x7F0000100000, 0x400000, str(smaps)) == (5120 << 10, 3072 << 10)
    assert pages.mapped_bytes(0x7F0000600000, 0x200000, str(smaps)) == (0, 0)
    assert pages.mapped_bytes(0, 1, str(tmp_path / "missing")) is None


def test_mapped_bytes_skips_what_is_not_a_count_and_refuses_what_is_not_a_file(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_bytes(SMAPS.replace("Rss:                4096 kB", "Rss: abc kB\nRss:\nRss: -8 kB\nRss: 1.5 kB\n"
                                    "Rss: 4096 kB").encode() + b"\x00\xff garbage\n")
    assert pages.mapped_bytes(0x7F0000000000, 0x400000, str(smaps)) == (4096 << 10, 2048 << 10)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert pages.mapped_bytes(0, 1, str(fifo)) is None  # (no writer: a blocking open would hang)
    assert pages.mapped_bytes(0, 1, "/dev/zero") is None
    assert pages.mapped_bytes(0, 1, str(tmp_path)) is None


def test_advice_on_a_closed_mapping_or_without_the_platform_is_refused_quietly(monkeypatch):
    mapping = mmap.mmap(-1, 1 << 21)
    mapping.close()
    assert pages.advise_huge_pages(mapping) is False
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    with mmap.mmap(-1, 1 << 21) as open_mapping:
        assert pages.advise_huge_pages(open_mapping) is False


@pytest.mark.skipif(page_support.thp_mode() in (None, "never"),
                    reason="transparent huge pages are off or not built here")
def test_advice_is_accepted_where_the_kernel_has_huge_pages(tmp_path):
    with mmap.mmap(-1, 4 << 21) as mapping:
        assert pages.advise_huge_pages(mapping) is True


def _weights(tmp_path: Path, experts: int = 8) -> Path:
    """A v1 fp32 file of about 12 MiB (1 layer, `experts` experts of 3 x 256 x 512 float32)."""
    from colibri_sdk.format import Header

    header = Header(num_layers=1, num_experts=experts, top_k=2, hidden_size=512, intermediate_size=256, dtype=0)
    rng = np.random.default_rng(0)
    arrays = {"gate_proj": rng.standard_normal((1, experts, 256, 512), np.float32),
              "up_proj": rng.standard_normal((1, experts, 256, 512), np.float32),
              "down_proj": rng.standard_normal((1, experts, 512, 256), np.float32),
              "router": rng.standard_normal((1, 512, experts), np.float32)}
    path = tmp_path / "model.colibri"
    write_arrays(path, header, arrays)
    return path


def test_the_file_reports_its_mapping_and_refuses_once_closed(tmp_path):
    f = ColibriFile(_weights(tmp_path))
    got = f.mapped_bytes()
    if platform.system() == "Linux":
        resident, huge = got
        assert 0 <= huge <= resident
    else:
        assert got is None
    f.close()
    with pytest.raises(FormatError, match="is closed"):
        f.mapped_bytes()
    with pytest.raises(FormatError, match="is closed"):
        f.advise_huge_pages()


@pytest.mark.parametrize("cached", [False, True])
def test_chunks_are_the_file_bytes_in_order(tmp_path, monkeypatch, cached):
    path = tmp_path / "bytes.bin"
    data = np.random.default_rng(1).integers(0, 256, 50_001, np.uint8).tobytes()
    path.write_bytes(data)
    monkeypatch.setattr(bundle_reader, "_CHUNK", 4096)
    monkeypatch.setattr(bundle_reader, "_WINDOW", 16384)
    for start in (0, 64, 4095, 16384, 16390, 50_000, 50_001):
        with open(path, "rb") as fh:
            fh.seek(start)
            cache = pages.HugePageCache(fh.fileno()) if cached else None
            chunks = list(bundle_reader._chunks(fh, start, cache))
            if cache is not None:
                cache.close()
        assert b"".join(chunks) == data[start:]
        assert all(len(c) <= 4096 for c in chunks)
        # no chunk crosses a window's end (each window is brought into the page cache before its chunks)
        ends = np.cumsum([start] + [len(c) for c in chunks])
        assert all((a // 16384) == ((b - 1) // 16384) for a, b in zip(ends[:-1], ends[1:]))


def test_the_page_cache_helper_turns_off_where_the_file_shrank(tmp_path):
    """A range past the end of a file that shrank after it was mapped: an error from MADV_POPULATE_READ, so
    `load` returns False (through the mapping it would be SIGBUS); then the helper is off."""
    if pages.MADV_POPULATE_READ is None:
        pytest.skip("MADV_POPULATE_READ is Linux's (5.14 and later)")
    path = tmp_path / "shrinks.bin"
    path.write_bytes(bytes(8 << 20))
    with open(path, "rb") as fh:
        cache = pages.HugePageCache(fh.fileno())
        assert cache.load(0, 1 << 20)  # (False on a kernel before 5.14: the helper is then off from the start)
        os.truncate(path, 1 << 20)
        assert cache.load(4 << 20, 1 << 20) is False
        assert cache.load(0, 1 << 20) is False
        cache.close()
        cache.close()


def test_reading_through_the_page_cache_helper_keeps_the_resident_set_small(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(96 << 20)  # 96 MiB of zeros (a sparse file: read as zeros, cached as it is read)
    script = textwrap.dedent(f"""
        import hashlib
        from colibri_sdk.bundle.reader import _chunks
        from colibri_sdk.format.pages import HugePageCache
        def peak():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
        before = peak()
        digest = hashlib.sha256()
        with open({str(path)!r}, "rb") as fh:
            cache = HugePageCache(fh.fileno())
            for chunk in _chunks(fh, 0, cache):
                digest.update(chunk)
            cache.close()
        print(peak() - before, digest.hexdigest())
    """)
    if platform.system() != "Linux":
        pytest.skip("VmHWM is read from /proc/self/status (Linux)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    grown_kb, digest = out.stdout.split()
    assert digest == hashlib.sha256(bytes(96 << 20)).hexdigest()
    assert int(grown_kb) < 40 << 10, f"the peak resident set grew by {grown_kb} kB reading a 96 MiB file"


@pytest.fixture
def disk_folder():
    with page_support.disk_folder() as folder:
        yield folder


def test_a_file_read_first_by_the_bundle_check_is_mapped_in_2mib_pages(disk_folder):
    reason = page_support.file_thp_reason(disk_folder)
    if reason:
        pytest.skip(reason)
    path = _weights(disk_folder, experts=16)  # 24 MiB
    page_support.drop_cached(path)
    with open(path, "rb") as fh:  # as Bundle.verify reads the weights at load
        cache = pages.HugePageCache(fh.fileno())
        assert hashlib.sha256(b"".join(bundle_reader._chunks(fh, 0, cache))).digest()
        cache.close()
    f = ColibriFile(path)
    assert f.advise_huge_pages()
    f.data()[::4096].max()
    resident, huge = f.mapped_bytes()
    f.close()
    assert huge >= 16 << 20, f"{huge} of {resident} resident bytes in 2 MiB pages"
    # and the control: the same file read first by read() stays in small pages (why the check reads through a mapping)
    page_support.drop_cached(path)
    path.read_bytes()
    f = ColibriFile(path)
    f.advise_huge_pages()
    f.data()[::4096].max()
    resident, huge = f.mapped_bytes()
    f.close()
    assert huge < resident
