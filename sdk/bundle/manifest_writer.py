"""The manifest a build writes: one record per compiled shape (kernels, launch plan, buffers, self-test), the
files' sizes and sha256, and the digest over it all (keys and schema: `colibri_sdk.bundle`, docs/build.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import __version__
from ..aot.kernels import CompiledKernel
from ..aot.nvrtc import nvrtc_version
from ..errors import CompileError
from ..format import Header
from .reader import DIGEST_KEY, SCHEMA_VERSION, check_schema, file_sha256, header_record, manifest_digest

WEIGHTS_FILE = "model.colibri"


def check_launch_plan(plan: list[dict], kernels: list[CompiledKernel], profile) -> None:
    """Every launch names a compiled symbol, and its static + dynamic shared memory fits the profile.

    Raises:
        CompileError: naming the launch, the value and the limit.
    """
    resources = {k.spec.name: k.resources for k in kernels}
    hw = profile.hardware
    for index, launch in enumerate(plan):
        kernel, symbol = launch["kernel"], launch["symbol"]
        if symbol not in resources.get(kernel, {}):
            raise CompileError(f"launch {index}: {kernel}.{symbol} was not compiled; compiled: {sorted(resources)}")
        total = resources[kernel][symbol]["shared_bytes"] + launch["shared_bytes"]
        limit = hw["shared_memory_per_block_optin"] if launch["shared_bytes"] else hw["shared_memory_per_block"]
        if total > limit:
            raise CompileError(
                f"launch {index} ({symbol}): {total} bytes of shared memory; allowed: at most {limit} "
                f"(hardware.shared_memory_per_block{'_optin' if launch['shared_bytes'] else ''})"
            )


def shape_tag(batch: int, tokens: int) -> str:
    """The file-name tag of one compiled shape: "b4t16" (kernels/<name>.b4t16.<arch>.cubin, selftest/b4t16/)."""
    return f"b{int(batch)}t{int(tokens)}"


def kernel_entry(k: CompiledKernel, arch: str, tag: str = "") -> dict:
    """The manifest entry of one compiled kernel; `tag` (a `shape_tag`; "" for the largest shape, which keeps the
    single-shape names) goes into the file names so the shapes' images sit side by side in kernels/."""
    stem = f"kernels/{k.spec.name}" + (f".{tag}" if tag else "")
    return {
        "name": k.spec.name,
        "source": k.spec.source,
        "symbols": list(k.spec.symbols),
        "cubin": f"{stem}.{arch}.cubin",
        "ptx": f"{stem}.ptx",
        "defines": dict(sorted(k.defines.items())),
        "resources": {s: k.resources[s] for s in sorted(k.resources)},
        "inputs": k.inputs,  # what `verify --rebuild` compiles again (sdk/aot/rebuild.py)
    }


@dataclasses.dataclass(frozen=True)
class ShapeBuild:
    """What one compiled shape of a bundle holds (one `shapes` entry of the manifest).

    Attributes:
        batch, tokens: the fixed shape.
        kernels: the catalogue compiled with this shape's -D defines.
        entries: their manifest entries (`kernel_entry`, file names tagged when the bundle has several shapes).
        plan: `catalog.launch_plan` for this shape.
        buffers, io_buffers: `catalog.device_buffers` / `catalog.io_buffers` for this shape.
        selftest: the manifest's self-test record ({input, output, rtol, atol, seed}).
    """

    batch: int
    tokens: int
    kernels: list
    entries: list
    plan: list
    buffers: dict
    io_buffers: dict
    selftest: dict

    def record(self) -> dict:
        """The manifest's `shapes` entry (docs/build.md, "Several shapes")."""
        return {"batch": self.batch, "tokens": self.tokens, "kernels": self.entries, "launch": self.plan,
                "buffers": self.buffers, "io_buffers": self.io_buffers, "selftest": self.selftest}


def make_manifest(
    profile,
    header: Header,
    shapes: list[ShapeBuild],
    root: Path,
    digests: dict[str, str] | None = None,
    model_top_k: int | None = None,
) -> dict:
    """The manifest for the files already written under `root` (everything except manifest.json).

    Args:
        shapes: every compiled shape, smallest first (`Profile.shapes`); the top-level `shape`, `kernels`,
            `launch`, `buffers`, `io_buffers` and `selftest` are the last (largest) one's, so a reader of
            single-shape bundles runs that shape, and `shapes` lists them all.
        digests: sha256 already computed, by relative path (the weights, hashed while copied); the other files
            are hashed here.
        model_top_k: the source model's own k, recorded as `weights.model_top_k` (it differs from the header's
            top_k under a top-k override, sdk/bundle/top_k.py).
    """
    major, minor = nvrtc_version()
    pdict = profile.to_dict()
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        digest = (digests or {}).get(rel) or file_sha256(path)
        files.append({"path": rel, "sha256": digest, "size": path.stat().st_size})
    files.sort(key=lambda e: e["path"])
    largest = shapes[-1]
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "sdk_version": __version__,
        "arch": profile.arch,
        "compute_capability": list(profile.compute_capability),
        "nvrtc_version": f"{major}.{minor}",
        "min_driver": profile.min_driver,
        "dtype": profile.dtype,
        "shape": {"batch": largest.batch, "tokens": largest.tokens},
        "shapes": [s.record() for s in shapes],
        "aggregation": profile.aggregation,
        "profile": pdict,
        "weights": {"file": WEIGHTS_FILE, "header": header_record(header),
                    "model_top_k": header.top_k if model_top_k is None else int(model_top_k)},
        "kernels": largest.entries,
        "launch": largest.plan,
        "buffers": largest.buffers,
        "io_buffers": largest.io_buffers,
        "selftest": largest.selftest,
        "files": files,
    }
    manifest[DIGEST_KEY] = manifest_digest(manifest)
    check_schema(manifest, "the new manifest")
    return manifest
