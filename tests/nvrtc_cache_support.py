"""A content-keyed cache of NVRTC output for the bundle builds of the tests (installed by tests/conftest.py).

Many tests build bundles of the same kernels with the same compile-time constants; NVRTC gives the same bytes for
the same input (tests/build/test_bundle_build.py::test_reproducible_byte_for_byte builds once through the cache and
once without it and compares every byte). `install` replaces the name `compile_source` that
`colibri_sdk.aot.kernels` (the bundle build) calls with a cached one; `colibri_sdk.aot.nvrtc.compile_source` itself
is not touched, so the tests that call it (tests/build/test_nvrtc.py, tests/kernels/test_compile*.py) always run
NVRTC, and only successful compilations are cached (a failure is raised again on every call).

The key is a sha256 of the NVRTC version, the arch, the source and its name, the defines, the toolkit asked for and
the name and bytes of every file in the include folders. Entries live under the temp folder
(`colibri-nvrtc-cache/<key>/`), are written to a private folder first and renamed into place (atomic: concurrent
test processes that compile the same key write the same bytes), and are read back as `CompiledSource`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from colibri_sdk.aot import kernels as aot_kernels
from colibri_sdk.aot import nvrtc

CACHE = Path(tempfile.gettempdir()) / "colibri-nvrtc-cache"
_HEADER_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


def _key(source: str, name: str, arch: str, defines, include_dirs, toolkit) -> str:
    digest = hashlib.sha256()
    headers = nvrtc.find_cuda_include_dir()
    parts = [repr(nvrtc.nvrtc_version()), str(headers), name, arch, repr(toolkit),
             repr(sorted((defines or {}).items()))]
    digest.update("\n".join(parts).encode() + b"\0" + source.encode())
    for folder in include_dirs or []:
        folder = Path(folder)
        digest.update(b"\0dir\0" + str(folder).encode())
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path.suffix in _HEADER_SUFFIXES and path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def _read(entry: Path) -> nvrtc.CompiledSource | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        cubin, ptx = (entry / "cubin").read_bytes(), (entry / "ptx").read_bytes()
    except (OSError, ValueError):
        return None
    log = meta["log"]
    return nvrtc.CompiledSource(cubin, ptx, log, nvrtc.parse_resources(log), tuple(meta["options"]))


def _write(entry: Path, out: nvrtc.CompiledSource) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=CACHE, prefix="write-"))
    try:
        (work / "cubin").write_bytes(out.cubin)
        (work / "ptx").write_bytes(out.ptx)
        (work / "meta.json").write_text(json.dumps({"log": out.log, "options": list(out.options)}))
        os.rename(work, entry)
    except OSError:
        pass  # another process renamed the same key into place first: its bytes are the same
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cached_compile_source(source, name, arch, defines=None, include_dirs=None, toolkit=None):
    """`colibri_sdk.aot.nvrtc.compile_source`, answered from the cache when the same input was compiled before."""
    entry = CACHE / _key(source, name, arch, defines, include_dirs, toolkit)
    found = _read(entry) if entry.is_dir() else None
    if found is not None:
        return found
    out = nvrtc.compile_source(source, name, arch, defines, include_dirs, toolkit=toolkit)
    _write(entry, out)
    return out


@contextlib.contextmanager
def uncached():
    """Bundle builds inside this block run NVRTC (the module attribute is swapped back on exit)."""
    original = aot_kernels.compile_source
    aot_kernels.compile_source = nvrtc.compile_source
    try:
        yield
    finally:
        aot_kernels.compile_source = original


def install() -> None:
    """Make the bundle build (`colibri_sdk.aot.kernels.compile_kernel`) compile through the cache."""
    aot_kernels.compile_source = cached_compile_source
