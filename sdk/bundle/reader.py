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

Device side: needs NumPy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path, PurePosixPath

import numpy as np

from ..errors import BundleError, FormatError
from ..format import Header
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
# `buffers` (scratch buffer name → bytes) and `io_buffers` ({"input", "output"[, "valid_tokens"]} → buffer name) are
# what the C runtime (sdk/libcolibri) allocates and copies through; the Python backend derives them from the catalogue.
OPTIONAL_KEYS: dict[str, type | tuple[type, ...]] = {"launch": list, "buffers": dict, "io_buffers": dict}
# weights.header: the .colibri header fields (colibri_sdk.format.Header) the runtime reads from the manifest.
HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(Header) if f.name != "version")
# kernels[i].resources[symbol]: the ptxas resource report (colibri_sdk.aot.nvrtc), all integers.
RESOURCE_KEYS = ("registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes")
_CHUNK = 1 << 20


def canonical_json(data: dict) -> bytes:
    """The one serialisation of a manifest: sorted keys, 2-space indent, ASCII, trailing newline."""
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def manifest_digest(manifest: dict) -> str:
    """sha256 (hex) of the canonical JSON of `manifest` without its `manifest_sha256` key."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def file_sha256(path: Path, progress=None) -> str:
    """sha256 (hex) of a file, read in 1 MiB chunks; `progress(n)`, if given, is called with each chunk's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def check_relative(path: str, what: str) -> PurePosixPath:
    """A manifest path must be relative, POSIX, and stay inside the bundle."""
    if not isinstance(path, str) or not path:
        raise BundleError(f"{what}: path {path!r}; allowed: a non-empty relative POSIX path")
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or str(pure) != path:
        raise BundleError(f"{what}: path {path!r}; allowed: a normalised relative path inside the bundle")
    return pure


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

        Args:
            path: the bundle folder.
            verify: also check every file's size and sha256, the manifest's digest and canonical form, and that
                no unlisted file is present (reads every byte once). The schema is always checked.

        Raises:
            BundleError: no such folder, no or unreadable manifest.json, unknown schema_version, a missing or
                mistyped key, or (verify=True) a file whose size or sha256 differs, naming the file.
        """
        root = Path(path)
        if not root.is_dir():
            raise BundleError(f"{root} is not a bundle folder (no such directory)")
        manifest_path = root / MANIFEST
        if manifest_path.exists() and not manifest_path.is_file():
            raise BundleError(f"{manifest_path}: not a regular file; the manifest must be a JSON file")
        if manifest_path.is_file() and manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise BundleError(
                f"{manifest_path}: {manifest_path.stat().st_size:,} bytes; allowed: at most {MAX_MANIFEST_BYTES:,}"
            )
        try:
            raw = manifest_path.read_bytes()
        except OSError as exc:
            raise BundleError(f"{manifest_path}: cannot read the manifest: {exc.strerror}") from exc
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            detail = str(exc) if len(str(exc)) <= 200 else str(exc)[:197] + "..."
            raise BundleError(f"{manifest_path}: not valid JSON ({detail}); the file was changed or truncated") from exc
        if not isinstance(manifest, dict):
            raise BundleError(f"{manifest_path}: top level is {type(manifest).__name__}; allowed: a JSON object")
        check_schema(manifest, str(manifest_path))
        bundle = cls(root, manifest)
        if verify:
            bundle.verify(raw)
        return bundle

    def verify(self, raw_manifest: bytes | None = None, progress=None) -> None:
        """Check the manifest's canonical form and digest, then every listed file's size and sha256.

        Args:
            progress: optional `progress(step, done_bytes, total_bytes)` (colibri_sdk.bundle.writer.Progress),
                called with step "sha256" while the files are hashed.

        Raises:
            BundleError: naming the first file that differs, is missing, or is not listed.
        """
        manifest_path = self.path / MANIFEST
        raw = manifest_path.read_bytes() if raw_manifest is None else raw_manifest
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
        listed = set()
        total, done = sum(entry["size"] for entry in self.manifest["files"]), [0]

        def advance(n: int) -> None:
            done[0] += n
            progress("sha256", done[0], total)

        for entry in self.manifest["files"]:
            rel = entry["path"]
            listed.add(rel)
            full = self.path / rel
            if full.is_symlink() or not full.is_file():
                raise BundleError(f"{rel}: listed in the manifest but missing (or not a regular file)")
            size = full.stat().st_size
            if size != entry["size"]:
                raise BundleError(f"{rel}: {size} bytes; the manifest records {entry['size']}")
            digest = file_sha256(full, advance if progress is not None else None)
            if digest != entry["sha256"]:
                raise BundleError(f"{rel}: sha256 {digest} differs from the manifest's {entry['sha256']}")
        for full in sorted(self.path.rglob("*")):
            if full.is_dir() and not full.is_symlink():
                continue
            rel = full.relative_to(self.path).as_posix()
            if rel != MANIFEST and rel not in listed:
                raise BundleError(f"{rel}: not listed in the manifest; a bundle holds only the files it lists")

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
        return self.path / self.manifest["weights"]["file"]

    def open_weights(self):
        """The weights as a `colibri_sdk.format.ColibriFile` (mmap, read-only)."""
        from ..format import ColibriFile

        weights = ColibriFile(self.weights_path)
        recorded = self.manifest["weights"]["header"]
        actual = dataclasses.asdict(weights.header)
        differ = sorted(k for k in HEADER_FIELDS if recorded[k] != actual[k])
        if differ:
            weights.close()
            key = differ[0]
            raise BundleError(
                f"{self.manifest['weights']['file']}: header {key} = {actual[key]}, but the manifest's "
                f"weights.header.{key} = {recorded[key]}; the weights do not belong to this manifest"
            )
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
            full = self.path / entry[key]
            try:
                array = np.load(full, allow_pickle=False)
            except (OSError, ValueError, MemoryError) as exc:
                raise BundleError(f"{entry[key]}: cannot load the self-test {key}: {exc}") from exc
            if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                what = f"dtype {array.dtype}" if isinstance(array, np.ndarray) else f"a {type(array).__name__}"
                raise BundleError(f"{entry[key]}: the self-test {key} is {what}; allowed: a float32 .npy array")
            arrays.append(array)
        return arrays[0], arrays[1], float(entry["rtol"]), float(entry["atol"])

    def _read(self, rel: str) -> bytes:
        try:
            return (self.path / rel).read_bytes()
        except OSError as exc:
            raise BundleError(f"{rel}: cannot read: {exc.strerror}") from exc

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
    for key in HEADER_FIELDS:
        _expect(manifest["weights"]["header"].get(key), int, f"weights.header.{key}", where)
    for i, kernel in enumerate(manifest["kernels"]):
        _expect(kernel, dict, f"kernels[{i}]", where)
        for key, t in (("name", str), ("source", str), ("symbols", list), ("cubin", str), ("ptx", str),
                       ("defines", dict), ("resources", dict)):
            _expect(kernel.get(key), t, f"kernels[{i}].{key}", where)
        for kind in KINDS:
            check_relative(kernel[kind], f"{where}: kernels[{i}].{kind}")
        for symbol, resources in kernel["resources"].items():
            _expect(resources, dict, f"kernels[{i}].resources.{symbol}", where)
            for key in RESOURCE_KEYS:
                _expect(resources.get(key), int, f"kernels[{i}].resources.{symbol}.{key}", where)
    for key, t in (("input", str), ("output", str), ("rtol", (int, float)), ("atol", (int, float))):
        _expect(manifest["selftest"].get(key), t, f"selftest.{key}", where)
    for key in ("input", "output"):
        check_relative(manifest["selftest"][key], f"{where}: selftest.{key}")
    for i, entry in enumerate(manifest["files"]):
        _expect(entry, dict, f"files[{i}]", where)
        for key, t in (("path", str), ("sha256", str), ("size", int)):
            _expect(entry.get(key), t, f"files[{i}].{key}", where)
        check_relative(entry["path"], f"{where}: files[{i}].path")
    for name, size in manifest.get("buffers", {}).items():
        _expect(size, int, f"buffers.{name}", where)
    for key, name in manifest.get("io_buffers", {}).items():
        _expect(name, str, f"io_buffers.{key}", where)
    paths = [e["path"] for e in manifest["files"]]
    if paths != sorted(set(paths)):
        raise BundleError(f"{where}: files must be sorted by path without duplicates")
    if MANIFEST in paths:
        raise BundleError(f"{where}: files lists {MANIFEST}; it covers every file except the manifest itself")


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
