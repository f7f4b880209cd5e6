"""Choosing wheels for a device that cannot reach an index: its platform tags, and the dependency closure of a
requirement from the wheels at hand.

The device says what it is (agent `probe`: machine, CPython version, SOABI, glibc version, PEP 508 markers); the
tags it accepts are computed here with `packaging.tags` (the same code pip uses): `cpython_tags` and
`compatible_tags` for the device's interpreter and ABI, over the manylinux platforms its glibc supports
(PEP 600: manylinux_2_M for every M from its glibc's minor down to 17, or to 5 on x86_64, with the legacy
aliases manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5; then linux_ARCH). Wheel file names are
parsed with `packaging.utils.parse_wheel_filename`, requirements and markers with `packaging.requirements`.
A JetPack 6 device (aarch64, CPython 3.10, glibc 2.35) accepts e.g. `numpy-1.26.4-cp310-cp310-manylinux_2_17_
aarch64.manylinux2014_aarch64.whl` and not the x86_64, cp311 or manylinux_2_38 builds of it.
"""

from __future__ import annotations

import email.parser
import shlex
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from .errors import DeployError

LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


@dataclass(frozen=True)
class Device:
    """What decides which wheels a device can install.

    Attributes:
        machine: `platform.machine()` there ("aarch64", "x86_64").
        python: (major, minor) of its CPython.
        abi: the CPython ABI tag ("cp310"; "cp313t" free-threaded, "cp310d" debug).
        glibc: (major, minor) of its C library.
        markers: its PEP 508 environment (python_version, platform_machine, sys_platform, ...).
    """

    machine: str
    python: tuple
    abi: str
    glibc: tuple
    markers: dict

    @classmethod
    def from_probe(cls, probe: dict) -> "Device":
        """From the agent's `probe` answer.

        Raises:
            DeployError: not CPython, or not a glibc Linux (no wheels of ours are built for those).
        """
        if probe.get("implementation") != "cpython":
            raise DeployError(f"the device's Python is {probe.get('implementation')!r}; --install-runtime needs "
                              f"CPython (its wheels are built for it)")
        libc, version = probe.get("libc") or ["", ""]
        if libc != "glibc" or not version:
            raise DeployError(f"the device's C library is {libc or 'unknown'!r}; --install-runtime needs a glibc "
                              f"Linux (manylinux wheels)")
        major, minor = (int(p) for p in version.split(".")[:2])
        py = tuple(int(v) for v in probe["python"][:2])
        abi = f"cp{py[0]}{py[1]}"
        soabi = probe.get("soabi") or ""  # e.g. cpython-310-aarch64-linux-gnu, cpython-313t-x86_64-linux-gnu
        if soabi.startswith("cpython-"):
            abi = "cp" + soabi.split("-")[1]
        elif probe.get("debug"):
            abi += "d"
        return cls(probe["machine"], py, abi, (major, minor), dict(probe.get("markers") or {}))

    @property
    def platforms(self) -> list:
        """Platform tags, most specific first: manylinux_2_M_ARCH (and legacy aliases), then linux_ARCH."""
        major, minor = self.glibc
        lowest = 5 if self.machine in ("x86_64", "i686") else 17
        out = []
        if major == 2:
            for m in range(minor, lowest - 1, -1):
                out.append(f"manylinux_2_{m}_{self.machine}")
                if m in LEGACY_MANYLINUX:
                    out.append(f"{LEGACY_MANYLINUX[m]}_{self.machine}")
        return out + [f"linux_{self.machine}"]

    @property
    def tags(self) -> list:
        """Every wheel tag the device accepts, in pip's order of preference."""
        platforms = self.platforms
        return [*cpython_tags(self.python, abis=[self.abi], platforms=platforms),
                *compatible_tags(self.python, interpreter=f"cp{self.python[0]}{self.python[1]}",
                                 platforms=platforms)]

    def describe(self) -> str:
        return (f"{self.machine}, CPython {self.python[0]}.{self.python[1]} ({self.abi}), "
                f"glibc {self.glibc[0]}.{self.glibc[1]}")

    def pip_download(self, requirements, dest: str) -> str:
        """The `pip download` command that fetches wheels of `requirements` (and their dependencies) for this
        device on any machine with an index."""
        platforms = [self.platforms[0]] + [p for p in self.platforms if p.startswith("manylinux2014")]
        argv = ["pip", "download", "--only-binary=:all:", *(f"--platform={p}" for p in platforms),
                f"--python-version={self.python[0]}{self.python[1]}", "--implementation=cp", f"--abi={self.abi}",
                "-d", dest, *(str(r) for r in requirements)]
        return shlex.join(argv)


def select_wheel(requirement: Requirement, files, device: Device) -> Path | None:
    """The wheel of `files` for `requirement` that `device` installs: the highest version the specifier allows
    (no pre-releases unless it names one), then the tag the device prefers most. None when there is none."""
    ranks = {tag: i for i, tag in enumerate(device.tags)}
    name = canonicalize_name(requirement.name)
    best, best_key = None, None
    for path in files:
        try:
            wheel_name, version, _, tags = parse_wheel_filename(Path(path).name)
        except InvalidWheelFilename:
            continue
        if wheel_name != name or not requirement.specifier.contains(
                version, prereleases=bool(requirement.specifier.prereleases)):
            continue
        rank = min((ranks[t] for t in tags if t in ranks), default=None)
        if rank is None:
            continue
        key = (version, -rank)
        if best_key is None or key > best_key:
            best, best_key = Path(path), key
    return best


def wheel_requirements(path: Path) -> list:
    """Requires-Dist of a wheel's METADATA, as Requirement objects.

    Raises:
        DeployError: not a readable wheel.
    """
    try:
        with zipfile.ZipFile(path) as z:
            meta = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
            if meta is None:
                raise DeployError(f"wheel {path} has no .dist-info/METADATA")
            message = email.parser.BytesParser().parsebytes(z.read(meta), headersonly=True)
    except (OSError, zipfile.BadZipFile) as exc:
        raise DeployError(f"wheel {path} cannot be read ({exc})") from None
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def resolve(requirement: str, files, device: Device, local: dict | None = None) -> tuple:
    """The wheels that install `requirement` on `device`, dependencies included, from `files`.

    Each name gets the highest version its requirements seen so far allow (select_wheel); where a later requirement
    excludes the version chosen (numba's numpy<2.1 after colibri-sdk's numpy>=1.22 took numpy 2.2), its specifier
    joins that name's constraints and the resolution starts again, at most RESOLVE_ROUNDS times. A wheel in `local`
    is never replaced.

    Args:
        local: {canonical name: wheel path} chosen beforehand (the colibri-sdk wheel built here).

    Returns:
        ({canonical name: wheel path}, [Requirement missing]) — nothing in `files` fits those.
    """
    constraints: dict = {}
    for _ in range(RESOLVE_ROUNDS):
        chosen, missing, conflict = _resolve_once(requirement, files, device, local or {}, constraints)
        if conflict is None:
            break
        name, specifier = conflict
        constraints[name] = constraints.get(name, SpecifierSet()) & specifier
    return chosen, list({str(r): r for r in missing}.values())  # each missing requirement once


RESOLVE_ROUNDS = 16  # restarts with a new constraint; each adds one specifier, so a handful suffice


def _resolve_once(requirement: str, files, device: Device, local: dict, constraints: dict) -> tuple:
    """One pass of `resolve`: (chosen, missing, conflict) where conflict is (name, specifier) of the first
    requirement that excludes a version chosen earlier in this pass and is not yet among `constraints`, else None."""
    chosen = dict(local)
    missing, queue, seen = [], [(Requirement(requirement), None)], set()
    while queue:
        req, parent_extras = queue.pop(0)
        key = (str(req), parent_extras)
        if key in seen:
            continue
        seen.add(key)
        name = canonicalize_name(req.name)
        path = chosen.get(name)
        if path is None:
            wanted = Requirement(str(req))
            wanted.specifier = req.specifier & constraints.get(name, SpecifierSet())
            path = select_wheel(wanted, files, device)
            if path is None:
                missing.append(_without_marker(wanted))
                continue
            chosen[name] = path
        elif not req.specifier.contains(parse_wheel_filename(path.name)[1], prereleases=True):
            known = constraints.get(name, SpecifierSet())
            if name not in local and (known & req.specifier) != known:
                return chosen, missing, (name, req.specifier)
            missing.append(_without_marker(req))
            continue
        for dep in wheel_requirements(path):
            if dep.marker is None or any(dep.marker.evaluate({**device.markers, "extra": e})
                                         for e in (sorted(req.extras) or [""])):
                queue.append((dep, tuple(sorted(req.extras))))
    return chosen, missing, None


def _without_marker(req: Requirement) -> Requirement:
    """`req` as pip download takes it: name, extras and versions (the marker was evaluated for the device)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return Requirement(f"{req.name}{extras}{req.specifier}")
