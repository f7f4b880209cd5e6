"""Build a bundle: weights in the profile's dtype, compiled kernels, self-test vectors and the manifest, written
into a temporary folder and renamed into place. The layout and manifest keys: `colibri_sdk.bundle`, docs/build.md.

Reproducible: the same profile, weights, kernel sources and NVRTC give a byte-identical bundle (no timestamps or
machine paths, sorted keys and files, a seeded self-test input, the expected output computed in float64 and stored
as float32, so BLAS summation order cannot change a stored bit in practice).

Memory does not grow with the weights: the weights are copied (and hashed on the way) in CHUNK_BYTES pieces,
converted to another dtype one tensor at a time, and the self-test reads them in row chunks of at most CHUNK_BYTES
(as float64), each mapped only while it is read, so no more than one chunk of the file is resident at a time.

The parts: weights.py (copy or convert the weights, the top-k limit), selftest_vectors.py (the self-test input and
its float64 reference output), manifest_writer.py (the manifest); this module compiles each shape and puts the
bundle in place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import catalog
from ..aot.kernels import CompiledKernel, compile_catalog
from ..errors import BundleError
from ..format import ColibriFile, Header
from .manifest_writer import WEIGHTS_FILE, ShapeBuild, kernel_entry, check_launch_plan, make_manifest, shape_tag
from .reader import MANIFEST, canonical_json
from .selftest_vectors import (
    SELFTEST_ATTEMPTS,
    SELFTEST_MIN_MARGIN,
    SELFTEST_SEED,
    SELFTEST_TOLERANCE,
    reference_with_margin,
    selftest_vectors,
)
from .top_k import apply_top_k
from .weights import (
    CHUNK_BYTES,
    PROFILE_DTYPE,
    Progress,
    no_progress,
    check_top_k,
    copy_with_sha256,
    prepare_weights,
    sha256_with_progress,
)

# Re-exported: the names this module held before its parts moved to weights.py, selftest_vectors.py and
# manifest_writer.py.
__all__ = [
    "BuildResult", "CHUNK_BYTES", "PROFILE_DTYPE", "Progress", "SELFTEST_ATTEMPTS", "SELFTEST_MIN_MARGIN",
    "SELFTEST_SEED", "SELFTEST_TOLERANCE", "ShapeBuild", "WEIGHTS_FILE", "build_bundle", "check_launch_plan",
    "check_top_k", "copy_with_sha256", "make_manifest", "prepare_weights", "reference_with_margin",
    "selftest_vectors", "sha256_with_progress", "shape_tag", "write_archive",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `build_bundle` produced.

    Attributes:
        path: the bundle folder.
        manifest: its manifest.
        kernels: the compiled kernels of the largest shape (logs included), in catalogue order.
        archive: the .tar written next to the folder, or None.
        source_dtype: the storage dtype of the weights given ("fp16" | "fp32"); it differs from the manifest's
            dtype when the build converted them to the profile's dtype.
    """

    path: Path
    manifest: dict
    kernels: list[CompiledKernel]
    archive: Path | None = None
    source_dtype: str = ""

    @property
    def converted(self) -> bool:
        """The weights were converted to the profile's storage dtype (fp32 → fp16 rounds every value)."""
        return bool(self.source_dtype) and self.source_dtype != self.manifest["dtype"]


def _build_shape(root: Path, profile, header: Header, batch: int, tokens: int, tag: str, kernel_dir, workers: int,
                 progress: Progress, steps, cache=None) -> ShapeBuild:
    """Compile, plan and self-test one shape: the catalogue functions get a copy of the profile with this scalar
    shape (`Profile.for_shape`); its kernel images and self-test vectors are written under `root`."""
    sub = profile.for_shape(batch, tokens)
    kernels = compile_catalog(sub, header, kernel_dir, workers=workers, cache=cache)
    plan = catalog.launch_plan(sub.to_dict(), header)
    check_launch_plan(plan, kernels, sub)
    entries = [kernel_entry(k, profile.arch, tag) for k in kernels]
    for k, entry in zip(kernels, entries):
        (root / entry["cubin"]).write_bytes(k.output.cubin)
        (root / entry["ptx"]).write_bytes(k.output.ptx)
    where = f", batch {batch} x tokens {tokens}" if len(profile.shapes) > 1 else ""
    steps.done(f"kernels: {len(kernels)} compiled with NVRTC ({workers} workers{where})")
    folder = Path("selftest", tag) if tag else Path("selftest")
    (root / folder).mkdir(parents=True, exist_ok=True)
    x, expected, seed = selftest_vectors(root / WEIGHTS_FILE, batch, tokens, progress)
    np.save(root / folder / "input.npy", x, allow_pickle=False)
    np.save(root / folder / "output.npy", expected, allow_pickle=False)
    steps.done(f"self-test: reference output computed (seed {seed}{where})")
    rtol, atol = SELFTEST_TOLERANCE[profile.dtype]
    selftest = {"input": (folder / "input.npy").as_posix(), "output": (folder / "output.npy").as_posix(),
                "rtol": rtol, "atol": atol, "seed": seed}
    return ShapeBuild(batch, tokens, kernels, entries, plan, catalog.device_buffers(sub.to_dict(), header),
                      catalog.io_buffers(header), selftest)


# ---- the build ------------------------------------------------------------------------------------------------------
class _Steps:
    """Times each build step for the debug log."""

    def __init__(self):
        self.start = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        log.debug("%s in %.2f s", what, now - self.start)
        self.start = now


def _write_contents(
    root: Path, profile, weights: Path | None, kernel_dir: Path | None, workers: int, progress: Progress, cache=None
) -> tuple[dict, list[CompiledKernel], str]:
    """Write every bundle file under `root` and return (manifest, compiled kernels, the weights' source dtype)."""
    (root / "kernels").mkdir()
    (root / "selftest").mkdir()
    target = root / WEIGHTS_FILE
    steps = _Steps()
    digests = {}
    if weights is None:
        from ..demo import write_demo_model

        write_demo_model(target, dtype=profile.dtype)
        with ColibriFile(target) as written:
            header = written.header
        source_dtype = profile.dtype
        steps.done("weights: demo model written")
    else:
        header, digests[WEIGHTS_FILE] = prepare_weights(Path(weights), profile.dtype, target, progress)
        with ColibriFile(weights) as src:
            source_dtype = profile.dtype if catalog.is_v2(src.header) else PROFILE_DTYPE[src.header.dtype]
        verb = "copied" if source_dtype == profile.dtype else f"converted {source_dtype} → {profile.dtype}"
        steps.done(f"weights: {header.file_size:,} bytes {verb}")
        if not digests[WEIGHTS_FILE]:
            digests[WEIGHTS_FILE] = sha256_with_progress(target, progress)
            steps.done("weights: sha256")
    model_top_k = header.top_k
    overridden = apply_top_k(target, header, profile.to_dict().get("top_k"), profile.source)
    if overridden is not header:  # the header bytes changed: the digest taken while copying is stale
        header = overridden
        digests[WEIGHTS_FILE] = sha256_with_progress(target, progress)
    # The largest shape keeps the single-shape file names (it is the top-level one); the others' carry their tag.
    largest = profile.shapes[-1]
    shapes = [_build_shape(root, profile, header, b, t, "" if (b, t) == largest else shape_tag(b, t), kernel_dir,
                           workers, progress, steps, cache) for b, t in profile.shapes]
    manifest = make_manifest(profile, header, shapes, root, digests, model_top_k)
    (root / MANIFEST).write_bytes(canonical_json(manifest))
    steps.done("manifest: written")
    return manifest, shapes[-1].kernels, source_dtype


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


def _check_force(out: Path, archive: bool, force: bool) -> None:
    """Without `force`, refuse an existing bundle at `out` (an empty folder is used as it is) and an existing
    `<out>.tar` when an archive is asked for; an archive path that is a folder, a symlink or a special file is
    refused before anything is built, with `force` too.

    Raises:
        BundleError: naming what exists and that force (`--force`) replaces it (or why it is never replaced).
    """
    tar = out.with_name(out.name + ".tar")
    if archive and (tar.is_symlink() or (tar.exists() and not tar.is_file())):  # never replaced, --force or not
        raise BundleError(f"cannot write the archive {tar}: it exists and is not a regular file")
    if force:
        return
    if out.is_dir() and not out.is_symlink() and any(out.iterdir()):
        raise BundleError(f"{out} exists (a bundle); refusing to replace it without --force (or choose another -o)")
    if archive and tar.exists():
        raise BundleError(f"{tar} exists; refusing to replace the archive without --force (or choose another -o)")


def _nvrtc_cache(choice):
    """build_bundle's `nvrtc_cache` argument → an NvrtcCache or None."""
    from ..aot.cache import NvrtcCache

    if choice is True:
        return NvrtcCache()
    return choice or None


def build_bundle(
    profile,
    out: str | os.PathLike,
    weights: str | os.PathLike | None = None,
    *,
    kernel_dir: str | os.PathLike | None = None,
    archive: bool = False,
    workers: int = 2,
    force: bool = False,
    progress: Progress | None = None,
    nvrtc_cache=True,
) -> BuildResult:
    """Build a bundle for `profile` into the folder `out`.

    Args:
        profile: a validated `colibri_sdk.profile.Profile` (toolchain checked).
        out: the bundle folder: a new path or an empty folder; an earlier bundle there is replaced only with
            `force` (a folder that is not a bundle never is).
        weights: a .colibri file (converted to the profile's dtype when it is stored in another; see
            `BuildResult.converted`); None = the embedded demo model (`colibri_sdk.demo`).
        kernel_dir: folder of the kernel sources; default the packaged kernels/.
        archive: also write `<out>.tar` (reproducible); an existing one is replaced only with `force`.
        workers: parallel NVRTC compilations.
        force: replace an earlier bundle at `out` (and its archive).
        progress: called as `progress(step, done_bytes, total_bytes)` during the steps that read or write the
            weights ("weights", "sha256", "self-test"); see `Progress`.
        nvrtc_cache: True = the NVRTC cache at `colibri_sdk.aot.cache.default_cache_dir()`; an `NvrtcCache`; or
            False / None = run NVRTC for every kernel. The bundle's bytes are the same either way.

    Raises:
        CompileError: top_k above catalog.MAX_TOP_K (before compiling), NVRTC, the cubin's SM, spills, shared
            memory or the launch plan.
        FormatError: unreadable weights or fp16 overflow while converting.
        BundleError: `out` exists and is not a bundle (or holds files its manifest does not list), or is a bundle
            and `force` is False; has no file name, or its parent folder cannot be created; the archive path is
            a folder or cannot be written, or exists and `force` is False.
    """
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise BundleError(f"output {str(out)!r} is not a folder name; allowed: a path ending in the bundle's name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"cannot create the folder {out.parent} for {out}: {exc.strerror}") from exc
    _check_replaceable(out)
    _check_force(out, archive, force)
    if weights is not None:
        from ..format.support import check_kernel_support

        check_kernel_support(weights, profile.name)
        check_top_k(Path(weights))
    tmp = None
    try:  # made inside the try: a Ctrl-C / SIGTERM just after mkdtemp must remove it too
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        manifest, kernels, source_dtype = _write_contents(
            tmp, profile, weights, kernel_dir, workers, progress or no_progress, _nvrtc_cache(nvrtc_cache)
        )
        tmp.chmod(0o755)
        _place(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    tar = write_archive(out, out.with_name(out.name + ".tar")) if archive else None
    return BuildResult(out, manifest, kernels, tar, source_dtype)
