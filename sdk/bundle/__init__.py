"""Bundles: the folder a build writes and the runtime loads (layout and manifest keys: docs/build.md).

`reader` opens and verifies a bundle with NumPy only (the device side); `writer` builds one (needs NVRTC and the
build extra) and is imported on its own: `from colibri_sdk.bundle.writer import build_bundle`.
"""

from .reader import (
    DIGEST_KEY,
    HEADER_FIELDS,
    KINDS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SCHEMA_VERSION,
    Bundle,
    bundle_summary,
    canonical_json,
    check_inside,
    check_relative,
    check_schema,
    file_sha256,
    manifest_digest,
    open_inside,
    parse_manifest,
)

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
