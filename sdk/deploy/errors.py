"""Typed deploy errors. Each is a `DeployError` (so the CLI prints it and exits 1) and names the host.

    DeployError
    ├── ConnectError              the TCP connection failed
    │   ├── ConnectRefusedError       nothing listens on the port
    │   └── ConnectTimeoutError       no answer, or no SSH banner, within the connect timeout
    ├── AuthenticationError       the server refused every key offered
    ├── HostKeyError              the server's host key is not trusted
    │   ├── HostKeyUnknownError       no key stored for this host (use --accept-new-host-key once)
    │   └── HostKeyChangedError       a different key, or only keys of another type, are stored for this host
    ├── RemoteCommandError        a remote command failed (exit status and stderr attached)
    │   ├── RemoteTimeoutError        a remote command ran past its timeout
    │   ├── RemoteAnswerError         the device's agent gave an answer that does not follow its schema, or one
    │   │                             larger than answers.MAX_ANSWER_BYTES
    │   ├── RemoteDiskFullError       ENOSPC / EDQUOT on the device
    │   ├── RemotePermissionError     EACCES / EPERM / EROFS on the device
    │   ├── RuntimeInstallError       --install-runtime: a wheel is missing here, or the install failed there
    │   ├── RemoteVerifyError         `colibri-sdk verify` failed on the device (the pointer was not switched),
    │   │                             or ran on another backend than asked (a CPU fallback for a GPU bundle)
    │   └── HealthCheckError          after the switch, --on-activate or the health check failed; the previous
    │                                 bundle was made current again
    └── ChecksumMismatchError     a file's sha256 on the device differs from the manifest after upload
"""

from __future__ import annotations

from ..errors import DeployError

__all__ = [
    "DeployError",
    "ConnectError",
    "ConnectRefusedError",
    "ConnectTimeoutError",
    "AuthenticationError",
    "HostKeyError",
    "HostKeyUnknownError",
    "HostKeyChangedError",
    "RemoteCommandError",
    "RemoteTimeoutError",
    "RemoteAnswerError",
    "RemoteDiskFullError",
    "RemotePermissionError",
    "RemoteVerifyError",
    "HealthCheckError",
    "RuntimeInstallError",
    "ChecksumMismatchError",
]


class ConnectError(DeployError):
    """The TCP connection to the device failed."""


class ConnectRefusedError(ConnectError):
    """Nothing accepts connections on the host and port."""


class ConnectTimeoutError(ConnectError):
    """The host did not answer, or accepted TCP but sent no SSH protocol banner, within the connect timeout."""


class AuthenticationError(DeployError):
    """The SSH server refused every key that was offered."""


class HostKeyError(DeployError):
    """The server's host key is not trusted."""


class HostKeyUnknownError(HostKeyError):
    """No key is stored for this host in known_hosts."""


class HostKeyChangedError(HostKeyError):
    """known_hosts holds a different key for this host (of the same type or only of other types)."""


class RemoteCommandError(DeployError):
    """A remote command failed.

    Attributes:
        exit_status: the remote exit status, or None when it never finished.
        stderr: the command's standard error, decoded (may be truncated to its last 2000 characters).
    """

    def __init__(self, message: str, exit_status: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.exit_status = exit_status
        self.stderr = stderr


class RemoteTimeoutError(RemoteCommandError):
    """A remote command ran past its timeout and was abandoned."""


class RemoteAnswerError(RemoteCommandError):
    """The device's agent answered with something that is not its operation's answer (wrong types, missing keys,
    values out of range, cut short, or larger than answers.MAX_ANSWER_BYTES); nothing of it was used."""


class RemoteDiskFullError(RemoteCommandError):
    """The device's file system is full (ENOSPC) or over quota (EDQUOT)."""


class RemotePermissionError(RemoteCommandError):
    """The device refused a write: EACCES, EPERM (e.g. an immutable folder) or EROFS (read-only file system)."""


class RemoteVerifyError(RemoteCommandError):
    """The bundle's self-test failed on the device; the active bundle was left as it was."""


class HealthCheckError(RemoteCommandError):
    """After the switch, the --on-activate command or the health check failed; the previous bundle was made
    current again (and --on-activate re-run for it)."""


class RuntimeInstallError(RemoteCommandError):
    """`--install-runtime` could not install the device runtime: wheels missing on this machine (each named, with
    the `pip download` command that fetches them), or venv / pip failed on the device."""


class ChecksumMismatchError(DeployError):
    """A file's sha256 on the device differs from the manifest after upload (and after one retry)."""
