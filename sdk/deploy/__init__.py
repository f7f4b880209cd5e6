"""Deploying bundles to devices over SSH (paramiko): verified, atomic, incremental, resumable, with rollback.

    connection.py    Target, Connection: connect, host keys, authentication, remote commands with timeouts
    hostkeys.py      known_hosts policy (unknown refused unless accepted once, changed always refused)
    remote.py        RemoteAgent: runs agent.py on the device; typed errors from the device's errno
    agent.py         the device side of the store (stdlib-only Python, run with `python3 -c`)
    store.py         DeviceStore: typed plan / stage / switch / rollback / status
    transfer.py      Uploader: incremental, resumable, parallel streams, verified on the device
    deployment.py    deploy(), rollback(), status()
    inventory.py     --hosts YAML, bounded pool, result table
    progress.py      byte progress bar (tqdm)

Needs paramiko (and pyyaml for inventories, tqdm for the bar): `pip install colibri-sdk[deploy]`.
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
    HostKeyChangedError,
    HostKeyError,
    HostKeyUnknownError,
    RemoteCommandError,
    RemoteDiskFullError,
    RemotePermissionError,
    RemoteTimeoutError,
    RemoteVerifyError,
)
from .local_bundle import LocalBundle

__all__ = [
    "Connection", "Target", "DEFAULT_REMOTE_DIR", "DeployOptions", "DeployResult", "deploy", "rollback", "status",
    "LocalBundle", "DeployError", "ConnectError", "ConnectRefusedError", "ConnectTimeoutError",
    "AuthenticationError", "HostKeyError", "HostKeyUnknownError", "HostKeyChangedError", "RemoteCommandError",
    "RemoteTimeoutError", "RemoteDiskFullError", "RemotePermissionError", "RemoteVerifyError",
    "ChecksumMismatchError",
]
