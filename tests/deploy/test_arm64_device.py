"""An emulated arm64 device, end to end: a Debian arm64 root (scripts/arm64_device.sh setup) whose programs run
under qemu-user-static through binfmt_misc, with its own sshd on 127.0.0.1. Everything on the 'device' is aarch64:
the deploy agent (its `python3`), the venv `--install-runtime` makes, pip, NumPy's OpenBLAS, `colibri-sdk verify`.

What a user does for a Jetson, step by step, each through the CLI (`python -m colibri_sdk`):
1. `deploy --install-runtime --wheels EMPTY` names the missing wheels and the `pip download` command for the
   device (aarch64, its CPython, its glibc);
2. that command, run here, fetches them (cached beside the root; skipped, saying so, when PyPI cannot be reached);
3. `deploy --install-runtime --wheels DIR` installs colibri-sdk[jetson] into ~/colibri/venv on the device;
4. `deploy BUNDLE --verify --verify-backend cpu` runs the bundle's self-test there before the switch;
5. the device's CPU backend output for the self-test inputs and for other inputs equals this machine's to fp32
   rounding (not bit for bit: OpenBLAS's sgemm kernels for ARMv8 and for x86-64 add in other orders).

Skipped, with the reason, unless COLIBRI_ARM64=1 asks for it (`bash scripts/arm64_device.sh test` makes the root once
and runs this file so). Minutes: everything on the device runs emulated.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sshd_server import free_port, keygen, stop_process

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "arm64_device.sh"
PROFILE = REPO / "profiles" / "orin.yaml"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri-sdk"
ROOT = Path(os.environ.get("COLIBRI_ARM64_ROOT") or CACHE / "arm64-root")
MARKER = ROOT / ".colibri-arm64-root"
WHEELS = ROOT.parent / (ROOT.name + "-wheels")  # aarch64 wheels fetched here once, beside the root
USER = "colibri"
# The CPU qemu emulates: Orin's Cortex-A78AE is ARMv8.2-A without SVE; qemu's closest model is the Cortex-A76. Its
# default ("max") has SVE, which OpenBLAS then uses and TCG runs about 6x slower (verify: 155 s instead of 25 s).
CPU = os.environ.get("COLIBRI_ARM64_CPU") or "cortex-a76"
EMULATED_S = 900  # seconds one remote command may take there (--install-runtime: 3.5-6.5 min on 2 busy cores)

pytestmark = [pytest.mark.arm64, pytest.mark.ssh, pytest.mark.slow]


def unavailable_reason() -> str | None:
    """Why the emulated device cannot run here, or None."""
    if os.geteuid() != 0:
        return f"the arm64 device needs root (chroot, binfmt_misc, its sshd); running as uid {os.geteuid()}"
    for tool in ("ssh", "ssh-keygen", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} not found (openssh-client, util-linux, coreutils)"
    if os.environ.get("COLIBRI_ARM64") != "1":  # an opt-in even where the root exists: ten minutes, emulated
        return (f"the emulated arm64 device runs on request: `bash scripts/arm64_device.sh test` (makes the root at "
                f"{ROOT} once with debootstrap + qemu, then runs this file; or COLIBRI_ARM64=1)")
    return None


@pytest.fixture(scope="module")
def root():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not MARKER.is_file() or not entry.is_file() or entry.read_text().split()[0] != "enabled":
        # makes the root (once), registers qemu-aarch64 with binfmt_misc (after each boot)
        proc = subprocess.run(["bash", str(SCRIPT), "setup"], capture_output=True, text=True,
                              env={**os.environ, "COLIBRI_ARM64_ROOT": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
    return ROOT


class Device:
    """sshd of the arm64 root on 127.0.0.1:port (in its own mount namespace, so its /proc goes with it)."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        conf = root / "etc" / "colibri-test"
        conf.mkdir(parents=True, exist_ok=True)
        self.host_key = keygen(conf / "host_ed25519")
        self.user_key = keygen(conf / "user_ed25519")
        (conf / "authorized_keys").write_text(self.user_key.with_suffix(".pub").read_text())
        (conf / "authorized_keys").chmod(0o644)
        (conf / "sshd_config").write_text("\n".join([
            "ListenAddress 127.0.0.1", f"Port {self.port}", "HostKey /etc/colibri-test/host_ed25519",
            "AuthorizedKeysFile /etc/colibri-test/authorized_keys", "PidFile none", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PubkeyAuthentication yes", "UsePAM no", "StrictModes no",
            "MaxStartups 64:30:128", "MaxSessions 64", "LogLevel ERROR", f"SetEnv QEMU_CPU={CPU}", ""]))
        (root / "run" / "sshd").mkdir(parents=True, exist_ok=True)
        self.known_hosts = conf / "known_hosts"  # read here, by the deploying machine
        kind, blob = self.host_key.with_suffix(".pub").read_text().split()[:2]
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {kind} {blob}\n")
        self.log = open(conf / "sshd.log", "ab")
        inner = "mount -t proc proc /proc && exec /usr/sbin/sshd -D -e -f /etc/colibri-test/sshd_config"
        self.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "chroot", str(root),
                                         "/bin/sh", "-c", inner], stdout=self.log, stderr=self.log,
                                        stdin=subprocess.DEVNULL, env={**os.environ, "QEMU_CPU": CPU})
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the device's sshd exited with {self.process.returncode}: "
                                   f"{(self.root / 'etc/colibri-test/sshd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.settimeout(10.0)
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the device's sshd did not answer on 127.0.0.1:{self.port} within {timeout} s")

    def cli(self) -> list:
        """The deploy options that reach this device."""
        return ["--host", f"{USER}@127.0.0.1:{self.port}", "--identity", str(self.user_key), "--known-hosts",
                str(self.known_hosts), "--timeout", str(EMULATED_S), "-q"]

    def ssh(self, command: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
        """Run `command` on the device with OpenSSH's client (as the deploy user)."""
        return subprocess.run(["ssh", "-p", str(self.port), "-i", str(self.user_key), "-o", "BatchMode=yes",
                               "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
                               f"{USER}@127.0.0.1", command], input=stdin, capture_output=True,
                              timeout=EMULATED_S)

    def stop(self) -> None:
        stop_process(self.process, 20)
        self.log.close()


@pytest.fixture(scope="module")
def device(root):
    home = root / "home" / USER / "colibri"
    shutil.rmtree(home, ignore_errors=True)  # a fresh device: no store, no venv
    dev = Device(root)
    yield dev
    dev.stop()


def colibri(*args, timeout: float = 2 * EMULATED_S) -> subprocess.CompletedProcess:
    """`python -m colibri_sdk ARGS` here, from the checkout (--install-runtime builds the wheel from it)."""
    return subprocess.run([sys.executable, "-m", "colibri_sdk", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wheels(device, tmp_path_factory):
    """The device's wheels, fetched with the `pip download` command the installer prints for it."""
    empty = tmp_path_factory.mktemp("no_wheels")
    proc = colibri("deploy", *device.cli(), "--install-runtime", "--wheels", str(empty))
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert "no wheel for the device (aarch64, CPython 3." in line, line
    command = line.split("Fetch them on a machine with an index: ", 1)[1].split(" ; then run again", 1)[0]
    argv = shlex.split(command)
    assert argv[:2] == ["pip", "download"] and "--platform=manylinux2014_aarch64" in argv, command
    argv[argv.index("-d") + 1] = str(WHEELS)
    WHEELS.mkdir(parents=True, exist_ok=True)
    fetch = subprocess.run([sys.executable, "-m", *argv, "-q", "--disable-pip-version-check"], capture_output=True,
                           text=True, timeout=600)
    if fetch.returncode != 0 and not any(WHEELS.glob("*.whl")):  # else: the ones fetched before (offline now)
        pytest.skip(f"pip download of the device's wheels failed here (no index?): "
                    f"{(fetch.stderr.strip().splitlines() or ['?'])[-1]}")
    return WHEELS


@pytest.fixture(scope="module")
def installed(device, wheels):
    started = time.monotonic()
    proc = colibri("deploy", *device.cli(), "--install-runtime", "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stderr
    print(f"\n--install-runtime on the emulated device: {time.monotonic() - started:.0f} s: {proc.stdout.strip()}")
    return proc.stdout


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The demo model built for profiles/orin.yaml (NVRTC, no GPU): shapes 1x16 and 4x16."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import load_profile

    return build_bundle(load_profile(PROFILE), tmp_path_factory.mktemp("arm64") / "orin").path


def test_the_device_is_aarch64(device):
    proc = device.ssh("uname -m; python3 -c 'import platform, sys; print(platform.machine(), sys.version_info[:2])'")
    assert proc.returncode == 0, proc.stderr
    uname, python = proc.stdout.decode().splitlines()
    assert uname == "aarch64" and python.startswith("aarch64 (3, "), proc.stdout


def test_install_runtime_puts_aarch64_wheels_in_a_venv_there(device, installed):
    home = device.root / "home" / USER / "colibri"
    record = json.loads((home / "runtime.json").read_text())
    assert record["venv"] == "/home/colibri/colibri/venv", record
    assert installed.strip().endswith(f"in /home/colibri/colibri/venv ({len(record['wheels'])} wheels)")
    names = sorted(os.listdir(home / "wheels"))
    binary = [n for n in names if not n.endswith("-none-any.whl")]
    # numba (the CPU backend's kernels) and its llvmlite are binary wheels too
    assert {n.split("-")[0] for n in binary} == {"numpy", "cuda_bindings", "numba", "llvmlite"}, names
    assert all(n.endswith("aarch64.whl") for n in binary), names
    dists = {n.split("-")[0] for n in names}
    wanted = {"colibri_sdk", "numpy", "threadpoolctl", "numba", "llvmlite", "cuda_bindings"}
    assert wanted <= dists <= wanted | {"cuda_pathfinder", "pip"}, names  # cuda-bindings >= 12.9.1 needs pathfinder
    proc = device.ssh("colibri/venv/bin/python -c 'import platform, numpy, colibri_sdk, cuda.bindings; "
                      "print(platform.machine(), numpy.__file__, colibri_sdk.__file__)'")
    assert proc.returncode == 0, proc.stderr
    machine, numpy_at, sdk_at = proc.stdout.decode().split()
    assert machine == "aarch64" and numpy_at.startswith("/home/colibri/colibri/venv/") and \
        sdk_at.startswith("/home/colibri/colibri/venv/"), proc.stdout


def test_deploy_verify_on_the_cpu_backend_there(device, installed, bundle):
    started = time.monotonic()
    proc = colibri("deploy", str(bundle), *device.cli(), "--verify", "--verify-backend", "cpu")
    assert proc.returncode == 0, proc.stderr
    print(f"\ndeploy --verify --verify-backend cpu on the emulated device: {time.monotonic() - started:.0f} s:\n"
          f"{proc.stdout.strip()}")
    assert "(self-test passed on cpu)" in proc.stdout and "  self-test passed on cpu: max abs err" in proc.stdout
    assert (device.root / "home" / USER / "colibri" / "current").is_symlink()


# The device's CPU backend on inputs sent over SSH (.npz on stdin), its outputs back (.npz on stdout).
DEVICE_PROGRAM = """
import io, platform, sys
import numpy as np
from threadpoolctl import threadpool_info
from colibri_sdk.runtime import Runtime
inputs = np.load(io.BytesIO(sys.stdin.buffer.read()))
with Runtime.load(sys.argv[1], backend="cpu") as rt:
    outputs = {name: rt.infer(inputs[name]) for name in inputs.files}
out = io.BytesIO()
np.savez(out, **outputs)
sys.stdout.buffer.write(out.getvalue())
blas = [(i.get("internal_api"), i.get("version"), i.get("architecture")) for i in threadpool_info()]
print(platform.machine(), np.__version__, blas, file=sys.stderr)
"""


def test_output_on_the_device_equals_this_machines_cpu_backend(device, installed, bundle):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.runtime import Runtime

    current = "/home/colibri/colibri/current"
    proc = colibri("deploy", str(bundle), *device.cli())  # the bundle active there (a no-op when already)
    assert proc.returncode == 0, proc.stderr
    opened = Bundle.open(bundle)
    rng = np.random.default_rng(23)
    inputs = {}
    with Runtime.load(bundle, backend="cpu") as rt:
        for batch, tokens in rt.shapes:
            x, _, _, _ = opened.for_shape(batch, tokens).selftest()
            inputs[f"selftest_{batch}x{tokens}"] = np.ascontiguousarray(x, dtype=np.float32)
            inputs[f"normal_{batch}x{tokens}"] = rng.standard_normal((batch, tokens, rt.hidden_size),
                                                                     dtype=np.float32)
        inputs["short_1x5"] = rng.standard_normal((1, 5, rt.hidden_size), dtype=np.float32)  # padded to 1x16
        here = {name: rt.infer(x) for name, x in inputs.items()}
    sent = io.BytesIO()
    np.savez(sent, **inputs)
    run = device.ssh(f"colibri/venv/bin/python -c {shlex.quote(DEVICE_PROGRAM)} {current}", stdin=sent.getvalue())
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    print(f"\nthe device: {run.stderr.decode().strip()}")
    there = np.load(io.BytesIO(run.stdout))
    assert sorted(there.files) == sorted(inputs)
    for name in inputs:
        a, b = there[name], here[name]
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, name
        diff = np.abs(a.astype(np.float64) - b)
        # fp32 rounding: sums over hidden/intermediate (256..1024 terms) in another order differ by a few ulp of
        # the largest partial sum; 64 ulp of max|y| bounds that with room, and is far below a wrong expert
        # (which moves the output by the size of an expert's contribution, ~10-100 % of |y|).
        bound = 64 * np.finfo(np.float32).eps * float(np.abs(b).max())
        print(f"  {name}: bitwise equal {np.array_equal(a, b)}, max |y| {np.abs(b).max():.3g}, max |diff| "
              f"{diff.max():.3g} = {diff.max() / (np.finfo(np.float32).eps * np.abs(b).max()):.1f} eps x max|y| "
              f"(bound 64), {np.count_nonzero(a != b)} of {a.size} values differ")
        assert diff.max() <= bound, (name, diff.max(), bound)
