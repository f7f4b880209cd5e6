"""Remote commands: the device-side agent (agent.py) run with the device's Python, and `colibri-sdk verify`.

Every command is an argv list turned into one shell line by `connection.command_line` (each argument
`shlex.quote`d), so paths with spaces, quotes or `$` reach the device unchanged. Every command has a timeout.
The agent answers with one JSON object; an OS error on the device comes back as its errno name and is raised
here as a typed error (ENOSPC → RemoteDiskFullError, EACCES/EPERM/EROFS → RemotePermissionError).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .connection import CommandResult, Connection, collect
from .errors import RemoteCommandError, RemoteDiskFullError, RemotePermissionError, RemoteVerifyError

DISK_FULL = {"ENOSPC", "EDQUOT"}
PERMISSION = {"EACCES", "EPERM", "EROFS"}


@lru_cache(maxsize=1)
def agent_source() -> str:
    """The agent's Python source, sent as `python3 -c SOURCE`."""
    return (Path(__file__).with_name("agent.py")).read_text(encoding="utf-8")


class RemoteAgent:
    """Runs agent operations under `remote_dir` on the device.

    Args:
        conn: an open Connection.
        remote_dir: the store root on the device (`~` is expanded there).
        python: the device's Python command, split like a shell would (e.g. "python3", "/opt/venv/bin/python").
    """

    def __init__(self, conn: Connection, remote_dir: str, python: str = "python3"):
        self.conn = conn
        self.remote_dir = remote_dir
        self.python = shlex.split(python)
        self.label = conn.target.label

    def argv(self, op: str, *args) -> list:
        return [*self.python, "-c", agent_source(), op, self.remote_dir, *map(str, args)]

    def call(self, op: str, *args, timeout: float | None = None) -> dict:
        """Run one operation and return its JSON answer.

        Raises:
            RemoteDiskFullError, RemotePermissionError: the device refused a write.
            RemoteCommandError: Python missing on the device, or any other failure (errno and message quoted).
            RemoteTimeoutError: no answer within `timeout` seconds.
        """
        result = self.conn.run(self.argv(op, *args), timeout=timeout)
        return self.answer(op, result)

    def open_receive(self, objects) -> object:
        """Start `receive` for [(sha256, size, offset), ...]: returns the channel; write each object's bytes
        from its offset, back to back, then call `finish`."""
        return self.conn.exec(self.argv("receive", *(str(v) for obj in objects for v in obj)))

    def finish(self, channel, timeout: float) -> dict:
        """Close the stream's stdin and wait for the agent's answer."""
        try:
            channel.shutdown_write()
        except OSError:
            pass  # the agent already exited (e.g. disk full); its answer is still in the buffers
        return self.answer("receive", collect(channel, timeout, self.label, ["receive"]))

    def answer(self, op: str, result: CommandResult) -> dict:
        text = result.stdout.decode("utf-8", "replace").strip()
        try:
            data = json.loads(text.splitlines()[-1]) if text else None
        except ValueError:
            data = None
        if isinstance(data, dict) and "error" in data:
            raise agent_error(self.label, self.remote_dir, op, data["error"], result)
        if result.exit_status == 127:
            raise RemoteCommandError(
                f"{self.label}: {' '.join(self.python)!r} not found on the device: install python3 (>= 3.8) or "
                f"pass --remote-python", 127, result.stderr_text)
        if result.exit_status != 0 or not isinstance(data, dict):
            raise RemoteCommandError(
                f"{self.label}: remote {op} in {self.remote_dir!r} failed with exit status {result.exit_status}: "
                f"{result.stderr_text.strip() or text or '(no output)'}", result.exit_status, result.stderr_text)
        return data


def agent_error(label: str, remote_dir: str, op: str, error: dict, result: CommandResult):
    """The typed error for an agent's {"errno", "path", "message"} answer."""
    name, path, message = error.get("errno", "EIO"), error.get("path", ""), error.get("message", "")
    where = f" {path!r}" if path else ""
    code = f" ({name})" if name != "EINVAL" else ""  # EINVAL: the agent's own refusal, its message says why
    text = f"{label}: {op} in {remote_dir!r}: {message}{where}{code}"
    if name in DISK_FULL:
        return RemoteDiskFullError(f"{text}: the device's disk is full", result.exit_status, result.stderr_text)
    if name in PERMISSION:
        return RemotePermissionError(f"{text}: permission denied on the device", result.exit_status,
                                     result.stderr_text)
    return RemoteCommandError(text, result.exit_status, result.stderr_text)


VERIFY_BACKENDS = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class VerifyReport:
    """What a passing `colibri-sdk verify` said on the device.

    Attributes:
        selftest: its self-test line, e.g. "self-test passed on cpu: max abs err 0, ..." (the backend that ran
            it is named there); "" when the command printed none.
        notes: its standard error lines (e.g. "colibri-sdk: running on the CPU backend: <why>"), at most 5.
    """

    selftest: str
    notes: tuple

    @property
    def backend(self) -> str:
        """The backend named in the self-test line ("cuda", "cpu"), or "" when there is none."""
        match = re.search(r"self-test \w+ on (\w+)", self.selftest)
        return match.group(1) if match else ""


def run_verify(conn: Connection, colibri: str, bundle_path: str, timeout: float,
               backend: str = "auto") -> VerifyReport:
    """Run `COLIBRI verify --backend BACKEND BUNDLE_PATH` on the device (checksums, then the bundle's self-test).

    Args:
        colibri: the device's command, split like a shell would ("colibri-sdk", "python3 -m colibri_sdk").
        backend: "auto" (CUDA when it works there, else the CPU), "cuda" (fail rather than fall back) or "cpu".

    Raises:
        RemoteVerifyError: non-zero exit; its stdout/stderr tail is quoted, and a command not found (exit 127,
            or Python's "No module named colibri_sdk") is explained with --remote-colibri.
    """
    argv = [*shlex.split(colibri), "verify", "--backend", backend, bundle_path]
    result = conn.run(argv, timeout=timeout)
    if result.exit_status != 0:
        output = (result.stdout + result.stderr).decode("utf-8", "replace").strip()[-1500:]
        if result.exit_status == 127 or "No module named colibri_sdk" in output:
            raise RemoteVerifyError(
                f"{conn.target.label}: {colibri!r} cannot run on the device (exit status {result.exit_status}): "
                f"colibri-sdk is not on the PATH of a non-interactive SSH command there, or not installed. Pass the "
                f"device's command with --remote-colibri, e.g. --remote-colibri '/opt/colibri/venv/bin/python -m "
                f"colibri_sdk'; the active bundle was not changed:\n{output}", result.exit_status, result.stderr_text)
        raise RemoteVerifyError(
            f"{conn.target.label}: self-test of {bundle_path!r} failed (exit status {result.exit_status}); "
            f"the active bundle was not changed:\n{output}", result.exit_status, result.stderr_text)
    lines = result.stdout.decode("utf-8", "replace").splitlines()
    selftest = next((line.strip() for line in reversed(lines) if "self-test" in line), "")
    selftest = selftest.removeprefix("self-test: ")  # `verify` prints "  self-test: self-test passed on ..."
    notes = tuple(line.strip() for line in result.stderr_text.splitlines() if line.strip())[-5:]
    return VerifyReport(selftest, notes)
