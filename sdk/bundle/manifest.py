"""The manifest of a bundle (docs/build.md, "Bundle" and "Reading rules"): its keys, its one serialisation, strict
parsing, and the schema check. Standard library only (the device side).

`files` lists every file but manifest.json with its size and sha256; `manifest_sha256` is the sha256 of the
canonical JSON of the manifest without that key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import unicodedata
from pathlib import PurePosixPath

from ..errors import BundleError, ProfileError
from ..format import Header, HeaderV2
from ..profile import AGGREGATIONS, DTYPES, MAX_TOKENS, check_recorded

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
# `shapes`: every compiled shape, smallest first, each {batch, tokens, kernels, launch, buffers, io_buffers, selftest}
# (SHAPE_KEYS); the last (largest) one's values are the top-level ones (docs/build.md, "Several shapes"). A bundle
# without `shapes` has the one shape of its top-level keys.
OPTIONAL_KEYS: dict[str, type | tuple[type, ...]] = {"launch": list, "buffers": dict, "io_buffers": dict,
                                                     "shapes": list}
SHAPE_KEYS: dict[str, type] = {"batch": int, "tokens": int, "kernels": list, "launch": list, "buffers": dict,
                               "io_buffers": dict, "selftest": dict}
MAX_SHAPES = 64  # shape.batch and shape.tokens lists of at most 8 values each (colibri_sdk.profile)
# weights.header: the .colibri header fields (colibri_sdk.format.Header) the runtime reads from the manifest.
HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(Header) if f.name != "version")
# Every key of weights.header: the whole header, `version` included; it must equal the weights file's header.
HEADER_KEYS = tuple(f.name for f in dataclasses.fields(Header))
# The v2 fields (colibri_sdk.format.HeaderV2; docs/format.md v2 "Header"), recorded for v2 weights only (so the
# manifests of v1 weights, older ones included, hold HEADER_KEYS alone): the storage (quant, group_size,
# zero_points) and every other v2 field, floats as JSON numbers and layer_map as a list.
HEADER_V2_KEYS = tuple(f.name for f in dataclasses.fields(HeaderV2) if f.name not in HEADER_KEYS)
HEADER_V2_FLOAT_KEYS = ("routed_scaling_factor", "swiglu_limit", "swiglu_alpha")
# kernels[i].resources[symbol]: the ptxas resource report (colibri_sdk.aot.nvrtc), all integers.
RESOURCE_KEYS = ("registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes")
# kernels[i].inputs (optional): what `verify --rebuild` compiles again (colibri_sdk.aot.rebuild).
INPUT_KEYS: dict[str, type] = {"source_sha256": str, "headers": dict, "options": list}
_HEX = frozenset("0123456789abcdef")


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


def control_character(text: str) -> str | None:
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
    bad = control_character(path)
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
        bad = control_character(value)
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
    try:  # the recorded profile's values by the profile schema (the catalogue plans launches from them)
        check_recorded(manifest["profile"], f"{where}: profile")
    except ProfileError as exc:
        raise BundleError(str(exc)) from None
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
    unknown = sorted(set(header) - set(HEADER_KEYS) - set(HEADER_V2_KEYS))
    if unknown:
        raise BundleError(f"{where}: unknown keys {unknown} in weights.header; allowed: "
                          f"{list(HEADER_KEYS)} (+ {list(HEADER_V2_KEYS)} for v2 weights)")
    for key in HEADER_V2_KEYS:
        if key in header:
            kind = (int, float) if key in HEADER_V2_FLOAT_KEYS else list if key == "layer_map" else int
            _expect(header[key], kind, f"weights.header.{key}", where)
    _check_kernels(manifest["kernels"], "kernels", where)
    _check_selftest(manifest["selftest"], "selftest", where)
    for i, entry in enumerate(manifest["files"]):
        _expect(entry, dict, f"files[{i}]", where)
        for key, t in (("path", str), ("sha256", str), ("size", int)):
            _expect(entry.get(key), t, f"files[{i}].{key}", where)
        check_relative(entry["path"], f"{where}: files[{i}].path")
        if len(entry["sha256"]) != 64 or not set(entry["sha256"]) <= _HEX:
            raise BundleError(f"{where}: files[{i}].sha256 = {entry['sha256'][:80]!r}; allowed: 64 lowercase hex digits")
        if entry["size"] < 0:
            raise BundleError(f"{where}: files[{i}].size = {entry['size']}; allowed: a byte count >= 0")
    _check_buffers(manifest.get("buffers", {}), manifest.get("io_buffers", {}), "", where)
    if "shapes" in manifest:
        _check_shapes(manifest, where)
    paths = [e["path"] for e in manifest["files"]]
    if paths != sorted(set(paths)):
        raise BundleError(f"{where}: files must be sorted by path without duplicates")
    if MANIFEST in paths:
        raise BundleError(f"{where}: files lists {MANIFEST}; it covers every file except the manifest itself")
    listed = set(paths)
    referenced = [("weights.file", manifest["weights"]["file"])]
    referenced += [(f"kernels[{i}].{kind}", k[kind]) for i, k in enumerate(manifest["kernels"]) for kind in KINDS]
    referenced += [(f"selftest.{key}", manifest["selftest"][key]) for key in ("input", "output")]
    for n, entry in enumerate(manifest.get("shapes", [])):
        referenced += [(f"shapes[{n}].kernels[{i}].{kind}", k[kind]) for i, k in enumerate(entry["kernels"])
                       for kind in KINDS]
        referenced += [(f"shapes[{n}].selftest.{key}", entry["selftest"][key]) for key in ("input", "output")]
    for key, rel in referenced:
        if rel not in listed:
            raise BundleError(
                f"{where}: {key} = {rel!r} is not in files; allowed: a file the manifest lists (with size and sha256)"
            )
    for key, value in manifest.items():
        if key != "profile":  # the profile's free text (its description) may span lines
            _check_printable(value, key, where)
    if "shapes" in manifest:  # last: a fault in a top-level key is reported by its own rule first
        _check_largest_is_top_level(manifest, where)


def _check_kernels(kernels: list, key: str, where: str) -> None:
    """`kernels` (top level or of one shape): entries with their keys, relative image paths, C identifiers."""
    for i, kernel in enumerate(kernels):
        _expect(kernel, dict, f"{key}[{i}]", where)
        for name, t in (("name", str), ("source", str), ("symbols", list), ("cubin", str), ("ptx", str),
                        ("defines", dict), ("resources", dict)):
            _expect(kernel.get(name), t, f"{key}[{i}].{name}", where)
        for kind in KINDS:
            check_relative(kernel[kind], f"{where}: {key}[{i}].{kind}")
        for j, symbol in enumerate(kernel["symbols"]):
            _expect(symbol, str, f"{key}[{i}].symbols[{j}]", where)
            if not symbol.isidentifier() or not symbol.isascii():
                raise BundleError(f"{where}: {key}[{i}].symbols[{j}] = {symbol!r}; allowed: a C identifier")
        for symbol, resources in kernel["resources"].items():
            _expect(resources, dict, f"{key}[{i}].resources.{symbol}", where)
            for name in RESOURCE_KEYS:
                _expect(resources.get(name), int, f"{key}[{i}].resources.{symbol}.{name}", where)


def check_inputs(inputs, key: str, where: str = MANIFEST) -> None:
    """`kernels[i].inputs` (sdk/aot/rebuild.py): source_sha256, headers {path: sha256}, options [str]. Checked by
    `verify --rebuild`, its one reader; the schema check (`check_schema`), like the C runtime's, lets a kernel entry
    hold keys it does not read, so both readers accept the same bundles.

    Raises:
        BundleError: naming the key, the value and what is allowed.
    """
    _expect(inputs, dict, key, where)
    unknown = sorted(set(inputs) - set(INPUT_KEYS))
    if unknown:
        raise BundleError(f"{where}: unknown keys {unknown} in {key}; allowed: {list(INPUT_KEYS)}")
    for name, t in INPUT_KEYS.items():
        _expect(inputs.get(name), t, f"{key}.{name}", where)
    digests = [(f"{key}.source_sha256", inputs["source_sha256"])]
    digests += [(f"{key}.headers.{path}", digest) for path, digest in inputs["headers"].items()]
    for name, digest in digests:
        _expect(digest, str, name, where)
        if len(digest) != 64 or not set(digest) <= _HEX:
            raise BundleError(f"{where}: {name} = {digest[:80]!r}; allowed: 64 lowercase hex digits")
    for j, option in enumerate(inputs["options"]):
        _expect(option, str, f"{key}.options[{j}]", where)


def _check_selftest(selftest: dict, key: str, where: str) -> None:
    for name, t in (("input", str), ("output", str), ("rtol", (int, float)), ("atol", (int, float))):
        _expect(selftest.get(name), t, f"{key}.{name}", where)
    for name in ("rtol", "atol"):
        if selftest[name] < 0:
            raise BundleError(f"{where}: {key}.{name} = {selftest[name]!r}; allowed: a number >= 0")
    for name in ("input", "output"):
        check_relative(selftest[name], f"{where}: {key}.{name}")


def _check_buffers(buffers: dict, io_buffers: dict, prefix: str, where: str) -> None:
    for name, size in buffers.items():
        _expect(size, int, f"{prefix}buffers.{name}", where)
    for key, name in io_buffers.items():
        _expect(name, str, f"{prefix}io_buffers.{key}", where)


def _check_shapes(manifest: dict, where: str) -> None:
    """`shapes`: 1..MAX_SHAPES entries of exactly SHAPE_KEYS, sizes in range, strictly increasing in (batch*tokens,
    batch, tokens), the last one at least as large as every other in both batch and tokens (so "the smallest shape
    that fits" exists for every call the largest takes). That the last equals the top-level keys is checked at the
    end of `check_schema` (`_check_largest_is_top_level`)."""
    shapes = manifest["shapes"]
    if not 1 <= len(shapes) <= MAX_SHAPES:
        raise BundleError(f"{where}: shapes has {len(shapes)} entries; allowed: 1..{MAX_SHAPES}")
    order = []
    for n, entry in enumerate(shapes):
        key = f"shapes[{n}]"
        _expect(entry, dict, key, where)
        missing = sorted(set(SHAPE_KEYS) - set(entry))
        unknown = sorted(set(entry) - set(SHAPE_KEYS))
        if missing or unknown:
            raise BundleError(f"{where}: {key} keys: missing {missing}, unknown {unknown}; allowed: "
                              f"{sorted(SHAPE_KEYS)}")
        for name, t in SHAPE_KEYS.items():
            _expect(entry[name], t, f"{key}.{name}", where)
        for name in ("batch", "tokens"):
            if not 1 <= entry[name] <= MAX_TOKENS:
                raise BundleError(f"{where}: {key}.{name} = {entry[name]}; allowed: 1..{MAX_TOKENS}")
        if entry["batch"] * entry["tokens"] > MAX_TOKENS:
            raise BundleError(f"{where}: {key} batch*tokens = {entry['batch'] * entry['tokens']}; allowed: at most "
                              f"{MAX_TOKENS}")
        _check_kernels(entry["kernels"], f"{key}.kernels", where)
        _check_selftest(entry["selftest"], f"{key}.selftest", where)
        _check_buffers(entry["buffers"], entry["io_buffers"], f"{key}.", where)
        order.append((entry["batch"] * entry["tokens"], entry["batch"], entry["tokens"]))
    if order != sorted(set(order)):
        raise BundleError(f"{where}: shapes must be sorted smallest first (by batch*tokens, batch, tokens) without "
                          f"duplicates; got {[(b, t) for _, b, t in order]}")
    last = shapes[-1]
    for n, entry in enumerate(shapes[:-1]):
        if entry["batch"] > last["batch"] or entry["tokens"] > last["tokens"]:
            raise BundleError(
                f"{where}: shapes[{n}] is batch {entry['batch']} x tokens {entry['tokens']}, beyond the largest "
                f"(last) shape batch {last['batch']} x tokens {last['tokens']}; allowed: the last shape has the "
                "largest batch and the largest tokens"
            )


def _check_largest_is_top_level(manifest: dict, where: str) -> None:
    """The last (largest) `shapes` entry equals the top-level shape, kernels, launch, buffers and self-test."""
    shapes = manifest["shapes"]
    last = shapes[-1]
    top = {"batch": manifest["shape"]["batch"], "tokens": manifest["shape"]["tokens"],
           "kernels": manifest["kernels"], "launch": manifest.get("launch"), "buffers": manifest.get("buffers"),
           "io_buffers": manifest.get("io_buffers"), "selftest": manifest["selftest"]}
    for name in SHAPE_KEYS:
        if last[name] != top[name]:
            where_top = "shape." + name if name in ("batch", "tokens") else name
            raise BundleError(f"{where}: shapes[{len(shapes) - 1}].{name} differs from the top-level {where_top}; "
                              "allowed: the last (largest) shape is the top-level one")
