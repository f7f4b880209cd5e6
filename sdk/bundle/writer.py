"""Build a bundle: weights in the profile's dtype, compiled kernels, self-test vectors and the manifest, written
into a temporary folder and renamed into place. The layout and manifest keys: `colibri_sdk.bundle`, docs/build.md.

Reproducible: the same profile, weights, kernel sources and NVRTC give a byte-identical bundle (no timestamps or
machine paths, sorted keys and files, a seeded self-test input, the expected output computed in float64 and stored
as float32, so BLAS summation order cannot change a stored bit in practice).

Memory does not grow with the weights: the weights are copied (and hashed on the way) in CHUNK_BYTES pieces,
converted to another dtype one tensor at a time, and the self-test reads them in row chunks of at most CHUNK_BYTES
(as float64), each mapped only while it is read, so no more than one chunk of the file is resident at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__, catalog
from .reader import (
    header_record,
    DIGEST_KEY,
    MANIFEST,
    SCHEMA_VERSION,
    canonical_json,
    check_schema,
    file_sha256,
    manifest_digest,
)
from ..errors import BundleError, CompileError, FormatError
from ..format import ColibriFile, ColibriWriter, Header, HeaderV2
from ..format.constants import COMPOSITION_RESIDUAL, DTYPE_CODES
from ..format.writer import tensor_order
from ..aot.kernels import CompiledKernel, compile_catalog
from ..aot.nvrtc import nvrtc_version
from .top_k import apply_top_k
from ..blas import blas_threads
from ..reference import silu, topk_route

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.colibri"
SELFTEST_SEED = 20261130
SELFTEST_ATTEMPTS = 32
SELFTEST_MIN_MARGIN = 1e-3  # smallest gap between the k-th and (k+1)-th router logit the self-test input may have
# Self-test tolerances per dtype: |actual - expected| <= atol + rtol * |expected|. The expected output is exact
# (float64) on the stored weights; the GPU accumulates in fp32, and fp16 profiles may round activations to fp16.
SELFTEST_TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2)}
PROFILE_DTYPE = {code: name for name, code in DTYPE_CODES.items()}  # header dtype code -> "fp16" | "fp32"
CHUNK_BYTES = 8 << 20  # the most bytes of weights (copy) or of float64 weights (self-test) held at a time

Progress = Callable[[str, int, int], None]
"""`progress(step, done, total)`: `done` of `total` bytes of the build step `step` ("weights", "sha256",
"self-test") are finished. Called repeatedly with `done` growing; a step starts again at 0 under a new name."""


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


def _no_progress(step: str, done: int, total: int) -> None:
    pass


# ---- weights --------------------------------------------------------------------------------------------------------
def copy_with_sha256(source: Path, target: Path, progress: Progress = _no_progress, step: str = "weights") -> str:
    """Copy `source` to `target` in CHUNK_BYTES pieces (one buffer, reused) and return the sha256 (hex) of what
    was written, so the bundle's largest file is read once for both.

    Raises:
        OSError: reading or writing failed.
    """
    total = source.stat().st_size
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    done = 0
    progress(step, 0, total)
    with open(source, "rb") as src, open(target, "wb") as dst:
        while True:
            n = src.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            dst.write(view[:n])
            done += n
            progress(step, done, total)
    return digest.hexdigest()


def sha256_with_progress(path: Path, progress: Progress = _no_progress, step: str = "sha256") -> str:
    """sha256 (hex) of a file, read in CHUNK_BYTES pieces, reporting progress."""
    total = path.stat().st_size
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    done = 0
    progress(step, 0, total)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            done += n
            progress(step, done, total)
    return digest.hexdigest()


def prepare_weights(source: Path, dtype: str, target: Path, progress: Progress = _no_progress) -> tuple[Header, str]:
    """Put the weights into the bundle in the profile's dtype: copied when the dtype matches, else converted
    tensor by tensor (each source tensor mapped only while it is converted).

    Returns:
        (the header of the bundle's weights, the sha256 of the copied file or "" when converted).

    Raises:
        FormatError: the source is not a valid .colibri file, or converting to fp16 overflows (|x| > 65504).
    """
    with ColibriFile(source) as src:
        header = src.header
    code = DTYPE_CODES[dtype]
    # v2 weights are copied as they are: the kernels follow the file's storage (fp16/fp32 matrices, int8/int4 codes
    # with fp16 or fp32 scales); the profile's dtype applies to v1 weights (docs/kernels.md, "Quantized weights",
    # "Model features").
    if header.dtype == code or catalog.is_v2(header):
        try:
            digest = copy_with_sha256(source, target, progress)
        except OSError as exc:
            raise FormatError(f"cannot copy {source} into the bundle: {exc.strerror or exc}") from exc
        with ColibriFile(target) as copied:  # what was copied, checked again (the source may have changed)
            return copied.header, digest
    out = dataclasses.replace(header, dtype=code)
    log.debug("converting %s from %s to the profile's %s", source, PROFILE_DTYPE[header.dtype], dtype)
    total, done = header.data_size, 0
    progress("weights", 0, total)
    try:
        with ColibriWriter(target, out) as writer:
            for kind, layer, expert in tensor_order(out):
                # A fresh mapping per tensor: the source's pages leave the resident set when it is closed.
                with ColibriFile(source) as src:
                    writer.write(kind, layer, expert, src.tensor(kind, layer, expert))
                rows, cols = header.shape(kind)
                done += rows * cols * header.itemsize
                progress("weights", done, total)
    except FormatError as exc:
        raise FormatError(f"{source} → {dtype} for the profile: {exc}; use a profile with dtype: fp32") from None
    return out, ""


def check_top_k(weights: Path) -> None:
    """Refuse weights whose top-k exceeds what the kernels are compiled for, before anything is copied or compiled.

    Raises:
        CompileError: top_k > catalog.MAX_TOP_K, or num_experts > catalog.MAX_EXPERTS, naming the value and the limit.
        FormatError: the file is not a valid .colibri file.
    """
    with ColibriFile(weights) as f:
        top_k, experts = f.header.top_k, f.header.num_experts
    if experts > catalog.MAX_EXPERTS:
        raise CompileError(
            f"{weights}: num_experts = {experts}; allowed: 1..{catalog.MAX_EXPERTS} (MAX_EXPERTS, the most experts per "
            "layer the kernels are compiled for)"
        )
    if top_k > catalog.MAX_TOP_K:
        raise CompileError(
            f"{weights}: top_k = {top_k}; allowed: 1..{catalog.MAX_TOP_K} (MAX_TOP_K, the most experts per token the "
            "kernels are compiled for)"
        )


# ---- self-test ------------------------------------------------------------------------------------------------------
class _RowChunks:
    """Row chunks of a .colibri file's tensors as float64, each chunk read through a mapping opened and closed for
    it alone, so at most one chunk of the file is resident at a time (the page cache keeps the rest for the OS)."""

    def __init__(self, path: Path):
        self.path = path
        with ColibriFile(path) as f:
            self.header = f.header

    def read(self, kind: str, layer: int, expert: int | None, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of one tensor, float64 (a copy; int8/int4 matrices dequantized exactly)."""
        with ColibriFile(self.path) as f:
            if catalog.quant(self.header) and kind != "router":
                return f.weight(kind, layer, expert, rows=np.arange(start, stop)).astype(np.float64)
            view = f.tensor(kind, layer, expert)[start:stop]
            rows = view.astype(np.float64)
            del view
        return rows

    def chunks(self, kind: str) -> list[tuple[int, int]]:
        """(start, stop) row ranges of a `kind` tensor, each at most CHUNK_BYTES as float64."""
        rows, cols = self.header.shape(kind)
        step = max(1, CHUNK_BYTES // (cols * 8))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _expert_forward(weights: _RowChunks, layer: int, expert: int, xs: np.ndarray) -> np.ndarray:
    """One SwiGLU expert in float64 on xs (n, hidden): down(silu(gate(xs)) * up(xs)), as in colibri_sdk.reference,
    with gate/up read in chunks of intermediate rows and down in chunks of hidden rows."""
    h = weights.header
    act = np.empty((xs.shape[0], h.intermediate_size), dtype=np.float64)
    for start, stop in weights.chunks("gate_proj"):
        gate = weights.read("gate_proj", layer, expert, start, stop)
        up = weights.read("up_proj", layer, expert, start, stop)
        act[:, start:stop] = silu(xs @ gate.T) * (xs @ up.T)
    y = np.empty((xs.shape[0], h.hidden_size), dtype=np.float64)
    for start, stop in weights.chunks("down_proj"):
        y[:, start:stop] = act @ weights.read("down_proj", layer, expert, start, stop).T
    return y


def reference_with_margin(
    weights: _RowChunks, x: np.ndarray, progress: Progress = _no_progress, step: str = "self-test"
) -> tuple[np.ndarray, float]:
    """The reference engine's forward pass (docs/format.md, "Semantics"; colibri_sdk.reference) in float64, read
    in chunks, and the smallest gap between the k-th and (k+1)-th largest router logit over all tokens and layers
    (inf when top_k == num_experts).

    Args:
        x: (batch, tokens, hidden) float32.

    Returns:
        (output float64 of x's shape, margin).
    """
    h = weights.header
    if _needs_v2_semantics(h):
        return _reference_v2(weights.path, x, progress, step)
    state = x.reshape(-1, h.hidden_size).astype(np.float64)
    expert_bytes = sum(int(np.prod(h.shape(k))) for k in ("gate_proj", "up_proj", "down_proj")) * h.itemsize
    total, done = h.num_layers * h.num_experts * expert_bytes, 0
    progress(step, 0, total)
    margin = np.inf
    for layer in range(h.num_layers):
        logits = state @ weights.read("router", layer, None, 0, h.hidden_size)
        if h.top_k < h.num_experts:
            ordered = np.sort(logits, axis=-1)[:, ::-1]
            margin = min(margin, float((ordered[:, h.top_k - 1] - ordered[:, h.top_k]).min()))
        indices, routing = topk_route(logits, h.top_k, h.routing)
        y = np.zeros_like(state)
        for expert in range(h.num_experts):
            tokens, slots = np.nonzero(indices == expert)
            if tokens.size:
                # Each (token, expert) pair occurs once, so this scatter has no duplicate indices.
                y[tokens] += routing[tokens, slots][:, None] * _expert_forward(weights, layer, expert, state[tokens])
            done += expert_bytes
            progress(step, done, total)
        state = state + y if h.composition == COMPOSITION_RESIDUAL else y
    return state.reshape(x.shape), margin


def _needs_v2_semantics(header: Header) -> bool:
    """True for a v2 header with routing or expert features beyond v1 (the int8/int4 storage alone is read by the
    chunked v1 path above, which dequantizes exactly)."""
    if not isinstance(header, HeaderV2):
        return False
    return bool(dataclasses.replace(header, quant=0, group_size=0, zero_points=0).v1_gaps()) or bool(header.norm_topk)


def _reference_v2(
    path: Path, x: np.ndarray, progress: Progress = _no_progress, step: str = "self-test"
) -> tuple[np.ndarray, float]:
    """`reference_with_margin` for a file with v2 features: the reference engine in float64 (docs/format.md
    "Semantics v2"; it reads one expert at a time), the margin taken at every selection boundary
    (`colibri_sdk.reference.selection_margin`: group scores and the k-th score)."""
    from ..reference import ReferenceEngine, selection_margin

    engine = ReferenceEngine(path, compute_dtype=np.float64, check_overflow=False)
    try:
        h = engine.header
        state = x.reshape(-1, h.hidden_size).astype(np.float64)
        margin = np.inf
        progress(step, 0, h.num_layers)
        for layer in range(h.num_layers):
            logits = state @ engine.file.router(layer).astype(np.float64)
            if h.router_bias:
                logits = logits + engine.file.vector("router_bias", layer).astype(np.float64)
            correction = engine.file.vector("correction_bias", layer) if h.correction_bias else None
            margin = min(margin, float(selection_margin(logits, h, correction).min()))
            y = engine.layer(layer, state)
            state = state + y if h.composition == COMPOSITION_RESIDUAL else y
            progress(step, layer + 1, h.num_layers)
    finally:
        engine.close()
    return state.reshape(x.shape), margin


def selftest_vectors(
    weights_path: Path, batch: int, tokens: int, progress: Progress = _no_progress
) -> tuple[np.ndarray, np.ndarray, int]:
    """A seeded input and the reference engine's output for it.

    The input is N(0, 1) from NumPy's PCG64 with seed SELFTEST_SEED + attempt, for the first attempt whose router
    logits leave a gap of at least SELFTEST_MIN_MARGIN at the top-k boundary in every layer, so rounding
    differences between backends cannot flip an expert choice (else the attempt with the largest gap).
    The output is computed in float64 and rounded to float32. Memory: CHUNK_BYTES of weights at a time.

    Returns:
        (input float32 (batch, tokens, hidden), output float32 (batch, tokens, hidden), seed used).
    """
    weights = _RowChunks(Path(weights_path))
    hidden = weights.header.hidden_size
    with blas_threads(batch * tokens):
        best = _search(weights, batch, tokens, hidden, progress)
    _, x, y, seed = best
    return x, y.astype(np.float32), seed


def _search(weights: _RowChunks, batch: int, tokens: int, hidden: int, progress: Progress):
    """(margin, input, output float64, seed) of the first self-test attempt with a margin, else the best."""
    best = None
    for attempt in range(SELFTEST_ATTEMPTS):
        seed = SELFTEST_SEED + attempt
        x = np.random.default_rng(seed).standard_normal((batch, tokens, hidden)).astype(np.float32)
        step = "self-test" if attempt == 0 else f"self-test, input {attempt + 1}"
        y, margin = reference_with_margin(weights, x, progress, step)
        if best is None or margin > best[0]:
            best = (margin, x, y, seed)
        if margin >= SELFTEST_MIN_MARGIN:
            break
        log.debug("self-test input %d: router margin %.3g < %g; trying the next seed", attempt + 1, margin,
                  SELFTEST_MIN_MARGIN)
    return best


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


def shape_tag(batch: int, tokens: int) -> str:
    """The file-name tag of one compiled shape: "b4t16" (kernels/<name>.b4t16.<arch>.cubin, selftest/b4t16/)."""
    return f"b{int(batch)}t{int(tokens)}"


def _kernel_entry(k: CompiledKernel, arch: str, tag: str = "") -> dict:
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
        entries: their manifest entries (`_kernel_entry`, file names tagged when the bundle has several shapes).
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


def _build_shape(root: Path, profile, header: Header, batch: int, tokens: int, tag: str, kernel_dir, workers: int,
                 progress: Progress, steps, cache=None) -> ShapeBuild:
    """Compile, plan and self-test one shape: the catalogue functions get a copy of the profile with this scalar
    shape (`Profile.for_shape`); its kernel images and self-test vectors are written under `root`."""
    sub = profile.for_shape(batch, tokens)
    kernels = compile_catalog(sub, header, kernel_dir, workers=workers, cache=cache)
    plan = catalog.launch_plan(sub.to_dict(), header)
    check_launch_plan(plan, kernels, sub)
    entries = [_kernel_entry(k, profile.arch, tag) for k in kernels]
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
            tmp, profile, weights, kernel_dir, workers, progress or _no_progress, _nvrtc_cache(nvrtc_cache)
        )
        tmp.chmod(0o755)
        _place(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    tar = write_archive(out, out.with_name(out.name + ".tar")) if archive else None
    return BuildResult(out, manifest, kernels, tar, source_dtype)
