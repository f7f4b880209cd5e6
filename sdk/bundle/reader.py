"""Read a bundle: the folder `colibri-sdk build` writes and the device runs (docs/build.md, "Bundle").

    manifest.json                  canonical JSON: sorted keys, 2-space indent, trailing newline
    model.colibri                  the weights, in the profile's dtype
    kernels/<name>.<arch>.cubin    SASS for the profile's arch, one per catalogue kernel
    kernels/<name>.ptx             PTX of the same source (JIT on newer GPUs)
    selftest/input.npy             float32 (batch, tokens, hidden) at the fixed shape
    selftest/output.npy            float32, the reference engine's output for it, computed at build time
    kernels/<name>.b<B>t<T>.*      with several compiled shapes: the kernels of each shape but the largest
    selftest/b<B>t<T>/*.npy        ... and its self-test vectors (the largest keeps the names above)

Several shapes (docs/build.md, "Several shapes"): the manifest's `shapes` lists every compiled shape, smallest
first, each with its kernels, launch plan, buffers and self-test; the top-level keys are the largest one's.
`Bundle.shapes` lists them and `Bundle.for_shape(batch, tokens)` gives the bundle seen at one of them.

Integrity: `files` in the manifest lists every other file with its size and sha256, and `manifest_sha256` is the
sha256 of the canonical JSON of the manifest without that key. A bundle is accepted only if manifest.json is byte
for byte its own canonical form, the digest matches, every listed file has its size and digest, and the folder holds
no file the manifest does not list. So a changed byte anywhere, in manifest.json too, is refused with the file's
name. (This detects corruption and edits; it is not a signature: whoever can rewrite the files can recompute it.)

A bundle is read only through what is inside its folder (`paths`: no symbolic link anywhere below it), its manifest
is strict JSON that follows the schema (`manifest`), and `verify` also checks the weights' header against the
manifest and their values for NaN/Inf (docs/build.md, "Reading rules").

Device side: needs NumPy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import contextlib
import hashlib
import os
import stat
from pathlib import Path

import numpy as np

from ..errors import BundleError, FormatError
from ..format import Header, HeaderV2
from ..format.constants import HEADER_SIZE, KINDS as TENSOR_KINDS, VERSION_2
from ..format.header_v2 import prefix_size
from ..format.pages import HugePageCache
from .manifest import (  # noqa: F401 (re-exported: the writer and the deploy import them from here)
    DIGEST_KEY,
    HEADER_FIELDS,
    HEADER_KEYS,
    HEADER_V2_KEYS,
    KINDS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    RESOURCE_KEYS,
    SCHEMA_VERSION,
    canonical_json,
    check_relative,
    check_schema,
    control_character,
    manifest_digest,
    parse_manifest,
)
from .paths import LINK_RULE, check_inside, kind_of, open_inside, read_manifest
from .records import check_buffer_records, check_profile_shape

_CHUNK = 1 << 20
_WINDOW = 8 << 20  # the weights are brought into the page cache a _WINDOW at a time (a multiple of 2 MiB)


def _chunks(fh, start: int, cache: HugePageCache | None):
    """The bytes of the open file fh from `start` (its position) to its end, read() in _CHUNK pieces; where a cache
    is given, each _WINDOW from the next one on first brought into the page cache through its mapping, which asks
    for 2 MiB pages (colibri_sdk.format.pages.HugePageCache), so that a file read here for the first time (a
    device after a reboot) is cached in the 2 MiB pages the CPU backend's own mapping then gets. A file that
    changes meanwhile reads as it is (the sha256 then differs): the mapping never serves the bytes, so a file that
    shrinks cannot raise SIGBUS here."""
    position = start
    while True:
        into = position % _WINDOW
        if cache is not None and into == 0:
            cache.load(position, _WINDOW)
        chunk = fh.read(min(_CHUNK, _WINDOW - into))
        if not chunk:
            return
        yield chunk
        position += len(chunk)


def file_sha256(path: Path, progress=None) -> str:
    """sha256 (hex) of a file, read in 1 MiB chunks; `progress(n)`, if given, is called with each chunk's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def header_record(header: Header) -> dict:
    """The manifest's weights.header of a weights header: the v1 fields (HEADER_KEYS), plus for a v2 header every v2
    field (HEADER_V2_KEYS; layer_map as a list), so the runtime knows the storage without opening the file."""
    record = dataclasses.asdict(header)
    if "layer_map" in record:
        record["layer_map"] = list(record["layer_map"])
    return record


def _float_ranges(header: Header) -> list[tuple[int, int, np.dtype]]:
    """(start, end, dtype) byte ranges of a .colibri file's float tensor blocks (format layout: Header). For a v2
    file: only its float blocks (float matrices, scales, router, biases, shared gate), never the int8/int4 codes or
    the zero points, whose bytes may look like any float pattern."""
    if isinstance(header, HeaderV2):
        return [(b.offset, b.offset + b.nbytes, b.dtype) for b in header.blocks() if b.dtype.kind == "f"]
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
    v2_keys = [key for key in HEADER_V2_KEYS if key in recorded or key in actual]
    for key in (*HEADER_KEYS, *v2_keys):
        if key == "version" and key not in recorded:
            continue
        if recorded.get(key) != actual.get(key):
            raise BundleError(
                f"{rel}: header {key} = {actual.get(key)}, but the manifest's weights.header.{key} = {recorded.get(key)}; "
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
                manifest's `weights.header`, that the weights hold no NaN/Inf (reads every byte once), and that
                every shape's `buffers` and `io_buffers` are the catalogue's (`records.check_buffer_records`).
                Always: `profile.shape` gives exactly the compiled shapes (`records.check_profile_shape`).

        Raises:
            BundleError: any violation, naming the file or key.
        """
        root = Path(path)
        try:
            is_dir = root.is_dir()
        except OSError as exc:  # e.g. EACCES on a folder above it: Path.is_dir raises what is not "no such file"
            raise BundleError(f"{root}: cannot examine the bundle folder: {exc.strerror}") from None
        if not is_dir:
            what = ("an archive; unpack it first (tar -xf): `build --archive` writes the bundle folder beside it"
                    if root.is_file() and root.name.endswith(".tar") else
                    "a file; `colibri-sdk build` makes a bundle folder of a .colibri file" if root.is_file()
                    else "not a directory" if root.exists() else "no such directory")
            raise BundleError(f"{root} is not a bundle folder ({what})")
        raw = read_manifest(root)
        where = str(root / MANIFEST)
        manifest = parse_manifest(raw, where)
        check_schema(manifest, where)
        check_profile_shape(manifest, where)
        bundle = cls(root, manifest)
        for entry in manifest["files"]:
            check_inside(root, entry["path"])
        if verify:
            bundle.verify(raw)
        return bundle

    def verify(self, raw_manifest: bytes | None = None, progress=None) -> None:
        """Check the manifest's canonical form and digest, the folder's contents, then every listed file's size and
        sha256; the weights' header against the manifest's and their values for NaN/Inf.

        Args:
            raw_manifest: manifest.json's bytes as `open` read them (None: read them again, by the same rules).
            progress: optional `progress(step, done_bytes, total_bytes)` (colibri_sdk.bundle.writer.Progress),
                called with step "sha256" after each chunk while the files are hashed.

        Raises:
            BundleError: naming the first file that differs, is missing, is a link, is not listed, or holds NaN/Inf.
        """
        raw = read_manifest(self.path) if raw_manifest is None else raw_manifest
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
        total, done = sum(entry["size"] for entry in self.manifest["files"]), [0]

        def advance(n: int) -> None:
            done[0] += n
            progress("sha256", done[0], total)

        for entry in self.manifest["files"]:
            rel = entry["path"]
            with open_inside(self.path, rel) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != entry["size"]:
                    raise BundleError(f"{rel}: {size} bytes; the manifest records {entry['size']}")
                digest = self._hash(fh, rel, rel == weights, advance if progress is not None else None)
            if digest != entry["sha256"]:
                raise BundleError(f"{rel}: sha256 {digest} differs from the manifest's {entry['sha256']}")
        with self.open_weights() as opened:
            check_buffer_records(self.manifest, opened.header)

    def _check_contents(self, folder: Path, prefix: str, listed: set[str]) -> None:
        """Walk the folder without following links: every entry is a real folder or a listed regular file."""
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise BundleError(f"{prefix or '.'}: cannot list the folder: {exc.strerror}") from None
        for entry in entries:
            rel = prefix + entry.name
            shown = repr(rel) if control_character(rel) is not None else rel
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                self._check_contents(Path(entry.path), rel + "/", listed)
            elif stat.S_ISLNK(mode):
                raise BundleError(f"{shown}: a symbolic link; {LINK_RULE}")
            elif not stat.S_ISREG(mode):
                raise BundleError(f"{shown}: {kind_of(mode)}; a bundle holds only regular files and folders")
            elif rel != MANIFEST and rel not in listed:
                raise BundleError(f"{shown}: not listed in the manifest; a bundle holds only the files it lists")

    def _hash(self, fh, rel: str, weights: bool, progress=None) -> str:
        """sha256 of an open file; for the weights also the header against the manifest and a NaN/Inf scan."""
        with HugePageCache(fh.fileno()) if weights else contextlib.nullcontext() as cache:
            if cache is not None:
                cache.load(0, _WINDOW)  # before the header's read(), which would cache the file's start in small pages
            digest = hashlib.sha256()
            ranges = None
            if weights:
                head = fh.read(HEADER_SIZE)
                if len(head) == HEADER_SIZE and int.from_bytes(head[4:6], "little") == VERSION_2:
                    head += fh.read(prefix_size(int.from_bytes(head[6:8], "little")) - HEADER_SIZE)  # the layer map
                digest.update(head)
                if progress is not None:
                    progress(len(head))
                self._check_weights_header(head, rel)
                ranges = _float_ranges(Header.unpack(head))
            offset = fh.tell()
            for chunk in _chunks(fh, offset, cache):
                digest.update(chunk)
                if progress is not None:
                    progress(len(chunk))
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
            actual = header_record(Header.unpack(head))
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
    def shapes(self) -> list[tuple[int, int]]:
        """Every compiled (batch, tokens), smallest first; the last is `shape`. A bundle built before `shapes`
        existed has its one shape."""
        entries = self.manifest.get("shapes")
        return [(int(e["batch"]), int(e["tokens"])) for e in entries] if entries else [self.shape]

    def for_shape(self, batch: int, tokens: int) -> "Bundle":
        """This bundle seen at one compiled shape: a Bundle whose manifest's top-level `shape`, `kernels`, `launch`,
        `buffers`, `io_buffers`, `selftest` and `profile.shape` are that shape's (the `shapes` entry), so a backend
        built for one fixed shape runs it. The files are the same; nothing is read.

        Raises:
            BundleError: (batch, tokens) is not one of `shapes`.
        """
        if (batch, tokens) not in self.shapes:
            raise BundleError(f"{self.path}: no compiled shape batch {batch} x tokens {tokens}; allowed: "
                              f"{self.shapes}")
        if "shapes" not in self.manifest:
            return self
        entry = next(e for e in self.manifest["shapes"] if (e["batch"], e["tokens"]) == (batch, tokens))
        manifest = dict(self.manifest)
        manifest.update(shape={"batch": int(batch), "tokens": int(tokens)}, kernels=entry["kernels"],
                        launch=entry["launch"], buffers=entry["buffers"], io_buffers=entry["io_buffers"],
                        selftest=entry["selftest"])
        manifest["profile"] = {**self.manifest["profile"], "shape": dict(manifest["shape"])}
        return Bundle(self.path, manifest)

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
            _check_header_matches(self.manifest["weights"]["header"], header_record(weights.header),
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
        "shapes": [
            {"batch": view.shape[0], "tokens": view.shape[1], "launches": len(view.launch or []),
             "kernels": [{key: k[key] for key in ("name", "cubin", "ptx")} for k in view.kernels],
             "selftest": {key: view.manifest["selftest"][key] for key in ("input", "output")}}
            for view in (bundle.for_shape(b, t) for b, t in bundle.shapes)
        ],
        "files": m["files"],
    }
