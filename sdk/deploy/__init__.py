"""Deploying bundles to devices over SSH (paramiko): checked, verified, atomic, incremental, resumable, with
health-gated rollback, and the device runtime installed from the host.

    connection.py    Target, Connection: connect (directly or through a ProxyJump host), host keys,
                     authentication, remote commands with timeouts
    sshconfig.py     ~/.ssh/config (paramiko's SSHConfig): Host aliases, HostName, User, Port, IdentityFile, ProxyJump
    hostkeys.py      known_hosts policy (unknown refused unless accepted once, changed always refused)
    remote.py        RemoteAgent: runs the agent on the device; typed errors from the device's errno; `verify` there
    answers.py       the schema of each agent answer, checked before use; device text made printable
    agent/           the device side of the store (stdlib-only Python, sent with `python3 -c`), one module per noun
    store.py         DeviceStore: typed plan / stage / switch / rollback / undo / status / probe / install
    local_bundle.py  LocalBundle: the bundle opened with the runtime's own loader before anything is sent
    transfer.py      Uploader: incremental, resumable, parallel streams, verified on the device
    activation.py    --on-activate, the health check, and the rollback when either fails
    deployment.py    deploy(), rollback(), status()
    wheels.py        which wheels a device takes (packaging.tags), the dependency closure from wheel metadata
    installer.py     install_runtime(): colibri-sdk and its wheels into a venv on the device, no index there
    inventory.py     --hosts YAML, bounded pool, result table
    progress.py      byte progress bar (tqdm)

Needs paramiko and packaging (and pyyaml for inventories, tqdm for the bar): `pip install colibri-sdk[deploy]`.
"""

from .connection import Connection, Target
from .deployment import DEFAULT_REMOTE_DIR, DeployOptions, DeployResult, deploy, rollback, status
from .errors import (
    AuthenticationError,
    ChecksumMismatchError,
    ConnectError,
    ConnectRefusedError,
    ConnectTimeoutError,
    DeployError,
    HealthCheckError,
    HostKeyChangedError,
    HostKeyError,
    HostKeyUnknownError,
    RemoteAnswerError,
    RemoteCommandError,
    RemoteDiskFullError,
    RemotePermissionError,
    RemoteTimeoutError,
    RemoteVerifyError,
    RuntimeInstallError,
)
from .local_bundle import LocalBundle

__all__ = [
    "Connection", "Target", "DEFAULT_REMOTE_DIR", "DeployOptions", "DeployResult", "deploy", "rollback", "status",
    "LocalBundle", "DeployError", "ConnectError", "ConnectRefusedError", "ConnectTimeoutError",
    "AuthenticationError", "HostKeyError", "HostKeyUnknownError", "HostKeyChangedError", "RemoteCommandError",
    "RemoteTimeoutError", "RemoteAnswerError", "RemoteDiskFullError", "RemotePermissionError", "RemoteVerifyError",
    "HealthCheckError", "RuntimeInstallError", "ChecksumMismatchError",
]
