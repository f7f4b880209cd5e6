"""Page size of a .colibri file's mapping: asking the kernel for 2 MiB pages, and reading what it gave.

A forward pass on the CPU streams each selected expert's weights once, tens of MB per layer. With 4 KiB pages that
is one page walk every 4 KiB (a core's second-level TLB holds 1.5-2k entries: 6-8 MiB); with the file mapped in
2 MiB pages (transparent huge pages, "THP") the walks all but vanish: shape A's fp32 layer (hidden 1024,
intermediate 2816, top-2) at one token, caches cold, 1.21x faster, fp16 1.18x, int8 1.12x, int4 g128 1.11x (2-core
Intel Xeon KVM guest, Linux 6.18, ext4, 2026-12-08; docs/runtime.md, "2 MiB pages").

Linux maps file pages in 2 MiB only where the page cache holds the file in 2 MiB folios, which it builds when it
reads the file from storage through a mapping that carries MADV_HUGEPAGE (THP "always" or "madvise" in
/sys/kernel/mm/transparent_hugepage/enabled) on a file system with large folios (ext4 from Linux 6.16, xfs from
5.18); not through read(), and not for pages it holds already in smaller folios (read with read(), or written in
small pieces; large aligned write() calls may leave 2 MiB folios): those stay in 4 KiB pages until the kernel drops
them from its cache (memory pressure, a reboot, posix_fadvise POSIX_FADV_DONTNEED). Once cached so, a mapping gets
2 MiB pages unless it carries MADV_NOHUGEPAGE. Elsewhere (older kernels, such as the Jetson's L4T kernels, other
systems) the advice is accepted or refused and nothing changes: the same values, 4 KiB pages.
"""

from __future__ import annotations

import mmap
import os
import stat
import sys

SMAPS = "/proc/self/smaps"
SMAPS_LIMIT = 64 << 20  # bytes of smaps read at most (a process with ~100k mappings)
# madvise(MADV_POPULATE_READ), Linux 5.14: fault a range in, an error (not SIGBUS) where that fails; 22 in Linux's
# asm-generic/mman-common.h, which x86-64 and arm64 use (Python's mmap module names it from 3.14 only)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
HUGE_KEYS = ("FilePmdMapped:", "AnonHugePages:", "ShmemPmdMapped:")  # smaps fields of 2 MiB mappings, kB


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for 2 MiB pages for the whole of `mapping` (an open mmap.mmap; madvise MADV_HUGEPAGE). Returns True where
    the kernel accepted the advice, False where the platform has no such advice (not Linux), the kernel refused it
    (THP "never", a kernel without THP) or the mapping is closed."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except (OSError, ValueError):  # EINVAL: THP off or not built; ValueError: the mapping is closed
        return False
    return True


class HugePageCache:
    """Brings ranges of an open file into the page cache through a read-only mapping that asks for 2 MiB pages, so
    that a file not cached yet is cached in 2 MiB folios where the kernel builds them (module docstring) before
    read() copies it out; read() alone would cache it in small folios.

    `load(offset, length)` faults the range in (MADV_POPULATE_READ: an error, never SIGBUS, where the file shrank
    meanwhile) and releases it from the mapping at once (MADV_DONTNEED on a file mapping: the page cache keeps the
    pages), so the process's resident set does not grow. Every failure only turns the cache off: no mapping
    (mmap refused, e.g. RLIMIT_MEMLOCK under mlockall), a kernel without MADV_POPULATE_READ (before 5.14, which has
    no large file folios either), a file that shrank. `close()` (or leaving a `with` block) unmaps; safe to
    call more than once."""

    def __init__(self, fd: int):
        self._mapping = None
        if MADV_POPULATE_READ is None:
            return
        try:
            size = os.fstat(fd).st_size
            if size > 0:
                self._mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return
        if self._mapping is not None:
            advise_huge_pages(self._mapping)

    def load(self, offset: int, length: int) -> bool:
        """Fault bytes offset .. offset + length - 1 (clipped to the mapping; offset a multiple of the page size)
        into the page cache; returns whether it did (False once anything failed: the cache is then off)."""
        mapping = self._mapping
        if mapping is None or offset >= len(mapping):
            return False
        length = min(length, len(mapping) - offset)
        try:
            mapping.madvise(MADV_POPULATE_READ, offset, length)
        except (OSError, ValueError):  # EINVAL: no such advice; EFAULT / EIO: past a shrunk file's end, bad storage
            self.close()
            return False
        try:
            mapping.madvise(mmap.MADV_DONTNEED, offset, length)
        except (OSError, ValueError):  # EINVAL on a locked mapping (mlockall): unmapped at close instead
            pass
        return True

    def close(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()

    def __enter__(self) -> "HugePageCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def drop_cached(path: str | os.PathLike) -> None:
    """Write the file back and drop its clean pages from the page cache (fsync, then posix_fadvise
    POSIX_FADV_DONTNEED; pages another process maps stay), as a reboot does: the next reader reads it from storage,
    through a 2 MiB mapping in 2 MiB folios where the kernel builds them (module docstring).

    Raises:
        OSError: the file cannot be opened; where the platform has no posix_fadvise, nothing is dropped.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped_bytes(address: int, length: int, smaps: str = SMAPS) -> tuple[int, int] | None:
    """(resident, of which in 2 MiB pages) bytes of this process's mappings that overlap [address, address +
    length), whole mappings (smaps Rss, and FilePmdMapped + AnonHugePages + ShmemPmdMapped of each overlapping
    mapping), or None where `smaps` is not a readable regular file (not Linux). Pages not touched through the
    mapping yet are not resident in it. Lines that are not "Key: <count> kB" are skipped; at most SMAPS_LIMIT
    bytes are read."""
    try:
        fd = os.open(smaps, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block (refused below)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read(SMAPS_LIMIT).decode("ascii", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    resident = huge = 0
    inside, end = False, address + length
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset ..."
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) < end and address < int(hi, 16)
            except ValueError:
                inside = False
            continue
        if not inside or (head != "Rss:" and head not in HUGE_KEYS):
            continue
        fields = rest.split()
        if len(fields) != 2 or fields[1] != "kB" or not fields[0].isdigit() or len(fields[0]) > 20:
            continue
        if head == "Rss:":
            resident += int(fields[0]) * 1024
        else:
            huge += int(fields[0]) * 1024
    return resident, huge
