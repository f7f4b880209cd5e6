"""Helpers for the GPU tests: random models, bundles built for this GPU, the float64 reference with routing margins."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from colibri_sdk.format import Header, write_model
from colibri_sdk.reference import ReferenceEngine


def device_compute_capability(ordinal: int = 0) -> tuple[int, int]:
    from cuda.bindings import driver as cu

    from colibri_sdk.runtime.driver import check

    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
    minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
    return int(major), int(minor)


def random_model(path: Path, *, layers=1, experts=8, top_k=2, hidden=256, inter=512, routing=0, composition=1,
                 seed=0) -> Path:
    """A float32 .colibri file with N(0, 1/fan_in) weights."""
    rng = np.random.default_rng(seed)
    header = Header(layers, experts, top_k, hidden, inter, dtype=0, routing=routing, composition=composition)
    f32 = np.float32
    gate = (rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden)).astype(f32)
    up = (rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden)).astype(f32)
    down = (rng.standard_normal((layers, experts, hidden, inter)) / np.sqrt(inter)).astype(f32)
    router = (rng.standard_normal((layers, hidden, experts)) / np.sqrt(hidden)).astype(f32)
    return write_model(path, header, gate, up, down, router)


def retarget_toolkit(data: dict, major: int) -> dict:
    """Point a profile dict at CUDA `major` (the installed NVRTC), keeping its arch: target.toolkit = major and
    target.min_driver raised to a driver of that major (1000 * major at least). Returns `data`, changed in place."""
    data["target"]["toolkit"] = major
    data["target"]["min_driver"] = max(data["target"]["min_driver"], 1000 * major)
    return data


def profile_for_this_gpu(base: str = "orin", **overrides) -> dict:
    """A profile dict for the GPU of this machine (its arch, the installed NVRTC major), with `overrides`:
    top-level keys replace, `kernels` entries are merged per kernel."""
    from colibri_sdk.aot.nvrtc import nvrtc_version
    from colibri_sdk.profile import load_profile

    data = copy.deepcopy(load_profile(base, toolchain=False).data)
    major, minor = device_compute_capability()
    data["target"]["arch"] = f"sm_{major}{minor}"
    retarget_toolkit(data, nvrtc_version()[0])
    data["target"]["unified_memory"] = False
    kernels = overrides.pop("kernels", {})
    data.update(overrides)
    for name, params in kernels.items():
        data["kernels"][name].update(params)
    return data


def build(profile: dict, weights: Path | None, out: Path, *, retarget: bool = False) -> Path:
    """Build a bundle with the SDK's build API; returns its folder."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile

    return build_bundle(Profile.from_dict(profile), out, weights, workers=4).path


def reference(weights: Path, x: np.ndarray, margin: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference output of x (batch, tokens, hidden) and a (batch, tokens) mask of the tokens whose
    k-th and (k+1)-th router logits differ by at least `margin` at every layer (elsewhere fp32 rounding may pick
    another expert, legitimately)."""
    engine = ReferenceEngine(weights, compute_dtype=np.float64)
    h = engine.header
    flat = x.reshape(-1, h.hidden_size).astype(np.float64)
    stable = np.ones(flat.shape[0], dtype=bool)
    for layer in range(h.num_layers):
        if h.top_k < h.num_experts:
            logits = flat @ engine.file.router(layer).astype(np.float64)
            top = -np.sort(-logits, axis=-1)
            stable &= (top[:, h.top_k - 1] - top[:, h.top_k]) >= margin
        y = engine.layer(layer, flat)
        flat = flat + y if h.composition == 1 else y
    engine.close()
    return flat.reshape(x.shape), stable.reshape(x.shape[:-1])
