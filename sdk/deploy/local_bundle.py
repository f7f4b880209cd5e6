"""The bundle on the deploying machine, as the deploy needs it: opened and checked by the runtime's own loader,
then its files with sizes and sha256, and an id derived from the manifest's own sha256.

`LocalBundle.open(path)` is `Bundle.open(path, verify=True)`: schema, canonical manifest, digest, no unlisted or
symlinked file, every file's size and sha256, the weights' header and values. `deploy` opens it with
`hash_files=False`: the same checks but the files' sha256 and the weights' NaN/Inf scan, which would be a pass
over every byte before the upload reads them all again. The device hashes every byte it receives and keeps a file
only under the manifest's sha256; a file it found different is hashed here then (transfer.py), and the files the
device already holds in a thread beside the upload: one whose sha256 differs from the manifest stops the deploy
before anything is staged or switched (`check_digest`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..bundle import MANIFEST, Bundle, canonical_json, manifest_digest
from ..bundle.manifest import DIGEST_KEY
from ..bundle.paths import _O_NOFOLLOW, _O_NONBLOCK, kind_of, open_inside, read_manifest
from ..bundle.records import check_buffer_records
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
    def open(cls, path, hash_files: bool = True) -> "LocalBundle":
        """Open and verify the bundle at `path` exactly as the runtime would (reads every byte once); with
        `hash_files=False` all but the files' sha256 and the weights' NaN/Inf scan (reads the manifest and the
        weights' header only: the caller hashes the files, `check_digest`).

        Raises:
            BundleError: whatever `Bundle.open(path, verify=True)` refuses (no folder, no or malformed
                manifest, schema, digest, a file missing, changed, unlisted or reached through a symlink), in its
                words.
        """
        bundle = Bundle.open(path, verify=hash_files)
        if not hash_files:
            check_structure(bundle)
        root = Path(path)
        raw = canonical_json(bundle.manifest)  # verify=True: manifest.json is byte for byte this
        files = [BundleFile(e["path"], e["sha256"], e["size"], root.joinpath(*e["path"].split("/")))
                 for e in bundle.manifest["files"]]
        manifest_sha = hashlib.sha256(raw).hexdigest()
        files.append(BundleFile(MANIFEST, manifest_sha, len(raw), root / MANIFEST))
        return cls(root, tuple(files), manifest_sha, bundle.manifest)


def check_structure(bundle: Bundle) -> None:
    """What `Bundle.verify` checks besides the files' sha256 and the weights' values, in the loader's words: the
    manifest's canonical form and digest, no unlisted file, link or special file, every file's size, the weights'
    header against the manifest and the buffer records.

    Raises:
        BundleError: the first violation.
    """
    raw = read_manifest(bundle.path)
    if raw != canonical_json(bundle.manifest):
        raise BundleError(f"{MANIFEST}: not in canonical form (sorted keys, 2-space indent, trailing newline); the "
                          f"file was edited after the build")
    expected = manifest_digest(bundle.manifest)
    if bundle.manifest[DIGEST_KEY] != expected:
        raise BundleError(f"{MANIFEST}: content sha256 {expected} differs from the recorded {DIGEST_KEY} "
                          f"{bundle.manifest[DIGEST_KEY]}; the manifest was changed after the build")
    bundle._check_contents(bundle.path, "", {e["path"] for e in bundle.manifest["files"]})  # the loader's walk
    for entry in bundle.manifest["files"]:
        with open_inside(bundle.path, entry["path"]) as fh:
            size = os.fstat(fh.fileno()).st_size
        if size != entry["size"]:
            raise BundleError(f"{entry['path']}: {size} bytes; the manifest records {entry['size']}")
    with bundle.open_weights() as opened:
        check_buffer_records(bundle.manifest, opened.header)


def check_digest(file: BundleFile, digest: str) -> None:
    """Refuse a local file whose sha256 (computed while it was read for sending) is not the manifest's.

    Raises:
        BundleError: naming the file, both digests, and that nothing was staged or switched.
    """
    if digest != file.sha256:
        raise BundleError(f"bundle file {file.path!r} changed on this machine: its sha256 {digest} differs from the "
                          f"manifest's {file.sha256}; nothing was staged, the active bundle was not changed")


READ_BYTES = 1 << 20  # the block size of read_chunks


def read_chunks(path, offset: int, chunk: int = READ_BYTES):
    """The bytes of `path` from `offset` to its end, in blocks of at most `chunk` bytes. `path` is opened without
    following a link at its last component and without blocking (a FIFO), and refused unless it is a regular file,
    so a file swapped after the bundle's check for a link, a device or a FIFO is never read.

    Raises:
        BundleError: not a regular file, or it cannot be opened.
        OSError: a read failed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK)
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise BundleError(f"{path}: {what}; allowed: a regular file inside the bundle") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BundleError(f"{path}: {kind_of(mode)}; allowed: a regular file inside the bundle")
    with os.fdopen(fd, "rb", buffering=0) as f:
        f.seek(offset)
        while block := f.read(chunk):
            yield block


def exact_blocks(file: BundleFile, offset: int, chunk: int = READ_BYTES, reader=read_chunks):
    """The bytes of `file` from `offset` to its manifest size, read through `reader` (read_chunks), refusing a file
    that is no longer that size: no byte past the size is yielded, and a file that ends early is refused after its
    last byte.

    Raises:
        BundleError: the file changed on this machine (longer or shorter than the manifest says), is not a regular
            file, or cannot be read (naming the file; nothing was staged or switched).
    """
    at = offset
    try:
        for block in reader(file.local, offset, chunk):
            if at + len(block) > file.size:
                raise BundleError(f"bundle file {file.path!r} changed on this machine: it is now longer than the "
                                  f"manifest's {file.size} bytes; nothing was staged, the active bundle was not changed")
            at += len(block)
            yield block
    except OSError as exc:
        raise BundleError(f"bundle file {file.path!r} cannot be read: {exc.strerror or exc}; nothing was staged, the "
                          f"active bundle was not changed") from None
    if at < file.size:
        raise BundleError(f"bundle file {file.path!r} changed on this machine: it now ends after {at} bytes, the "
                          f"manifest says {file.size}; nothing was staged, the active bundle was not changed")


def rehash(file: BundleFile) -> str:
    """sha256 hex of the local file now, read as `exact_blocks` reads it (at most its manifest size, never through a
    link, a device or a FIFO).

    Raises:
        BundleError: as exact_blocks.
    """
    digest = hashlib.sha256()
    for block in exact_blocks(file, 0):
        digest.update(block)
    return digest.hexdigest()
