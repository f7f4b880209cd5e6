"""`colibri-sdk deploy` on the command line: one host, --status, --rollback, and an inventory with a dead host."""

from __future__ import annotations

import os
import sys

import pytest
import yaml
from deploy_bundles import remote_tree, write_bundle
from sshd_server import free_port

from colibri_sdk.cli import main

pytestmark = pytest.mark.ssh


def flags(sshd, known_hosts, device_dir) -> list:
    return ["--identity", str(sshd.user_key), "--known-hosts", str(known_hosts), "--remote-dir", str(device_dir),
            "--remote-python", sys.executable, "--quiet"]


def test_deploy_status_rollback(tmp_path, sshd, known_hosts, device_dir, capsys):
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", *flags(sshd, known_hosts, device_dir)]
    a, b = write_bundle(tmp_path / "a", kernel_seed=0), write_bundle(tmp_path / "b", kernel_seed=1)
    assert main(["deploy", str(a), *common]) == 0
    out = capsys.readouterr().out
    assert "active at" in out and f"sent {sum(p.stat().st_size for p in a.rglob('*') if p.is_file()):,} of" in out
    assert main(["deploy", str(b), *common, "--keep", "2"]) == 0
    capsys.readouterr()
    assert main(["deploy", "--status", *common]) == 0
    out = capsys.readouterr().out
    current = os.path.basename(os.readlink(device_dir / "current"))
    assert f"* {current}" in out and "(* current, - previous)" in out and "sm_87" in out
    assert main(["deploy", "--rollback", *common]) == 0
    assert remote_tree(device_dir / "current") == remote_tree(a)
    assert f"(was {current})" in capsys.readouterr().out


def test_single_host_error_exits_1_with_message(tmp_path, sshd, known_hosts, device_dir, capsys):
    port = free_port()
    code = main(["deploy", str(write_bundle(tmp_path / "a")), "--host", "root@127.0.0.1", "--port", str(port),
                 *flags(sshd, known_hosts, device_dir)])
    assert code == 1
    assert f"colibri-sdk deploy: error: root@127.0.0.1:{port}: connection refused" in capsys.readouterr().err


def test_inventory_with_a_dead_host(tmp_path, sshd, known_hosts, device_dir, capsys):
    dead = free_port()
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({
        "defaults": {"user": sshd.user},
        "hosts": [{"host": "127.0.0.1", "port": sshd.port, "name": "line-1"},
                  {"host": "127.0.0.1", "port": sshd.port, "name": "line-2", "remote_dir": f"{device_dir}2"},
                  f"127.0.0.1:{dead}"],
    }))
    bundle = write_bundle(tmp_path / "a")
    code = main(["deploy", str(bundle), "--hosts", str(inventory), *flags(sshd, known_hosts, device_dir)])
    out = capsys.readouterr().out
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split() == ["HOST", "RESULT", "DETAIL"]
    assert lines[1].split()[:2] == ["line-1", "ok"] and lines[2].split()[:2] == ["line-2", "ok"]
    assert lines[3].startswith(f"{sshd.user}@127.0.0.1:{dead}  FAILED: ConnectRefusedError")
    assert remote_tree(device_dir / "current") == remote_tree(bundle)
    assert remote_tree(device_dir.parent / (device_dir.name + "2") / "current") == remote_tree(bundle)


def test_inventory_unknown_key_is_refused(tmp_path, sshd, known_hosts, device_dir, capsys):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("hosts:\n  - {host: 127.0.0.1, prot: 22}\n")
    assert main(["deploy", str(tmp_path), "--hosts", str(inventory), *flags(sshd, known_hosts, device_dir)]) == 1
    assert ("unknown key(s) ['prot'] in hosts[0]; allowed: ['host', 'identity', 'known_hosts', 'name', 'port', "
            "'remote_dir', 'user']") in capsys.readouterr().err


def test_bundle_required_without_rollback_or_status(sshd, known_hosts, device_dir, capsys):
    assert main(["deploy", "--host", "127.0.0.1", *flags(sshd, known_hosts, device_dir)]) == 1
    assert "deploy needs a BUNDLE folder (or --rollback / --status)" in capsys.readouterr().err
