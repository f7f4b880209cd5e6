"""known_hosts policy: verify the server's host key, never accept one silently.

- The keys come from `--known-hosts FILE`, or else the user's ~/.ssh/known_hosts plus /etc/ssh/ssh_known_hosts
  (read with paramiko's `HostKeys`, which understands hashed host names and `[host]:port` entries).
- A host with no stored key is refused (`HostKeyUnknownError`) unless `accept_new` is set
  (`--accept-new-host-key`, OpenSSH's `StrictHostKeyChecking=accept-new`); then the key is appended to the
  known_hosts file (the user's, or `--known-hosts`), and one line says so on stderr, as OpenSSH does.
- A host whose stored key differs — or for which only keys of other types are stored — is always refused
  (`HostKeyChangedError`), as OpenSSH does under StrictHostKeyChecking.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
from pathlib import Path

import paramiko

from .errors import HostKeyChangedError, HostKeyError, HostKeyUnknownError

USER_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
# paramiko key type -> the name OpenSSH prints ("Permanently added 'host' (ED25519) ...").
OPENSSH_KEY_NAMES = {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "ssh-dss": "DSA", "ecdsa-sha2-nistp256": "ECDSA",
                     "ecdsa-sha2-nistp384": "ECDSA", "ecdsa-sha2-nistp521": "ECDSA"}

_append_lock = threading.Lock()
log = logging.getLogger(__name__)  # the OpenSSH-style notice of an added key (shown by the CLI)


def host_entry_name(host: str, port: int) -> str:
    """The name known_hosts uses for a host: `host` on port 22, `[host]:port` otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


class KnownHosts:
    """The trusted host keys, and the file new keys are appended to.

    Args:
        path: the known_hosts file to read and append to; None for ~/.ssh/known_hosts (and the system file,
            read only).
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path).expanduser() if path is not None else USER_KNOWN_HOSTS.expanduser()
        self.is_default = path is None
        self.keys = paramiko.HostKeys()
        sources = [self.path] if path is not None else [SYSTEM_KNOWN_HOSTS, self.path]
        if path is not None and self.path.is_dir():
            raise HostKeyError(f"known_hosts {self.path} is not a file (a folder?); expected a known_hosts file, "
                               f"which need not exist yet")
        if path is not None and self.path.exists() and not self.path.is_file():  # a FIFO, a device
            from ..bundle.paths import kind_of

            raise HostKeyError(f"known_hosts {self.path} is {kind_of(self.path.stat().st_mode)}; expected a "
                               f"known_hosts file (a regular file), which need not exist yet")
        for source in sources:
            if source.is_file():
                try:
                    self.keys.load(str(source))
                except (OSError, paramiko.SSHException, ValueError) as exc:  # ValueError: not UTF-8 text
                    raise HostKeyError(f"cannot read known_hosts file {source}: {exc}") from None

    def stored(self, name: str) -> dict:
        """{key type: PKey} stored for `name` (a `host_entry_name`), empty when none."""
        found = self.keys.lookup(name)
        return dict(found) if found is not None else {}

    def append(self, name: str, key: paramiko.PKey) -> None:
        """Add `name KEYTYPE BASE64` as one line at the end of the known_hosts file (created 0600 if missing),
        and log OpenSSH's one-line notice (INFO)."""
        with _append_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                if f.tell() > 0 and not self.path.read_bytes().endswith(b"\n"):
                    f.write("\n")
                f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
            self.keys.add(name, key.get_name(), key)
        kind = OPENSSH_KEY_NAMES.get(key.get_name(), key.get_name())
        log.info("Permanently added '%s' (%s) to the list of known hosts (%s)", name, kind, self.path)


class StrictHostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """paramiko calls this when no key of the offered type is stored for the host.

    Refuses when keys of other types are stored (changed key); otherwise refuses an unknown host, or appends
    its key when `accept_new` is set.
    """

    def __init__(self, known: KnownHosts, accept_new: bool):
        self.known = known
        self.accept_new = accept_new

    def missing_host_key(self, client, hostname, key):
        if self.known.stored(hostname):
            raise changed_key_error(self.known, hostname, key)
        if not self.accept_new:
            raise HostKeyUnknownError(
                f"host {hostname} is not in {self.known.path} (it offers {key.get_name()} {key.fingerprint}); "
                f"refusing. Check the fingerprint on the device (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) and "
                f"pass --accept-new-host-key once to store it"
            )
        self.known.append(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def changed_key_error(known: KnownHosts, name: str, offered: paramiko.PKey) -> HostKeyChangedError:
    """The error for a host whose stored key(s) do not match the offered one (paramiko's BadHostKeyException)."""
    stored = known.stored(name)
    same_type = stored.get(offered.get_name())
    if same_type is not None:
        what = f"{known.path} stores {same_type.get_name()} {same_type.fingerprint}"
    else:
        types = ", ".join(sorted(stored)) or "none"
        what = f"{known.path} stores only keys of another type ({types}) for it"
    return HostKeyChangedError(
        f"host key for {name} has CHANGED: the server offers {offered.get_name()} {offered.fingerprint}, but "
        f"{what}; refusing (possible man-in-the-middle). If the device was reinstalled, remove the old entry "
        f"({remove_command(known, name)}) and connect again"
    )


def remove_command(known: KnownHosts, name: str) -> str:
    """The `ssh-keygen -R` command that deletes `name` from the known_hosts file in use (`-f FILE` unless it is
    the default ~/.ssh/known_hosts, which ssh-keygen edits by default)."""
    file = "" if known.is_default else f"-f {shlex.quote(str(known.path))} "
    return f"ssh-keygen {file}-R {shlex.quote(name)}"
