"""Recompile a bundle's kernels from what its manifest records and compare the images byte for byte
(`colibri-sdk verify --rebuild`, docs/build.md "Checking a bundle against its sources").

The NVRTC cache (`colibri_sdk.aot.cache`) catches damage, not a deliberate edit: whoever can write the cache folder
can plant an entry with a cubin of their own and a recomputed digest, and a build through that cache ships it (the
manifest's checksums are computed from what was written, so `verify` passes). The check that settles it is to run
NVRTC again, without the cache, on the same input and compare: NVRTC is deterministic, so the same source, options
and NVRTC version give the same cubin and PTX bytes.

What a build records for that, per kernel entry of the manifest, as `inputs` (`record_inputs`):

    {"source_sha256": sha256 of the .cu source,
     "headers": {relative path: sha256} of every header under the kernels folder (*.cuh, *.h, *.hpp, *.inc),
     "options": the NVRTC options in order, the -I folders as "-I<kernels>" / "-I<cuda-headers>"}

with the arch, the `-D` constants (`defines`) and the NVRTC version (`nvrtc_version`) recorded as before. No machine
path is recorded (the placeholders), so a bundle stays byte-identical across checkouts and virtual environments.
The sources themselves are not in the bundle: a rebuild compiles the kernels folder of the installed colibri-sdk
(or `--kernels DIR`) after checking that its files are the recorded ones, so the trust rests on the installed
package, not on anything the bundle says about itself.

A bundle written before `inputs` existed is refused (`BundleError`: build it again); so is a rebuild under another
NVRTC version than the recorded one, or from sources or options that differ from the recorded ones (a
`CompileError` naming what differs): either would compare other bytes, not prove anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import BundleError, CompileError
from . import nvrtc

KERNELS_DIR = "<kernels>"  # the -I placeholders of `inputs.options`
CUDA_HEADERS_DIR = "<cuda-headers>"
HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc")
INPUTS_KEY = "inputs"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header_digests(kernel_dir: Path) -> dict[str, str]:
    """{relative POSIX path: sha256} of every header file (HEADER_SUFFIXES) under `kernel_dir`, sorted."""
    folder = Path(kernel_dir)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in HEADER_SUFFIXES)
    return {p.relative_to(folder).as_posix(): _sha256(p.read_bytes()) for p in files}


def portable_options(options, kernel_dir: Path) -> list[str]:
    """NVRTC options with the kernels folder and the CUDA headers folder as placeholders (no machine path)."""
    headers = nvrtc.find_cuda_include_dir()
    names = {f"-I{Path(kernel_dir)}": f"-I{KERNELS_DIR}"}
    if headers is not None:
        names[f"-I{headers}"] = f"-I{CUDA_HEADERS_DIR}"
    return [names.get(o, o) for o in options]


def record_inputs(source: str, kernel_dir: Path, options) -> dict:
    """The manifest's `inputs` of one compiled kernel (module docstring): what a rebuild needs besides the arch,
    the defines and the NVRTC version."""
    return {"source_sha256": _sha256(source.encode()), "headers": header_digests(kernel_dir),
            "options": portable_options(options, kernel_dir)}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One image of the bundle that differs from NVRTC's output.

    Attributes:
        path: the image, relative to the bundle ("kernels/routing.sm_87.cubin").
        kernel: the catalogue kernel name; source: its .cu file; shape: "batch 1 x tokens 16".
        bundle_bytes, rebuilt_bytes: the two sizes (bytes); first_difference: the first differing byte offset.
    """

    path: str
    kernel: str
    source: str
    shape: str
    bundle_bytes: int
    rebuilt_bytes: int
    first_difference: int

    def line(self) -> str:
        """One line: the image, the kernel, the shape, the sizes and the first differing byte."""
        return (f"{self.path}: differs from NVRTC's output for {self.source} ({self.kernel}, {self.shape}): "
                f"{self.bundle_bytes:,} bytes in the bundle, {self.rebuilt_bytes:,} rebuilt, first difference at "
                f"byte {self.first_difference:,}")


@dataclasses.dataclass(frozen=True)
class RebuildReport:
    """What `rebuild_and_compare` found.

    Attributes:
        images: how many images (cubin and PTX) were compared.
        compilations: how many NVRTC compilations ran.
        nvrtc_version: "12.9".
        mismatches: the images that differ (empty: the bundle is what its sources give).
    """

    images: int
    compilations: int
    nvrtc_version: str
    mismatches: list[Mismatch]

    @property
    def identical(self) -> bool:
        return not self.mismatches


def _kernel_entries(manifest: dict) -> list[tuple[str, dict]]:
    """(shape text, kernel entry) for every compiled kernel of every shape, each image once."""
    shapes = manifest.get("shapes") or [{"batch": manifest["shape"]["batch"], "tokens": manifest["shape"]["tokens"],
                                         "kernels": manifest["kernels"]}]
    seen, out = set(), []
    for shape in shapes:
        for entry in shape["kernels"]:
            if entry["cubin"] not in seen:
                seen.add(entry["cubin"])
                out.append((f"batch {shape['batch']} x tokens {shape['tokens']}", entry))
    return out


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _check_sources(entries, folder: Path, sdk_version: str) -> dict[str, str]:
    """The source text of every recorded kernel, after checking it and the headers against the recorded sha256.

    Raises:
        CompileError: a source missing, or a source or header that differs from the recorded one (naming it).
    """
    hint = (f"rebuild with the kernel sources the bundle was built from (those of colibri-sdk {sdk_version}: "
            f"--kernels DIR)")
    here = header_digests(folder)
    texts = {}
    for _, entry in entries:
        recorded = entry[INPUTS_KEY]
        if recorded["headers"] != here:
            changed = sorted(set(recorded["headers"]) ^ set(here)
                             | {k for k in set(recorded["headers"]) & set(here) if recorded["headers"][k] != here[k]})
            raise CompileError(f"{folder}: header(s) {changed} differ from the ones the bundle was built from "
                               f"(sha256 recorded in the manifest); {hint}")
        path = folder / entry["source"]
        if entry["source"] not in texts:
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise CompileError(f"kernel source {path} cannot be read: {exc.strerror}; {hint}") from exc
            if _sha256(data) != recorded["source_sha256"]:
                raise CompileError(f"{path}: sha256 {_sha256(data)[:16]}... differs from the source the bundle was "
                                   f"built from ({recorded['source_sha256'][:16]}...); {hint}")
            try:
                texts[entry["source"]] = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CompileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return texts


def rebuild_and_compare(bundle, kernel_dir: Path | None = None, workers: int = 2) -> RebuildReport:
    """Compile every kernel of `bundle` (a `colibri_sdk.bundle.Bundle`, already verified) again with NVRTC, without
    the cache, from the sources and options its manifest records, and compare the cubin and PTX byte for byte with
    the bundle's files.

    Args:
        kernel_dir: the kernel sources; default the installed package's (`catalog.kernel_dir()`).
        workers: NVRTC compilations run at once.

    Raises:
        BundleError: the manifest records no `inputs` (a bundle written before they existed).
        CompileError: `kernel_dir` is not a folder, the installed NVRTC is another version than the recorded one, a
            source or header differs
            from the recorded sha256, the options differ from the recorded ones, or NVRTC fails.
    """
    from .. import catalog

    from ..bundle.manifest import check_inputs

    manifest = bundle.manifest
    entries = _kernel_entries(manifest)
    for shape, entry in entries:
        where = f"{bundle.path}/manifest.json"
        sources = sorted({k.source for k in catalog.KERNELS})
        if entry["source"] not in sources:  # a file name of the catalogue, never a path to read elsewhere
            raise BundleError(f"{where}: kernel {entry['name']} ({shape}): source = {entry['source']!r}; allowed: "
                              f"one of the catalogue's sources {sources}")
        bad = [k for k, v in entry["defines"].items() if type(v) is not int]
        if bad:
            raise BundleError(f"{where}: kernel {entry['name']} ({shape}): defines.{bad[0]} = "
                              f"{entry['defines'][bad[0]]!r}; allowed: an integer (a -D constant)")
        if INPUTS_KEY in entry:
            check_inputs(entry[INPUTS_KEY], f"kernel {entry['name']} ({shape}): {INPUTS_KEY}", where)
        else:
            raise BundleError(
                f"{bundle.path}: kernel {entry['name']} ({shape}) records no NVRTC inputs (kernels[].{INPUTS_KEY}): "
                f"the bundle was written by colibri-sdk {manifest['sdk_version']}, before --rebuild existed; build it "
                "again with this colibri-sdk (--no-cache) to check it"
            )
    major, minor = nvrtc.nvrtc_version()
    recorded = manifest["nvrtc_version"]
    if f"{major}.{minor}" != recorded:
        wanted = recorded.split(".")[0]
        hint = nvrtc.pip_hint(int(wanted)) if wanted.isascii() and wanted.isdigit() and len(wanted) <= 3 else ""
        raise CompileError(
            f"{bundle.path} was built with NVRTC {recorded[:40]}; the installed NVRTC is {major}.{minor}: another "
            f"NVRTC may give other bytes, so a rebuild here proves nothing; install NVRTC {recorded[:40]}"
            + (f" ({hint})" if hint else "")
        )
    folder = Path(kernel_dir) if kernel_dir is not None else catalog.kernel_dir()
    if not folder.is_dir():  # else every header "differs" (a folder that is not there has none)
        raise CompileError(f"--kernels {folder}: {'no such folder' if not folder.exists() else 'not a folder'}; "
                           f"allowed: a folder with the kernel sources (*.cu, common.cuh) the bundle was built from")
    texts = _check_sources(entries, folder, manifest["sdk_version"])
    arch = manifest["arch"]
    dirs = nvrtc.include_folders([folder])
    for shape, entry in entries:
        options = portable_options(nvrtc.compile_options(arch, entry["defines"], dirs), folder)
        recorded = entry[INPUTS_KEY]["options"]
        if options != recorded:
            i = next((j for j, (a, b) in enumerate(zip(options, recorded)) if a != b), min(len(options),
                                                                                         len(recorded)))
            here, there = (repr(o[i][:80]) if i < len(o) else "(none)" for o in (options, recorded))
            raise CompileError(
                f"kernel {entry['name']} ({shape}): NVRTC option {i} here is {here}, recorded {there} ({len(options)} "
                f"options here, {len(recorded)} recorded); rebuild where the same options apply (colibri-sdk "
                f"{manifest['sdk_version'][:40]}, the CUDA headers installed or not as at the build)"
            )

    def compile_one(item):
        _, entry = item
        return nvrtc.compile_source(texts[entry["source"]], entry["source"], arch, entry["defines"], [folder])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        outputs = list(pool.map(compile_one, entries))
    mismatches = []
    for (shape, entry), out in zip(entries, outputs):
        for kind, rebuilt in (("cubin", out.cubin), ("ptx", out.ptx)):
            held = (Path(bundle.path) / entry[kind]).read_bytes()
            if held != rebuilt:
                mismatches.append(Mismatch(entry[kind], entry["name"], entry["source"], shape, len(held),
                                           len(rebuilt), _first_difference(held, rebuilt)))
    return RebuildReport(2 * len(entries), len(entries), f"{major}.{minor}", mismatches)
