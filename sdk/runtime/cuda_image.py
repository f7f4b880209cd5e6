"""What a bundle asks of the device, checked before anything is loaded: which image runs (the cubin, or the PTX
JIT-compiled by a newer driver), and the launch plan, which must be the catalogue's for the bundle's profile and
weights at its shape (docs/runtime-cuda.md). Used by the CUDA backend; no driver call here.
"""

from __future__ import annotations

import json

from .. import catalog
from ..driver_version import format_driver_version
from ..errors import BackendError, BundleError


def parse_version(text: str) -> int:
    """"12.9" → 12090, cuDriverGetVersion's encoding (1000*major + 10*minor)."""
    major, _, minor = str(text).partition(".")
    return 1000 * int(major) + 10 * int(minor or 0)


def select_image(device_cc, bundle_cc, driver_version: int, min_driver: int, nvrtc_version: str) -> str:
    """Which image of a bundle runs on a device.

    Args:
        device_cc, bundle_cc: (major, minor) compute capabilities of the GPU and of the bundle's arch.
        driver_version: cuDriverGetVersion of this driver (e.g. 12060).
        min_driver: the bundle's minimum driver (manifest `min_driver`).
        nvrtc_version: the NVRTC that wrote the PTX ("12.9"); JIT needs a driver at least that new.

    Returns:
        "cubin" (same major, device minor >= bundle minor) or "ptx" (a newer GPU and a new enough driver).

    Raises:
        BackendError: the driver is older than the bundle's minimum, or the GPU is older than the bundle's arch,
            or PTX JIT would need a newer driver; the message names both capabilities and versions.
    """
    dev, bun = tuple(int(v) for v in device_cc), tuple(int(v) for v in bundle_cc)
    names = f"the GPU is sm_{dev[0]}{dev[1]}, the bundle is built for sm_{bun[0]}{bun[1]}"
    if driver_version < min_driver:
        raise BackendError(
            f"the CUDA driver is {format_driver_version(driver_version)}; the bundle needs at least "
            f"{format_driver_version(min_driver)} (manifest min_driver {min_driver}); {names}"
        )
    if dev[0] == bun[0] and dev[1] >= bun[1]:
        return "cubin"
    if dev < bun:
        raise BackendError(
            f"{names}: its code cannot run on an older GPU; build the bundle with a profile for "
            f"sm_{dev[0]}{dev[1]} or older"
        )
    needed = max(min_driver, parse_version(nvrtc_version))
    if driver_version < needed:
        raise BackendError(
            f"{names}: the cubin needs compute capability {bun[0]}.x, and JIT-compiling the PTX (NVRTC "
            f"{nvrtc_version}) needs a CUDA driver >= {format_driver_version(needed)}, this one is "
            f"{format_driver_version(driver_version)}"
        )
    return "ptx"


def checked_launch_plan(manifest: dict, header) -> list[dict]:
    """The catalogue's launch plan for the bundle's profile (at its shape) and weights. A manifest's `launch`, when
    present, must equal it, and every kernel's `defines` the catalogue's compile constants: a grid, buffer name or
    weights offset of its own, or kernels compiled for another shape, would run the kernels outside their buffers.

    Raises:
        BundleError: naming the first kernel or launch that differs, or the plan the profile does not allow.
    """
    from ..bundle.records import check_buffer_records, planned

    bt = (manifest["shape"]["batch"], manifest["shape"]["tokens"])
    defines = json.loads(json.dumps(planned(lambda: catalog.compile_defines(manifest["profile"], header),
                                            "manifest.json: kernels[].defines", bt)))
    for i, kernel in enumerate(manifest["kernels"]):
        if kernel.get("defines") != defines:  # e.g. another shape's kernels: they would index past this one's buffers
            raise BundleError(
                f"manifest.json: kernels[{i}] ({kernel.get('name')!r}).defines differ from the catalogue's compile "
                f"constants for the bundle's profile and weights at shape batch {manifest['shape']['batch']} x "
                f"tokens {manifest['shape']['tokens']}; allowed: the kernels colibri-sdk build compiled for it "
                "(rebuild the bundle)"
            )
    check_buffer_records(manifest, header, only=bt)  # what a C runtime allocates
    plan = planned(lambda: catalog.launch_plan(manifest["profile"], header), "manifest.json: launch", bt)
    recorded = manifest.get("launch")
    expected = json.loads(json.dumps(plan))
    if recorded is not None and recorded != expected:
        index = next((i for i, (a, b) in enumerate(zip(recorded, expected)) if a != b),
                     min(len(recorded), len(expected)))
        raise BundleError(
            f"manifest.json: launch[{index}] differs from the catalogue's launch plan for the bundle's profile and "
            f"weights ({len(recorded)} launches recorded, {len(expected)} expected); allowed: the plan colibri-sdk "
            "build writes (rebuild the bundle)"
        )
    return plan
