"""`--install-runtime`: install colibri-sdk and the wheels it needs into a venv on the device, from this machine.

The device never reaches an index (a factory line usually cannot):

1. probe     the device's machine, CPython version and ABI, glibc (agent `probe`): the wheel tags it accepts
             (wheels.Device, packaging.tags)
2. wheels    colibri-sdk built here (`pip wheel --no-deps` of this source tree), and the closure of
             `colibri-sdk[jetson]` (numpy, cuda-bindings 12.x, cuda-pathfinder, ...) chosen for those tags from
             `--wheels DIR` and pip's cache of built wheels; anything missing stops here, naming each package and
             the `pip download --platform ...` command that fetches it
3. upload    the wheels travel as store objects (incremental, resumable, hashed on the device: transfer.py)
4. install   on the device (agent `install`): `python -m venv REMOTE_DIR/venv`, `pip install --no-index
             --find-links REMOTE_DIR/wheels colibri-sdk[jetson]==VERSION`, `python -m colibri_sdk --version`; then
             REMOTE_DIR/runtime.json records the venv, and `--verify` and the health check run
             `REMOTE_DIR/venv/bin/python -m colibri_sdk` unless --remote-colibri says otherwise.

The `jetson` extra pins cuda-bindings>=12,<13: JetPack 6's driver (540) cannot run cuda-bindings 13, which needs
a driver >= 580.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import __version__
from ..bundle import file_sha256
from .connection import Connection, Target
from .errors import RemoteCommandError, RuntimeInstallError
from .local_bundle import BundleFile
from .remote import RemoteAgent
from .store import DeviceStore
from .transfer import Upload, Uploader
from .wheels import Device, resolve

EXTRA = "jetson"
SDK_NAME = "colibri-sdk"
INSTALL_TIMEOUT_S = 1800.0  # pip on a Jetson's eMMC: minutes, not seconds


def source_tree() -> Path | None:
    """The colibri-sdk source tree to build the device's wheel from, or None: the tree this package runs from (an
    editable install or a checkout), else the current folder when it is a colibri-sdk checkout (a normal
    `pip install .` run from the checkout, as the README does)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        pyproject = root / "pyproject.toml"
        try:
            text = pyproject.read_text(encoding="utf-8", errors="replace") if pyproject.is_file() else ""
        except OSError:
            continue
        if 'name = "colibri-sdk"' in text and (root / "sdk" / "__init__.py").is_file():
            return root
    return None


# pyproject.toml's [build-system] requires: what an offline build (--no-build-isolation) needs installed here.
BUILD_SETUPTOOLS_MIN = 68


def _offline_build_possible() -> bool:
    """setuptools >= BUILD_SETUPTOOLS_MIN and wheel importable here, as pyproject.toml's build-system requires."""
    import importlib.metadata as metadata

    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return major >= BUILD_SETUPTOOLS_MIN and importlib.util.find_spec("wheel") is not None


def _pip_error(stderr: str) -> str:
    """The line of pip's output that names the failure: the last `error:` line that says more than one of pip's
    codes (`error: subprocess-exited-with-error`), else the last such code, else the last line that is no hint."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith(("hint:", "note:"))]
    specific = [line for line in errors if not re.fullmatch(r"error: [a-z-]+", line)]
    plain = [line for line in lines if not line.startswith(("hint:", "note:"))]
    return (specific or errors or plain or lines or ["(no output)"])[-1]


def build_sdk_wheel(out: Path) -> Path:
    """`pip wheel --no-deps` of the source tree into `out`: with `--no-build-isolation --no-index` when the build
    backend pyproject.toml asks for (setuptools >= 68 and wheel) is installed here, so no index is needed; else pip
    fetches it into an isolated build.

    Raises:
        RuntimeInstallError: no source tree, or the build failed (pip's error line quoted).
    """
    root = source_tree()
    if root is None:
        raise RuntimeInstallError(f"--install-runtime builds the device's colibri-sdk wheel from a colibri-sdk source "
                                  f"checkout, and there is none here (colibri-sdk runs from an installed copy and the "
                                  f"current folder is not a checkout): run it from inside the checkout, or build the "
                                  f"wheel there (pip wheel --no-deps . -w DIR: colibri_sdk-{__version__}-py3-none-any"
                                  f".whl) and pass --wheels DIR")
    offline = ["--no-build-isolation", "--no-index"] if _offline_build_possible() else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline,
                           "--disable-pip-version-check", "-q", "-w", str(out), str(root)],
                          capture_output=True, text=True)
    built = sorted(out.glob("colibri_sdk-*.whl"))
    if proc.returncode != 0 or not built:
        hint = "" if offline else (f" (pip needed an index for the build backend, setuptools>={BUILD_SETUPTOOLS_MIN} "
                                   f"and wheel: pip install 'setuptools>={BUILD_SETUPTOOLS_MIN}' wheel, or give "
                                   f"--wheels a colibri_sdk wheel)")
        raise RuntimeInstallError(f"building the colibri-sdk wheel from {root} failed (pip wheel exit status "
                                  f"{proc.returncode}): {_pip_error(proc.stderr + proc.stdout)}{hint}")
    return built[-1]


def pip_cache_wheels() -> list:
    """The wheels pip built and cached on this machine (`pip cache list --format=abspath`); [] when none."""
    proc = subprocess.run([sys.executable, "-m", "pip", "cache", "list", "--format=abspath",
                           "--disable-pip-version-check"], capture_output=True, text=True)
    return [Path(line) for line in proc.stdout.splitlines() if line.endswith(".whl")] if proc.returncode == 0 else []


def available_wheels(wheels_dir) -> list:
    """Wheel files in `wheels_dir` (if given), then in pip's cache.

    Raises:
        RuntimeInstallError: `wheels_dir` is not a folder.
    """
    files = []
    if wheels_dir is not None:
        folder = Path(wheels_dir).expanduser()
        if not folder.is_dir():
            raise RuntimeInstallError(f"--wheels {wheels_dir}: not a folder; expected a folder of .whl files (fill "
                                      f"it with pip download, see docs/deploy.md)")
        files += sorted(p for p in folder.iterdir() if p.name.endswith(".whl") and p.is_file())
    return files + pip_cache_wheels()


def install_runtime(target: Target, options, wheels_dir=None, progress=None) -> dict:
    """Install the device runtime on `target` under options.remote_dir (venv at REMOTE_DIR/venv).

    Returns:
        The device's record: {"venv", "python", "colibri", "version", "requirement", "wheels", "installed"}.

    Raises:
        RuntimeInstallError: wheels missing here (each named, with the pip download command), the colibri-sdk
            wheel cannot be built, or venv / pip / the import failed on the device (its error line quoted).
        DeployError subclasses: connection, authentication, disk full, ... as for a deploy.
    """
    files = available_wheels(wheels_dir)
    looked = ", ".join([f"--wheels {wheels_dir}"] if wheels_dir else []) or "no --wheels folder"
    requirement = f"{SDK_NAME}[{EXTRA}]=={__version__}"
    with tempfile.TemporaryDirectory(prefix="colibri-wheel-") as tmp, Connection(target) as conn:
        store = DeviceStore(RemoteAgent(conn, options.remote_dir, options.remote_python))
        device = Device.from_probe(store.probe())
        given = [p for p in files if p.name.startswith(f"colibri_sdk-{__version__}-")]
        # From an installed copy (no source tree here), a colibri_sdk wheel of this version in --wheels will do.
        local = {SDK_NAME: build_sdk_wheel(Path(tmp))} if source_tree() is not None or not given else {}
        chosen, missing = resolve(requirement, files, device, local=local)
        if missing:
            dest = str(wheels_dir or "wheels")
            raise RuntimeInstallError(
                f"{target.label}: no wheel for the device ({device.describe()}) of: "
                f"{', '.join(str(r) for r in missing)} (looked in {looked} and pip's wheel cache). Fetch them "
                f"on a machine with an index: {device.pip_download(missing, dest)} ; then run again with "
                f"--wheels {dest}")
        if not any(p.name.startswith("pip-") for p in chosen.values()):
            pip = next((p for p in files if p.name.startswith("pip-") and p.name.endswith("-py3-none-any.whl")), None)
            if pip is not None:  # lets the venv be made where the device's Python has no ensurepip
                chosen["pip"] = pip
        wheels = [BundleFile(p.name, file_sha256(p), p.stat().st_size, p) for p in chosen.values()]
        plan = store.plan({w.sha256: w.size for w in wheels})
        uploads = [Upload(w, plan.objects[w.sha256].offset) for w in wheels
                   if plan.objects[w.sha256].state != "stored"]
        if hasattr(progress, "add_total"):
            progress.add_total(sum(u.file.size - u.offset for u in uploads))
        Uploader(store.agent, options.streams, progress).upload(uploads)
        venv = f"{plan.root.rstrip('/')}/venv"
        try:
            return store.install(venv, requirement, [(w.sha256, w.path) for w in wheels],
                                 timeout=max(INSTALL_TIMEOUT_S, target.command_timeout))
        except RemoteCommandError as exc:
            if type(exc) is not RemoteCommandError:  # disk full, permission, timeout: already typed
                raise
            raise RuntimeInstallError(str(exc), exc.exit_status, exc.stderr) from None
