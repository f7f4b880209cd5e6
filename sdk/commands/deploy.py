"""`colibri-sdk deploy`: push a bundle to one device or many over SSH; roll back; show what is there.

    colibri-sdk deploy BUNDLE --host USER@HOST [--port N] [--identity KEY] [--known-hosts FILE]
                       [--remote-dir DIR] [--accept-new-host-key] [--verify [--verify-backend auto|cuda|cpu]]
                       [--remote-colibri CMD] [--keep N]
    colibri-sdk deploy BUNDLE --hosts inventory.yaml [--parallel N] ...
    colibri-sdk deploy --rollback [--to ID] --host USER@HOST ...
    colibri-sdk deploy --status --host USER@HOST ...

Exit status: 0 when every host succeeded, 1 otherwise (the table names the failures).
"""

from __future__ import annotations

import argparse
import time


def register(sub) -> None:
    p = sub.add_parser(
        "deploy", help="push a bundle to devices over SSH (verified, atomic, incremental), roll back, show status",
        description="Push a bundle to devices over SSH. The device's active bundle (REMOTE_DIR/current) is "
                    "switched only after every file's sha256 was verified on the device.")
    p.add_argument("bundle", nargs="?", help="the bundle folder (not needed with --rollback or --status)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--host", metavar="[USER@]HOST[:PORT]", help="the device")
    where.add_argument("--hosts", metavar="FILE", help="YAML inventory of devices (see docs/deploy.md)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--rollback", action="store_true", help="switch back to the previously active bundle")
    action.add_argument("--status", action="store_true", help="list the bundles on the device")
    p.add_argument("--to", metavar="ID", help="with --rollback: the bundle id to switch to (see --status)")
    p.add_argument("--port", type=int, default=22, help="SSH port (default 22)")
    p.add_argument("--identity", "-i", metavar="KEY", help="private key file (default: ssh-agent, ~/.ssh/id_*)")
    p.add_argument("--known-hosts", metavar="FILE", help="known_hosts file (default ~/.ssh/known_hosts)")
    p.add_argument("--accept-new-host-key", action="store_true",
                   help="trust and store the key of a host not yet in known_hosts (a changed key is never accepted)")
    p.add_argument("--remote-dir", metavar="DIR", help="store root on the device (default ~/colibri)")
    p.add_argument("--verify", action="store_true",
                   help="run `colibri-sdk verify` on the device before switching to the new bundle")
    p.add_argument("--verify-backend", choices=("auto", "cuda", "cpu"), metavar="{auto,cuda,cpu}",
                   help="with --verify: the device's `verify --backend` (default auto: CUDA, else the CPU; cuda "
                        "fails instead of falling back)")
    p.add_argument("--keep", type=int, default=3, metavar="N", help="bundles kept on the device (default 3)")
    p.add_argument("--remote-python", default="python3", metavar="CMD",
                   help="the device's Python 3.8+ (runs the store helper; default python3)")
    p.add_argument("--remote-colibri", default="colibri-sdk", metavar="CMD",
                   help="the device's colibri-sdk command for --verify (default colibri-sdk, found only if on the "
                        "PATH of a non-interactive SSH command; e.g. '/opt/colibri/venv/bin/python -m colibri_sdk')")
    p.add_argument("--streams", type=int, default=2, metavar="N", help="parallel upload channels per host (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=4, metavar="N", help="hosts deployed at once with --hosts (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds before a silent remote command is abandoned (default 120)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="connect timeout (default 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..deploy import DEFAULT_REMOTE_DIR, DeployError, DeployOptions, Target
    from ..deploy.inventory import InventoryHost, format_table, load_inventory, run_on_hosts, with_remote_dir

    if args.to is not None and not args.rollback:
        raise DeployError("--to ID only goes with --rollback")
    if not (args.rollback or args.status) and not args.bundle:
        raise DeployError("deploy needs a BUNDLE folder (or --rollback / --status)")
    if (args.rollback or args.status) and args.bundle:
        raise DeployError(f"BUNDLE {args.bundle!r} does not go with --rollback or --status (--rollback --to ID "
                          f"names a bundle on the device)")
    if args.parallel < 1:
        raise DeployError(f"--parallel {args.parallel}: must be at least 1")
    if args.verify_backend and not args.verify:
        raise DeployError(f"--verify-backend {args.verify_backend} only goes with --verify")
    base = Target(host="-", port=args.port, identity=args.identity, known_hosts=args.known_hosts,
                  accept_new_host_key=args.accept_new_host_key, connect_timeout=args.connect_timeout,
                  command_timeout=args.timeout)
    remote_dir = DEFAULT_REMOTE_DIR if args.remote_dir is None else args.remote_dir
    options = DeployOptions(remote_dir=remote_dir, keep=args.keep, verify=args.verify,
                            remote_python=args.remote_python, remote_colibri=args.remote_colibri,
                            verify_backend=args.verify_backend or "auto", streams=args.streams)
    if args.hosts:
        hosts = load_inventory(args.hosts, base)
    else:
        target = Target.parse(args.host, **{k: getattr(base, k) for k in (
            "port", "identity", "known_hosts", "accept_new_host_key", "connect_timeout", "command_timeout")})
        hosts = [InventoryHost(target.label, target)]

    if args.status:
        results = run_on_hosts(hosts, lambda h: _status(h, with_remote_dir(options, h)), args.parallel)
    elif args.rollback:
        results = run_on_hosts(hosts, lambda h: _rollback(h, with_remote_dir(options, h), args.to), args.parallel)
    else:
        results = _deploy_all(args, hosts, options)
    if len(results) == 1 and not results[0].ok:
        raise results[0].error
    if len(results) > 1:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


def _deploy_all(args, hosts, options):
    from ..deploy import deploy
    from ..deploy.inventory import run_on_hosts, with_remote_dir
    from ..deploy.progress import ByteProgress

    description = hosts[0].name if len(hosts) == 1 else f"{len(hosts)} hosts"
    with ByteProgress(description, enabled=not args.quiet) as bar:

        def one(host):
            result = deploy(args.bundle, host.target, with_remote_dir(options, host), progress=bar)
            return result, _summary(result)

        results = run_on_hosts(hosts, one, args.parallel)
    if len(results) == 1 and results[0].ok:
        print(f"{results[0].name}: {results[0].detail}")
    return results


def _summary(result) -> str:
    """One line for the table (the backend that ran the self-test included), then the device's self-test line
    and its notes, indented."""
    rate = result.bytes_sent / result.seconds / 1e6 if result.seconds else 0.0
    state = "active" if result.changed else "already active"
    if result.selftest_backend:
        state = f"{state} (self-test passed on {result.selftest_backend})"
    resumed = f", {len(result.resumed)} resumed" if result.resumed else ""
    first = (f"bundle {result.bundle_id} {state} at {result.remote_path}; sent {result.bytes_sent:,} of "
             f"{result.total_bytes:,} bytes ({count_files(result.sent)}{resumed}) in {result.seconds:.1f} s "
             f"({rate:.1f} MB/s)")
    lines = [first]
    lines += [f"  {line}" for line in (result.selftest, *result.verify_notes) if line]
    return "\n".join(lines)


def count_files(paths) -> str:
    """"11 files + manifest", "1 file", "0 files": the convention of `build`, `verify` and `--status`
    (manifest.json is not counted among the files)."""
    from ..bundle import MANIFEST

    paths = list(paths)
    others = len([p for p in paths if p != MANIFEST])
    text = f"{others} file{'' if others == 1 else 's'}"
    return text + " + manifest" if MANIFEST in paths else text


def _rollback(host, options, to):
    from ..deploy import rollback

    answer = rollback(host.target, options, to)
    detail = f"current {answer['current']} (was {answer['previous']})"
    print(f"{host.name}: {detail}")
    return answer, detail


def _status(host, options):
    from ..deploy import status

    st = status(host.target, options)
    if not st.exists:
        text = f"{host.name}: no bundles under {st.root}"
        print(text)
        return st, "no bundles"
    lines = [f"{host.name}: {st.root}  ({st.store_objects} store objects, {st.store_bytes:,} bytes, "
             f"{st.partial} partial uploads, {st.free_bytes:,} bytes free)"]
    lines.append(f"  {'':2}{'ID':<18}{'ACTIVATED':<21}{'FILES':>6}{'BYTES':>16}  ARCH   DTYPE")
    for b in st.bundles:
        mark = "*" if b.bundle_id == st.current else ("-" if b.bundle_id == st.previous else " ")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.activated))
        lines.append(f"  {mark} {b.bundle_id:<18}{when:<21}{b.files:>6}{b.bytes:>16,}  "
                     f"{b.manifest.get('arch') or '?':<6} {b.manifest.get('dtype') or '?'}{b.error}")
    lines.append("  (* current, - previous; FILES: files besides manifest.json; BYTES: all, manifest included)")
    print("\n".join(lines))
    return st, f"current {st.current}, {len(st.bundles)} bundles"
