"""Synthetic bundles for the deploy tests, and a way to look at the 'device' side (this machine)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

# A store root on the 'device' with spaces, quotes, `$`, backticks and $(...): nothing may expand it.
HOSTILE = "dev ice's \"$HOME\" `id` $(id)"


def write_bundle(folder: Path, model_bytes: int = 3 << 20, kernel_seed: int = 0, model_seed: int = 0) -> Path:
    """A bundle folder per the bundle contract: manifest.json with the `files` list, a model.colibri of
    `model_bytes` random bytes (`model_seed`), two kernels (cubin + PTX, content from `kernel_seed`) and the
    self-test vectors."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(model_seed)
    contents = {"model.colibri": rng.integers(0, 256, model_bytes, dtype=np.uint8).tobytes()}
    krng = np.random.default_rng(1000 + kernel_seed)
    for name in ("moe_ffn", "router"):
        contents[f"kernels/{name}.sm_87.cubin"] = b"\x7fELF" + krng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
        contents[f"kernels/{name}.ptx"] = f"// {name} seed {kernel_seed}\n.version 8.0\n".encode() * 200
    contents["selftest/input.npy"] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    contents["selftest/output.npy"] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    files = []
    for rel, data in sorted(contents.items()):
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    manifest = {"schema_version": 1, "arch": "sm_87", "dtype": "fp16", "shape": {"batch": 1, "tokens": 8},
                "kernel_seed": kernel_seed, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    return folder


def remote_tree(root: Path) -> dict:
    """{relative path: sha256} of every regular file under `root` (the 'device' side, read locally)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
