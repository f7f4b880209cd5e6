"""`colibri-sdk deploy`: push a bundle to one device or many over SSH; roll back; show what is there.

    colibri-sdk deploy BUNDLE --host [USER@]HOST[:PORT] [--port N] [-i KEY] [--ssh-config FILE]
                       [--known-hosts FILE] [--remote-dir DIR] [--accept-new-host-key]
                       [--verify] [--verify-backend cuda|cpu] [--remote-colibri CMD] [--keep N]
                       [--on-activate CMD] [--health-cmd CMD]
    colibri-sdk deploy [BUNDLE] --host HOST --install-runtime [--wheels DIR]
    colibri-sdk deploy BUNDLE --hosts inventory.yaml [--parallel N] ...
    colibri-sdk deploy --rollback [--to ID] --host HOST ...
    colibri-sdk deploy --status --host HOST ...

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
    p.add_argument("bundle", nargs="?",
                   help="the bundle folder (not needed with --rollback, --status or --install-runtime)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--host", metavar="[USER@]HOST[:PORT]", help="the device")
    where.add_argument("--hosts", metavar="FILE", help="YAML inventory of devices (see docs/deploy.md)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--rollback", action="store_true",
                        help="step back one bundle in the device's history (each rollback goes one further back)")
    action.add_argument("--status", action="store_true", help="list the bundles on the device")
    p.add_argument("--to", metavar="ID", help="with --rollback: the bundle id to switch to (see --status)")
    action.add_argument("--install-runtime", action="store_true",
                        help="install colibri-sdk and its wheels into a venv on the device (REMOTE_DIR/venv) from "
                             "this machine, with no index reachable there; then deploy BUNDLE if one is given. Run it "
                             "from inside the colibri-sdk checkout (the device's wheel is built from the source "
                             "tree), or put a colibri_sdk wheel into --wheels")
    p.add_argument("--wheels", metavar="DIR", help="with --install-runtime: a folder of wheels for the device "
                                                    "(pip download --platform ...; see docs/deploy.md)")
    p.add_argument("--port", type=int, default=None, help="SSH port (default: the ssh config's Port, else 22)")
    p.add_argument("--identity", "-i", metavar="KEY",
                   help="private key file (default: ssh-agent, the ssh config's IdentityFile, ~/.ssh/id_*)")
    p.add_argument("--ssh-config", metavar="FILE",
                   help="OpenSSH client config for Host aliases, HostName, User, Port, IdentityFile, ProxyJump "
                        "(default ~/.ssh/config)")
    p.add_argument("--known-hosts", metavar="FILE", help="known_hosts file (default ~/.ssh/known_hosts)")
    p.add_argument("--accept-new-host-key", action="store_true",
                   help="trust and store the key of a host not yet in known_hosts (a changed key is never accepted)")
    p.add_argument("--remote-dir", metavar="DIR", help="store root on the device (default ~/colibri)")
    p.add_argument("--verify", action="store_true",
                   help="run `colibri-sdk verify` on the device before switching to the new bundle (on CUDA: on a "
                        "device without a usable GPU add --verify-backend cpu)")
    p.add_argument("--verify-backend", choices=("cuda", "cpu"), metavar="{cuda,cpu}",
                   help="the backend the device's self-test must run on (--verify and the health check; default "
                        "cuda: a fall back to the CPU fails; cpu accepts a check on the CPU)")
    p.add_argument("--on-activate", metavar="CMD",
                   help="shell command run on the device after the switch (e.g. 'sudo systemctl restart "
                        "colibri-qc@line1'), followed by the health check")
    p.add_argument("--health-cmd", metavar="CMD",
                   help="health check run on the device after the switch (exit 0 = healthy; default: the bundle's "
                        "self-test there); on a failure the previous bundle is made current again")
    p.add_argument("--keep", type=int, default=3, metavar="N",
                   help="bundles kept on the device besides current and previous (default 3)")
    p.add_argument("--remote-python", default="python3", metavar="CMD",
                   help="the device's Python 3.8+ (runs the store helper; default python3)")
    p.add_argument("--remote-colibri", default=None, metavar="CMD",
                   help="the device's colibri-sdk command for --verify and the health check (default: the venv "
                        "--install-runtime made, else colibri-sdk on the PATH of a non-interactive SSH command; "
                        "e.g. '/opt/colibri/venv/bin/python -m colibri_sdk')")
    p.add_argument("--streams", type=int, default=2, metavar="N", help="parallel upload channels per host (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=4, metavar="N", help="hosts deployed at once with --hosts (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds before a silent remote command is abandoned (default 120)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="connect timeout (default 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..deploy import DEFAULT_REMOTE_DIR, DeployError, DeployOptions, Target
    from ..deploy.inventory import InventoryHost, format_table, load_inventory, run_on_hosts, with_remote_dir
    from ..deploy.sshconfig import load_config, resolve

    if args.to is not None and not args.rollback:
        raise DeployError("--to ID only goes with --rollback")
    if not (args.rollback or args.status or args.install_runtime) and not args.bundle:
        raise DeployError("deploy needs a BUNDLE folder (or --rollback / --status / --install-runtime)")
    if (args.rollback or args.status) and args.bundle:
        raise DeployError(f"BUNDLE {args.bundle!r} does not go with --rollback or --status (--rollback --to ID "
                          f"names a bundle on the device)")
    if args.wheels and not args.install_runtime:
        raise DeployError(f"--wheels {args.wheels} only goes with --install-runtime")
    if args.parallel < 1:
        raise DeployError(f"--parallel {args.parallel}: must be at least 1")
    if args.verify_backend and not (args.verify or args.on_activate or args.health_cmd):
        raise DeployError(f"--verify-backend {args.verify_backend} only goes with --verify, --on-activate or "
                          f"--health-cmd")
    base = Target(host="-", port=22 if args.port is None else args.port, identity=args.identity,
                  known_hosts=args.known_hosts,
                  accept_new_host_key=args.accept_new_host_key, connect_timeout=args.connect_timeout,
                  command_timeout=args.timeout)
    remote_dir = DEFAULT_REMOTE_DIR if args.remote_dir is None else args.remote_dir
    options = DeployOptions(remote_dir=remote_dir, keep=args.keep, verify=args.verify,
                            remote_python=args.remote_python, remote_colibri=args.remote_colibri,
                            verify_backend=args.verify_backend or "cuda", streams=args.streams,
                            on_activate=args.on_activate, health_cmd=args.health_cmd)
    config = load_config(args.ssh_config)
    if args.hosts:
        hosts = load_inventory(args.hosts, base, config=config, port_given=args.port is not None)
    else:
        target = resolve(args.host, config, port=args.port, identity=args.identity,
                         **{k: getattr(base, k) for k in ("known_hosts", "accept_new_host_key", "connect_timeout",
                                                          "command_timeout")})
        hosts = [InventoryHost(args.host if target.alias else target.label, target)]

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
    """Deploy to every host. Ctrl-C stops each deploy at its next step before the switch; one that had asked for
    the switch goes on to its end; then each host's line says what is true there, and the interrupt goes on to
    the CLI (exit status 130)."""
    import sys

    from ..deploy.deployment import Checkpoint
    from ..deploy.inventory import run_on_hosts
    from ..deploy.progress import ByteProgress

    description = hosts[0].name if len(hosts) == 1 else f"{len(hosts)} hosts"
    points = {host.name: Checkpoint() for host in hosts}

    def stop_all():
        for point in points.values():
            point.stop.set()

    try:
        with ByteProgress(description, enabled=not args.quiet) as bar:
            results = run_on_hosts(hosts, lambda host: _one(args, host, options, bar, points[host.name]),
                                   args.parallel, on_interrupt=stop_all)
    except KeyboardInterrupt:
        for host in hosts:
            print(f"colibri-sdk deploy: {points[host.name].describe(host.name)}", file=sys.stderr)
        raise
    if len(results) == 1 and results[0].ok:
        print(f"{results[0].name}: {results[0].detail}")
    return results


def _one(args, host, options, bar, point):
    """Install the runtime (--install-runtime) and/or deploy the bundle on one host: (value, detail)."""
    from ..deploy import deploy
    from ..deploy.answers import printable
    from ..deploy.inventory import with_remote_dir

    host_options = with_remote_dir(options, host)
    lines = []
    if args.install_runtime:
        record = _installer()(host.target, host_options, args.wheels, progress=bar)
        lines.append(f"runtime {printable(record['version'], 200)} installed in {printable(record['venv'], 500)} "
                     f"({len(record['wheels'])} wheels)")
        if not args.bundle:
            return record, lines[0]
    result = deploy(args.bundle, host.target, host_options, progress=bar, checkpoint=point)
    return result, "\n".join(lines + [_summary(result)])


def _installer():
    """deploy.installer.install_runtime, or a one-line error naming the extra when `packaging` is missing."""
    from ..deploy import DeployError

    try:
        from ..deploy.installer import install_runtime
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "packaging":
            raise
        raise DeployError("--install-runtime needs the Python package 'packaging' (extra \"deploy\"): pip install "
                          "\"colibri-sdk[deploy]\" (in a source checkout: pip install \".[deploy]\")") from None
    return install_runtime


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
    if result.on_activate:
        lines.append(f"  {result.on_activate}")
    if result.health:
        lines.append(f"  health: {result.health}")
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
    earlier = answer.get("history", [])[:-1]
    left = f"; {len(earlier)} earlier in the history" if earlier else "; nothing earlier in the history"
    detail = f"current {answer['current']} (was {answer.get('previous') or 'none'}){left}"
    print(f"{host.name}: {detail}")
    return answer, detail


def _status(host, options):
    from ..deploy import status
    from ..deploy.answers import printable

    st = status(host.target, options)
    if not st.exists:
        text = f"{host.name}: no bundles under {printable(st.root)}"
        print(text)
        return st, "no bundles"
    lines = [f"{host.name}: {printable(st.root)}  ({st.store_objects} store objects, {st.store_bytes:,} bytes, "
             f"{st.partial} partial uploads, {st.free_bytes:,} bytes free)"]
    lines.append(f"  {'':2}{'ID':<18}{'ACTIVATED':<21}{'FILES':>6}{'BYTES':>16}  {'PROFILE':<24}{'ARCH':<7}"
                 f"{'MODEL':<42}{'DTYPE':<6}SHAPE")
    for b in st.bundles:
        mark = "*" if b.bundle_id == st.current else ("-" if b.bundle_id == st.previous else " ")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.activated))
        field = {k: printable(b.manifest.get(k) or "?", 60) for k in ("profile", "arch", "dtype")}
        lines.append(f"  {mark} {b.bundle_id:<18}{when:<21}{b.files:>6}{b.bytes:>16,}  "
                     f"{field['profile']:<24}{field['arch']:<7}{model_text(b.manifest.get('model')):<42}"
                     f"{field['dtype']:<6}{shape_text(b.manifest.get('shape'))}{printable(b.error, 300)}")
    lines.append("  (* current, - previous; FILES: files besides manifest.json; BYTES: all, manifest included)")
    if st.runtime:
        lines.append(f"  runtime: {printable(st.runtime.get('version') or '?', 200)} in "
                     f"{printable(st.runtime.get('venv') or '?', 500)}")
    print("\n".join(lines))
    return st, f"current {st.current}, {len(st.bundles)} bundles"


def model_text(model) -> str:
    """"4 layers x 8 experts, top-2, hidden 256" from the weights header summary, "?" when unknown."""
    try:
        layers, experts = int(model["num_layers"]), int(model["num_experts"])
        return (f"{layers} layer{'' if layers == 1 else 's'} x {experts} experts, top-{int(model['top_k'])}, "
                f"hidden {int(model['hidden_size'])}")
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity), JSON's 1e999
        return "?"


def shape_text(shape) -> str:
    """"batch 1 x tokens 16", "?" when unknown."""
    try:
        return f"batch {int(shape['batch'])} x tokens {int(shape['tokens'])}"
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity), JSON's 1e999
        return "?"
