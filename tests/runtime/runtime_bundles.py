"""Bundles for the runtime tests (fixtures in conftest.py).

`small_bundle` and `demo_bundle` are built by `colibri-sdk build` (NVRTC, no GPU). `write_bundle` writes a bundle
folder by the bundle contract without kernels (the CPU backend needs none), for a model too large to build in a
test: a sparse 1 GiB file whose weights are never read. `write_manifest` regenerates a manifest's file list and
digest after a test changed a file.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np

from colibri_sdk.bundle import DIGEST_KEY, canonical_json, file_sha256, manifest_digest
from colibri_sdk.cli import main
from colibri_sdk.format import ColibriFile, Header
from colibri_sdk.format.constants import COMPOSITION_SEQUENTIAL, ROUTING_SOFTMAX_TOPK
from colibri_sdk.reference import ReferenceEngine

TOLERANCES = {"fp16": (1e-3, 1e-3), "fp32": (1e-4, 1e-5)}


def write_manifest(folder: Path, manifest: dict, digests: dict[str, str] | None = None) -> None:
    """(Re)write manifest.json listing every file in `folder` with its size and sha256 (or the given digest)."""
    digests = digests or {}
    files = []
    for full in sorted(folder.rglob("*")):
        rel = full.relative_to(folder).as_posix()
        if full.is_dir() or rel == "manifest.json":
            continue
        sha = digests.get(rel) or file_sha256(full)
        files.append({"path": rel, "sha256": sha, "size": full.stat().st_size})
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    body["files"] = sorted(files, key=lambda e: e["path"])
    body[DIGEST_KEY] = manifest_digest(body)
    (folder / "manifest.json").write_bytes(canonical_json(body))


def write_bundle(
    folder: Path,
    weights: Path,
    batch: int,
    tokens: int,
    *,
    seed: int = 7,
    expected: np.ndarray | None = None,
    weights_sha256: str | None = None,
) -> Path:
    """Write a CPU-only bundle for `weights` at the fixed shape (batch, tokens).

    The self-test input is N(0, 1) from `seed`; its expected output is the float64 reference engine's, unless
    `expected` is given. `weights_sha256` moves the weights into the bundle and records that digest
    without hashing them (for huge sparse files opened with verify=False).
    """
    folder.mkdir(parents=True)
    with ColibriFile(weights) as f:
        header = f.header
    if weights_sha256 is None:
        shutil.copyfile(weights, folder / "model.colibri")
    else:
        os.replace(weights, folder / "model.colibri")
    dtype = "fp16" if header.dtype == 1 else "fp32"
    x = np.random.default_rng(seed).standard_normal((batch, tokens, header.hidden_size)).astype(np.float32)
    if expected is None:
        engine = ReferenceEngine(folder / "model.colibri", compute_dtype=np.float64)
        expected = engine(x).astype(np.float32)
        engine.close()
    (folder / "selftest").mkdir()
    np.save(folder / "selftest" / "input.npy", x)
    np.save(folder / "selftest" / "output.npy", expected)
    rtol, atol = TOLERANCES[dtype]
    raw = {k: getattr(header, k) for k in ("num_layers", "num_experts", "top_k", "hidden_size",
                                           "intermediate_size", "dtype", "routing", "composition")}
    manifest = {
        "schema_version": 1,
        "sdk_version": "0.1.0",
        "arch": "sm_87",
        "compute_capability": [8, 7],
        "nvrtc_version": "12.9",
        "min_driver": 12020,
        "dtype": dtype,
        "shape": {"batch": batch, "tokens": tokens},
        "aggregation": "ordered",
        "profile": {"name": "runtime-tests", "dtype": dtype, "shape": {"batch": batch, "tokens": tokens}},
        "weights": {"file": "model.colibri", "header": raw},
        "kernels": [],
        "selftest": {"input": "selftest/input.npy", "output": "selftest/output.npy", "rtol": rtol, "atol": atol},
        "files": [],
    }
    write_manifest(folder, manifest, {"model.colibri": weights_sha256} if weights_sha256 else None)
    return folder


SMALL = Header(num_layers=2, num_experts=6, top_k=2, hidden_size=64, intermediate_size=96, dtype=1,
               routing=ROUTING_SOFTMAX_TOPK, composition=COMPOSITION_SEQUENTIAL)


ORIN = Path(__file__).resolve().parents[2] / "profiles" / "orin.yaml"


def build(out: Path, profile: Path, weights: Path | None = None) -> Path:
    """`colibri-sdk build --profile PROFILE (--weights WEIGHTS | --demo) -o OUT`."""
    model = ["--weights", str(weights)] if weights else ["--demo"]
    args = ["build", "--profile", str(profile), "-o", str(out), *model]
    assert main(args) == 0, f"colibri-sdk {' '.join(args)} failed"
    return out


def profile_with_shape(folder: Path, batch: int, tokens: int) -> Path:
    """A copy of profiles/orin.yaml with another fixed shape."""
    text = ORIN.read_text()
    text, n1 = re.subn(r"(?m)^  batch: [^#\n]+", f"  batch: {batch} ", text)
    text, n2 = re.subn(r"(?m)^  tokens: [^#\n]+", f"  tokens: {tokens} ", text)
    assert n1 == n2 == 1, "profiles/orin.yaml no longer has shape.batch / shape.tokens lines"
    path = folder / f"orin-{batch}x{tokens}.yaml"
    path.write_text(text)
    return path
