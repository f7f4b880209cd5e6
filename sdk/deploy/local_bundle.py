"""The bundle on the deploying machine, as the deploy needs it: its files with sizes and sha256 from the
manifest, and an id derived from the manifest's own sha256.

The manifest's `files` list (path, sha256, size; see the bundle contract in sdk/bundle.py) is trusted for the
plan; the device hashes every byte it receives, and a mismatch is traced back here with `rehash()` to tell a
corrupt local bundle from a corrupt transfer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..bundle import MANIFEST, file_sha256
from ..errors import BundleError

ID_HEX_DIGITS = 16


@dataclass(frozen=True)
class BundleFile:
    """One file of a bundle: `path` relative posix, `sha256` lowercase hex, `size` in bytes."""

    path: str
    sha256: str
    size: int
    local: Path


@dataclass(frozen=True)
class LocalBundle:
    """A bundle folder read for deployment.

    Attributes:
        root: the bundle folder.
        files: every file the manifest lists, plus manifest.json itself (last).
        manifest_sha256: sha256 of manifest.json's bytes.
        bundle_id: its first 16 hex digits; names the bundle folder on the device.
    """

    root: Path
    files: tuple
    manifest_sha256: str

    @property
    def bundle_id(self) -> str:
        return self.manifest_sha256[:ID_HEX_DIGITS]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def open(cls, path) -> "LocalBundle":
        """Read `path`/manifest.json and check that every listed file exists with its listed size.

        Raises:
            BundleError: no manifest, unreadable JSON, no `files` list, an unsafe path ('..', absolute), a
                malformed sha256, or a listed file missing or of another size than listed.
        """
        root = Path(path)
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise BundleError(f"{root} is not a bundle: {MANIFEST} not found")
        raw = manifest_path.read_bytes()
        try:
            entries = json.loads(raw)["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"{manifest_path}: no readable 'files' list ({exc})") from None
        files = [_bundle_file(root, entry) for entry in entries]
        manifest_sha = hashlib.sha256(raw).hexdigest()
        files.append(BundleFile(MANIFEST, manifest_sha, len(raw), manifest_path))
        return cls(root, tuple(files), manifest_sha)


def _bundle_file(root: Path, entry) -> BundleFile:
    try:
        rel, sha, size = entry["path"], entry["sha256"], int(entry["size"])
    except (KeyError, TypeError, ValueError):
        raise BundleError(f"manifest 'files' entry {entry!r} needs 'path', 'sha256' and 'size'") from None
    parts = PurePosixPath(rel).parts
    if (not rel or rel.startswith("/") or any(p in ("..", ".") for p in rel.split("/")) or rel == MANIFEST
            or any(ord(c) < 32 for c in rel)):
        raise BundleError(f"manifest lists an unsafe path {rel!r}: must be relative, without '..' or '.'")
    if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
        raise BundleError(f"manifest entry {rel!r}: sha256 {sha!r} is not 64 lowercase hex digits")
    local = root.joinpath(*parts)
    if not local.is_file():
        raise BundleError(f"bundle file {rel!r} listed in the manifest is missing from {root}")
    actual = local.stat().st_size
    if actual != size:
        raise BundleError(f"bundle file {rel!r} is {actual} bytes, the manifest says {size}")
    return BundleFile(rel, sha, size, local)


def rehash(file: BundleFile) -> str:
    """sha256 hex of the local file now."""
    return file_sha256(file.local)
