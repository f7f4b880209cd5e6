"""The colibri kernels emulated on the CPU: the unmodified kernels/*.cu compiled by g++ through
tests/kernels/emu/cuda_shim.h, and a whole `catalog.launch_plan` run on host memory.

An emulation of the LOGIC (indexing, tails, padded expert order, barriers, warp exchanges, atomics, what is
written): it proves nothing about GPU timing, the GPU memory model, occupancy or registers. See docs/kernels.md,
"Emulated on the CPU", and the execution model in emu/cuda_shim.h.

    lib = build_library(catalog.compile_defines(profile, header))     # cached by hash of sources, flags, defines
    device = EmulatedDevice(profile, "model.colibri")
    device.poison()
    y = device.run(x)                                                   # x (tokens, hidden) float32
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import numpy as np

from colibri_sdk import catalog
from colibri_sdk.format import ColibriFile
from colibri_sdk.format.constants import HEADER_SIZE
from colibri_sdk.runtime.cuda_backend import POISON_WORD, CudaBackend

EMU_DIR = Path(__file__).parent / "emu"
# The shim's headers (cuda_shim.h and the parts it includes, smem_model.h): the library keys hash every one of
# them (`_sources_digest`), and an access site's name is its innermost frame outside them (`site_name`).
SHIM_HEADERS = tuple(sorted(path.name for path in EMU_DIR.glob("*.h")))
CXX = shutil.which("g++")
CXXFLAGS = ("-O1", "-std=c++20", "-pthread", "-fPIC", "-fvisibility=hidden", "-U_FORTIFY_SOURCE", "-Wall",
            "-Wno-unknown-pragmas")
CACHE = Path(tempfile.gettempdir()) / "colibri-kernel-emu"
ALIGN = 256  # bytes: cuMemAlloc's alignment, so the GEMV picks the same vector/scalar path as on the GPU
GUARD = 4096  # bytes of canary before and after every buffer
CANARY_WORD = 0x7FC0CAFE  # a float32 NaN that no kernel writes
# Address classes of the access model (emu/emu_access.h kClasses): weights, activations, other scratch, unregistered.
ACCESS_CLASSES = 4
ACCESS_CLASS_NAMES = ("weights", "activations", "other", "unregistered")
ACTIVATION_BUFFERS = ("x0", "x1", "act", "pair_out")


class EmulationError(RuntimeError):
    """The emulation library failed to build, or a launch failed (deadlock, divergent barrier, memory fault)."""


def kernel_units() -> list[tuple[str, tuple[str, ...]]]:
    """(source file in kernels/, its entry points) for every catalogue kernel."""
    return [(spec.source, spec.symbols) for spec in catalog.KERNELS]


def unit_text(source: str, symbols: tuple[str, ...]) -> str:
    exports = "".join(f"COLI_EMU_EXPORT({s})\n" for s in symbols)
    return f'#include "cuda_shim.h"\n#include "{source}"\n{exports}'


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


# Compile constants that change no emulated instruction: COLI_PDL selects griddepcontrol PTX only (common.cuh
# pdl_entry), so a bundle with programmatic dependent launch shares the library of the same constants without it.
EMULATION_IGNORES = ("COLI_PDL",)


def build_library(defines: dict[str, int], source_dir: Path | None = None,
                  units: list[tuple[str, tuple[str, ...]]] | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernel sources with g++ into one shared library; returns its path.

    Args:
        defines: -D constants (`catalog.compile_defines`).
        source_dir: folder of the .cu sources and common.cuh (default: the catalogue's kernels/).
        units: (source file, entry points) to compile (default: every catalogue kernel).
        extra_flags: more g++ flags (build_model_library's instrumentation).

    The library is cached under the temp folder by a hash of compiler, flags, defines and every source byte; one
    process at a time builds a given key (a lock file beside it), the others then load what it built. Each object
    file is cached too (`_objects`), so libraries that share units or constants compile them once, and runner.cpp,
    which reads none of the -D constants, is compiled once for every library.

    Raises:
        EmulationError: g++ missing or a compile/link error (the compiler's output is in the message).
    """
    if CXX is None:
        raise EmulationError("g++ not found on PATH")
    source_dir = Path(source_dir or catalog.kernel_dir())
    units = units or kernel_units()
    defines = {k: v for k, v in defines.items() if k not in EMULATION_IGNORES}
    flags = [*CXXFLAGS, *extra_flags, *(f"-D{k}={int(v)}" for k, v in sorted(defines.items()))]
    sources = _sources_digest(source_dir)
    digest = hashlib.sha256("\n".join([_compiler_version(), *flags, repr(units), sources]).encode())
    out = CACHE / digest.hexdigest()[:24] / "libcolibri_emu.so"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    # One build per key at a time across processes (parallel test workers): the others wait, then find it built.
    with open(CACHE / f"{out.parent.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        return _build(out, flags, source_dir, units)


def _sources_digest(source_dir: Path) -> str:
    """sha256 of every .cu/.cuh/.h/.cpp byte in `source_dir` and the shim's folder."""
    digest = hashlib.sha256()
    for folder in (source_dir, EMU_DIR):
        for path in sorted(folder.iterdir()):
            if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _unit_files(unit: Path, source_dir: Path) -> list[Path]:
    """The unit and every file it includes with `#include "..."`, transitively, each resolved as g++ does: the
    including file's folder, then the -I folders (the shim's, then `source_dir`). Names found in none of them (a
    system header) are left out."""
    seen, todo = [], [unit]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        for name in INCLUDE.findall(path.read_text()):
            for folder in (path.parent, EMU_DIR, source_dir):
                if (folder / name).is_file():
                    todo.append((folder / name).resolve())
                    break
    return seen


def object_key(unit: Path, flags: list[str], source_dir: Path) -> str:
    """The cache key of one object: the compiler, the flags other than -D, every byte of the unit and of the files
    it includes (`_unit_files`), and the -D constants it can read — those whose name appears in one of those files
    (a -D of another name than COLI_* counts always). So a unit that mentions none of the constants two define sets
    differ in (runner.cpp none of the kernels' constants; routing.cu none of the intermediate size's) is compiled
    once for both."""
    files = _unit_files(unit.resolve(), source_dir)
    texts = [path.read_bytes() for path in files]
    names = set(IDENTIFIER.findall(b"\n".join(texts).decode(errors="replace")))
    read = [f for f in flags if f.startswith("-D") and
            (not f.startswith("-DCOLI_") or f[2:].split("=", 1)[0] in names)]
    digest = hashlib.sha256("\n".join([_compiler_version(), *(f for f in flags if not f.startswith("-D")),
                                        *read]).encode())
    for path, text in zip(files, texts):
        digest.update(b"\0" + path.name.encode() + b"\0" + text)
    return digest.hexdigest()[:24]


def _objects(flags: list[str], source_dir: Path, units: list[tuple[str, tuple[str, ...]]], work: Path) -> list[Path]:
    """Compile (in parallel) the objects of runner.cpp and each unit not yet in CACHE/objects; returns their paths
    in link order. An object is keyed by `object_key`; runner.cpp, which holds the shim's definitions and reads
    none of the kernels' constants, is compiled once for every library of the same flags. The units compile with
    cuda_shim.h precompiled (`_shim_pch`): the same object bytes, less g++ time."""
    includes = [f"-I{EMU_DIR}", f"-I{source_dir}"]
    compiles = [EMU_DIR / "runner.cpp"]
    for source, symbols in units:
        unit = work / (Path(source).stem + ".cpp")
        unit.write_text(unit_text(source, symbols))
        compiles.append(unit)
    store = CACHE / "objects"
    store.mkdir(exist_ok=True)
    objects, pending = [], []
    for src in compiles:
        obj = store / f"{src.stem}-{object_key(src, flags, source_dir)}.o"
        objects.append(obj)
        if not obj.exists():
            pending.append((src, obj))
    pch = [f"-I{_shim_pch(flags, work)}"] if pending else []
    jobs = [subprocess.Popen([CXX, *flags, *pch, *includes, "-c", str(src), "-o", str(work / obj.name)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for src, obj in pending]
    _check([src for src, _ in pending], jobs, "g++ failed")
    for _, obj in pending:
        os.replace(work / obj.name, obj)  # atomic: a concurrent build of the same key writes the same bytes
    return objects


def _shim_pch(flags: list[str], work: Path) -> Path:
    """The folder holding cuda_shim.h precompiled (cuda_shim.h.gch) for these flags, built once per key under CACHE.

    Keyed by the compiler, the flags without the kernels' -D constants (the shim reads only its own COLI_EMU_*
    switches) and every byte of the shim's headers. g++ takes the .gch from the first -I folder only where it is
    valid for the compilation (the same options; no macro defined differently that the header uses) and otherwise
    reads cuda_shim.h itself, so an object is the same either way (runner.cpp, which includes a system header first,
    never uses it)."""
    pch_flags = [f for f in flags if not f.startswith("-D") or f.startswith("-DCOLI_EMU_")]
    headers = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in sorted(EMU_DIR.glob("*.h")))
    key = hashlib.sha256("\n".join([_compiler_version(), *pch_flags]).encode() + b"\n" + headers)
    folder = CACHE / f"pch-{key.hexdigest()[:24]}"
    if not (folder / "cuda_shim.h.gch").exists():
        built = work / "cuda_shim.h.gch"
        job = subprocess.Popen([CXX, *pch_flags, f"-I{EMU_DIR}", "-x", "c++-header", str(EMU_DIR / "cuda_shim.h"),
                                "-o", str(built)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _check([EMU_DIR / "cuda_shim.h"], [job], "g++ (precompiling cuda_shim.h) failed")
        folder.mkdir(parents=True, exist_ok=True)
        # Beside the .gch, a header that forwards to the shim: where g++ finds the .gch but cannot use it (invalid,
        # or a unit including the shim a second time), it reads this one, which reads the real one.
        stub = work / "cuda_shim.h"
        stub.write_text('#include_next "cuda_shim.h"\n')
        os.replace(stub, folder / "cuda_shim.h")
        os.replace(built, folder / "cuda_shim.h.gch")  # atomic: a concurrent build of the same key writes the same bytes
    return folder


def _check(sources: list[Path], jobs: list[subprocess.Popen], what: str) -> None:
    """Wait for every job; raise EmulationError with the output of each that failed."""
    logs = [(src, job.communicate()[0], job.returncode) for src, job in zip(sources, jobs)]
    failed = [f"{src.name}:\n{log}" for src, log, rc in logs if rc != 0]
    if failed:
        raise EmulationError(f"{what}:\n" + "\n".join(failed))


def _build(out: Path, flags: list[str], source_dir: Path, units: list[tuple[str, tuple[str, ...]]]) -> Path:
    """Compile the objects and link the library into a private folder, then rename it to `out`."""
    work = Path(tempfile.mkdtemp(dir=CACHE, prefix="build-"))
    objects = _objects(flags, source_dir, units, work)
    link = subprocess.run([CXX, *CXXFLAGS, "-shared", *(str(o) for o in objects), "-o", str(work / out.name)],
                          capture_output=True, text=True)
    if link.returncode != 0:
        raise EmulationError(f"g++ link failed:\n{link.stderr}")
    out.parent.mkdir(exist_ok=True)
    os.replace(work / out.name, out)  # atomic: a concurrent build of the same key writes the same bytes
    shutil.rmtree(work, ignore_errors=True)
    return out


class EmulationLibrary:
    """A loaded emulation library: one launch function per kernel symbol, the schedule setting, the fp16 conversion.

    The library keeps its scheduler state in globals: one launch at a time per process.
    """

    SCHEDULES = {"increasing": 0, "decreasing": 1, "random": 2}

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(path))
        self._lib.coli_emu_error.restype = ctypes.c_char_p
        self._lib.coli_emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self._lib.coli_emu_half_to_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        self._lib.coli_emu_half_to_float.restype = None

    def access_regions(self, regions: list[tuple[int, int, int]]) -> None:
        """Set the access model's address classes: (start address, size in bytes, class 0..ACCESS_CLASSES-2)."""
        self._lib.coli_emu_access_region(0, -1, 0)
        for start, size, cls in regions:
            self._lib.coli_emu_access_region(ctypes.c_ulonglong(start), ctypes.c_longlong(size), cls)

    def access_enable(self, on: bool) -> None:
        """Record (or stop recording) the warp-level global loads of the following launches."""
        self._lib.coli_emu_access_enable(1 if on else 0)

    def access_read(self) -> np.ndarray:
        """(classes, 4) uint64: instructions, sectors touched, minimum sectors, bytes requested since the last read
        (then reset). Class ACCESS_CLASSES-1 holds addresses outside every registered region."""
        out = np.zeros((ACCESS_CLASSES, 4), dtype=np.uint64)
        self._lib.coli_emu_access_read(out.ctypes.data_as(ctypes.POINTER(ctypes.c_ulonglong)))
        return out

    def function(self, symbol: str):
        fn = getattr(self._lib, f"coli_emu_launch_{symbol}")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn

    def launch(self, function, grid, block, params_address: int) -> None:
        """Run one grid; `params_address` is a cuLaunchKernel kernelParams array (pointers to the arguments)."""
        g = (ctypes.c_uint * 3)(*grid)
        b = (ctypes.c_uint * 3)(*block)
        if function(g, b, params_address) != 0:
            raise EmulationError(self._lib.coli_emu_error().decode())

    def set_schedule(self, name: str, seed: int = 0) -> None:
        """'increasing', 'decreasing' or 'random' (seeded) order of threads and blocks for the next launches."""
        self._lib.coli_emu_set_schedule(self.SCHEDULES[name], seed)

    def half_to_float(self, bits: np.ndarray) -> np.ndarray:
        """fp16 bit patterns (uint16) → the float32 bit patterns (uint32) the kernels' wt_to_float gives."""
        bits = np.ascontiguousarray(bits, dtype=np.uint16)
        out = np.empty(bits.shape, dtype=np.uint32)
        self._lib.coli_emu_half_to_float(bits.ctypes.data, out.ctypes.data, bits.size)
        return out


class Region:
    """A host buffer standing for a device allocation: ALIGN-aligned, with GUARD bytes of canary on each side."""

    def __init__(self, size: int):
        self.size = max(int(size), 1)
        self._raw = np.empty(self.size + 2 * GUARD + ALIGN, dtype=np.uint8)
        start = (-self._raw.ctypes.data) % ALIGN + GUARD
        self.bytes = self._raw[start : start + self.size]
        after = start + -(-self.size // 4) * 4
        self._before = self._raw[start - GUARD : start].view(np.uint32)
        self._after = self._raw[after : after + GUARD].view(np.uint32)
        self._before[:] = CANARY_WORD
        self._after[:] = CANARY_WORD
        self.bytes[:] = 0
        self.address = self.bytes.ctypes.data

    def view(self, dtype) -> np.ndarray:
        return self.bytes[: self.size // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize].view(dtype)

    def guards_intact(self) -> bool:
        return bool((self._before == CANARY_WORD).all() and (self._after == CANARY_WORD).all())


class EmulatedDevice:
    """One bundle's forward pass on the CPU: the scratch buffers of `catalog.device_buffers`, the weights buffer
    (the .colibri bytes after the header) and `catalog.launch_plan`, with the kernel arguments built by the CUDA
    backend's own code (`CudaBackend._pointer` and `_prepare`), so what runs is what the backend launches.

    Args:
        profile: a validated profile dict.
        weights: path of a .colibri file.
        kernels: run only the launches of these catalogue kernels (e.g. ("routing",)), in plan order; None: all.

    Raises:
        EmulationError: the library does not build, or a launch fails.
    """

    library_builder = staticmethod(build_library)  # ModelDevice: build_model_library
    library_class = EmulationLibrary

    def __init__(self, profile: dict, weights: str | os.PathLike, kernels: tuple[str, ...] | None = None):
        with ColibriFile(weights) as f:
            self.header = f.header
        self.profile = profile
        self.plan = [launch for launch in catalog.launch_plan(profile, self.header)
                     if kernels is None or launch["kernel"] in kernels]
        launched = {launch["kernel"] for launch in self.plan}  # only the sources the plan launches are compiled
        units = [(spec.source, spec.symbols) for spec in catalog.KERNELS if spec.name in launched]
        self.lib = self.library_class(self.library_builder(catalog.compile_defines(profile, self.header), units=units))
        self.sizes = catalog.sizes(profile, self.header)
        self.buffers = {name: Region(size) for name, size in sorted(catalog.device_buffers(profile, self.header).items())}
        for name, region in self.buffers.items():
            if catalog.is_counter_buffer(name):  # zero once, as every backend does (the kernels leave them zero)
                region.bytes[:] = 0
        data = Path(weights).read_bytes()[HEADER_SIZE:]
        self.weights = Region(len(data) + catalog.WEIGHTS_TAIL_BYTES)  # as CudaBackend allocates it
        self.weights.bytes[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.weights.bytes[len(data) :] = 0xFF  # NaN as fp16 and fp32: a tail byte that reaches a product shows
        self.io = catalog.io_buffers(self.header)
        symbols = {s for _, unit_symbols in units for s in unit_symbols}
        backend = types.SimpleNamespace(
            _buffers={name: r.address for name, r in self.buffers.items()},
            _weights=self.weights.address,
            _functions={s: self.lib.function(s) for s in symbols},
        )
        backend._pointer = functools.partial(CudaBackend._pointer, backend)
        self._launches = [CudaBackend._prepare(backend, launch) for launch in self.plan]

    def poison(self) -> None:
        """Fill every scratch buffer with POISON_WORD (float32 NaN), as CudaBackend.poison does."""
        for name, region in self.buffers.items():
            region.view(np.uint32)[:] = 0 if catalog.is_counter_buffer(name) else POISON_WORD

    def _load_input(self, x: np.ndarray, valid_tokens) -> tuple:
        """The runtime's input copy: x into the input buffer and, where the plan has one, the valid-token counts
        (catalog.io_buffers "valid_tokens"; None: every token valid)."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(self.sizes.tokens, self.header.hidden_size)
        self.buffers[self.io["input"]].view(np.float32)[:] = x.reshape(-1)
        if "valid_tokens" in self.io:
            batch, tokens = self.profile["shape"]["batch"], self.profile["shape"]["tokens"]
            counts = np.full(batch, tokens, dtype=np.int32) if valid_tokens is None else np.asarray(valid_tokens)
            self.buffers[self.io["valid_tokens"]].view(np.int32)[:] = counts.astype(np.int32)
        return x.shape

    def run(self, x: np.ndarray, schedule: str = "increasing", seed: int = 0, valid_tokens=None) -> np.ndarray:
        """The forward pass: x (tokens, hidden) float32 → (tokens, hidden) float32, a new array.
        valid_tokens: (batch,) ints, the valid tokens of each sequence (None: all)."""
        self.lib.set_schedule(schedule, seed)
        shape = self._load_input(x, valid_tokens)
        for function, grid, block, _shared, params, _values in self._launches:
            self.lib.launch(function, grid, block, params.ctypes.data)
        return self.buffers[self.io["output"]].view(np.float32).reshape(shape).copy()

    def _prepare_access(self, x: np.ndarray, valid_tokens) -> None:
        """Mark the regions for the access model (weights class 0, ACTIVATION_BUFFERS class 1, other scratch class
        2), run blocks in increasing order, and load the input."""
        regions = [(self.weights.address, self.weights.size, 0)]
        for name, region in self.buffers.items():
            regions.append((region.address, region.size, 1 if name in ACTIVATION_BUFFERS else 2))
        self.lib.access_regions(regions)
        self.lib.set_schedule("increasing", 0)
        self._load_input(x, valid_tokens)

    def run_recorded(self, x: np.ndarray, valid_tokens=None) -> list[tuple[dict, np.ndarray]]:
        """The forward pass with the access model on: [(launch of the plan, (classes, 4) load totals)] in launch
        order (EmulationLibrary.access_read). Weights are class 0, the buffers of ACTIVATION_BUFFERS class 1, every
        other scratch buffer class 2."""
        self._prepare_access(x, valid_tokens)
        out = []
        self.lib.access_read()
        self.lib.access_enable(True)
        try:
            for launch, (function, grid, block, _shared, params, _values) in zip(self.plan, self._launches):
                self.lib.launch(function, grid, block, params.ctypes.data)
                out.append((launch, self.lib.access_read()))
        finally:
            self.lib.access_enable(False)
        return out

    def buffer(self, name: str, dtype) -> np.ndarray:
        """A copy of scratch buffer `name` as `dtype`."""
        return self.buffers[name].view(dtype).copy()

    def damaged_guards(self) -> list[str]:
        """Names of the buffers whose canary words before or after were overwritten (out-of-bounds writes)."""
        regions = dict(self.buffers, weights=self.weights)
        return [name for name, region in regions.items() if not region.guards_intact()]


# ---- shared memory, lanes and bytes in flight (emu/smem_model.h) --------------------------------------------------
# A second library per define set, its kernel units instrumented by g++'s ThreadSanitizer pass at compile time only
# (the hooks are emu/runner.cpp's; no sanitizer runtime is linked) and with line tables for the site names. The
# ordinary library (build_library) has no instrumentation: the emulated tests do not pay for this.
MODEL_FLAGS = ("-g", "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0", "-DCOLI_EMU_SMEM_MODEL=1")
SITE_KINDS = ("shared load", "shared store", "global load")
SITE_COLUMNS = 7  # emu/runner.cpp coli_emu_model_sites


def build_model_library(defines: dict[str, int], source_dir: Path | None = None,
                        units: list[tuple[str, tuple[str, ...]]] | None = None) -> Path:
    """build_library with the shared-memory model compiled in (MODEL_FLAGS); cached the same way, by its own key.

    Raises:
        EmulationError: as build_library.
    """
    return build_library({**defines, "COLI_EMU_SMEM_MODEL": 1}, source_dir, units, extra_flags=MODEL_FLAGS[:-1])


def template_statics(library: Path) -> list[tuple[int, int]]:
    """(offset, size) of the function-local statics of function templates in `library` outside the shim: the
    `__shared__` variables g++ left out of the coli_shared section (it ignores a section attribute there)."""
    tool = shutil.which("nm")
    if tool is None:
        raise EmulationError("nm not found on PATH (binutils): the shared-memory model needs it")
    listing = subprocess.run([tool, "-C", "-S", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout
    out = []
    for line in listing.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[2] in "bBdDu" and ")::" in parts[3] and ">(" in parts[3] \
                and not parts[3].startswith("coli_emu::") and "coli_emu::" not in parts[3].split(">(")[0]:
            out.append((int(parts[0], 16), int(parts[1], 16)))
    return out


class ModelLibrary(EmulationLibrary):
    """An emulation library built by build_model_library: the access model also records shared-memory requests,
    active lanes and bytes in flight per access site."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._lib.coli_emu_model_sites.restype = ctypes.c_longlong
        self._lib.coli_emu_model_sites.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
        self._lib.coli_emu_model_inflight.argtypes = [ctypes.c_void_p]
        self._lib.coli_emu_model_inflight.restype = None
        self.shared_recorded = bool(self._lib.coli_emu_model_shared())
        self._lib.coli_emu_model_shared_region.argtypes = [ctypes.c_ulonglong, ctypes.c_longlong]
        self._lib.coli_emu_model_sample.restype = ctypes.c_longlong
        self._lib.coli_emu_model_sample.argtypes = [ctypes.c_longlong]
        self._lib.coli_emu_model_shared_region(0, -1)
        for offset, size in template_statics(self.path):
            if self._lib.coli_emu_model_shared_region(offset, size):
                raise EmulationError(f"{self.path}: more template `__shared__` variables than the model registers")

    def model_sample(self, stride: int) -> int:
        """Run only every `stride`-th block (by linear index) of the following recorded launches; returns the blocks
        run since the previous call."""
        return int(self._lib.coli_emu_model_sample(int(stride)))

    def model_read(self) -> tuple[np.ndarray, np.ndarray]:
        """(sites, in_flight) since the last read, then reset.

        sites: (n, 7) uint64 rows: site offset in the library, kind (SITE_KINDS index), warp-level requests,
            wavefronts, ideal wavefronts, active lanes summed over the requests, distinct bytes (global loads:
            requests, lanes and bytes only).
        in_flight: (6,) uint64: __ldg batches, their bytes, bytes squared; cp.async batches, bytes, bytes squared.
        """
        cap = 4096
        while True:
            rows = np.zeros((cap, SITE_COLUMNS), dtype=np.uint64)
            n = self._lib.coli_emu_model_sites(rows.ctypes.data, cap)
            if n <= cap:
                break
            raise EmulationError(f"{n} access sites; at most {cap} are read")  # reset already: no retry possible
        flight = np.zeros(6, dtype=np.uint64)
        self._lib.coli_emu_model_inflight(flight.ctypes.data)
        return rows[:n], flight

    @functools.lru_cache(maxsize=None)
    def site_name(self, offset: int) -> str:
        """The source line of an access site ("small_batch.cu:380"), the innermost inlined frame; "?" without
        addr2line."""
        tool = shutil.which("addr2line")
        if tool is None:
            return "?"
        frames = subprocess.run([tool, "-e", str(self.path), "-i", hex(max(int(offset) - 1, 0))],
                                capture_output=True, text=True).stdout.split()
        names = [Path(f).name for f in frames]
        outside = [n for n in names if not n.startswith(SHIM_HEADERS)]  # the kernel's own line
        return (outside or names or ["?"])[0]


class ModelDevice(EmulatedDevice):
    """EmulatedDevice on a build_model_library library; run_modelled records every launch."""

    library_builder = staticmethod(build_model_library)
    library_class = ModelLibrary

    def run_modelled(self, x: np.ndarray, valid_tokens=None, sample_blocks: int | None = None,
                     sampled: tuple[str, ...] = ()) -> list[dict]:
        """The forward pass with the access model on: per launch of the plan {"launch", "loads" ((classes, 4) as
        run_recorded), "sites" ((n, 7), ModelLibrary.model_read), "in_flight" ((6,)), "block_scale"}, in launch
        order.

        sample_blocks: for the launches of the catalogue kernels in `sampled`, run about this many of the grid's
            blocks (every k-th by linear index, k the first stride >= blocks / sample_blocks that is coprime to
            grid.x, so that the samples take every x: the expert of an experts grid (the quantized tiles), where a
            k divisible by the experts ran one expert's blocks only; the others write nothing, so later kernels
            read unwritten data: counts only, no results); block_scale = grid blocks / blocks run (1.0 for a launch
            run whole)."""
        self._prepare_access(x, valid_tokens)
        out = []
        self.lib.access_read()
        self.lib.model_read()
        self.lib.access_enable(True)
        try:
            for launch, (function, grid, block, _shared, params, _values) in zip(self.plan, self._launches):
                blocks = int(np.prod(grid))
                stride = max(blocks // sample_blocks, 1) if sample_blocks and launch["kernel"] in sampled else 1
                while stride > 1 and math.gcd(stride, int(grid[0])) != 1:
                    stride += 1
                self.lib.model_sample(stride)
                self.lib.launch(function, grid, block, params.ctypes.data)
                ran = self.lib.model_sample(1)
                sites, flight = self.lib.model_read()
                out.append({"launch": launch, "loads": self.lib.access_read(), "sites": sites, "in_flight": flight,
                            "block_scale": blocks / max(ran, 1)})
        finally:
            self.lib.access_enable(False)
            self.lib.model_sample(1)
        return out
