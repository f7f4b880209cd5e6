"""The bundle on the deploying machine, as the deploy needs it: its files with sizes and sha256 from the
manifest, and an id derived from the manifest's own sha256.

The manifest's `files` list (path, sha256, size; see the bundle contract in sdk/bundle/reader.py) is trusted for the
plan; the device hashes every byte it receives, and a mismatch is traced back here with `rehash()` to tell a
corrupt local bundle from a corrupt transfer.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..bundle import MANIFEST, MAX_MANIFEST_BYTES, file_sha256
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
            BundleError: no folder, no manifest (or one over MAX_MANIFEST_BYTES), unreadable JSON, no `files` list,
                an entry of the wrong types, an unsafe path ('..', absolute, empty parts), a path listed twice, a
                malformed sha256, or a listed file missing or of another size than listed.
        """
        root = Path(path)
        manifest_path = root / MANIFEST
        if not root.exists():
            raise BundleError(f"bundle folder {root} does not exist")
        if not root.is_dir():
            raise BundleError(f"{root} is a file, not a bundle folder (the output folder of `colibri-sdk build`; "
                              f"extract an archive first)")
        if not manifest_path.is_file():
            raise BundleError(f"{root} is not a bundle: {MANIFEST} not found")
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{manifest_path}: {manifest_path.stat().st_size:,} bytes; a manifest is at most "
                              f"{MAX_MANIFEST_BYTES:,} bytes")
        raw = manifest_path.read_bytes()
        try:
            entries = json.loads(raw)["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"{manifest_path}: no readable 'files' list ({exc})") from None
        if not isinstance(entries, list):
            raise BundleError(f"{manifest_path}: 'files' is {type(entries).__name__}; expected a list of "
                              f"{{path, sha256, size}}")
        files, seen = [], set()
        for entry in entries:
            file = _bundle_file(root, entry)
            if file.path in seen:
                raise BundleError(f"{manifest_path}: {file.path!r} is listed twice")
            seen.add(file.path)
            files.append(file)
        manifest_sha = hashlib.sha256(raw).hexdigest()
        files.append(BundleFile(MANIFEST, manifest_sha, len(raw), manifest_path))
        return cls(root, tuple(files), manifest_sha)


def _bundle_file(root: Path, entry) -> BundleFile:
    try:
        rel, sha, size = entry["path"], entry["sha256"], entry["size"]
    except (KeyError, TypeError, IndexError):
        raise BundleError(f"manifest 'files' entry {reprlib.repr(entry)} needs 'path', 'sha256' and "
                          f"'size'") from None
    if not isinstance(rel, str) or not isinstance(sha, str):
        raise BundleError(f"manifest 'files' entry {reprlib.repr(entry)}: 'path' and 'sha256' must be strings")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BundleError(f"manifest entry {rel!r}: size {size!r} is not a whole number of bytes >= 0")
    parts = PurePosixPath(rel).parts
    if (not rel or rel.startswith("/") or any(p in ("..", ".", "") for p in rel.split("/")) or rel == MANIFEST
            or any(ord(c) < 32 for c in rel)):
        raise BundleError(f"manifest lists an unsafe path {rel!r}: must be relative, without '..', '.' or empty "
                          f"parts")
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
