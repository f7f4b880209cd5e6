"""Synthetic bundles for the deploy tests, and a way to look at the 'device' side (this machine).

`write_bundle` writes a folder the runtime's loader accepts (`Bundle.open(path, verify=True)`): a real .colibri of
random fp16 weights sized to about `model_bytes`, kernel images of random bytes (no NVRTC: deploys only move
bytes), float32 self-test vectors, and a canonical manifest with its digest. Its self-test would not pass on a
backend: tests that run the device's self-test use `colibri-sdk build` bundles (test_real_bundle.py) or a stand-in
`--remote-colibri` command.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import numpy as np

from colibri_sdk.bundle import MANIFEST, canonical_json, manifest_digest
from colibri_sdk.format import ColibriWriter, Header
from colibri_sdk.format.constants import DTYPE_CODES

# A store root on the 'device' with spaces, quotes, `$`, backticks and $(...): nothing may expand it.
HOSTILE = "dev ice's \"$HOME\" `id` $(id)"
HIDDEN, INTERMEDIATE = 64, 128
KERNELS = ("moe_ffn", "router")
RESOURCES = {"registers": 32, "shared_bytes": 0, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_weights(path: Path, model_bytes: int, seed: int) -> Header:
    """A .colibri with as many experts (3 fp16 blocks of 64 x 128 each), and above 65535 experts layers, as make
    about `model_bytes`."""
    per_expert = 3 * HIDDEN * INTERMEDIATE * 2
    experts = min(65535, max(2, model_bytes // per_expert))
    layers = max(1, model_bytes // (per_expert * experts))
    header = Header(num_layers=layers, num_experts=experts, top_k=2, hidden_size=HIDDEN,
                    intermediate_size=INTERMEDIATE, dtype=DTYPE_CODES["fp16"])
    rng = np.random.default_rng(seed)
    shapes = {"gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
              "down_proj": (HIDDEN, INTERMEDIATE), "router": (HIDDEN, experts)}
    with ColibriWriter(path, header) as w:
        for kind, layer, expert in w.pending():
            w.write(kind, layer, expert, (rng.standard_normal(shapes[kind]) * 0.05).astype(np.float32))
    return header


def write_bundle(folder: Path, model_bytes: int = 3 << 20, kernel_seed: int = 0, model_seed: int = 0,
                 profile_name: str = "test-orin") -> Path:
    """A bundle folder: model.colibri (`model_seed`), two kernels (cubin + PTX, content from `kernel_seed`), the
    self-test vectors and manifest.json. 7 files besides the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").mkdir(exist_ok=True)
    (folder / "selftest").mkdir(exist_ok=True)
    header = write_weights(folder / "model.colibri", model_bytes, model_seed)
    krng = np.random.default_rng(1000 + kernel_seed)
    kernels = []
    for name in KERNELS:
        cubin, ptx = f"kernels/{name}.sm_87.cubin", f"kernels/{name}.ptx"
        (folder / cubin).write_bytes(b"\x7fELF" + krng.integers(0, 256, 20000, dtype=np.uint8).tobytes())
        (folder / ptx).write_bytes(f"// {name} seed {kernel_seed}\n.version 8.0\n".encode() * 200)
        kernels.append({"name": name, "source": f"{name}.cu", "symbols": [name], "cubin": cubin, "ptx": ptx,
                        "defines": {}, "resources": {name: dict(RESOURCES)}})
    rng = np.random.default_rng(model_seed)
    (folder / "selftest" / "input.npy").write_bytes(npy_bytes(rng.standard_normal((1, 8, HIDDEN), np.float32)))
    (folder / "selftest" / "output.npy").write_bytes(npy_bytes(rng.standard_normal((1, 8, HIDDEN), np.float32)))
    manifest = {
        "schema_version": 1, "sdk_version": "0.1.0", "arch": "sm_87", "compute_capability": [8, 7],
        "nvrtc_version": "12.9", "min_driver": 12020, "dtype": "fp16", "shape": {"batch": 1, "tokens": 8},
        "aggregation": "ordered", "profile": {"name": profile_name, "kernel_seed": kernel_seed},
        "weights": {"file": "model.colibri", "header": {k: v for k, v in vars(header).items() if k != "version"}},
        "kernels": kernels,
        "selftest": {"input": "selftest/input.npy", "output": "selftest/output.npy", "rtol": 0.01, "atol": 0.001},
        "files": [],
    }
    write_manifest(folder, manifest)
    return folder


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Recompute `files` from what is in `folder` and the digest, and write the canonical manifest.json (what a
    build does): for tests that change a bundle's files and want it consistent again."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        data = path.read_bytes()
        files.append({"path": path.relative_to(folder).as_posix(), "sha256": hashlib.sha256(data).hexdigest(),
                      "size": len(data)})
    manifest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["files"] = sorted(files, key=lambda e: e["path"])
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / MANIFEST).write_bytes(canonical_json(manifest))
    return manifest


def reseal(folder: Path) -> dict:
    """Re-write manifest.json of `folder` for its current files (see write_manifest)."""
    return write_manifest(folder, json.loads((folder / MANIFEST).read_text()))


def remote_tree(root: Path) -> dict:
    """{relative path: sha256} of every regular file under `root` (the 'device' side, read locally)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_store(src: Path, dst: Path) -> Path:
    """Copy the device store `src` to `dst` (which must not exist) as the agent left it: the hard links between a
    bundle's files and the store objects, the relative symlinks `current` / `previous`, modes and times (`cp -a`).
    A store records no path of its own, so the copy is the store a deploy to `dst` would have made."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True)
    return dst
