"""2 MiB file pages in the tests (colibri_sdk.format.pages): whether this kernel and file system can give them, a
folder on disk for such a file, and `drop_cached` (colibri_sdk.format.pages: a file out of the page cache, as a
reboot)."""

from __future__ import annotations

import os
import platform
import tempfile
from contextlib import contextmanager
from pathlib import Path

from colibri_sdk.format.pages import drop_cached  # noqa: F401 (the tests' name for it)


def thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled, or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1: text.index("]")] if "[" in text else None


def file_thp_reason(folder: Path) -> str | None:
    """Why this kernel / file system would not cache a file of `folder` in 2 MiB pages, or None where it should:
    Linux with THP on and large folios in the file system (ext4 from 6.16, xfs from 5.18)."""
    if platform.system() != "Linux":
        return f"2 MiB file pages are a Linux feature; this is {platform.system()}"
    if thp_mode() in (None, "never"):
        return f"transparent huge pages are {thp_mode() or 'not built'} on this kernel"
    version = tuple(int(p) for p in platform.release().split("-")[0].split(".")[:2])
    device = os.stat(folder).st_dev
    kind = "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():  # the last mount of the folder's device wins
        fields = line.split()
        try:
            if len(fields) > 2 and os.stat(fields[1]).st_dev == device:
                kind = fields[2]
        except OSError:
            continue
    needed = {"ext4": (6, 16), "xfs": (5, 18)}.get(kind)
    if needed is None or version < needed:
        return f"{kind} on Linux {platform.release()} has no large folios (ext4 from 6.16, xfs from 5.18)"
    return None


@contextmanager
def disk_folder():
    """A temporary folder under tempfile.gettempdir(), removed afterwards (the tests' own temporary folders may be
    on tmpfs: scripts/test.sh)."""
    with tempfile.TemporaryDirectory(prefix="colibri-pages-") as folder:
        yield Path(folder)
