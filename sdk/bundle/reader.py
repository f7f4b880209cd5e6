"""Read a bundle: the folder `colibri-sdk build` writes and the device runs (docs/build.md, "Bundle").

    manifest.json                  canonical JSON: sorted keys, 2-space indent, trailing newline
    model.colibri                  the weights, in the profile's dtype
    kernels/<name>.<arch>.cubin    SASS for the profile's arch, one per catalogue kernel
    kernels/<name>.ptx             PTX of the same source (JIT on newer GPUs)
    selftest/input.npy             float32 (batch, tokens, hidden) at the fixed shape
    selftest/output.npy            float32, the reference engine's output for it, computed at build time

Integrity: `files` in the manifest lists every other file with its size and sha256, and `manifest_sha256` is the
sha256 of the canonical JSON of the manifest without that key. A bundle is accepted only if manifest.json is byte
for byte its own canonical form, the digest matches, every listed file has its size and digest, and the folder holds
no file the manifest does not list. So a changed byte anywhere, in manifest.json too, is refused with the file's
name. (This detects corruption and edits; it is not a signature: whoever can rewrite the files can recompute it.)

Confinement (docs/build.md, "Reading rules"): a bundle is read only through what is inside its folder. manifest.json,
every listed file and every folder on a listed path must be a regular file / folder, not a symbolic link, and is
checked with lstat before anything is read; files are then opened component by component with O_NOFOLLOW below
the bundle folder's own descriptor, so a link swapped in later is refused too. The bundle folder itself may be a
link (a deploy's `current`).

Device side: needs NumPy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import unicodedata
from pathlib import Path, PurePosixPath

import numpy as np

from ..errors import BundleError, FormatError
from ..format import Header
from ..format.constants import HEADER_SIZE, KINDS as TENSOR_KINDS
from ..profile import AGGREGATIONS, DTYPES, MAX_TOKENS

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # a manifest is a few KB; anything near this is not one
DIGEST_KEY = "manifest_sha256"
KINDS = ("cubin", "ptx")

# Top-level manifest keys and their JSON types. `launch` may be absent (a catalogue without a launch plan).
REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "sdk_version": str,
    "arch": str,
    "compute_capability": list,
    "nvrtc_version": str,
    "min_driver": int,
    "dtype": str,
    "shape": dict,
    "aggregation": str,
    "profile": dict,
    "weights": dict,
    "kernels": list,
    "selftest": dict,
    "files": list,
    DIGEST_KEY: str,
}
OPTIONAL_KEYS: dict[str, type | tuple[type, ...]] = {"launch": list}
# weights.header: the .colibri header fields (colibri_sdk.format.Header) the runtime reads from the manifest.
HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(Header) if f.name != "version")
# Every key of weights.header: the whole header, `version` included; it must equal the weights file's header.
HEADER_KEYS = tuple(f.name for f in dataclasses.fields(Header))
# kernels[i].resources[symbol]: the ptxas resource report (colibri_sdk.aot.nvrtc), all integers.
RESOURCE_KEYS = ("registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes")
_CHUNK = 1 << 20
_HEX = frozenset("0123456789abcdef")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open; it is refused as not a regular file


def canonical_json(data: dict) -> bytes:
    """The one serialisation of a manifest: sorted keys, 2-space indent, ASCII, trailing newline.

    Raises:
        BundleError: `data` holds NaN or ±Infinity (JSON has no such numbers).
    """
    try:
        text = json.dumps(data, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)
    except ValueError as exc:
        raise BundleError(f"a manifest cannot hold NaN or Infinity ({exc})") from None
    return (text + "\n").encode("ascii")


def manifest_digest(manifest: dict) -> str:
    """sha256 (hex) of the canonical JSON of `manifest` without its `manifest_sha256` key."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _control_character(text: str) -> str | None:
    """The first control, format, surrogate, private-use or unassigned character (Unicode category C*), or None."""
    for ch in text:
        if unicodedata.category(ch)[0] == "C":
            return ch
    return None


def check_relative(path: str, what: str) -> PurePosixPath:
    """A manifest path must be relative, POSIX, normalised, free of control characters, and stay inside the bundle.

    Messages show the path with repr(): control characters appear escaped (`'a\\x00b'`).

    Raises:
        BundleError: naming `what`, the path and what is allowed.
    """
    if not isinstance(path, str) or not path:
        raise BundleError(f"{what}: path {path!r}; allowed: a non-empty relative POSIX path")
    bad = _control_character(path)
    if bad is not None:
        raise BundleError(
            f"{what}: path {path!r} holds the control character {bad!r} (U+{ord(bad):04X}); allowed: printable "
            "characters"
        )
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or str(pure) != path:
        raise BundleError(f"{what}: path {path!r}; allowed: a normalised relative path inside the bundle")
    return pure


def _refuse_constant(name: str):
    raise BundleError(f"{name} in the manifest; allowed: finite JSON numbers only (strict JSON has no {name})")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BundleError(f"the number {text[:40]} in the manifest is beyond float range; allowed: finite numbers")
    return value


def _pairs(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise BundleError(f"duplicate key {key!r} in the manifest; allowed: each key once per object")
        out[key] = value
    return out


def parse_manifest(raw: bytes, where: str = MANIFEST) -> dict:
    """manifest.json bytes → dict, strictly: UTF-8, a JSON object, no NaN / Infinity / -Infinity, no number beyond
    float range, no duplicate key.

    Raises:
        BundleError: naming `where` and the fault.
    """
    try:
        manifest = json.loads(
            raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_parse_float, object_pairs_hook=_pairs
        )
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        detail = str(exc) if len(str(exc)) <= 200 else str(exc)[:197] + "..."
        raise BundleError(f"{where}: not valid JSON ({detail}); the file was changed or truncated") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: top level is {type(manifest).__name__}; allowed: a JSON object")
    return manifest


# ---- confinement ----------------------------------------------------------------------------------------------------
def _kind(mode: int) -> str:
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


_LINK_RULE = "a bundle is read only through regular files and folders inside it (nothing through a link)"


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
            raise BundleError(f"{shown}: a symbolic link; {_LINK_RULE}")
        if not last and not stat.S_ISDIR(mode):
            raise BundleError(f"{shown}: {_kind(mode)} on the path of {rel}; allowed: a folder inside the bundle")
        if last and not stat.S_ISREG(mode):
            raise BundleError(f"{rel}: {_kind(mode)}; allowed: a regular file inside the bundle")
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
        raise BundleError(f"{rel}: {_kind(mode)}; allowed: a regular file inside the bundle")
    return os.fdopen(fd, "rb", buffering=0)


def _read_manifest(root: Path) -> bytes:
    manifest_path = root / MANIFEST
    try:
        mode = os.lstat(manifest_path).st_mode
    except FileNotFoundError:
        raise BundleError(f"{manifest_path}: cannot read the manifest: No such file or directory") from None
    except OSError as exc:
        raise BundleError(f"{manifest_path}: cannot read the manifest: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise BundleError(f"{manifest_path}: a symbolic link; {_LINK_RULE}")
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


def _float_ranges(header: Header) -> list[tuple[int, int, np.dtype]]:
    """(start, end, dtype) byte ranges of a .colibri file's float tensor blocks (format layout: Header)."""
    ranges = []
    for kind in TENSOR_KINDS:
        start = header.block_offset(kind)
        ranges.append((start, start + header.block_elements(kind) * header.itemsize, header.np_dtype))
    return ranges


def _first_nonfinite(chunk: bytes, chunk_start: int, ranges) -> int | None:
    """File offset of the first NaN/Inf element of `chunk` (which starts at file offset chunk_start), or None."""
    end = chunk_start + len(chunk)
    for lo, hi, dtype in ranges:
        a, b = max(lo, chunk_start), min(hi, end)
        if a >= b:
            continue
        a += (-(a - lo)) % dtype.itemsize  # align to an element of this block
        b -= (b - lo) % dtype.itemsize
        if a >= b:
            continue
        # NaN and Inf are the IEEE 754 patterns with every exponent bit set: an integer mask test runs ~10x faster
        # than np.isfinite on float16 (about 2 GB/s here, so the scan costs far less than the sha256 beside it).
        info = np.finfo(dtype)
        exponent = ((1 << info.nexp) - 1) << info.nmant
        bits = np.frombuffer(chunk, dtype=dtype.str.replace("f", "u"), count=(b - a) // dtype.itemsize,
                             offset=a - chunk_start)
        special = (bits & exponent) == exponent
        if special.any():
            return a + int(np.argmax(special)) * dtype.itemsize
    return None


def _check_header_matches(recorded: dict, actual: dict, rel: str) -> None:
    """The manifest's weights.header must equal the weights file's header (every field; `version` where recorded).

    Raises:
        BundleError: naming the first field that differs (in HEADER_KEYS order) and both values.
    """
    for key in HEADER_KEYS:
        if key == "version" and key not in recorded:
            continue
        if recorded.get(key) != actual[key]:
            raise BundleError(
                f"{rel}: header {key} = {actual[key]}, but the manifest's weights.header.{key} = {recorded.get(key)}; "
                "the weights do not belong to this manifest"
            )


class Bundle:
    """An opened bundle folder.

    Usage::

        bundle = Bundle.open("bundles/orin")              # checks schema, sizes and sha256 of every file
        cubin = bundle.kernel_image("routing", "cubin")     # bytes
        x, expected, rtol, atol = bundle.selftest()

    Attributes:
        path: the bundle folder.
        manifest: the parsed manifest.json (see the module docstring and docs/build.md for its keys).
    """

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest

    # ---- opening ----------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = True) -> "Bundle":
        """Open a bundle folder.

        Always checked (nothing is read through a link): manifest.json is a regular file inside the folder, strict
        JSON (no NaN/Infinity, no duplicate key), follows the schema; every path field is a normalised relative
        path without control characters; kernel images, weights and self-test files are listed in `files`; and
        every listed path is a regular file below real folders of the bundle (lstat, no symbolic link).

        Args:
            path: the bundle folder.
            verify: also check the manifest's canonical form and digest, every file's size and sha256, that no
                unlisted file, link or special file is present, that the weights file's header equals the
                manifest's `weights.header`, and that the weights hold no NaN/Inf (reads every byte once).

        Raises:
            BundleError: any violation, naming the file or key.
        """
        root = Path(path)
        if not root.is_dir():
            raise BundleError(f"{root} is not a bundle folder (no such directory)")
        raw = _read_manifest(root)
        where = str(root / MANIFEST)
        manifest = parse_manifest(raw, where)
        check_schema(manifest, where)
        bundle = cls(root, manifest)
        for entry in manifest["files"]:
            check_inside(root, entry["path"])
        if verify:
            bundle.verify(raw)
        return bundle

    def verify(self, raw_manifest: bytes | None = None) -> None:
        """Check the manifest's canonical form and digest, the folder's contents, then every listed file's size and
        sha256; the weights' header against the manifest's and their values for NaN/Inf.

        Raises:
            BundleError: naming the first file that differs, is missing, is a link, is not listed, or holds NaN/Inf.
        """
        raw = _read_manifest(self.path) if raw_manifest is None else raw_manifest
        if raw != canonical_json(self.manifest):
            raise BundleError(
                f"{MANIFEST}: not in canonical form (sorted keys, 2-space indent, trailing newline); "
                "the file was edited after the build"
            )
        expected = manifest_digest(self.manifest)
        if self.manifest[DIGEST_KEY] != expected:
            raise BundleError(
                f"{MANIFEST}: content sha256 {expected} differs from the recorded {DIGEST_KEY} "
                f"{self.manifest[DIGEST_KEY]}; the manifest was changed after the build"
            )
        listed = {entry["path"] for entry in self.manifest["files"]}
        self._check_contents(self.path, "", listed)
        weights = self.manifest["weights"]["file"]
        for entry in self.manifest["files"]:
            rel = entry["path"]
            with open_inside(self.path, rel) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != entry["size"]:
                    raise BundleError(f"{rel}: {size} bytes; the manifest records {entry['size']}")
                digest = self._hash(fh, rel, weights=rel == weights)
            if digest != entry["sha256"]:
                raise BundleError(f"{rel}: sha256 {digest} differs from the manifest's {entry['sha256']}")

    def _check_contents(self, folder: Path, prefix: str, listed: set[str]) -> None:
        """Walk the folder without following links: every entry is a real folder or a listed regular file."""
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise BundleError(f"{prefix or '.'}: cannot list the folder: {exc.strerror}") from None
        for entry in entries:
            rel = prefix + entry.name
            shown = repr(rel) if _control_character(rel) is not None else rel
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                self._check_contents(Path(entry.path), rel + "/", listed)
            elif stat.S_ISLNK(mode):
                raise BundleError(f"{shown}: a symbolic link; {_LINK_RULE}")
            elif not stat.S_ISREG(mode):
                raise BundleError(f"{shown}: {_kind(mode)}; a bundle holds only regular files and folders")
            elif rel != MANIFEST and rel not in listed:
                raise BundleError(f"{shown}: not listed in the manifest; a bundle holds only the files it lists")

    def _hash(self, fh, rel: str, weights: bool) -> str:
        """sha256 of an open file; for the weights also the header against the manifest and a NaN/Inf scan."""
        digest = hashlib.sha256()
        ranges = None
        if weights:
            head = fh.read(HEADER_SIZE)
            digest.update(head)
            self._check_weights_header(head, rel)
            ranges = _float_ranges(Header.unpack(head))
        offset = fh.tell()
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
            if ranges is not None:
                bad = _first_nonfinite(chunk, offset, ranges)
                if bad is not None:
                    raise BundleError(
                        f"{rel}: a NaN or Inf weight at byte offset {bad}; allowed: finite weights (the file was "
                        "damaged, or the checkpoint holds non-finite values)"
                    )
            offset += len(chunk)
        return digest.hexdigest()

    def _check_weights_header(self, head: bytes, rel: str) -> None:
        try:
            actual = dataclasses.asdict(Header.unpack(head))
        except FormatError as exc:
            raise BundleError(f"{rel}: {exc}") from None
        _check_header_matches(self.manifest["weights"]["header"], actual, rel)

    # ---- accessors --------------------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        """The target arch, e.g. "sm_87"."""
        return self.manifest["arch"]

    @property
    def compute_capability(self) -> tuple[int, int]:
        major, minor = self.manifest["compute_capability"]
        return int(major), int(minor)

    @property
    def shape(self) -> tuple[int, int]:
        """The fixed shape (batch, tokens)."""
        shape = self.manifest["shape"]
        return int(shape["batch"]), int(shape["tokens"])

    @property
    def dtype(self) -> str:
        """Storage dtype of the weights: "fp16" | "fp32"."""
        return self.manifest["dtype"]

    @property
    def aggregation(self) -> str:
        return self.manifest["aggregation"]

    @property
    def min_driver(self) -> int:
        """Minimum CUDA driver version (cuDriverGetVersion encoding: 1000 * major + 10 * minor)."""
        return int(self.manifest["min_driver"])

    @property
    def kernels(self) -> list[dict]:
        return self.manifest["kernels"]

    @property
    def launch(self) -> list[dict] | None:
        """The catalogue's launch plan recorded at build time, or None."""
        return self.manifest.get("launch")

    @property
    def weights_path(self) -> Path:
        """The weights file, after `check_inside` (a regular file, no link on its path).

        Raises:
            BundleError: it is missing, a link, or not a regular file.
        """
        return check_inside(self.path, self.manifest["weights"]["file"])

    def open_weights(self):
        """The weights as a `colibri_sdk.format.ColibriFile` (mmap, read-only)."""
        from ..format import ColibriFile

        try:
            weights = ColibriFile(self.weights_path)
        except FormatError as exc:
            raise BundleError(f"{self.manifest['weights']['file']}: {exc}") from None
        try:
            _check_header_matches(self.manifest["weights"]["header"], dataclasses.asdict(weights.header),
                                  self.manifest["weights"]["file"])
        except BundleError:
            weights.close()
            raise
        return weights

    def kernel(self, name: str) -> dict:
        """The manifest entry of one kernel (keys: name, source, symbols, cubin, ptx, defines, resources).

        Raises:
            BundleError: no kernel of that name.
        """
        for entry in self.manifest["kernels"]:
            if entry["name"] == name:
                return entry
        names = [k["name"] for k in self.manifest["kernels"]]
        raise BundleError(f"no kernel {name!r} in {self.path}; allowed: {names}")

    def kernel_image(self, name: str, kind: str) -> bytes:
        """The compiled image of kernel `name`: kind "cubin" (SASS for `arch`) or "ptx" (text, no NUL).

        Raises:
            BundleError: unknown kernel or kind, or the file cannot be read.
        """
        if kind not in KINDS:
            raise BundleError(f"kernel image kind {kind!r}; allowed: {KINDS}")
        rel = self.kernel(name)[kind]
        return self._read(rel)

    def selftest(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The self-test vectors.

        Returns:
            (input float32 (batch, tokens, hidden), expected output float32 (batch, tokens, hidden), rtol, atol).
            Pass: |actual - expected| <= atol + rtol * |expected| elementwise.
        """
        entry = self.manifest["selftest"]
        arrays = []
        for key in ("input", "output"):
            with open_inside(self.path, entry[key]) as fh:
                try:
                    array = np.load(fh, allow_pickle=False)
                except (OSError, ValueError, MemoryError, EOFError) as exc:
                    raise BundleError(f"{entry[key]}: cannot load the self-test {key}: {exc}") from None
            if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                what = f"dtype {array.dtype}" if isinstance(array, np.ndarray) else f"a {type(array).__name__}"
                raise BundleError(f"{entry[key]}: the self-test {key} is {what}; allowed: a float32 .npy array")
            arrays.append(array)
        return arrays[0], arrays[1], float(entry["rtol"]), float(entry["atol"])

    def _read(self, rel: str) -> bytes:
        with open_inside(self.path, rel) as fh:
            try:
                return fh.read()
            except OSError as exc:
                raise BundleError(f"{rel}: cannot read: {exc.strerror}") from None

    def __repr__(self) -> str:
        b, t = self.shape
        return f"Bundle({str(self.path)!r}, arch={self.arch}, dtype={self.dtype}, shape=({b}, {t}))"


# ---- schema -------------------------------------------------------------------------------------------------------
def _type_name(t) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def _expect(value, t, key: str, where: str) -> None:
    ok = isinstance(value, t) and not (isinstance(value, bool) and t in (int, float, (int, float)))
    if not ok:
        raise BundleError(f"{where}: {key} = {value!r}; allowed: {_type_name(t)}")


def _check_printable(value, key: str, where: str) -> None:
    """No string (key or value) in `value` holds a control character: `inspect` prints them, messages quote them."""
    if isinstance(value, str):
        bad = _control_character(value)
        if bad is not None:
            raise BundleError(
                f"{where}: {key} = {value[:80]!r} holds the control character {bad!r} (U+{ord(bad):04X}); allowed: "
                "printable characters"
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_printable(k, f"{key} (a key)", where)
            _check_printable(v, f"{key}.{k}", where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_printable(v, f"{key}[{i}]", where)


def check_schema(manifest: dict, where: str = MANIFEST) -> None:
    """Check keys and types of a manifest (not the files).

    Raises:
        BundleError: unknown schema_version, missing, unknown or mistyped key, naming it.
    """
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"{where}: schema_version = {version!r}; this SDK reads schema_version {SCHEMA_VERSION}")
    for key, t in REQUIRED_KEYS.items():
        if key not in manifest:
            raise BundleError(f"{where}: missing key {key!r}")
        _expect(manifest[key], t, key, where)
    for key, t in OPTIONAL_KEYS.items():
        if key in manifest:
            _expect(manifest[key], t, key, where)
    unknown = sorted(set(manifest) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise BundleError(f"{where}: unknown keys {unknown}; allowed: {sorted({**REQUIRED_KEYS, **OPTIONAL_KEYS})}")
    if manifest["dtype"] not in DTYPES:
        raise BundleError(f"{where}: dtype = {manifest['dtype']!r}; allowed: {DTYPES}")
    if manifest["aggregation"] not in AGGREGATIONS:
        raise BundleError(f"{where}: aggregation = {manifest['aggregation']!r}; allowed: {AGGREGATIONS}")
    cc = manifest["compute_capability"]
    if len(cc) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in cc):
        raise BundleError(f"{where}: compute_capability = {cc!r}; allowed: [major, minor] integers")
    for key in ("batch", "tokens"):
        _expect(manifest["shape"].get(key), int, f"shape.{key}", where)
        if not 1 <= manifest["shape"][key] <= MAX_TOKENS:
            raise BundleError(f"{where}: shape.{key} = {manifest['shape'][key]}; allowed: 1..{MAX_TOKENS}")
    if manifest["shape"]["batch"] * manifest["shape"]["tokens"] > MAX_TOKENS:
        raise BundleError(
            f"{where}: shape batch*tokens = {manifest['shape']['batch'] * manifest['shape']['tokens']}; "
            f"allowed: at most {MAX_TOKENS}"
        )
    _expect(manifest["weights"].get("file"), str, "weights.file", where)
    _expect(manifest["weights"].get("header"), dict, "weights.header", where)
    check_relative(manifest["weights"]["file"], f"{where}: weights.file")
    header = manifest["weights"]["header"]
    for key in HEADER_FIELDS:
        _expect(header.get(key), int, f"weights.header.{key}", where)
    if "version" in header:  # bundles of this schema always record it; the weights file's header must match
        _expect(header["version"], int, "weights.header.version", where)
    unknown = sorted(set(header) - set(HEADER_KEYS))
    if unknown:
        raise BundleError(f"{where}: unknown keys {unknown} in weights.header; allowed: {list(HEADER_KEYS)}")
    for i, kernel in enumerate(manifest["kernels"]):
        _expect(kernel, dict, f"kernels[{i}]", where)
        for key, t in (("name", str), ("source", str), ("symbols", list), ("cubin", str), ("ptx", str),
                       ("defines", dict), ("resources", dict)):
            _expect(kernel.get(key), t, f"kernels[{i}].{key}", where)
        for kind in KINDS:
            check_relative(kernel[kind], f"{where}: kernels[{i}].{kind}")
        for j, symbol in enumerate(kernel["symbols"]):
            _expect(symbol, str, f"kernels[{i}].symbols[{j}]", where)
            if not symbol.isidentifier() or not symbol.isascii():
                raise BundleError(f"{where}: kernels[{i}].symbols[{j}] = {symbol!r}; allowed: a C identifier")
        for symbol, resources in kernel["resources"].items():
            _expect(resources, dict, f"kernels[{i}].resources.{symbol}", where)
            for key in RESOURCE_KEYS:
                _expect(resources.get(key), int, f"kernels[{i}].resources.{symbol}.{key}", where)
    for key, t in (("input", str), ("output", str), ("rtol", (int, float)), ("atol", (int, float))):
        _expect(manifest["selftest"].get(key), t, f"selftest.{key}", where)
    for key in ("rtol", "atol"):
        if manifest["selftest"][key] < 0:
            raise BundleError(f"{where}: selftest.{key} = {manifest['selftest'][key]!r}; allowed: a number >= 0")
    for key in ("input", "output"):
        check_relative(manifest["selftest"][key], f"{where}: selftest.{key}")
    for i, entry in enumerate(manifest["files"]):
        _expect(entry, dict, f"files[{i}]", where)
        for key, t in (("path", str), ("sha256", str), ("size", int)):
            _expect(entry.get(key), t, f"files[{i}].{key}", where)
        check_relative(entry["path"], f"{where}: files[{i}].path")
        if len(entry["sha256"]) != 64 or not set(entry["sha256"]) <= _HEX:
            raise BundleError(f"{where}: files[{i}].sha256 = {entry['sha256'][:80]!r}; allowed: 64 lowercase hex digits")
        if entry["size"] < 0:
            raise BundleError(f"{where}: files[{i}].size = {entry['size']}; allowed: a byte count >= 0")
    paths = [e["path"] for e in manifest["files"]]
    if paths != sorted(set(paths)):
        raise BundleError(f"{where}: files must be sorted by path without duplicates")
    if MANIFEST in paths:
        raise BundleError(f"{where}: files lists {MANIFEST}; it covers every file except the manifest itself")
    listed = set(paths)
    referenced = [("weights.file", manifest["weights"]["file"])]
    referenced += [(f"kernels[{i}].{kind}", k[kind]) for i, k in enumerate(manifest["kernels"]) for kind in KINDS]
    referenced += [(f"selftest.{key}", manifest["selftest"][key]) for key in ("input", "output")]
    for key, rel in referenced:
        if rel not in listed:
            raise BundleError(
                f"{where}: {key} = {rel!r} is not in files; allowed: a file the manifest lists (with size and sha256)"
            )
    for key, value in manifest.items():
        if key != "profile":  # the profile's free text (its description) may span lines
            _check_printable(value, key, where)


# ---- inspect ------------------------------------------------------------------------------------------------------
def bundle_summary(bundle: Bundle) -> dict:
    """A short JSON-friendly summary for `colibri-sdk inspect`."""
    m = bundle.manifest
    return {
        "path": str(bundle.path),
        "profile": m["profile"].get("name"),
        "arch": m["arch"],
        "compute_capability": m["compute_capability"],
        "dtype": m["dtype"],
        "shape": m["shape"],
        "aggregation": m["aggregation"],
        "sdk_version": m["sdk_version"],
        "nvrtc_version": m["nvrtc_version"],
        "min_driver": m["min_driver"],
        "weights": m["weights"],
        "kernels": [
            {key: k[key] for key in ("name", "symbols", "cubin", "ptx", "resources")}
            for k in m["kernels"]
        ],
        "launches": len(m.get("launch") or []),
        "files": m["files"],
    }
