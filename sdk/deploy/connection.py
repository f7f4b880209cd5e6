"""One SSH connection to one device (paramiko), with timeouts and typed errors.

`Target` says where to go (user, host, port, key, known_hosts policy, timeouts). `Connection` connects,
verifies the host key through `hostkeys.StrictHostKeyPolicy`, authenticates with a key, and runs remote
commands (argv lists, each argument quoted with `shlex.quote`) on exec channels of the one transport, so
several uploads can share the connection.

paramiko's own logger ("paramiko") gets a NullHandler, so its thread's tracebacks (e.g. "Error reading SSH
protocol banner") never reach the terminal; every failure surfaces as one typed error instead.

The transport prefers AES-GCM (`aes128-gcm@openssh.com`): paramiko spends less CPU per byte with it than with
AES-CTR + HMAC, which is what limits its throughput (see bench/deploy_bench.py). With these ciphers the keys are
renegotiated every 4 GiB rather than paramiko's 512 MiB (REKEY_BYTES_128_BIT_BLOCK).
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import re
import select
import shlex
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import (
    AuthenticationError,
    ConnectError,
    ConnectRefusedError,
    ConnectTimeoutError,
    DeployError,
    RemoteAnswerError,
    RemoteTimeoutError,
)
from .hostkeys import KnownHosts, StrictHostKeyPolicy, changed_key_error, host_entry_name

PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr", "aes256-ctr")
# Bytes between key exchanges with a 128-bit block cipher (all of PREFERRED_CIPHERS). paramiko renegotiates every
# 512 MiB whatever the cipher, and each renegotiation holds every channel's sending (~45 ms on loopback); RFC 4344
# section 3.2 allows 2**32 blocks (64 GiB) for a 128-bit block, which OpenSSH uses. 4 GiB stays far inside it.
REKEY_BYTES_128_BIT_BLOCK = 1 << 32
# A host name, IPv4 or IPv6 address (with an optional %zone): nothing a resolver would not take.
HOST_PATTERN = re.compile(r"[A-Za-z0-9._%:-]+")
PUBLIC_KEY_PREFIXES = (b"ssh-", b"ecdsa-", b"sk-ssh-", b"sk-ecdsa-", b"---- BEGIN SSH2 PUBLIC KEY")


@dataclass(frozen=True)
class Target:
    """Where and how to connect.

    Attributes:
        host: host name or address.
        user: login user; None for the local user name.
        port: TCP port.
        identity: private key file; None to try ssh-agent and ~/.ssh/id_* keys.
        known_hosts: known_hosts file; None for ~/.ssh/known_hosts (+ /etc/ssh/ssh_known_hosts).
        accept_new_host_key: store the key of a host not yet in known_hosts instead of refusing.
        connect_timeout: seconds for TCP connect, SSH banner and authentication each.
        command_timeout: seconds of silence after which a remote command is abandoned.
        identities: IdentityFile entries of the SSH config, tried besides ssh-agent and ~/.ssh/id_* when
            `identity` is None.
        proxy_jump: the host to reach this one through (SSH config ProxyJump), or None.
        alias: the SSH config Host alias this target was resolved from, or None.
    """

    host: str
    user: str | None = None
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    identities: tuple = ()
    proxy_jump: "Target | None" = None
    alias: str | None = None

    def __post_init__(self):
        if not isinstance(self.host, str) or not HOST_PATTERN.fullmatch(self.host):
            raise DeployError(f"host {self.host!r}: expected a host name or IP address (letters, digits, '.', '-', "
                              f"':' and '%' only)")
        if self.user is not None and (not isinstance(self.user, str) or not self.user
                                      or any(c.isspace() or ord(c) < 32 for c in self.user)):
            raise DeployError(f"user {self.user!r}: expected a non-empty login name without spaces")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise DeployError(f"port {self.port!r}: expected a whole number from 1 to 65535")
        for name in ("connect_timeout", "command_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                       and value > 0):
                raise DeployError(f"--{name.replace('_', '-').replace('command-', '')} {value!r}: expected a "
                                  f"finite number of seconds > 0")
        for name in ("identity", "known_hosts"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, Path)) or not str(value)):
                raise DeployError(f"{name} {value!r}: expected a file path")

    @classmethod
    def parse(cls, spec: str, **fields) -> "Target":
        """`[user@]host[:port]` (IPv6 as `[addr]:port`) plus other fields; the spec's user/port win.

        Raises:
            DeployError: an empty user before '@', an unclosed '[', text after ']' other than ':PORT', a port
                that is not a number from 1 to 65535, or a host with characters no host name has.
        """
        if not isinstance(spec, str):
            raise DeployError(f"host {spec!r}: expected [user@]host[:port] as a string")
        user, at, hostport = spec.rpartition("@")
        if at and not user:
            raise DeployError(f"host {spec!r}: no user before '@'; expected [user@]host[:port]")
        host, port = hostport, None
        if hostport.startswith("["):
            host, bracket, rest = hostport[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise DeployError(f"host {spec!r}: expected [user@][ADDRESS]:PORT for an IPv6 address")
            port = rest[1:] if rest else None
            if port == "":
                raise DeployError(f"host {spec!r}: no port after ':'; expected [user@]host[:port]")
        elif hostport.count(":") == 1:
            host, port = hostport.split(":")
            if not port:
                raise DeployError(f"host {spec!r}: no port after ':'; expected [user@]host[:port]")
        if not host:
            raise DeployError(f"host {spec!r}: expected [user@]host[:port]")
        if user:
            fields["user"] = user
        if port is not None:
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise DeployError(f"host {spec!r}: port {port!r} is not a number from 1 to 65535")
            fields["port"] = int(port)
        try:
            return cls(host=host, **fields)
        except DeployError as exc:
            if str(exc).startswith("host "):
                raise
            raise DeployError(f"host {spec!r}: {exc}") from None

    @property
    def login(self) -> str:
        return self.user or getpass.getuser()

    @property
    def label(self) -> str:
        """`user@host:port`, as messages name the device."""
        return f"{self.login}@{self.host}:{self.port}"

    def with_(self, **changes) -> "Target":
        return replace(self, **changes)


@dataclass(frozen=True)
class CommandResult:
    """A finished remote command: exit status, stdout and stderr bytes."""

    exit_status: int
    stdout: bytes
    stderr: bytes

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")[-2000:]


def command_line(argv) -> str:
    """The remote shell command for `argv`: every argument quoted with shlex.quote, nothing left to the shell."""
    return " ".join(shlex.quote(str(a)) for a in argv)


class Connection:
    """An authenticated SSH connection to `target`. Use as a context manager, or call `close()`.

    Raises (from `open`):
        HostKeyUnknownError, HostKeyChangedError: the host key is not trusted.
        AuthenticationError: no offered key was accepted.
        ConnectRefusedError, ConnectTimeoutError, ConnectError: no SSH session could be set up.
    """

    def __init__(self, target: Target):
        self.target = target
        self.client = None
        self.jump = None  # the Connection to the ProxyJump host, when there is one

    def __enter__(self) -> "Connection":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "Connection":
        import paramiko

        _quiet_paramiko_log()
        t = self.target
        known = KnownHosts(t.known_hosts)
        client = paramiko.SSHClient()
        # Only our own HostKeys: paramiko compares same-type keys itself (BadHostKeyException) and calls the
        # policy for everything else.
        for hostname in known.keys.keys():
            for key_type, key in known.keys[hostname].items():
                client.get_host_keys().add(hostname, key_type, key)
        client.set_missing_host_key_policy(StrictHostKeyPolicy(known, t.accept_new_host_key))
        key_file = str(Path(t.identity).expanduser()) if t.identity else None
        if key_file:
            check_identity(t, key_file)
        keys = [key_file] if key_file else [p for p in t.identities if Path(p).is_file()]
        sock = self._jump_channel() if t.proxy_jump is not None else None
        try:
            client.connect(
                t.host, port=t.port, username=t.login, key_filename=keys or None,
                look_for_keys=key_file is None, allow_agent=key_file is None, sock=sock,
                timeout=t.connect_timeout, banner_timeout=t.connect_timeout, auth_timeout=t.connect_timeout,
                channel_timeout=t.connect_timeout, transport_factory=_transport_factory,
            )
        except paramiko.BadHostKeyException as exc:
            self._close_all(client)
            raise changed_key_error(known, host_entry_name(t.host, t.port), exc.key) from None
        except paramiko.PasswordRequiredException:
            self._close_all(client)
            raise AuthenticationError(f"{t.label}: key {key_file} is encrypted; load it into ssh-agent "
                                      f"(ssh-add) and leave out --identity") from None
        except paramiko.AuthenticationException as exc:
            self._close_all(client)
            raise AuthenticationError(f"{t.label}: authentication failed ({exc}); tried {tried_keys(t, keys)}. "
                                      f"Is the public key in the device's ~/.ssh/authorized_keys? Another key: "
                                      f"-i KEY (--identity)") from None
        except (socket.timeout, TimeoutError):
            self._close_all(client)
            raise ConnectTimeoutError(f"{t.label}: connection timed out after {t.connect_timeout:g} s") from None
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            self._close_all(client)
            raise ConnectRefusedError(f"{t.label}: connection refused ({_no_connection_reasons(exc)})") from None
        except ConnectionRefusedError:
            self._close_all(client)
            raise ConnectRefusedError(f"{t.label}: connection refused (nothing listens on port {t.port})") from None
        except socket.gaierror as exc:
            self._close_all(client)
            raise ConnectError(f"{t.label}: cannot resolve host {t.host!r} ({exc.strerror})") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            transport = client.get_transport()
            self._close_all(client)
            if isinstance(exc, DeployError):
                raise
            if "No authentication methods available" in str(exc):
                raise AuthenticationError(f"{t.label}: no key to offer: looked in {tried_keys(t, keys)} and found "
                                          f"none usable; pass the private key with -i KEY (--identity)") from None
            if transport is not None and not transport.remote_version:
                raise _no_banner_error(t, exc) from None
            raise ConnectError(f"{t.label}: SSH connection failed: {exc}") from None
        transport = client.get_transport()
        if transport.local_cipher in PREFERRED_CIPHERS and transport.remote_cipher in PREFERRED_CIPHERS:
            transport.packetizer.REKEY_BYTES = REKEY_BYTES_128_BIT_BLOCK
        self.client = client
        return self

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.jump is not None:
            self.jump.close()
            self.jump = None

    def _close_all(self, client) -> None:
        client.close()
        if self.jump is not None:
            self.jump.close()
            self.jump = None

    def _jump_channel(self):
        """A direct-tcpip channel from the ProxyJump host to this target's host and port (what `ssh -J` opens)."""
        import paramiko

        t = self.target
        self.jump = Connection(t.proxy_jump).open()
        try:
            return self.jump.client.get_transport().open_channel(
                "direct-tcpip", (t.host, t.port), ("127.0.0.1", 0), timeout=t.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.jump.close()
            self.jump = None
            raise ConnectError(f"{t.label}: the jump host {t.proxy_jump.label} cannot open a connection to "
                               f"{t.host}:{t.port} ({exc})") from None

    def exec(self, argv):
        """Start `argv` on the device; returns the paramiko Channel (stdin writable, stdout/stderr readable)."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectError(f"{self.target.label}: the SSH connection was lost")
        channel = transport.open_session(timeout=self.target.connect_timeout)
        channel.settimeout(self.target.command_timeout)
        channel.exec_command(command_line(argv))
        return channel

    def run(self, argv, timeout: float | None = None, max_stdout: int | None = None,
            what: str | None = None) -> CommandResult:
        """Run `argv` to completion (stdin closed) and collect its output (bounded: see `collect`).

        Raises:
            RemoteTimeoutError: it did not finish within `timeout` seconds (default: the target's
                command_timeout).
            RemoteAnswerError: its stdout passed `max_stdout` bytes.
        """
        channel = self.exec(argv)
        channel.shutdown_write()
        return collect(channel, timeout or self.target.command_timeout, self.target.label, argv, max_stdout, what)

    def run_shell(self, command: str, env: dict, timeout: float) -> CommandResult:
        """Run the user's shell `command` with `sh -c` on the device, `env` set for it (through `env`, so the
        server's AcceptEnv does not matter)."""
        return self.run(["env", *(f"{k}={v}" for k, v in env.items()), "sh", "-c", command], timeout=timeout)


DEFAULT_KEY_NAMES = ("id_rsa", "id_ecdsa", "id_ed25519", "id_dsa")


def tried_keys(t: Target, keys) -> str:
    """Where the keys offered came from, for an authentication error: the identity file, or ssh-agent, the SSH
    config's IdentityFile entries and ~/.ssh/id_* (naming those that exist)."""
    if t.identity:
        return f"identity file {keys[0]}"
    agent = os.environ.get("SSH_AUTH_SOCK")
    parts = [f"ssh-agent ({agent})" if agent else "ssh-agent (not running: SSH_AUTH_SOCK is not set)"]
    if t.identities:
        parts.append("the ssh config's IdentityFile " + ", ".join(t.identities)
                     + ("" if keys else " (none of them exists)"))
    found = [f"~/.ssh/{n}" for n in DEFAULT_KEY_NAMES if Path(f"~/.ssh/{n}").expanduser().is_file()]
    parts.append("~/.ssh/id_* (" + (", ".join(found) if found else "none there") + ")")
    return "; ".join(parts)


def check_identity(t: Target, key_file: str) -> None:
    """Refuse an --identity that is missing, a folder, a FIFO or a device, a public key, or no private key paramiko
    can read, before any connection is made.

    Raises:
        AuthenticationError: the file and what is wrong with it.
    """
    import paramiko

    from ..bundle.paths import kind_of

    path = Path(key_file)
    if path.is_dir():
        raise AuthenticationError(f"{t.label}: identity {key_file} is a folder; expected a private key file "
                                  f"(e.g. ~/.ssh/id_ed25519)")
    if path.exists() and not path.is_file():  # a FIFO would block the read, a device not end
        raise AuthenticationError(f"{t.label}: identity {key_file} is {kind_of(path.stat().st_mode)}; expected a "
                                  f"private key file (a regular file, e.g. ~/.ssh/id_ed25519)")
    if not path.is_file():
        raise AuthenticationError(f"{t.label}: identity file {key_file} not found")
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as exc:
        raise AuthenticationError(f"{t.label}: cannot read identity file {key_file}: {exc.strerror}") from None
    if head.startswith(PUBLIC_KEY_PREFIXES):
        raise AuthenticationError(f"{t.label}: identity file {key_file} is a public key; pass the private key "
                                  f"(the same name without .pub)")
    try:
        paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        raise AuthenticationError(f"{t.label}: key {key_file} is encrypted; load it into ssh-agent "
                                  f"(ssh-add) and leave out --identity") from None
    except (paramiko.SSHException, paramiko.UnknownKeyType, OSError, ValueError, TypeError) as exc:
        if "password" in str(exc).lower():  # an encrypted PEM key (cryptography's TypeError)
            raise AuthenticationError(f"{t.label}: key {key_file} is encrypted; load it into ssh-agent "
                                      f"(ssh-add) and leave out --identity") from None
        raise AuthenticationError(f"{t.label}: identity file {key_file} is not a private key paramiko can read "
                                  f"(OpenSSH ed25519, ECDSA or RSA): {exc}") from None


TAIL_STDOUT_BYTES = 1 << 20  # what is kept of a user command's stdout (verify, hooks): its last MiB


class Tail:
    """The last `limit` bytes of a stream (at most 2 x limit buffered while appending)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()

    def add(self, block: bytes) -> None:
        self.data += block
        if len(self.data) > 2 * self.limit:
            del self.data[:-self.limit]

    def bytes(self) -> bytes:
        return bytes(self.data[-self.limit:])


# After the exit status, how long collect waits for the channel's EOF (the output sshd has not sent yet), s.
EXIT_GRACE_S = 2.0


def close_quietly(channel) -> None:
    """Close `channel`, ignoring a transport that is already gone: closing sends a message, which fails with a
    broken pipe or reset once the device has dropped the connection (e.g. after flooding an answer). The caller
    has its result, or raises the typed error that says what went wrong, either way."""
    import paramiko

    try:
        channel.close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def collect(channel, timeout: float, label: str, argv, max_stdout: int | None = None,
            what: str | None = None) -> CommandResult:
    """Read stdout and stderr of `channel` until the command exits; abandon it after `timeout` seconds.

    Memory is bounded while reading (paramiko's channel window holds back the rest): stderr keeps its last
    answers.MAX_STDERR_BYTES; stdout is refused past `max_stdout` bytes (an agent answer), or with None keeps its
    last TAIL_STDOUT_BYTES (a user command's output, of which messages quote the last lines). Messages name the
    command as `what` ("remote plan in '~/colibri'"), else by its (shortened) command line.

    Raises:
        RemoteTimeoutError: the command did not finish within `timeout` seconds.
        RemoteAnswerError: stdout passed `max_stdout` bytes (the channel is closed at once).
    """
    from .answers import MAX_STDERR_BYTES

    out, err = (bytearray() if max_stdout is not None else Tail(TAIL_STDOUT_BYTES)), Tail(MAX_STDERR_BYTES)
    what = what or f"remote command {_short(argv)}"
    deadline = time.monotonic() + timeout
    exited = None
    while True:
        while channel.recv_ready() and time.monotonic() <= deadline:
            block = channel.recv(1 << 16)
            if max_stdout is None:
                out.add(block)
                continue
            out += block
            if len(out) > max_stdout:
                close_quietly(channel)
                raise RemoteAnswerError(f"{label}: {what} wrote more than {max_stdout:,} bytes before its answer "
                                        f"(the limit of one answer); abandoned", None,
                                        err.bytes().decode("utf-8", "replace")[-2000:])
        while channel.recv_stderr_ready() and time.monotonic() <= deadline:
            err.add(channel.recv_stderr(1 << 16))
        if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
            # sshd may send the exit status before the last output: wait for the channel's EOF, but not for a
            # background process that keeps the command's output open (EXIT_GRACE_S).
            exited = exited or time.monotonic()
            if channel.eof_received or channel.closed or time.monotonic() - exited > EXIT_GRACE_S:
                break
        if time.monotonic() > deadline:
            close_quietly(channel)
            raise RemoteTimeoutError(f"{label}: {what} did not finish within {timeout:g} s",
                                     None, err.bytes().decode("utf-8", "replace")[-2000:])
        select.select([channel], [], [], 0.05)
    status = channel.recv_exit_status()
    close_quietly(channel)
    return CommandResult(status, bytes(out) if max_stdout is not None else out.bytes(), err.bytes())


def _no_connection_reasons(exc) -> str:
    """One line from paramiko's NoValidConnectionsError: each address tried and why it failed (its str() starts
    with a meaningless "[Errno None]")."""
    parts = []
    for address, error in exc.errors.items():
        why = getattr(error, "strerror", None) or str(error)
        parts.append(f"{address[0]} port {address[1]}: {why}")
    return "; ".join(parts) or str(exc)


def _no_banner_error(t: Target, exc: Exception) -> ConnectError:
    """The error for a server that accepted TCP but sent no SSH protocol banner ("SSH-2.0-...")."""
    if "Indecipherable" in str(exc):  # paramiko: lines came, none of them an SSH banner
        return ConnectError(f"{t.label}: port {t.port} accepted the TCP connection but does not speak SSH (it sent "
                            f"no 'SSH-' protocol banner); is this the device's SSH port?")
    if isinstance(exc.__context__, (EOFError, ConnectionError)):  # paramiko's banner read hit EOF or a reset
        return ConnectError(f"{t.label}: port {t.port} accepted the TCP connection and closed it before sending an "
                            f"SSH protocol banner; is sshd running there (and not refusing this client: "
                            f"MaxStartups, a firewall, a port forward with nothing behind it), and is this its port?")
    return ConnectTimeoutError(f"{t.label}: port {t.port} accepted the TCP connection but did not speak SSH (no "
                               f"protocol banner) within {t.connect_timeout:g} s (--connect-timeout); is sshd "
                               f"running there, and is this its port?")


def _quiet_paramiko_log() -> None:
    """Keep paramiko's log records (tracebacks from its transport thread) off stderr: without a handler of its
    own, Python's last-resort handler would print them. An application that configures logging still gets
    them through propagation."""
    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


def _short(argv) -> str:
    text = command_line(argv)
    return text if len(text) < 160 else text[:70] + " ... " + text[-70:]


def _transport_factory(sock, **kwargs):
    import paramiko

    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    available = [c for c in PREFERRED_CIPHERS if c in options.ciphers]
    options.ciphers = tuple(available) + tuple(c for c in options.ciphers if c not in available)
    return transport
