"""Helpers for tests/robustness: a tiny synthetic checkpoint, a small bundle, manifest tampering, CLI capture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from colibri_sdk import cli
from colibri_sdk.bundle import MANIFEST, canonical_json, file_sha256, manifest_digest
from colibri_sdk.format import Header, write_model

# A Mixtral-style checkpoint: 1 layer, 2 experts, top-1, hidden 4, intermediate 8 (safetensors, float32), the one
# bench/fuzz.py mutates; write_checkpoint(folder, **config) overrides config.json keys.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fuzzing.checkpoints import CONFIG, PREFIX  # noqa: E402,F401
from fuzzing.checkpoints import checkpoint_base as write_checkpoint  # noqa: E402,F401


# A small model for bundles: 1 layer, 6 experts, top-2, hidden 64, intermediate 96, fp16.
SMALL = Header(num_layers=1, num_experts=6, top_k=2, hidden_size=64, intermediate_size=96, dtype=1)


def write_small_model(path: Path) -> Path:
    h = SMALL
    L, E, H, I = h.num_layers, h.num_experts, h.hidden_size, h.intermediate_size
    rng = np.random.default_rng(5)
    return write_model(
        path, h,
        rng.standard_normal((L, E, I, H)) / np.sqrt(H),
        rng.standard_normal((L, E, I, H)) / np.sqrt(H),
        rng.standard_normal((L, E, H, I)) / np.sqrt(I),
        rng.standard_normal((L, H, E)),
    )


def load_manifest(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


def save_manifest(bundle: Path, manifest: dict, *, rehash: tuple[str, ...] = ()) -> None:
    """Write `manifest` as a consistent one: the files in `rehash` get their size and sha256 recorded again, and the
    digest is recomputed (what a careful forger would do; the checks below must not rely on the digest)."""
    for entry in manifest["files"]:
        if entry["path"] in rehash:
            entry["size"] = (bundle / entry["path"]).stat().st_size
            entry["sha256"] = file_sha256(bundle / entry["path"])
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (bundle / MANIFEST).write_bytes(canonical_json(manifest))


def cli_error(capsys, *argv: str) -> str:
    """Run `colibri-sdk ARGV` in-process; it must exit 1 with one line on stderr. Returns that line."""
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 1, f"exit code {code}, stderr: {err}"
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()
