"""A throw-away OpenSSH server on 127.0.0.1 for the deploy tests and the deploy benchmark.

`SshServer.start(workdir)` writes an ed25519 host key, an ed25519 user key, an authorized_keys file and an
sshd_config into `workdir`, starts `/usr/sbin/sshd -D -e -f CONFIG` on a free loopback port and waits until it
answers. Its commands run in the login user's shell without that user's ~/.bashrc, on sshd's default PATH. Needs
root (sshd switches to the logged-in user) and the `openssh-server` package.
"""

from __future__ import annotations

import fcntl
import getpass
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def sshd_unavailable_reason() -> str | None:
    """Why a local sshd cannot be started here, or None when it can."""
    if not Path(SSHD).exists():
        return f"{SSHD} not found (apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (apt-get install openssh-client)"
    if os.geteuid() != 0:
        return "sshd needs root to start on 127.0.0.1 for the tests (running as uid %d)" % os.geteuid()
    return None


def stop_process(process: subprocess.Popen, grace_s: float) -> None:
    """Terminate `process` if it still runs; kill it if it has not exited `grace_s` seconds later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, kind: str = "ed25519") -> Path:
    """Write an unencrypted key pair `path` / `path.pub` of `kind` (ed25519, ecdsa, rsa)."""
    extra = ["-b", "2048"] if kind == "rsa" else []
    for old in (path, path.with_name(path.name + ".pub")):
        old.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C", "colibri-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return path


@dataclass
class SshServer:
    """A running sshd; `stop()` ends it."""

    workdir: Path
    port: int
    user: str
    user_key: Path
    host_keys: list
    process: subprocess.Popen

    @classmethod
    def start(cls, workdir: Path, host_key_types=("ed25519",), port: int | None = None) -> "SshServer":
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        host_keys = [keygen(workdir / f"host_{kind}", kind) for kind in host_key_types]
        user_key = keygen(workdir / "user_ed25519")
        authorized = workdir / "authorized_keys"
        authorized.write_text((user_key.with_suffix(".pub")).read_text())
        # Parallel test workers each start an sshd: one at a time picks a free port and waits until its sshd
        # listens there, so no two pick the same port (the lock file is beside the other temp files).
        with open(Path(tempfile.gettempdir()) / "colibri-test-sshd.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return cls._start_locked(workdir, host_keys, user_key, authorized, port or free_port())

    @classmethod
    def _start_locked(cls, workdir: Path, host_keys: list, user_key: Path, authorized: Path,
                      port: int) -> "SshServer":
        config = workdir / "sshd_config"
        lines = [
            "ListenAddress 127.0.0.1",
            f"Port {port}",
            *[f"HostKey {k}" for k in host_keys],
            f"AuthorizedKeysFile {authorized}",
            f"PidFile {workdir / 'sshd.pid'}",
            "PermitRootLogin yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "UsePAM no",
            "StrictModes no",
            "Subsystem sftp internal-sftp",
            "MaxStartups 64:30:128",
            "MaxSessions 64",
            "LogLevel ERROR",
            # bash reads ~/.bashrc for a command sshd runs only as a top-level shell (SHLVL < 2 once it counts
            # itself): from SHLVL=1 it does not, so every remote command starts without the login user's shell
            # setup (on a developer machine, e.g. `pyenv init`, ~0.4 s of each command).
            "SetEnv SHLVL=1",
        ]
        config.write_text("\n".join(lines) + "\n")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        log = open(workdir / "sshd.log", "ab")
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
        log.close()
        server = cls(workdir, port, getpass.getuser(), user_key, host_keys, proc)
        server._wait_ready()
        return server

    def _wait_ready(self, timeout: float | None = None) -> None:
        if timeout is None:  # tests/timeout_support.py's guard(120), inline: bench/deploy_bench.py imports this module
            timeout = 120 * float(os.environ.get("COLIBRI_TEST_TIMEOUT_SCALE", "1"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.process.returncode}: "
                                   f"{(self.workdir / 'sshd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sshd did not answer on 127.0.0.1:{self.port} within {timeout} s")

    def known_hosts_line(self, index: int = 0) -> str:
        """The known_hosts line for host key `index`, as `[127.0.0.1]:PORT TYPE BASE64`."""
        kind, blob = self.host_keys[index].with_suffix(".pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {blob}\n"

    @property
    def target(self) -> str:
        return f"{self.user}@127.0.0.1"

    def stop(self) -> None:
        stop_process(self.process, 5)
