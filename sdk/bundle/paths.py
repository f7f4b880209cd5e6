"""Reading inside a bundle folder only (docs/build.md, "Reading rules" 1, 2, 7, 8): every component of a listed
path is checked with lstat (a real folder, a regular file, never a symbolic link) before anything is opened, and
files are then opened component by component with O_NOFOLLOW relative to the bundle folder's descriptor, so a link
swapped in between is refused too. The bundle folder itself may be a link (a deploy's `current`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ..errors import BundleError
from .manifest import MANIFEST, MAX_MANIFEST_BYTES

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open; it is refused as not a regular file


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words, for messages."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


LINK_RULE = "a bundle is read only through regular files and folders inside it (nothing through a link)"


def check_inside(root: Path, rel: str) -> Path:
    """lstat every component of `rel` below `root`: each folder must be a real folder, the last a regular file, none
    a symbolic link. Nothing is opened or read.

    Returns:
        root / rel.

    Raises:
        BundleError: naming the first component that is missing, a link, or of the wrong kind.
    """
    parts = PurePosixPath(rel).parts
    current = root
    for i, name in enumerate(parts):
        current = current / name
        shown = "/".join(parts[: i + 1])
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            raise BundleError(f"{shown}: listed in the manifest but missing") from None
        except OSError as exc:
            raise BundleError(f"{shown}: cannot examine: {exc.strerror}") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(mode):
            raise BundleError(f"{shown}: a symbolic link; {LINK_RULE}")
        if not last and not stat.S_ISDIR(mode):
            raise BundleError(f"{shown}: {kind_of(mode)} on the path of {rel}; allowed: a folder inside the bundle")
        if last and not stat.S_ISREG(mode):
            raise BundleError(f"{rel}: {kind_of(mode)}; allowed: a regular file inside the bundle")
    return current


def open_inside(root: Path, rel: str):
    """Open `root/rel` for reading without following any link below `root` (each component opened with
    O_NOFOLLOW relative to the previous one's descriptor), after `check_inside`.

    Returns:
        A binary file object (unbuffered reads through it see only that regular file).

    Raises:
        BundleError: as check_inside, or the file cannot be opened.
    """
    check_inside(root, rel)
    parts = PurePosixPath(rel).parts
    try:
        dirfd = os.open(root, os.O_RDONLY | _O_DIRECTORY)
    except OSError as exc:
        raise BundleError(f"{root}: cannot open the bundle folder: {exc.strerror}") from None
    try:
        for name in parts[:-1]:
            try:
                fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW, dir_fd=dirfd)
            except OSError as exc:
                raise BundleError(f"{rel}: cannot open the folder {name!r} on its path: {exc.strerror}") from None
            os.close(dirfd)
            dirfd = fd
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK, dir_fd=dirfd)
        except OSError as exc:
            raise BundleError(f"{rel}: cannot open: {exc.strerror}") from None
    finally:
        os.close(dirfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BundleError(f"{rel}: {kind_of(mode)}; allowed: a regular file inside the bundle")
    return os.fdopen(fd, "rb", buffering=0)


def read_manifest(root: Path) -> bytes:
    manifest_path = root / MANIFEST
    try:
        mode = os.lstat(manifest_path).st_mode
    except FileNotFoundError:
        raise BundleError(f"{manifest_path}: cannot read the manifest: No such file or directory") from None
    except OSError as exc:
        raise BundleError(f"{manifest_path}: cannot read the manifest: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise BundleError(f"{manifest_path}: a symbolic link; {LINK_RULE}")
    if not stat.S_ISREG(mode):
        raise BundleError(f"{manifest_path}: not a regular file; the manifest must be a JSON file")
    with open_inside(root, MANIFEST) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{manifest_path}: {size:,} bytes; allowed: at most {MAX_MANIFEST_BYTES:,}")
        try:
            return fh.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise BundleError(f"{manifest_path}: cannot read the manifest: {exc.strerror}") from None
