"""The device runtime: `probe ROOT` (what wheels this device can install) and `install ROOT VENV REQ SHA:FILE...`.

`install` links the shipped wheels (store objects, verified by `receive`) into ROOT/wheels/, creates the venv
(`python -m venv`, with ensurepip; without it when the device's Python lacks ensurepip and a pip wheel was
shipped), runs `pip install --no-index --find-links ROOT/wheels REQ` in it (the device never reaches an index),
checks that `python -m colibri_sdk --version` runs there, and records the venv in ROOT/runtime.json, which `plan`
returns so that `--verify` and the health check use it.

platform, subprocess and sysconfig are imported by the two operations that use them: every remote command starts a
Python with all the agent's modules, and `plan` (which reads the record) should not pay for them.
"""

import json
import os
import sys
import time

from .common import AgentError, Lock, check_rel, check_sha, emit, write_atomic
from .layout import make_dirs

RECORD = "runtime.json"


def read_record(root):
    """ROOT/runtime.json as a dict, or None."""
    try:
        with open(os.path.join(root, RECORD), "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def op_probe(root):
    """The device's machine, Python, ABI and C library, and the environment markers of PEP 508."""
    import platform
    import sysconfig

    libc, libc_version = platform.libc_ver()
    impl = sys.implementation
    version = "%d.%d.%d" % impl.version[:3]
    if impl.version.releaselevel != "final":
        version += impl.version.releaselevel[0] + str(impl.version.serial)
    markers = {
        "implementation_name": impl.name,
        "implementation_version": version,
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }
    emit({
        "machine": platform.machine(),
        "python": list(sys.version_info[:2]),
        "implementation": impl.name,
        "soabi": sysconfig.get_config_var("SOABI") or "",
        "debug": bool(sysconfig.get_config_var("Py_DEBUG")),
        "libc": [libc, libc_version],
        "executable": sys.executable,
        "markers": markers,
        "record": read_record(root),
    })


def run(argv, what, timeout=1800):
    """Run `argv`; its output, or AgentError with its ERROR lines (pip's) or its last line."""
    import subprocess

    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AgentError("%s did not finish within %d s" % (what, timeout))
    if proc.returncode != 0:
        lines = [l for l in proc.stdout.decode("utf-8", "replace").splitlines() if l.strip()]
        errors = [l.strip() for l in lines if l.strip().startswith("ERROR")] or lines[-1:]
        raise AgentError("%s failed (exit status %d): %s" % (what, proc.returncode, " / ".join(errors[-3:])))
    return proc.stdout.decode("utf-8", "replace")


def op_install(root, venv, requirement, *items):
    import subprocess

    make_dirs(root)
    venv = os.path.abspath(os.path.expanduser(venv))
    wheels = os.path.join(root, "wheels")
    os.makedirs(wheels, exist_ok=True)
    names = []
    with Lock(root):
        for item in items:
            sha, name = item.split(":", 1)
            check_sha(sha)
            if len(check_rel(name)) != 1 or not name.endswith(".whl"):
                raise AgentError("not a wheel file name: %r" % (name,))
            target = os.path.join(wheels, name)
            if os.path.lexists(target):
                os.unlink(target)
            os.link(os.path.join(root, "store", sha), target)
            names.append(name)
        python = os.path.join(venv, "bin", "python")
        pip_wheels = [n for n in names if n.startswith("pip-")]
        if not os.path.exists(python):
            try:
                run([sys.executable, "-m", "venv", venv], "python -m venv %s" % venv)
            except AgentError:
                if not pip_wheels:
                    raise AgentError("python -m venv %s failed: this Python has no ensurepip (on Ubuntu / JetPack: "
                                     "sudo apt install python3-venv), or put a pip wheel into --wheels" % venv)
                run([sys.executable, "-m", "venv", "--without-pip", venv], "python -m venv --without-pip %s" % venv)
        pip = [python, "-m", "pip"]
        if subprocess.run(pip + ["--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            if not pip_wheels:
                raise AgentError("the venv %s has no pip; put a pip wheel into --wheels" % venv)
            pip = [python, os.path.join(wheels, sorted(pip_wheels)[-1], "pip")]  # pip runs from its wheel
        run(pip + ["install", "--no-index", "--find-links", wheels, "--disable-pip-version-check", "--no-input",
                   "--force-reinstall", "--no-cache-dir", "--no-compile", requirement], "pip install %s" % requirement)
        version = run([python, "-m", "colibri_sdk", "--version"], "colibri-sdk in %s" % venv).strip()
        record = {"venv": venv, "python": python, "colibri": "%s -m colibri_sdk" % python, "version": version,
                  "requirement": requirement, "wheels": sorted(names), "installed": time.time()}
        write_atomic(os.path.join(root, RECORD), (json.dumps(record, sort_keys=True, indent=2) + "\n").encode())
    emit(record)
