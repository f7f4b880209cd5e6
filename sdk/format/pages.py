"""Page size of a .colibri file's mapping: asking the kernel for 2 MiB pages, and reading what it gave.

A forward pass on the CPU streams each selected expert's weights once, tens of MB per layer. With 4 KiB pages that
is one page walk every 4 KiB (a core's second-level TLB holds 1.5-2k entries: 6-8 MiB); with the file mapped in
2 MiB pages (transparent huge pages, "THP") the walks all but vanish: shape A's fp32 layer (hidden 1024,
intermediate 2816, top-2) at one token, caches cold, 1.21x faster, fp16 1.18x, int8 1.12x, int4 g128 1.11x (2-core
Intel Xeon KVM guest, Linux 6.18, ext4, 2026-12-08; docs/runtime.md, "2 MiB pages").

Linux maps file pages in 2 MiB only where the page cache holds the file in 2 MiB folios, which it builds when it
reads the file from storage through a mapping that carries MADV_HUGEPAGE (THP "always" or "madvise" in
/sys/kernel/mm/transparent_hugepage/enabled) on a file system with large folios (ext4 from Linux 6.16, xfs from
5.18); not through read(), and not for pages it holds already in smaller folios (a file just written, or read
with read()): those stay in 4 KiB pages until the kernel drops them from its cache (memory pressure, a reboot,
posix_fadvise POSIX_FADV_DONTNEED). Once cached so, a mapping gets 2 MiB pages unless it carries
MADV_NOHUGEPAGE. Elsewhere (older kernels, such as the Jetson's L4T kernels, other systems) the advice is accepted
or refused and nothing changes: the same values, 4 KiB pages.
"""

from __future__ import annotations

import mmap

SMAPS = "/proc/self/smaps"
HUGE_KEYS = ("FilePmdMapped:", "AnonHugePages:", "ShmemPmdMapped:")  # smaps fields of 2 MiB mappings, kB


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for 2 MiB pages for the whole of `mapping` (madvise MADV_HUGEPAGE). Returns True where the kernel
    accepted the advice, False where the platform has no such advice (not Linux) or the kernel refused it (THP
    "never", a kernel without THP); never raises."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except (OSError, ValueError):  # EINVAL: THP off or not built; ValueError: the mapping is closed
        return False
    return True


def mapped_bytes(address: int, length: int, smaps: str = SMAPS) -> tuple[int, int] | None:
    """(resident, of which in 2 MiB pages) bytes of this process's mappings that overlap [address, address +
    length), whole mappings (smaps Rss, and FilePmdMapped + AnonHugePages + ShmemPmdMapped), or None where `smaps`
    cannot be read (not Linux). Pages not touched through the mapping yet are not resident in it."""
    try:
        with open(smaps, encoding="ascii", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    resident = huge = 0
    inside, end = False, address + length
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset ..."
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) < end and address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and head == "Rss:":
            resident += int(line.split()[1]) * 1024
        elif inside and head in HUGE_KEYS:
            huge += int(line.split()[1]) * 1024
    return resident, huge
