"""Compile CUDA C with NVRTC through `cuda.bindings.nvrtc` (the low-level API): no GPU and no driver needed.

One compilation per source with `-arch=sm_XY` gives both images: the SASS cubin for that arch and the PTX it was
assembled from (the PTX is byte-identical to a `-arch=compute_XY` compile of the same source; tests check this).
The arch always comes from the profile, never from a GPU. The CUDA headers (`cuda_fp16.h`, ...) come from the pip
package `nvidia-cuda-runtime-cu12`, passed with `-I`.

Every NVRTC call goes through `_check`, which raises CompileError with the call name, NVRTC's error string and,
for a failed compilation, the full log (file and line of each diagnostic).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import signal
import threading
from importlib import metadata
from pathlib import Path

from ..errors import CompileError

STD = "--std=c++17"
_PIP_NVRTC = {12: 'pip install "cuda-python>=12,<13" nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12',
              13: 'pip install "cuda-python>=13,<14" nvidia-cuda-nvrtc nvidia-cuda-runtime'}


def pip_hint(major: int) -> str:
    """The pip command that installs NVRTC and the CUDA headers of CUDA major version `major`."""
    wheels = f"nvidia-cuda-nvrtc-cu{major}, nvidia-cuda-runtime-cu{major}"
    return _PIP_NVRTC.get(major, f"the NVRTC {major}.x wheels ({wheels})")


_NVRTC_WHEEL = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}  # CUDA major -> its NVRTC pip wheel


def toolkit_hint(wanted: int, loaded: int) -> str:
    """How to get NVRTC `wanted` where cuda.bindings loads NVRTC `loaded`: `pip_hint(wanted)`, and, when the wheels
    of both majors are installed (a CUDA 13 torch brings `nvidia-cuda-nvrtc` next to `nvidia-cuda-nvrtc-cu12`), the
    uninstall of the loaded one: cuda.bindings (through cuda.pathfinder) then loads that one first, so installing
    the wanted wheel again changes nothing."""
    hint = pip_hint(wanted)
    try:
        metadata.version(_NVRTC_WHEEL[wanted])
        metadata.version(_NVRTC_WHEEL[loaded])
    except (KeyError, metadata.PackageNotFoundError):
        return hint
    return (f"{hint}; {_NVRTC_WHEEL[wanted]} is installed already, and so is {_NVRTC_WHEEL[loaded]} (NVRTC "
            f"{loaded}), which cuda.bindings loads first: pip uninstall {_NVRTC_WHEEL[loaded]}")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CompileError(f"cuda.bindings.nvrtc is not importable ({exc}); install it: {pip_hint(12)}") from exc
    return nvrtc


def _check(result, call: str, prog=None):
    """Unpack an NVRTC result tuple `(nvrtcResult, *values)`; raise CompileError unless NVRTC_SUCCESS.

    Args:
        result: what the cuda.bindings call returned.
        call: the NVRTC function name, quoted in the error.
        prog: the program, whose log is attached to the error when given.
    """
    nvrtc = _nvrtc()
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        text = text.decode(errors="replace")
        message = f"{call} failed: {err.name}" + (f" ({text})" if text != err.name else "")
        if prog is not None:
            log = program_log(prog)
            if log:
                message += "\n" + log
        raise CompileError(message)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def program_log(prog) -> str:
    """The compilation log of `prog` (diagnostics as `file(line): error: ...`, ptxas output), stripped."""
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00").decode(errors="replace").strip()


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that cuda.bindings loads."""
    nvrtc = _nvrtc()
    return _check(nvrtc.nvrtcVersion(), "nvrtcVersion")


def supported_archs() -> list[int]:
    """Compute capabilities (e.g. 87) the installed NVRTC can compile for (nvrtcGetSupportedArchs)."""
    nvrtc = _nvrtc()
    return [int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]


def find_cuda_include_dir() -> Path | None:
    """The CUDA headers shipped by pip (`nvidia-cuda-runtime-cu12`: nvidia/cuda_runtime/include; CUDA 13's
    `nvidia-cuda-runtime`: nvidia/cu13/include), or None when neither is installed."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in sorted(nvidia.__path__):
        for candidate in (Path(root) / "cuda_runtime" / "include", *sorted(Path(root).glob("cu*/include"))):
            if (candidate / "cuda_fp16.h").is_file():
                return candidate
    return None


def cuda_include_dir() -> Path:
    """Like `find_cuda_include_dir`, for code that needs the headers.

    Raises:
        CompileError: no CUDA headers are installed.
    """
    include = find_cuda_include_dir()
    if include is None:
        raise CompileError(f"the CUDA headers are missing (no nvidia/*/include/cuda_fp16.h); install them: {pip_hint(12)}")
    return include


@dataclasses.dataclass(frozen=True)
class CompiledSource:
    """The output of compiling one source for one arch.

    Attributes:
        cubin: SASS ELF image for the arch.
        ptx: PTX text (UTF-8 bytes, without the trailing NUL nvrtcGetPTX writes).
        log: the NVRTC log, including ptxas' resource report.
        resources: {symbol: {"registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes"}}
            for every entry function ptxas compiled.
        options: the NVRTC options used, in order.
    """

    cubin: bytes
    ptx: bytes
    log: str
    resources: dict
    options: tuple[str, ...]


def include_folders(include_dirs) -> list[Path]:
    """The `-I` folders of a compilation, in order: the given ones, then the pip CUDA headers where installed (the
    shipped kernels include no CUDA header; the headers are added for sources that do)."""
    headers = find_cuda_include_dir()
    return [Path(d) for d in (include_dirs or [])] + ([headers] if headers else [])


def compile_options(arch: str, defines: dict[str, int], include_dirs: list[Path]) -> list[str]:
    """NVRTC options: `-arch=<arch>`, C++17, `-I` dirs, sorted `-D` defines, and ptxas' verbose resource report."""
    opts = [f"-arch={arch}", STD]
    opts += [f"-I{d}" for d in include_dirs]
    opts += [f"-D{name}={int(value)}" for name, value in sorted(defines.items())]
    if arch.startswith("sm_"):
        opts += ["-Xptxas", "-v"]
    return opts


def compile_source(
    source: str,
    name: str,
    arch: str,
    defines: dict[str, int] | None = None,
    include_dirs: list[Path] | None = None,
    toolkit: int | None = None,
) -> CompiledSource:
    """Compile one CUDA C source with NVRTC.

    Args:
        source: the CUDA C text.
        name: the file name diagnostics are reported under (e.g. "routing.cu").
        arch: "sm_87" (cubin + PTX) or "compute_87" (PTX only; cubin is then b"").
        defines: `-D NAME=VALUE` compile-time constants.
        include_dirs: extra `-I` folders (the kernels folder for shared headers); the CUDA headers of
            pip packages (`find_cuda_include_dir`) are added when installed.
        toolkit: the CUDA major the profile requires; a different NVRTC major is refused.

    Raises:
        CompileError: NVRTC of another major than `toolkit` (naming the pip package), or a failed NVRTC call,
            with the log (`name(line): error: ...`).
    """
    nvrtc = _nvrtc()
    if toolkit is not None:
        major, minor = nvrtc_version()
        if major != toolkit:
            raise CompileError(
                f"the profile needs CUDA {toolkit} (target.toolkit = {toolkit}) but the installed NVRTC is "
                f"{major}.{minor}; install NVRTC {toolkit}: {toolkit_hint(toolkit, major)}"
            )
    options = compile_options(arch, defines or {}, include_folders(include_dirs))
    cubin, ptx, log = _compile_isolated(source, name, arch, options)
    return CompiledSource(cubin, ptx.rstrip(b"\x00"), log, parse_resources(log), tuple(options))


def _nvrtc_compile(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, bytes, str]:
    """(cubin, PTX with its NUL, log) of one NVRTC program, in this process. Raises CompileError."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        _check(nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded), f"nvrtcCompileProgram({name}, {arch})", prog)
        log = program_log(prog)
        ptx_size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * ptx_size
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        cubin = b""
        if arch.startswith("sm_"):
            cubin_size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * cubin_size
            _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, ptx, log


# ---- NVRTC in a child process
# While nvrtcCompileProgram runs, NVRTC puts its own SIGINT and SIGTERM handlers in place of the process's; a
# Ctrl-C or SIGTERM then reaching any thread (the main one, an OpenBLAS one) runs that handler, which calls exit(4)
# while the compilation goes on: the process ends with status 4 or SIGSEGV, with no message and no cleanup (a
# build's .NAME.partial-* folder stays behind). Measured: 6 of 12 SIGTERMs in a build's first 100 ms. So the
# compilations run in child Python processes, in a session of their own (a terminal's Ctrl-C does not reach them)
# and with both signals blocked; the calling process keeps Python's handlers, so a Ctrl-C or SIGTERM is a
# KeyboardInterrupt there and its cleanup runs (the child it was waiting on is killed). A child serves one
# compilation after another over its standard input and output (pickled arguments, pickled result) and stays for
# the next: starting one costs about 0.15 s (Python, then NVRTC's library), a compilation of a small kernel 0.07 s.
# Idle children wait in `_IDLE`, one per compilation that ran at once (the build's thread pool); a child whose
# exchange broke or was interrupted is killed, never reused; at exit (or when their stdin closes, the parent
# gone) they end.
_CHILD = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
sys.path[:] = [p for p in sys.path if p != ""] + ([sys.argv[1]] if sys.argv[1] not in sys.path else [])
import pickle
from colibri_sdk.aot.nvrtc import _nvrtc_compile
from colibri_sdk.errors import CompileError
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
while True:
    try:
        args = pickle.load(stdin)
    except EOFError:
        break
    try:
        result = (True, _nvrtc_compile(*args))
    except CompileError as exc:
        result = (False, str(exc))
    pickle.dump(result, stdout)
    stdout.flush()
"""

_IDLE: list = []  # (pid of the process that started it, Popen, stderr file) of the idle children
_IDLE_LOCK = threading.Lock()


def _start_child():
    """A new NVRTC child process (`python -c _CHILD`), its stderr in an unnamed temporary file. Raises OSError."""
    import subprocess
    import sys
    import tempfile

    root = str(Path(__file__).resolve().parents[2])  # the folder that holds the colibri_sdk package
    err = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True)
    except BaseException:
        err.close()
        raise
    return os.getpid(), proc, err


def _stop_child(child, wait: float = 5.0) -> tuple[int, str]:
    """End a child (stdin closed, then killed if it has not ended within `wait` seconds); its exit status and the
    last line it wrote to stderr ("nothing" if none)."""
    import subprocess

    _, proc, err = child
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        status = proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = proc.wait()
    proc.stdout.close()
    err.seek(0)
    last = (err.read().decode(errors="replace").strip().splitlines() or ["nothing"])[-1]
    err.close()
    return status, last


def _stop_idle_children() -> None:
    with _IDLE_LOCK:
        children, _IDLE[:] = list(_IDLE), []
    for child in children:
        if child[0] == os.getpid():
            _stop_child(child)


atexit.register(_stop_idle_children)
if hasattr(os, "register_at_fork"):  # a forked process must not share this one's children (their pipes)
    os.register_at_fork(after_in_child=lambda: _IDLE.clear())


def _compile_isolated(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, bytes, str]:
    """`_nvrtc_compile` in a child process (an idle one, or a new one: `_CHILD`, the arguments and result pickled
    over its standard input and output); in this process where no child can be started (pthread_sigmask missing,
    or the interpreter cannot be run).

    Raises:
        CompileError: NVRTC's (the same message as in this process), or the child ended without a result
            (naming the source, the arch, its exit status and the last line it wrote).
    """
    import pickle
    import sys

    if not hasattr(signal, "pthread_sigmask") or not sys.executable:
        return _nvrtc_compile(source, name, arch, options)
    child = None
    with _IDLE_LOCK:
        while _IDLE and child is None:
            candidate = _IDLE.pop()
            if candidate[0] == os.getpid() and candidate[1].poll() is None:
                child = candidate
    if child is None:
        try:
            child = _start_child()
        except OSError:
            return _nvrtc_compile(source, name, arch, options)
    proc = child[1]
    try:
        pickle.dump((source, name, arch, list(options)), proc.stdin)
        proc.stdin.flush()
        ok, value = pickle.load(proc.stdout)
    except (EOFError, OSError, pickle.UnpicklingError, ValueError, TypeError):  # the child ended without a result
        status, last = _stop_child(child)
        raise CompileError(f"{name} ({arch}): the NVRTC child process ended with status {status} and no result "
                           f"(its last line: {last})") from None
    except BaseException:  # KeyboardInterrupt, SIGTERM: the exchange is broken, the child is not reused
        _stop_child(child, wait=0)
        raise
    with _IDLE_LOCK:
        _IDLE.append(child)
    if not ok:
        raise CompileError(value)
    return value

# ptxas -v, per entry function:
#   ptxas info    : Compiling entry function 'colibri_routing' for 'sm_87'
#   ptxas info    : Function properties for colibri_routing
#   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
#   ptxas info    : Used 12 registers, used 1 barriers, 1024 bytes smem, 368 bytes cmem[0]
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, dict[str, int]]:
    """Registers, static shared memory, stack frame and spill bytes per entry function from a `-Xptxas -v` log.

    Returns:
        {symbol: {"registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes"}}, bytes;
        only entry functions (device functions that ptxas reports separately are not launchable).
    """
    out: dict[str, dict[str, int]] = {}
    entry = None  # the entry function whose report is being read
    props = None  # the function the next stack/spill line belongs to
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            out[entry] = {"registers": 0, "shared_bytes": 0, "stack_bytes": 0,
                          "spill_store_bytes": 0, "spill_load_bytes": 0}
            props = None
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif (m := _FRAME.search(line)) and props is not None and props == entry:
            stack, stores, loads = map(int, m.groups())
            out[entry].update(stack_bytes=stack, spill_store_bytes=stores, spill_load_bytes=loads)
        elif (m := _USED.search(line)) and entry is not None:
            out[entry]["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                out[entry]["shared_bytes"] = int(s.group(1))
    return out
