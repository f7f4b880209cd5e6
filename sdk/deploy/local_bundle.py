"""The bundle on the deploying machine, as the deploy needs it: opened and verified by the runtime's own loader
(`colibri_sdk.bundle.Bundle.open(path, verify=True)`: schema, canonical manifest, digest, every file's size and
sha256, no unlisted or symlinked file) before a byte is sent; then its files with sizes and sha256, and an id
derived from the manifest's own sha256.

The device hashes every byte it receives; a mismatch is traced back here with `rehash()` to tell a bundle changed
on this machine since it was checked from a corrupt transfer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..bundle import MANIFEST, Bundle, canonical_json, file_sha256

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
        manifest: the parsed manifest.
        bundle_id: its first 16 hex digits; names the bundle folder on the device.
    """

    root: Path
    files: tuple
    manifest_sha256: str
    manifest: dict

    @property
    def bundle_id(self) -> str:
        return self.manifest_sha256[:ID_HEX_DIGITS]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def open(cls, path) -> "LocalBundle":
        """Open and verify the bundle at `path` exactly as the runtime would (reads every byte once).

        Raises:
            BundleError: whatever `Bundle.open(path, verify=True)` refuses (no folder, no or malformed
                manifest, schema, digest, a file missing, changed, unlisted or reached through a symlink).
        """
        bundle = Bundle.open(path, verify=True)
        root = Path(path)
        raw = canonical_json(bundle.manifest)  # verify=True: manifest.json is byte for byte this
        files = [BundleFile(e["path"], e["sha256"], e["size"], root.joinpath(*e["path"].split("/")))
                 for e in bundle.manifest["files"]]
        manifest_sha = hashlib.sha256(raw).hexdigest()
        files.append(BundleFile(MANIFEST, manifest_sha, len(raw), root / MANIFEST))
        return cls(root, tuple(files), manifest_sha, bundle.manifest)


def rehash(file: BundleFile) -> str:
    """sha256 hex of the local file now."""
    return file_sha256(file.local)
