"""OpenSSH client configuration (`~/.ssh/config`), read with paramiko's `SSHConfig`.

`resolve(spec, ...)` turns what the user typed (`--host orin-01`, an alias) into a `Target` the way `ssh` would:
HostName, User, Port, IdentityFile and ProxyJump of the first matching Host blocks apply where the command line
says nothing; the command line (`user@host:port`, `--port`, `-i`) wins. ProxyJump hosts (comma-separated, `none`
for none) are resolved the same way and reached through a direct-tcpip channel of the previous hop
(connection.Connection). paramiko's parser is used rather than our own: it knows Host patterns, negation, Match
and token expansion (%h, %u, ~).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from pathlib import Path

from .connection import Target
from .errors import DeployError

USER_CONFIG = Path("~/.ssh/config")
MAX_JUMPS = 8
MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
_INCLUDE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(?P<files>.+?)\s*$", re.IGNORECASE)


def load_config(path=None):
    """The parsed config: `path`, or ~/.ssh/config when None. A missing default file is an empty config. Any
    readable file will do, an empty one and /dev/null included (OpenSSH's `ssh -F /dev/null`: no config).

    Raises:
        DeployError: `path` was given and is missing or a folder, the file is not a regular file (a FIFO, a device;
            /dev/null excepted), or it cannot be read or parsed.
    """
    import paramiko

    file = Path(path).expanduser() if path is not None else USER_CONFIG.expanduser()
    if not file.exists():
        if path is not None:
            raise DeployError(f"--ssh-config {path}: no such file; expected an OpenSSH client config file "
                              f"(/dev/null for none)")
        return paramiko.SSHConfig()
    if file.is_dir():
        raise DeployError(f"--ssh-config {path if path is not None else file}: a folder; expected an OpenSSH "
                          f"client config file (/dev/null for none)")
    if not file.is_file() and not _is_dev_null(file):  # a FIFO or a device would block the read, or never end
        from ..bundle.paths import kind_of

        raise DeployError(f"--ssh-config {path if path is not None else file}: {kind_of(file.stat().st_mode)}; "
                          f"expected an OpenSSH client config file (/dev/null for none)")
    try:
        return paramiko.SSHConfig.from_text(_with_includes(file, 0))
    except (OSError, ValueError, paramiko.ConfigParseError) as exc:
        raise DeployError(f"ssh config {file}: cannot read it ({exc})") from None


def _is_dev_null(file: Path) -> bool:
    try:
        return os.path.samefile(file, os.devnull)
    except OSError:
        return False


def _with_includes(file: Path, depth: int) -> str:
    """The text of `file` with every `Include` line replaced by the text of the files it names, as OpenSSH reads
    them (paramiko's parser keeps Include as an unknown key, so the hosts of an included file were not found):
    each pattern a glob, `~` expanded, a relative one under ~/.ssh, matches in sorted order, no match no error."""
    if depth > MAX_INCLUDE_DEPTH:
        raise DeployError(f"ssh config {file}: Include nests more than {MAX_INCLUDE_DEPTH} files deep")
    lines = []
    for line in file.read_text().splitlines():
        m = _INCLUDE.match(line)
        if not m:
            lines.append(line)
            continue
        for pattern in shlex.split(m["files"]):
            pattern = os.path.expanduser(pattern)
            if not os.path.isabs(pattern):
                pattern = os.path.join(os.path.expanduser("~/.ssh"), pattern)
            for match in sorted(glob.glob(pattern)):
                if os.path.isfile(match):
                    lines.append(_with_includes(Path(match), depth + 1))
    return "\n".join(lines) + "\n"


def resolve(spec: str, config=None, port: int | None = None, identity: str | None = None, _depth: int = 0,
            **fields) -> Target:
    """The Target for `[user@]alias[:port]` under `config` (a paramiko SSHConfig, or None for no config).

    Args:
        port, identity: the command line's --port and -i (None when not given).
        fields: other Target fields (known_hosts, timeouts, accept_new_host_key).

    Raises:
        DeployError: a malformed spec, a bad Port in the config, a ProxyCommand (not supported: ProxyJump is), or
            ProxyJump hops nested too deep.
    """
    parsed = Target.parse(spec, **fields)
    spec_port = parsed.port if _has_port(spec) else None
    entry = config.lookup(parsed.host) if config is not None else {}
    host = entry.get("hostname", parsed.host)
    user = parsed.user or entry.get("user")
    chosen_port = spec_port or port
    if chosen_port is None and "port" in entry:
        text = entry["port"]
        # isascii: str.isdigit also holds for "²" (int() refuses it) and "٣" (int() reads 3; OpenSSH refuses both)
        if not (str(text).isascii() and str(text).isdigit()) or not 1 <= int(text) <= 65535:
            raise DeployError(f"ssh config: Host {parsed.host}: Port {text!r} is not a number from 1 to 65535")
        chosen_port = int(text)
    identities = ()
    if identity is None:
        identities = tuple(os.path.expanduser(p) for p in entry.get("identityfile", []))
    if entry.get("proxycommand") and entry["proxycommand"].lower() != "none":
        raise DeployError(f"ssh config: Host {parsed.host} uses ProxyCommand, which deploy does not run; use "
                          f"ProxyJump (a host to reach it through) instead")
    jump = None
    # a hop is [user@]host[:port] or, as OpenSSH also reads it, ssh://[user@]host[:port]
    hops = [h.strip().removeprefix("ssh://") for h in entry.get("proxyjump", "").split(",") if h.strip()]
    if hops and hops != ["none"]:
        if _depth >= MAX_JUMPS:
            raise DeployError(f"ssh config: ProxyJump for {parsed.host} nests more than {MAX_JUMPS} hops")
        for hop in hops:  # each hop is reached through the one before it
            nxt = resolve(hop, config, _depth=_depth + 1, **fields)
            jump = nxt if jump is None else nxt.with_(proxy_jump=jump)
    try:
        return Target(host=host, user=user, port=chosen_port or 22, identity=identity,
                      identities=identities, proxy_jump=jump, alias=parsed.host if host != parsed.host else None,
                      **fields)
    except DeployError as exc:
        raise DeployError(f"host {spec!r} (ssh config): {exc}") from None


def _has_port(spec: str) -> bool:
    hostport = spec.rpartition("@")[2]
    return ("]:" in hostport) if hostport.startswith("[") else hostport.count(":") == 1
