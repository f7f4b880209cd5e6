"""Build a bundle: weights in the profile's dtype, compiled kernels, self-test vectors and the manifest, written
into a temporary folder and renamed into place. The layout and manifest keys: `colibri_sdk.bundle`, docs/build.md.

Reproducible: the same profile, weights, kernel sources and NVRTC give a byte-identical bundle (no timestamps or
machine paths, sorted keys and files, a seeded self-test input, the expected output computed in float64 and stored
as float32, so BLAS summation order cannot change a stored bit in practice).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from .. import __version__, catalog
from .reader import (
    DIGEST_KEY,
    MANIFEST,
    SCHEMA_VERSION,
    canonical_json,
    check_schema,
    file_sha256,
    manifest_digest,
)
from ..errors import BundleError, CompileError, FormatError
from ..format import ColibriFile, ColibriWriter, Header
from ..format.constants import COMPOSITION_RESIDUAL, DTYPE_CODES
from ..format.writer import tensor_order
from ..aot.kernels import CompiledKernel, compile_catalog
from ..aot.nvrtc import nvrtc_version
from .top_k import apply_top_k

WEIGHTS_FILE = "model.colibri"
SELFTEST_SEED = 20261130
SELFTEST_ATTEMPTS = 32
SELFTEST_MIN_MARGIN = 1e-3  # smallest gap between the k-th and (k+1)-th router logit the self-test input may have
# Self-test tolerances per dtype: |actual - expected| <= atol + rtol * |expected|. The expected output is exact
# (float64) on the stored weights; the GPU accumulates in fp32, and fp16 profiles may round activations to fp16.
SELFTEST_TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2)}


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `build_bundle` produced.

    Attributes:
        path: the bundle folder.
        manifest: its manifest.
        kernels: the compiled kernels (logs included), in catalogue order.
        archive: the .tar written next to the folder, or None.
    """

    path: Path
    manifest: dict
    kernels: list[CompiledKernel]
    archive: Path | None = None


# ---- weights --------------------------------------------------------------------------------------------------------
def prepare_weights(source: Path, dtype: str, target: Path) -> Header:
    """Put the weights into the bundle in the profile's dtype: copied when the dtype matches, else converted
    tensor by tensor.

    Returns:
        The header of the bundle's weights.

    Raises:
        FormatError: the source is not a valid .colibri file, or converting to fp16 overflows (|x| > 65504).
    """
    with ColibriFile(source) as src:
        header = src.header
        code = DTYPE_CODES[dtype]
        if header.dtype == code:
            shutil.copyfile(source, target)
            return header
        out = dataclasses.replace(header, dtype=code)
        try:
            with ColibriWriter(target, out) as writer:
                for kind, layer, expert in tensor_order(out):
                    writer.write(kind, layer, expert, src.tensor(kind, layer, expert))
        except FormatError as exc:
            raise FormatError(f"{source} → {dtype} for the profile: {exc}; use a profile with dtype: fp32") from None
    return out


# ---- self-test ------------------------------------------------------------------------------------------------------
def reference_with_margin(weights: ColibriFile, x: np.ndarray) -> tuple[np.ndarray, float]:
    """The reference engine's forward pass in float64, and the smallest gap between the k-th and (k+1)-th largest
    router logit over all tokens and layers (inf when top_k == num_experts).

    Args:
        x: (batch, tokens, hidden) float32.

    Returns:
        (output float64 of x's shape, margin).
    """
    from ..reference import ReferenceEngine

    h = weights.header
    engine = ReferenceEngine(weights, compute_dtype=np.float64)
    state = engine.check_input(x)
    margin = np.inf
    for layer in range(h.num_layers):
        if h.top_k < h.num_experts:
            logits = np.sort(state @ weights.router(layer).astype(np.float64), axis=-1)[:, ::-1]
            margin = min(margin, float((logits[:, h.top_k - 1] - logits[:, h.top_k]).min()))
        y = engine.layer(layer, state)
        state = state + y if h.composition == COMPOSITION_RESIDUAL else y
    return state.reshape(x.shape), margin


def selftest_vectors(weights_path: Path, batch: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A seeded input and the reference engine's output for it.

    The input is N(0, 1) from NumPy's PCG64 with seed SELFTEST_SEED + attempt, for the first attempt whose router
    logits leave a gap of at least SELFTEST_MIN_MARGIN at the top-k boundary in every layer, so rounding
    differences between backends cannot flip an expert choice (else the attempt with the largest gap).
    The output is computed in float64 and rounded to float32.

    Returns:
        (input float32 (batch, tokens, hidden), output float32 (batch, tokens, hidden), seed used).
    """
    with ColibriFile(weights_path) as weights:
        hidden = weights.header.hidden_size
        best = None
        for attempt in range(SELFTEST_ATTEMPTS):
            seed = SELFTEST_SEED + attempt
            x = np.random.default_rng(seed).standard_normal((batch, tokens, hidden)).astype(np.float32)
            y, margin = reference_with_margin(weights, x)
            if best is None or margin > best[0]:
                best = (margin, x, y, seed)
            if margin >= SELFTEST_MIN_MARGIN:
                break
    _, x, y, seed = best
    return x, y.astype(np.float32), seed


# ---- manifest -------------------------------------------------------------------------------------------------------
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


def _kernel_entry(k: CompiledKernel, arch: str) -> dict:
    return {
        "name": k.spec.name,
        "source": k.spec.source,
        "symbols": list(k.spec.symbols),
        "cubin": f"kernels/{k.spec.name}.{arch}.cubin",
        "ptx": f"kernels/{k.spec.name}.ptx",
        "defines": dict(sorted(k.defines.items())),
        "resources": {s: k.resources[s] for s in sorted(k.resources)},
    }


def make_manifest(
    profile, header: Header, kernels: list[CompiledKernel], plan: list[dict], root: Path, selftest: dict,
    model_top_k: int | None = None,
) -> dict:
    """The manifest for the files already written under `root` (everything except manifest.json).

    `model_top_k`: the source model's own k, recorded as `weights.model_top_k` (differs from the header's top_k
    under a top-k override, sdk/bundle/top_k.py)."""
    major, minor = nvrtc_version()
    pdict = profile.to_dict()
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        files.append({"path": rel, "sha256": file_sha256(path), "size": path.stat().st_size})
    files.sort(key=lambda e: e["path"])
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "sdk_version": __version__,
        "arch": profile.arch,
        "compute_capability": list(profile.compute_capability),
        "nvrtc_version": f"{major}.{minor}",
        "min_driver": profile.min_driver,
        "dtype": profile.dtype,
        "shape": dict(pdict["shape"]),
        "aggregation": profile.aggregation,
        "profile": pdict,
        "weights": {"file": WEIGHTS_FILE, "header": dataclasses.asdict(header),
                    "model_top_k": header.top_k if model_top_k is None else int(model_top_k)},
        "kernels": [_kernel_entry(k, profile.arch) for k in kernels],
        "launch": plan,
        "selftest": selftest,
        "files": files,
    }
    manifest[DIGEST_KEY] = manifest_digest(manifest)
    check_schema(manifest, "the new manifest")
    return manifest


# ---- the build ------------------------------------------------------------------------------------------------------
def _write_contents(root: Path, profile, weights: Path | None, kernel_dir: Path | None, workers: int):
    """Write every bundle file under `root` and return (manifest, compiled kernels)."""
    (root / "kernels").mkdir()
    (root / "selftest").mkdir()
    target = root / WEIGHTS_FILE
    if weights is None:
        from ..demo import write_demo_model

        write_demo_model(target, dtype=profile.dtype)
        with ColibriFile(target) as written:
            header = written.header
    else:
        header = prepare_weights(Path(weights), profile.dtype, target)
    model_top_k = header.top_k
    header = apply_top_k(target, header, profile.to_dict().get("top_k"), profile.source)
    kernels = compile_catalog(profile, header, kernel_dir, workers=workers)
    plan = catalog.launch_plan(profile.to_dict(), header)
    check_launch_plan(plan, kernels, profile)
    for k in kernels:
        entry = _kernel_entry(k, profile.arch)
        (root / entry["cubin"]).write_bytes(k.output.cubin)
        (root / entry["ptx"]).write_bytes(k.output.ptx)
    batch, tokens = profile.shape
    x, expected, seed = selftest_vectors(target, batch, tokens)
    np.save(root / "selftest" / "input.npy", x, allow_pickle=False)
    np.save(root / "selftest" / "output.npy", expected, allow_pickle=False)
    rtol, atol = SELFTEST_TOLERANCE[profile.dtype]
    selftest = {"input": "selftest/input.npy", "output": "selftest/output.npy", "rtol": rtol, "atol": atol,
                "seed": seed}
    manifest = make_manifest(profile, header, kernels, plan, root, selftest, model_top_k)
    (root / MANIFEST).write_bytes(canonical_json(manifest))
    return manifest, kernels


def _check_replaceable(out: Path) -> None:
    """`out` may be replaced only if it is missing, an empty folder, or a bundle holding nothing but its manifest
    and the files it lists (so a folder that merely has a manifest.json, or a bundle someone added files to, is
    never deleted).

    Raises:
        BundleError: naming why `out` is not replaceable.
    """
    refuse = f"{out} exists and is not a bundle; refusing to replace it (choose another -o)"
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise BundleError(refuse)
    if not any(out.iterdir()):
        return
    from .reader import Bundle

    try:
        manifest = Bundle.open(out, verify=False).manifest
    except BundleError as exc:
        raise BundleError(f"{refuse}: {exc}") from None
    listed = {entry["path"] for entry in manifest["files"]} | {MANIFEST}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if rel not in listed and not (path.is_dir() and not path.is_symlink()):
            raise BundleError(f"{refuse}: {rel} is not one of its files")


def _place(tmp: Path, out: Path) -> None:
    """Rename the finished bundle into place, replacing an earlier bundle (never a folder that is not one)."""
    if out.exists():
        _check_replaceable(out)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def write_archive(folder: Path, archive: Path) -> Path:
    """A reproducible .tar of the bundle: members `<folder name>/...` sorted, mtime 0, uid/gid 0, no user names,
    modes 0644 (files) and 0755 (folders)."""

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    partial = archive.with_name(archive.name + ".partial")
    for target in (archive, partial):
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise BundleError(f"cannot write the archive {target}: it exists and is not a regular file")
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            paths = [folder] + sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).as_posix())
            for path in paths:
                name = Path(folder.name, path.relative_to(folder)).as_posix() if path != folder else folder.name
                tar.add(path, arcname=name, recursive=False, filter=normalise)
        os.replace(partial, archive)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise BundleError(f"cannot write the archive {archive}: {exc.strerror or exc}") from exc
    return archive


def build_bundle(
    profile,
    out: str | os.PathLike,
    weights: str | os.PathLike | None = None,
    *,
    kernel_dir: str | os.PathLike | None = None,
    archive: bool = False,
    workers: int = 2,
) -> BuildResult:
    """Build a bundle for `profile` into the folder `out`.

    Args:
        profile: a validated `colibri_sdk.profile.Profile` (toolchain checked).
        out: the bundle folder; replaced if it holds an earlier bundle.
        weights: a .colibri file; None = the embedded demo model (`colibri_sdk.demo`).
        kernel_dir: folder of the kernel sources; default the packaged kernels/.
        archive: also write `<out>.tar` (reproducible).
        workers: parallel NVRTC compilations.

    Raises:
        CompileError: NVRTC, the cubin's SM, spills, shared memory or the launch plan.
        FormatError: unreadable weights or fp16 overflow while converting.
        BundleError: `out` exists and is not a bundle (or holds files its manifest does not list), has no file
            name, or its parent folder cannot be created; the archive path is a folder or cannot be written.
    """
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise BundleError(f"output {str(out)!r} is not a folder name; allowed: a path ending in the bundle's name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"cannot create the folder {out.parent} for {out}: {exc.strerror}") from exc
    _check_replaceable(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest, kernels = _write_contents(tmp, profile, weights, kernel_dir, workers)
        tmp.chmod(0o755)
        _place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tar = write_archive(out, out.with_name(out.name + ".tar")) if archive else None
    return BuildResult(out, manifest, kernels, tar)
