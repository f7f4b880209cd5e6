"""Bundles: the folder a build writes and the runtime loads (layout, manifest keys and reading rules: docs/build.md).

`manifest` holds the manifest's keys, serialisation, strict parsing and schema; `paths` reads inside the bundle
folder only; `reader` opens and verifies a bundle with NumPy only (the device side); `writer` builds one (needs
NVRTC and the build extra) and is imported on its own: `from colibri_sdk.bundle.writer import build_bundle`.
"""

from .manifest import (
    DIGEST_KEY,
    HEADER_FIELDS,
    KINDS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SCHEMA_VERSION,
    canonical_json,
    check_relative,
    check_schema,
    manifest_digest,
    parse_manifest,
)
from .paths import check_inside, open_inside
from .reader import Bundle, bundle_summary, file_sha256

__all__ = [
    "DIGEST_KEY",
    "HEADER_FIELDS",
    "KINDS",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SCHEMA_VERSION",
    "Bundle",
    "bundle_summary",
    "canonical_json",
    "check_inside",
    "check_relative",
    "check_schema",
    "file_sha256",
    "manifest_digest",
    "open_inside",
    "parse_manifest",
]
