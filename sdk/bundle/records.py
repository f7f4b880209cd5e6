"""The manifest records that follow from the catalogue: each compiled shape's `buffers` and `io_buffers`
(`catalog.device_buffers` / `catalog.io_buffers` for the profile at that shape and the weights' header) and the
profile's `shape` (whose batch x tokens product is the list of compiled shapes, `profile.shape_list`).

The manifest digest only says the file was not changed after it was digested; these say its values are the ones a
build writes. A C runtime allocates and copies through `buffers` / `io_buffers` as recorded (sdk/libcolibri), so a
recorded size or name of its own would run the kernels outside their buffers there, while the Python backend
(which derives them) would not notice: both refuse it instead. The launch plan and the kernels' `defines` are
checked the same way by the CUDA backend (`cuda_image.checked_launch_plan`).
"""

from __future__ import annotations

import json

from .. import catalog
from ..errors import BundleError
from ..profile import shape_list
from .manifest import MANIFEST, MAX_SHAPES


def _entries(manifest: dict) -> list[tuple[str, dict, tuple[int, int]]]:
    """(key prefix, record, (batch, tokens)) of every compiled shape: the top-level one, then each `shapes` entry."""
    top = manifest["shape"]
    entries = [("", manifest, (int(top["batch"]), int(top["tokens"])))]
    for n, entry in enumerate(manifest.get("shapes", [])):
        entries.append((f"shapes[{n}].", entry, (int(entry["batch"]), int(entry["tokens"]))))
    return entries


def _short(value, limit: int = 200) -> str:
    """`value` as sorted JSON, cut to `limit` characters ("..." after): a hostile record stays a short line."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def check_profile_shape(manifest: dict, where: str = MANIFEST) -> None:
    """`profile.shape`, when the profile records one (every build does), must give exactly the compiled shapes:
    `shapes` (or the top-level `shape` without it).

    Raises:
        BundleError: naming profile.shape, its value and the compiled shapes.
    """
    if "shape" not in manifest["profile"]:  # a manifest written by hand (CPU-only test bundles): nothing to disagree
        return
    compiled = [(int(e["batch"]), int(e["tokens"])) for e in manifest["shapes"]] if "shapes" in manifest else \
        [(int(manifest["shape"]["batch"]), int(manifest["shape"]["tokens"]))]
    shape = manifest["profile"].get("shape")
    try:
        values = [v if isinstance(v, list) else [v] for v in (shape["batch"], shape["tokens"])]
        if not all(type(x) is int for v in values for x in v):  # no 1.5, True or "16" read as an int
            raise TypeError("profile.shape values must be integers")
        counts = [len(v) for v in values]
        # no product of hostile lists is formed: more than MAX_SHAPES pairs cannot be the compiled shapes
        listed = shape_list(shape) if counts[0] * counts[1] <= MAX_SHAPES else f"{counts[0]} x {counts[1]} pairs"
    except (TypeError, KeyError, ValueError):
        listed = None
    if listed != compiled:
        raise BundleError(f"{where}: profile.shape = {_short(shape)} gives the shapes {listed}; "
                          f"allowed: the compiled shapes {compiled} (shapes / shape)")


def planned(compute, what: str, bt: tuple[int, int]):
    """compute() (a catalogue call on a manifest's profile at shape `bt`), with the errors a profile edited badly
    makes it raise (a wrong type, a missing key, a zero divisor) turned into a BundleError naming `what`."""
    try:
        return compute()
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        raise BundleError(
            f"{what}: the catalogue cannot plan the manifest's profile at batch {bt[0]} x tokens {bt[1]} "
            f"({type(exc).__name__}: {_short(str(exc))}); allowed: the profile colibri-sdk build writes (rebuild the "
            "bundle)") from None


def check_buffer_records(manifest: dict, header, where: str = MANIFEST, only: tuple[int, int] | None = None) -> None:
    """Every compiled shape's `buffers` and `io_buffers` (when recorded) must be the catalogue's for the profile at
    that shape and the weights' `header` (a `colibri_sdk.format` Header).

    Args:
        only: check the records of this (batch, tokens) only (a backend built for one shape).

    Raises:
        BundleError: naming the first differing key (e.g. "shapes[0].buffers"), the recorded and expected values,
            or the key whose plan the manifest's profile does not allow (a value of the wrong type).
    """
    entries = _entries(manifest)
    if only is not None:  # a view (`Bundle.for_shape`): its `shapes` entry names the key, else the top level
        entries = [e for e in entries[1:] if e[2] == tuple(only)] or entries[:1]
    for prefix, record, bt in entries:
        profile = {**manifest["profile"], "shape": {"batch": bt[0], "tokens": bt[1]}}
        expected = {"buffers": lambda: catalog.device_buffers(profile, header),
                    "io_buffers": lambda: catalog.io_buffers(header)}
        for key, compute in expected.items():
            if key not in record:  # a bundle without a launch plan (CPU only, or built before these keys)
                continue
            want = planned(compute, f"{where}: {prefix}{key}", bt)
            if record[key] != json.loads(json.dumps(want)):
                raise BundleError(
                    f"{where}: {prefix}{key} = {_short(record[key])} differs from the catalogue's "
                    f"{json.dumps(want, sort_keys=True)} for the profile at batch {bt[0]} x tokens {bt[1]} and the "
                    "weights; allowed: what colibri-sdk build writes (rebuild the bundle)"
                )
