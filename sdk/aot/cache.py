"""A content-addressed cache of NVRTC output, so that a rebuild compiles only what changed (docs/build.md,
"NVRTC cache").

An entry is keyed by a sha256 of everything that decides the cubin and PTX bytes: the entry format, the NVRTC
version, the target arch, the CUDA major the profile asks for, the NVRTC options in order (`-arch`, the standard,
one `-I` per include folder, every `-D` constant), the source's name and bytes, and the name and bytes of every
file under each include folder, in the options' order (the kernels folder with `common.cuh`, and the CUDA headers
when they are installed). The same key therefore always stands for the same NVRTC input, and NVRTC gives the same
bytes for the same input: a bundle built through the cache is bit-identical to one built without it
(tests/build/test_nvrtc_cache.py). Where the include folders are (their paths) is not in the key: without `-G`
or `-lineinfo`, which the build never passes, no path reaches the cubin or the PTX (the same kernels compiled from
two folders give the same bytes, tests/build/test_nvrtc_cache.py), so another checkout, venv or install of the
same kernels finds the same entries. An answer from the cache carries the options of the call that asked for it
(its own `-I` paths); its log is the one NVRTC wrote for the entry.

Location: `$COLIBRI_CACHE_DIR` when set, else `${XDG_CACHE_HOME:-~/.cache}/colibri-sdk/nvrtc`. One file per
entry, `<key>.nvrtc`:

    b"colibri-nvrtc-cache 1\\n"          the format line
    64 hex digits + b"\\n"                sha256 of everything after this line
    8 bytes little-endian: n            the length of the JSON meta that follows
    meta (n bytes, UTF-8 JSON)          {"key", "cubin_bytes", "ptx_bytes", "log", "options"}
    cubin bytes, then PTX bytes

An entry is written to a temporary file in the cache folder and renamed into place (`os.replace`, atomic on POSIX):
a reader sees a whole entry or none. An entry whose format line, digest, key or sizes do not match (truncated,
corrupt, or another key's) is ignored, compiled again and replaced. An entry file that is not a regular file (a
FIFO, a device) or is larger than MAX_ENTRY_BYTES is never read. A cache folder that cannot be written makes the
build compile as if there were no cache (one warning).

What this protects against, and what not: the digest and the checks catch damage and accidents (a torn write, a
full disk, a bit flip, a file copied under another key's name, two builds racing). They do not stop a deliberate
edit: the digest is a plain sha256 that anyone can recompute, so whoever can write the cache folder can plant an
entry holding a cubin of their own, and a build through the cache ships it without notice (the bundle's checksums
are computed from what was written, so `verify` passes too). Keep the folder one only you write, and for a release
build with `--no-cache` or check the bundle with `colibri-sdk verify --rebuild` (colibri_sdk.aot.rebuild), which
compiles every kernel again without the cache and compares the bytes.

No library is used: an entry is a file named by a digest; none of the packages this project depends on offers a
content-addressed file cache, and the ones that do (diskcache, joblib.Memory) would add a dependency, pickles or a
SQLite index for what `hashlib`, `os.replace` and one folder do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import threading
from pathlib import Path

from . import nvrtc
from .nvrtc import CompiledSource, compile_options

log = logging.getLogger(__name__)

FORMAT_LINE = b"colibri-nvrtc-cache 1\n"
MAX_ENTRY_BYTES = 256 << 20  # an entry is 0.1-0.3 MB; a larger file is not one of ours and is not read
SUFFIX = ".nvrtc"
ENV_DIR = "COLIBRI_CACHE_DIR"


def home_dir() -> Path | None:
    """The user's home folder: `$HOME` when it is an absolute path, else the password database's entry for this
    user when that is absolute, else None (an empty or relative `HOME` would put the cache under the current
    folder, or under `/`)."""
    home = os.environ.get("HOME", "")
    if os.path.isabs(home):
        return Path(home)
    try:
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError, OSError):
        return None
    return Path(home) if os.path.isabs(home) else None


def default_cache_dir() -> Path | None:
    """`$COLIBRI_CACHE_DIR`, else `$XDG_CACHE_HOME/colibri-sdk/nvrtc`, else `~/.cache/colibri-sdk/nvrtc` (an empty
    variable counts as unset; a relative XDG_CACHE_HOME is ignored, as the XDG base directory specification says;
    `~` is `home_dir()`). None when no absolute home folder is known: the build then runs without the cache."""
    if os.environ.get(ENV_DIR):
        path = os.environ[ENV_DIR]
        if path == "~" or path.startswith("~/"):
            home = home_dir()
            return None if home is None else home / path[2:]
        try:
            return Path(path).expanduser()  # ~user/...
        except RuntimeError:  # no such user
            return None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "colibri-sdk" / "nvrtc"
    home = home_dir()
    return None if home is None else home / ".cache" / "colibri-sdk" / "nvrtc"


_folder_digests: dict[tuple, str] = {}
_folder_lock = threading.Lock()


def folder_digest(folder: Path) -> str:
    """sha256 of the relative path and bytes of every file under `folder` (sorted; "" when it is not a folder),
    but Python's byte code (`__pycache__/`, `*.pyc`: no `#include` reads it, and pip rewrites it, with the source's
    time in it, on every install of the package's kernels folder). Remembered per process for an unchanged listing
    (path, size and mtime of every file)."""
    folder = Path(folder)
    if not folder.is_dir():
        return ""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".pyc"
                   and "__pycache__" not in p.relative_to(folder).parts)
    listing = tuple((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    memo = (str(folder.resolve()), listing)
    with _folder_lock:
        if memo in _folder_digests:
            return _folder_digests[memo]
    digest = hashlib.sha256()
    for path, (rel, _, _) in zip(files, listing):
        data = path.read_bytes()
        digest.update(rel.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    with _folder_lock:
        _folder_digests[memo] = digest.hexdigest()
    return _folder_digests[memo]


def cache_key(source: str, name: str, arch: str, defines: dict | None, include_dirs, toolkit: int | None) -> str:
    """The sha256 (64 hex digits) of one NVRTC compilation's input, as `nvrtc.compile_source` would run it."""
    return _key(source, name, arch, defines, nvrtc.include_folders(include_dirs), toolkit)


def _key(source: str, name: str, arch: str, defines: dict | None, dirs: list[Path], toolkit: int | None) -> str:
    """`cache_key` with the `-I` folders already resolved (`nvrtc.include_folders`)."""
    # the include folders by position and content, not by path (module docstring)
    options = compile_options(arch, defines or {}, [Path(f"<include {i}>") for i in range(len(dirs))])
    record = {
        "format": FORMAT_LINE.decode().strip(),
        "nvrtc": list(nvrtc.nvrtc_version()),
        "arch": arch,
        "toolkit": toolkit,
        "options": options,
        "name": name,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "includes": [folder_digest(d) for d in dirs],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def encode_entry(key: str, out: CompiledSource) -> bytes:
    """The bytes of the entry file for `out` (layout in the module docstring)."""
    meta = json.dumps({"key": key, "cubin_bytes": len(out.cubin), "ptx_bytes": len(out.ptx), "log": out.log,
                       "options": list(out.options)}, sort_keys=True).encode()
    body = struct.pack("<Q", len(meta)) + meta + out.cubin + out.ptx
    return FORMAT_LINE + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode_entry(data: bytes, key: str) -> CompiledSource | None:
    """The CompiledSource an entry file holds, or None when it is not a whole, intact entry for `key`."""
    head = len(FORMAT_LINE) + 65
    if len(data) < head + 8 or not data.startswith(FORMAT_LINE) or data[head - 1:head] != b"\n":
        return None
    body = data[head:]
    if hashlib.sha256(body).hexdigest().encode() != data[len(FORMAT_LINE):head - 1]:
        return None
    (n,) = struct.unpack("<Q", body[:8])
    try:
        meta = json.loads(body[8:8 + n])
        cubin_bytes, ptx_bytes = meta["cubin_bytes"], meta["ptx_bytes"]
        sizes_ok = all(type(v) is int and v >= 0 for v in (cubin_bytes, ptx_bytes))
        ok = sizes_ok and meta["key"] == key and 8 + n + cubin_bytes + ptx_bytes == len(body)
        logtext, options = meta["log"], meta["options"]
        ok = ok and isinstance(logtext, str) and isinstance(options, list)
        ok = ok and all(isinstance(o, str) for o in options)
    except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, not a record, nested past the parser
        return None
    if not ok:
        return None
    options = tuple(options)
    cubin = body[8 + n:8 + n + cubin_bytes]
    ptx = body[8 + n + cubin_bytes:]
    return CompiledSource(cubin, ptx, logtext, nvrtc.parse_resources(logtext), options)


def read_entry_file(path: Path) -> bytes | None:
    """The bytes of the regular file at `path` (a symlink is followed), or None when it is missing, unreadable,
    not a regular file (a FIFO, a device, a folder: opened without blocking and never read) or larger than
    MAX_ENTRY_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY_BYTES:
            log.debug("nvrtc cache: ignoring %s (not a regular file of at most %d bytes)", path, MAX_ENTRY_BYTES)
            return None
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew while read is not taken as whole
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks) if left > 0 else None
    except OSError:
        return None
    finally:
        os.close(fd)


class NvrtcCache:
    """NVRTC output by content (`cache_key`), one file per entry in `folder`; thread-safe. Trusts whoever can write
    `folder` (module docstring: damage is caught, a planted entry is not).

    Attributes:
        folder: where the entries live (`default_cache_dir()` unless given); None when no absolute home folder is
            known and no `$COLIBRI_CACHE_DIR` / absolute `$XDG_CACHE_HOME` is set: nothing is read or kept.
        hits, misses: compilations answered from the cache / run by NVRTC (a corrupt entry counts as a miss).
        unwritable: True once an entry could not be written (the folder cannot be created or written; warned once).
    """

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        self._no_folder_reason = (f"no cache folder: HOME = {os.environ.get('HOME', '')!r} is not an absolute path "
                                  f"and this user has no absolute home folder; set {ENV_DIR}")
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self.unwritable = False

    def path(self, key: str) -> Path | None:
        """The entry file of `key` (None without a folder)."""
        if self.folder is None:
            return None
        return self.folder / f"{key}{SUFFIX}"

    def get(self, key: str) -> CompiledSource | None:
        """The entry of `key`, or None when it is missing or not intact (then it is logged at debug level)."""
        if self.folder is None:
            return None
        data = read_entry_file(self.path(key))
        if data is None:
            return None
        found = decode_entry(data, key)
        if found is None:
            log.debug("nvrtc cache: ignoring the damaged entry %s (compiled again)", self.path(key))
        return found

    def put(self, key: str, out: CompiledSource) -> None:
        """Write the entry of `key` atomically (a temporary file renamed into place); a folder that cannot be
        written is warned about once and otherwise ignored."""
        tmp = None
        try:
            if self.folder is None:
                raise OSError(self._no_folder_reason)
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key[:16]}-", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(encode_entry(key, out))
            os.replace(tmp, self.path(key))
            tmp = None
        except OSError as exc:
            with self._lock:
                warn, self.unwritable = not self.unwritable, True
            if warn and self.folder is None:
                log.warning("nvrtc cache: %s; compiling without the cache", self._no_folder_reason)
            elif warn:
                log.warning("nvrtc cache: cannot write to %s (%s); compiling without the cache",
                            self.folder, exc.strerror or exc)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def compile_source(self, source: str, name: str, arch: str, defines: dict | None = None,
                       include_dirs=None, toolkit: int | None = None) -> CompiledSource:
        """`nvrtc.compile_source` answered from the cache when the same input was compiled before; a successful
        compilation is stored (a failure raises CompileError every time and stores nothing).

        Raises:
            CompileError: as `nvrtc.compile_source`.
        """
        dirs = nvrtc.include_folders(include_dirs)
        key = _key(source, name, arch, defines, dirs, toolkit)
        found = self.get(key)
        if found is not None:
            with self._lock:
                self.hits += 1
            # the entry may come from the same kernels in another folder: the options name this call's folders
            return dataclasses.replace(found, options=tuple(compile_options(arch, defines or {}, dirs)))
        out = nvrtc.compile_source(source, name, arch, defines, include_dirs, toolkit=toolkit)
        with self._lock:
            self.misses += 1
        self.put(key, out)
        return out
