"""`colibri-sdk deploy` on the command line: one host, --status, --rollback, and an inventory with a dead host."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import signal
import sys
import threading
import time

import pytest
import yaml
from deploy_bundles import remote_tree, write_bundle
from sshd_server import free_port

from colibri_sdk.cli import main
from colibri_sdk.commands.deploy import count_files, model_text, shape_text

pytestmark = pytest.mark.ssh


def flags(sshd, known_hosts, device_dir) -> list:
    return ["--identity", str(sshd.user_key), "--known-hosts", str(known_hosts), "--remote-dir", str(device_dir),
            "--remote-python", sys.executable, "--quiet"]


def bundle_bytes(bundle) -> int:
    return sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())


def test_deploy_status_rollback(tmp_path, sshd, known_hosts, device_dir, capsys):
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", *flags(sshd, known_hosts, device_dir)]
    a, b = write_bundle(tmp_path / "a", kernel_seed=0), write_bundle(tmp_path / "b", kernel_seed=1)
    assert main(["deploy", "--rollback", *common]) == 1  # nothing there yet
    assert "nothing to roll back to: no bundles under" in capsys.readouterr().err
    assert main(["deploy", "--status", *common]) == 0
    assert "no bundles under" in capsys.readouterr().out
    assert main(["deploy", str(a), *common]) == 0
    out = capsys.readouterr().out
    # write_bundle: 7 files listed in the manifest, plus manifest.json ("N files + manifest", as build says).
    assert "active at" in out and f"sent {bundle_bytes(a):,} of {bundle_bytes(a):,} bytes (7 files + manifest)" in out
    assert main(["deploy", str(b), *common, "--keep", "2"]) == 0
    assert "(4 files + manifest)" in capsys.readouterr().out  # only the kernels changed
    assert main(["deploy", "--status", *common]) == 0
    out = capsys.readouterr().out
    current = os.path.basename(os.readlink(device_dir / "current"))
    assert "(* current, - previous; FILES: files besides manifest.json; BYTES: all, manifest included)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith(f"* {current}"))
    # *, id, date, time, FILES, BYTES, PROFILE, ARCH, then MODEL, DTYPE and SHAPE (write_bundle's sizes)
    assert row.split()[4:8] == ["7", f"{bundle_bytes(b):,}", "test-orin", "sm_87"]
    assert re.search(r"  1 layer x 64 experts, top-2, hidden 64 +fp16 +batch 1 x tokens 8$", row), row
    assert main(["deploy", "--rollback", *common]) == 0
    assert remote_tree(device_dir / "current") == remote_tree(a)
    assert f"(was {current})" in capsys.readouterr().out


def test_verify_echoes_the_devices_self_test_line(tmp_path, sshd, known_hosts, device_dir, capsys):
    record = tmp_path / "verify args"
    script = ('printf %s "$*" > "$0"; echo "  self-test: self-test passed on cuda: max abs err 0, max rel err 0"; '
              'echo "colibri-sdk: CUDA driver 12.6, 1 device(s)" >&2')
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", *flags(sshd, known_hosts, device_dir)]
    assert main(["deploy", str(write_bundle(tmp_path / "a")), *common, "--verify", "--verify-backend", "cuda",
                 "--remote-colibri", shlex.join(["sh", "-c", script, str(record)])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert record.read_text().startswith("verify --backend cuda ")
    assert " active (self-test passed on cuda) at " in lines[0]
    assert lines[1:] == ["  self-test passed on cuda: max abs err 0, max rel err 0",
                         "  colibri-sdk: CUDA driver 12.6, 1 device(s)"]


def test_verify_backend_needs_verify(tmp_path, sshd, known_hosts, device_dir, capsys):
    assert main(["deploy", str(tmp_path), "--host", "127.0.0.1", "--verify-backend", "cpu",
                 *flags(sshd, known_hosts, device_dir)]) == 1
    assert "--verify-backend cpu only goes with --verify, --on-activate or --health-cmd" in capsys.readouterr().err


def test_count_files_follows_the_files_plus_manifest_convention():
    assert count_files(["a", "manifest.json", "b"]) == "2 files + manifest"
    assert count_files(["kernels/x.cubin"]) == "1 file"
    assert count_files([]) == "0 files"


def test_status_summary_with_an_infinite_number_shows_a_question_mark():
    # JSON's Infinity / 1e999 from a device's status answer parse to float("inf"): int() of it is an OverflowError
    assert shape_text({"batch": float("inf"), "tokens": 1}) == "?"
    assert model_text({"num_layers": float("inf"), "num_experts": 8, "top_k": 2, "hidden_size": 64}) == "?"
    assert shape_text({"batch": 1, "tokens": 16}) == "batch 1 x tokens 16"


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
    assert "deploy needs a BUNDLE folder (or --rollback / --status / --install-runtime)" in capsys.readouterr().err


@pytest.fixture
def ctrl_c_delivered():
    """SIGINT raises KeyboardInterrupt here, as in a program started from a terminal, whatever this process
    inherited: a shell that starts a job in the background (`cmd &`, nohup) hands it SIGINT ignored, and so does a
    Python process to its children."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_when(path, timeout: float = 60.0) -> threading.Thread:
    """A thread that sends SIGINT to this process (Ctrl-C) as soon as `path` exists."""
    def run():
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_after_the_switch_says_the_new_bundle_is_active(tmp_path, sshd, known_hosts, device_dir, capsys,
                                                               ctrl_c_delivered):
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", *flags(sshd, known_hosts, device_dir)]
    assert main(["deploy", str(write_bundle(tmp_path / "a")), *common]) == 0
    b = write_bundle(tmp_path / "b", kernel_seed=1)
    b_id = hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()[:16]
    switched = tmp_path / "switched"
    interrupt_when(switched)
    on_activate = f"touch {shlex.quote(str(switched))}; sleep 1"
    capsys.readouterr()
    code = main(["deploy", str(b), *common, "--on-activate", on_activate, "--health-cmd", "true"])
    err = capsys.readouterr().err
    assert code == 130
    assert (f"colibri-sdk deploy: {sshd.user}@127.0.0.1:{sshd.port}: interrupted after the switch; the deploy "
            f"finished: bundle {b_id} is active at {device_dir}/bundles/{b_id}, complete and verified on the device"
            in err), err
    assert os.readlink(device_dir / "current") == f"bundles/{b_id}"


@pytest.mark.parametrize("lands_on", ["process", "reading-thread"])
def test_ctrl_c_during_the_upload_stops_before_the_switch(tmp_path, sshd, known_hosts, device_dir, lands_on):
    # The CLI runs in its own process (as from a shell): a pytest-xdist worker does not deliver SIGINT to the
    # deploy the way a terminal does. The child's upload is slowed and marks its first chunk; SIGINT then follows,
    # sent to the process (the kernel picks a thread) or raised by the thread that reads the chunk, which is not
    # the one Python runs its handler in: the waiting thread must still take it before the switch.
    import subprocess

    from timeout_support import guard

    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", *flags(sshd, known_hosts, device_dir)]
    a = write_bundle(tmp_path / "a")
    assert main(["deploy", str(a), *common]) == 0
    b = write_bundle(tmp_path / "b", model_seed=1, model_bytes=24 << 20)
    sending = tmp_path / "sending"
    child = (
        "import signal, sys, threading, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as from a terminal (see ctrl_c_delivered)
        "from pathlib import Path\n"
        "from colibri_sdk.cli import main\n"
        "from colibri_sdk.deploy import transfer\n"
        "real = transfer.read_chunks\n"
        "def slow(path, offset, chunk=transfer.CHUNK_BYTES):\n"
        "    for block in real(path, offset, chunk):\n"
        f"        if {lands_on == 'reading-thread'} and not Path({str(sending)!r}).exists():\n"
        "            signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
        f"        Path({str(sending)!r}).touch()\n"
        "        time.sleep(0.5)\n"
        "        yield block\n"
        "transfer.read_chunks = slow\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, "deploy", str(b), *common], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if lands_on == "process":
        deadline = time.monotonic() + guard(600)
        while not sending.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=guard(600))
    assert proc.returncode == 130, err
    assert "interrupted before the switch: the active bundle was not changed" in err, err
    assert remote_tree(device_dir / "current") == remote_tree(a)
