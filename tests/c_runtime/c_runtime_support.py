"""Constants and small helpers of the C runtime tests, importable by name (a conftest.py is not: with several test
folders, which `conftest` module a plain import finds depends on the order pytest loaded them)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

SHIPPED = ("orin", "a100", "rtx4090", "h200")


def manifest(bundle: Path) -> dict:
    """The bundle's manifest.json as a dict."""
    return json.loads((bundle / "manifest.json").read_text())


def captured_launches(m: dict) -> int:
    """Kernel launches libcolibri captures at init: every compiled shape's plan (the top-level one without `shapes`)."""
    return sum(len(entry["launch"]) for entry in m["shapes"]) if "shapes" in m else len(m["launch"])


def build_bundle_for(profile: str, out: Path, weights: Path, **changes) -> Path:
    """A bundle of a shipped profile (with `changes` to its top-level keys / kernels) on the given weights."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    data = copy.deepcopy(load_profile(profile, toolchain=False).data)
    for key, value in changes.items():
        if key in ("kernels", "target"):
            for name, params in value.items():
                if isinstance(params, dict):
                    data[key][name].update(params)
                else:
                    data[key][name] = params
        else:
            data[key] = value
    return build_bundle(Profile.from_dict(data), out, weights, workers=2).path
