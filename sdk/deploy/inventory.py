"""Many devices: a YAML inventory, a bounded thread pool, and a per-host result table.

Inventory file (`--hosts FILE`):

    defaults:                   # optional; fields every host inherits (command-line flags come first)
      user: nvidia
      port: 22
      identity: ~/.ssh/id_ed25519
      remote_dir: /opt/colibri
    hosts:
      - orin-01.local                         # [user@]host[:port]
      - {host: 10.0.0.12, port: 2222, name: line-3}

Host fields: host (required), name (table label), user, port, identity, known_hosts, remote_dir; all strings but
the port (1 to 65535). A device (host, port, remote_dir) may appear once.
"""

from __future__ import annotations

import reprlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ColibriError
from .connection import Target
from .errors import DeployError

HOST_FIELDS = {"host", "name", "user", "port", "identity", "known_hosts", "remote_dir"}
TOP_LEVEL = {"defaults", "hosts"}
STRING_FIELDS = ("host", "name", "user", "identity", "known_hosts", "remote_dir")
MAX_INVENTORY_BYTES = 1 << 20  # thousands of hosts fit in far less


@dataclass(frozen=True)
class InventoryHost:
    """One inventory entry: its label, connection target and store root (None: the command's --remote-dir)."""

    name: str
    target: Target
    remote_dir: str | None = None


@dataclass
class HostResult:
    """The outcome on one host: `ok`, a short `detail` for the table, and the result or the error."""

    name: str
    ok: bool
    detail: str
    value: object = None
    error: Exception | None = None


def load_inventory(path, base: Target, config=None, port_given: bool = True) -> list:
    """Read a YAML inventory; each host's Target starts from `base` (the command-line flags), and what neither
    gives comes from the SSH config `config` (sshconfig.load_config), as `ssh` would take it.

    Args:
        port_given: whether base.port came from the command line (else the config's Port may apply).

    Raises:
        DeployError: not a regular file (a FIFO, a device), unreadable YAML, unknown keys (the allowed set is quoted), a field of the wrong type, no hosts,
            duplicate names, the same device and remote_dir twice.
    """
    from ..errors import ProfileError
    from ..yaml_reader import parse_yaml

    file = Path(path)
    if file.exists() and not file.is_file() and not file.is_dir():  # a FIFO would block the read, a device not end
        from ..bundle.paths import kind_of

        raise DeployError(f"inventory {path}: {kind_of(file.stat().st_mode)}; expected a YAML file")
    try:
        if Path(path).is_file() and Path(path).stat().st_size > MAX_INVENTORY_BYTES:
            raise DeployError(f"inventory {path}: {Path(path).stat().st_size:,} bytes; an inventory is at most "
                              f"{MAX_INVENTORY_BYTES:,} bytes")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8 text
        raise DeployError(f"inventory {path}: cannot read it ({exc})") from None
    try:
        data = parse_yaml(text, f"inventory {path}")  # the profiles' safe loader: duplicate keys are refused too
    except ProfileError as exc:
        raise DeployError(str(exc)) from None
    if not isinstance(data, dict) or not isinstance(data.get("hosts"), list) or not data["hosts"]:
        raise DeployError(f"inventory {path}: expected a mapping with a non-empty 'hosts' list")
    _check_keys(path, "top level", data, TOP_LEVEL)
    defaults = data.get("defaults") or {}
    _check_keys(path, "defaults", defaults, HOST_FIELDS - {"host", "name"})
    hosts, names, places = [], set(), {}
    for index, entry in enumerate(data["hosts"]):
        fields = dict(defaults)
        if isinstance(entry, str):
            fields["spec"] = entry
        elif isinstance(entry, dict):
            _check_keys(path, f"hosts[{index}]", entry, HOST_FIELDS)
            if "host" not in entry:
                raise DeployError(f"inventory {path}: hosts[{index}] has no 'host'")
            fields.update(entry)
            fields["spec"] = entry["host"]
        else:
            raise DeployError(f"inventory {path}: hosts[{index}] is {reprlib.repr(entry)}; expected a string or a "
                              f"mapping")
        try:
            _check_types(fields)
            host = _host(base, fields, config, port_given)
        except DeployError as exc:
            raise DeployError(f"inventory {path}: hosts[{index}]: {exc}") from None
        if host.name in names:
            raise DeployError(f"inventory {path}: host name {host.name!r} appears twice")
        place = (host.target.host, host.target.port, host.remote_dir)
        if place in places:
            raise DeployError(f"inventory {path}: hosts[{index}] ({host.name}) is the same device and remote_dir "
                              f"as {places[place]}; each store may appear once")
        names.add(host.name)
        places[place] = host.name
        hosts.append(host)
    return hosts


def _check_types(fields: dict) -> None:
    """Strings where strings belong, a whole number for the port (YAML would give lists, numbers, booleans)."""
    for key in STRING_FIELDS:
        value = fields.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise DeployError(f"{key} {reprlib.repr(value)}: expected a non-empty string")
    port = fields.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise DeployError(f"port {reprlib.repr(port)}: expected a whole number from 1 to 65535")


def _check_keys(path, where: str, mapping, allowed: set) -> None:
    if not isinstance(mapping, dict):
        raise DeployError(f"inventory {path}: {where} must be a mapping, got {reprlib.repr(mapping)}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise DeployError(f"inventory {path}: unknown key(s) {unknown} in {where}; allowed: {sorted(allowed)}")


def _host(base: Target, fields: dict, config=None, port_given: bool = True) -> InventoryHost:
    from .sshconfig import resolve

    changes = {k: fields[k] for k in ("user", "identity", "known_hosts") if fields.get(k) is not None}
    if fields.get("port") is not None:
        changes["port"] = fields["port"]
    merged = {**_fields(base), **changes}
    if config is not None:
        port = merged.pop("port") if (port_given or "port" in changes) else None
        merged.pop("port", None)
        user = merged.pop("user", None)
        spec = fields["spec"] if user is None or "@" in fields["spec"] else f"{user}@{fields['spec']}"
        target = resolve(spec, config, port=port, **merged)
    else:
        target = Target.parse(fields["spec"], **merged)
    name = str(fields.get("name") or target.label)
    return InventoryHost(name, target, fields.get("remote_dir"))


def _fields(target: Target) -> dict:
    return {k: getattr(target, k) for k in ("user", "port", "identity", "known_hosts", "accept_new_host_key",
                                            "connect_timeout", "command_timeout")}


# How often the thread that waits for the hosts wakes to take a Ctrl-C (seconds).
SIGNAL_POLL_S = 0.1


def run_on_hosts(hosts: list, action, parallel: int = 4, on_interrupt=None) -> list:
    """Call `action(host) -> (value, detail)` for every host on at most `parallel` threads.

    A ColibriError from one host becomes a failed HostResult; the others go on. Results keep inventory order.
    Ctrl-C (KeyboardInterrupt in this thread) calls `on_interrupt()` if given (e.g. to ask the deploys to stop),
    waits for the running actions to return, and is raised again.
    """

    def one(host: InventoryHost) -> HostResult:
        try:
            value, detail = action(host)
            return HostResult(host.name, True, detail, value)
        except ColibriError as exc:
            return HostResult(host.name, False, str(exc), error=exc)

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts))), thread_name_prefix="host") as pool:
        futures = [pool.submit(one, host) for host in hosts]
        try:
            # The kernel hands a Ctrl-C to any thread of the process; Python runs its handler in this one only
            # when it wakes, so it waits in short steps rather than until every deploy has ended.
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=SIGNAL_POLL_S)
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            for f in futures:
                f.cancel()
            if on_interrupt is not None:
                on_interrupt()
            raise


def format_table(results: list) -> str:
    """A fixed-width table: HOST, RESULT (ok / FAILED: error type), DETAIL (first line of the message)."""
    rows = [("HOST", "RESULT", "DETAIL")]
    for r in results:
        outcome = "ok" if r.ok else f"FAILED: {type(r.error).__name__}"
        rows.append((r.name, outcome, r.detail.splitlines()[0] if r.detail else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)


def with_remote_dir(options, host: InventoryHost):
    """`options` with the host's own remote_dir, if the inventory gives one."""
    return replace(options, remote_dir=host.remote_dir) if host.remote_dir else options
