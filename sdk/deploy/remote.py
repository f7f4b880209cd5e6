"""Remote commands: the device-side agent (the agent/ package) run with the device's Python, and `colibri-sdk verify`.

Every command is an argv list turned into one shell line by `connection.command_line` (each argument
`shlex.quote`d), so paths with spaces, quotes or `$` reach the device unchanged. Every command has a timeout.
The agent answers with one JSON object; an OS error on the device comes back as its errno name and is raised
here as a typed error (ENOSPC → RemoteDiskFullError, EACCES/EPERM/EROFS → RemotePermissionError).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .answers import MAX_ANSWER_BYTES, AnswerError, check, printable, shown
from .connection import CommandResult, Connection, collect
from .errors import (
    RemoteAnswerError,
    RemoteCommandError,
    RemoteDiskFullError,
    RemotePermissionError,
    RemoteVerifyError,
)

DISK_FULL = {"ENOSPC", "EDQUOT"}
PERMISSION = {"EACCES", "EPERM", "EROFS"}


BOOTSTRAP = """import sys
from importlib.machinery import ModuleSpec
SOURCES = dict(%r)
class AgentModules:
    # Finds and loads the package colibri_agent from SOURCES; a module is compiled when it is first imported.
    @staticmethod
    def find_spec(name, path=None, target=None):
        package, _, short = name.partition(".")
        if package == "colibri_agent" and (not short or short in SOURCES):
            return ModuleSpec(name, AgentModules, origin="colibri_agent/%%s.py" %% (short or "__init__"),
                              is_package=not short)
        return None
    @staticmethod
    def create_module(spec):
        return None
    @staticmethod
    def exec_module(module):
        short = module.__name__.partition(".")[2]
        if short:
            exec(compile(SOURCES[short], "colibri_agent/" + short + ".py", "exec"), module.__dict__)
sys.meta_path.insert(0, AgentModules)
import colibri_agent.main
sys.exit(colibri_agent.main.main(sys.argv[1:]))
"""


@lru_cache(maxsize=1)
def agent_source() -> str:
    """The program sent as `python3 -c PROGRAM OP ROOT ARG...`: the agent package's modules (agent/, standard
    library only), made importable as the package `colibri_agent` (each compiled when first imported: an
    operation pays only for the modules it uses), then `main.main(argv)`. It
    travels zlib-compressed (base64), about a third of its size, since every remote command carries it; the
    device decodes it with binascii, not the base64 module, which would import `re` and more into each start."""
    from .agent.main import MODULES

    folder = Path(__file__).with_name("agent")
    sources = tuple((name, (folder / f"{name}.py").read_text(encoding="utf-8")) for name in MODULES)
    packed = base64.b64encode(zlib.compress((BOOTSTRAP % (sources,)).encode("utf-8"), 9)).decode("ascii")
    return f"import binascii, zlib; exec(zlib.decompress(binascii.a2b_base64({packed!r})))"


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

    def what(self, op: str) -> str:
        return f"remote {op} in {self.remote_dir!r}"

    def argv(self, op: str, *args) -> list:
        return [*self.python, "-c", agent_source(), op, self.remote_dir, *map(str, args)]

    def call(self, op: str, *args, timeout: float | None = None) -> dict:
        """Run one operation and return its JSON answer, checked against its schema (answers.SCHEMAS[op]).

        Raises:
            RemoteDiskFullError, RemotePermissionError: the device refused a write.
            RemoteAnswerError: the answer does not follow the operation's schema, or passed MAX_ANSWER_BYTES.
            RemoteCommandError: Python missing on the device, the connection lost, or any other failure (errno
                and message quoted, escaped).
            RemoteTimeoutError: no answer within `timeout` seconds.
        """
        result = self.conn.run(self.argv(op, *args), timeout=timeout, max_stdout=MAX_ANSWER_BYTES,
                               what=self.what(op))
        return self.answer(op, result)

    def open_receive(self, objects) -> object:
        """Start `receive` for [(sha256, size, offset), ...]: returns the channel; write each object's bytes
        from its offset, back to back, then call `finish`."""
        return self.conn.exec(self.argv("receive", *(str(v) for obj in objects for v in obj)))

    def finish(self, channel, timeout: float) -> dict:
        """Close the stream's stdin and wait for the agent's answer (checked as `call` does)."""
        try:
            channel.shutdown_write()
        except (OSError, EOFError):
            pass  # the agent already exited (e.g. disk full); its answer is still in the buffers
        return self.answer("receive", collect(channel, timeout, self.label, ["receive"], MAX_ANSWER_BYTES,
                                              self.what("receive")))

    def answer(self, op: str, result: CommandResult) -> dict:
        """The agent's answer to `op` in `result` (its stdout's last line, one JSON object), checked against
        answers.SCHEMAS[op]; an {"error": ...} answer raised as the typed error its errno names.

        Raises:
            RemoteAnswerError, RemoteDiskFullError, RemotePermissionError, RemoteCommandError (see `call`).
        """
        text = result.stdout.decode("utf-8", "replace").strip()
        try:
            data = json.loads(text.splitlines()[-1]) if text else None
        except (ValueError, RecursionError):
            data = None
        if result.exit_status == -1:  # paramiko: the channel closed without an exit status
            raise RemoteCommandError(
                f"{self.label}: the SSH connection was lost during {self.what(op)} (no exit status, "
                f"{len(result.stdout):,} bytes of answer)", None, result.stderr_text)
        if result.exit_status == 127 and not isinstance(data, dict):
            raise RemoteCommandError(
                f"{self.label}: {' '.join(self.python)!r} not found on the device: install python3 (>= 3.8) or "
                f"pass --remote-python", 127, result.stderr_text)
        if data is None and result.exit_status == 0:
            said = f"{len(result.stdout):,} bytes, ending {shown(text[-60:])}" if text else "no output"
            raise RemoteAnswerError(
                f"{self.label}: {self.what(op)}: the answer is not one JSON object ({said}); nothing of it was "
                f"used", 0, result.stderr_text)
        if data is not None:
            try:
                check(op, data)
            except AnswerError as exc:
                raise RemoteAnswerError(
                    f"{self.label}: {self.what(op)}: malformed answer: {exc}; nothing of it was used",
                    result.exit_status, result.stderr_text) from None
        if isinstance(data, dict) and "error" in data:
            raise agent_error(self.label, self.remote_dir, op, data["error"], result)
        if result.exit_status != 0 or not isinstance(data, dict):
            raise RemoteCommandError(
                f"{self.label}: remote {op} in {self.remote_dir!r} failed with exit status {result.exit_status}: "
                f"{device_error_line(result.stderr_text + chr(10) + text)}", result.exit_status, result.stderr_text)
        return data


def agent_error(label: str, remote_dir: str, op: str, error: dict, result: CommandResult):
    """The typed error for an agent's {"errno", "path", "message"} answer (checked by answers.ERROR); the device's
    message and path are shown escaped (printable)."""
    name, path, message = error["errno"], error.get("path") or "", error.get("message") or ""
    where = f" {printable(repr(path), 300)}" if path else ""
    code = f" ({name})" if name != "EINVAL" else ""  # EINVAL: the agent's own refusal, its message says why
    text = f"{label}: {op} in {remote_dir!r}: {printable(message, 500)}{where}{code}"
    if name in DISK_FULL:
        return RemoteDiskFullError(f"{text}: the device's disk is full", result.exit_status, result.stderr_text)
    if name in PERMISSION:
        return RemotePermissionError(f"{text}: permission denied on the device", result.exit_status,
                                     result.stderr_text)
    return RemoteCommandError(text, result.exit_status, result.stderr_text)


VERIFY_BACKENDS = ("cuda", "cpu")


def device_error_line(output: str) -> str:
    """The one line that says why a command failed on the device: `colibri-sdk ...: error: ...` when it printed
    one, else the exception line that ends a Python traceback, else its last line; never the traceback. Control
    characters in it are shown escaped (answers.printable)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if ": error: " in line:
            return printable(line, 500)
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        for line in reversed(lines):
            if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
                return printable(line, 500)
    return printable(lines[-1], 500) if lines else "(no output)"


@dataclass(frozen=True)
class VerifyReport:
    """What a passing `colibri-sdk verify` said on the device.

    Attributes:
        selftest: its self-test line, e.g. "self-test passed on cuda: max abs err 0, ..." (the backend that ran
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
               backend: str = "cuda") -> VerifyReport:
    """Run `colibri-sdk verify --backend BACKEND BUNDLE` on the device: checksums, schema, the self-test.

    Args:
        colibri: the device's colibri-sdk command, split like a shell would ("colibri-sdk",
            "/home/u/colibri/venv/bin/python -m colibri_sdk").
        backend: "cuda" (what a bundle for a GPU profile runs on; a fall back to the CPU fails the check) or
            "cpu" (accept a check on the CPU).

    Raises:
        RemoteVerifyError: non-zero exit, relayed as the device's one error line (never its traceback); a
            command not found (exit 127, or "No module named colibri_sdk") is explained with --remote-colibri and
            --install-runtime; a pass on another backend than `backend`.
    """
    argv = [*shlex.split(colibri), "verify", "--backend", backend, bundle_path]
    result = conn.run(argv, timeout=timeout)
    label = conn.target.label
    if result.exit_status != 0:
        output = (result.stdout + b"\n" + result.stderr).decode("utf-8", "replace")
        if result.exit_status == 127 or "No module named colibri_sdk" in output:
            raise RemoteVerifyError(
                f"{label}: {colibri!r} cannot run on the device (exit status {result.exit_status}): colibri-sdk is "
                f"not installed there, or not on the PATH of a non-interactive SSH command. Install it with "
                f"--install-runtime, or pass the device's command with --remote-colibri, e.g. --remote-colibri "
                f"'/opt/colibri/venv/bin/python -m colibri_sdk'; the active bundle was not changed",
                result.exit_status, result.stderr_text)
        line, hint = device_error_line(output), ""
        if backend == "cuda" and re.search(r"CUDA|GPU", line):  # the device's verify names its own --backend
            line = re.sub(r"; use the cpu or auto backend$", "", line)
            hint = " (a device without a usable GPU: pass --verify-backend cpu to deploy to accept a self-test on " \
                   "the CPU)"
        raise RemoteVerifyError(
            f"{label}: self-test of {bundle_path!r} on {backend} failed (exit status {result.exit_status}): "
            f"{line}{hint}; the active bundle was not changed", result.exit_status, result.stderr_text)
    lines = result.stdout.decode("utf-8", "replace").splitlines()
    selftest = printable(next((line.strip() for line in reversed(lines) if "self-test" in line), ""), 500)
    if selftest.startswith("self-test: "):  # `verify` prints "  self-test: self-test passed on ..."
        selftest = selftest[len("self-test: "):]
    notes = tuple(printable(line.strip(), 500) for line in result.stderr_text.splitlines() if line.strip())[-5:]
    report = VerifyReport(selftest, notes)
    if report.backend != backend:
        ran = f"ran on {report.backend}" if report.backend else "named no backend"
        raise RemoteVerifyError(
            f"{label}: the self-test of {bundle_path!r} {ran}, not on {backend}: the bundle was not checked on the "
            f"backend it will run on" + (" (pass --verify-backend cpu to accept a check on the CPU)"
                                         if backend == "cuda" else "")
            + f"; the active bundle was not changed{': ' + notes[-1] if notes else ''}", 0, result.stderr_text)
    return report
