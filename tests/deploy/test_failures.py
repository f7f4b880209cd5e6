"""Interrupted deploys, corrupted uploads and store objects, disk full, permission denied, bad manifests."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_bundles import remote_tree, write_bundle
from timeout_support import guard

from colibri_sdk.deploy import (
    ChecksumMismatchError,
    Connection,
    DeployOptions,
    RemoteCommandError,
    RemoteDiskFullError,
    RemotePermissionError,
    deploy,
)
from colibri_sdk.deploy.remote import RemoteAgent
from colibri_sdk.errors import BundleError

pytestmark = pytest.mark.ssh


def sha_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_bytes(old: Path, new: Path) -> int:
    """Bytes of `new`'s files whose content is not in `old` (counted once per distinct content)."""
    have = set(remote_tree(old).values())
    seen, total = set(), 0
    for p in sorted(new.rglob("*")):
        if p.is_file():
            digest = sha_of(p)
            if digest not in have and digest not in seen:
                seen.add(digest)
                total += p.stat().st_size
    return total


def wait_unlocked(path: Path, timeout: float | None = None) -> None:
    """Wait until no process holds the upload lock on `path` (the killed deploy's remote side has exited)."""
    timeout = guard(120) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.05)
    raise AssertionError(f"{path} still locked after {timeout} s")


def test_killed_deploy_keeps_previous_bundle_and_resume_sends_only_the_rest(tmp_path, sshd, target, known_hosts,
                                                                             options, device_dir, shared_bundle,
                                                                             start_from):
    a = shared_bundle()
    (first,) = start_from([a])
    b = write_bundle(tmp_path / "b", model_bytes=96 << 20, model_seed=7)
    partial = device_dir / "store" / (sha_of(b / "model.colibri") + ".partial")
    cli = [sys.executable, "-m", "colibri_sdk", "deploy", str(b), "--host", f"{sshd.user}@127.0.0.1",
           "--port", str(sshd.port), "--identity", str(sshd.user_key), "--known-hosts", str(known_hosts),
           "--remote-dir", str(device_dir), "--remote-python", sys.executable, "--quiet", "--streams", "1"]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + guard(600)
        while not (partial.exists() and partial.stat().st_size >= 8 << 20):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    wait_unlocked(partial)
    done = partial.stat().st_size
    assert 0 < done < (96 << 20)
    # The device still runs the previous bundle, intact.
    assert os.readlink(device_dir / "current") == f"bundles/{first.bundle_id}"
    assert remote_tree(device_dir / "current") == remote_tree(a)

    result = deploy(b, target, options)
    assert result.resumed == ["model.colibri"]
    assert result.bytes_sent == new_bytes(a, b) - done
    assert remote_tree(device_dir / "current") == remote_tree(b)
    assert not partial.exists()


def test_corrupt_partial_upload_is_detected_and_sent_again(tmp_path, target, options, device_dir):
    b = write_bundle(tmp_path / "b", model_bytes=6 << 20)
    model = (b / "model.colibri").read_bytes()
    (device_dir / "store").mkdir(parents=True)
    bad = bytearray(model[: 1 << 20])
    bad[1000] ^= 0xFF
    (device_dir / "store" / (sha_of(b / "model.colibri") + ".partial")).write_bytes(bad)
    result = deploy(b, target, options)
    assert result.resumed == ["model.colibri"] and result.retried == ["model.colibri"]
    total = sum(p.stat().st_size for p in b.rglob("*") if p.is_file())
    assert result.bytes_sent == total - (1 << 20) + len(model)
    assert remote_tree(device_dir / "current") == remote_tree(b)


def test_corrupt_store_object_is_detected_and_replaced(target, options, device_dir, shared_bundle, start_from):
    a = shared_bundle()
    (first,) = start_from([a])
    stored = device_dir / "store" / sha_of(a / "model.colibri")
    stored.chmod(0o644)
    data = bytearray(stored.read_bytes())
    data[12345] ^= 0x01
    stored.write_bytes(data)  # same inode as the active bundle's model.colibri: bit rot on the device
    result = deploy(a, target, options)
    assert result.retried == ["model.colibri"]
    assert result.bytes_sent == (a / "model.colibri").stat().st_size
    assert os.readlink(device_dir / "current") == f"bundles/{first.bundle_id}"
    assert remote_tree(device_dir / "current") == remote_tree(a)


def test_corruption_in_transit_fails_with_checksum_mismatch(tmp_path, target, options, device_dir, monkeypatch,
                                                            shared_bundle, start_from):
    from colibri_sdk.deploy import transfer

    a = shared_bundle()
    (first,) = start_from([a])
    b = write_bundle(tmp_path / "b", kernel_seed=3)
    real = transfer.HashingReader.__iter__

    def flipping(reader):  # after the local hash, on the way to the device
        for i, block in enumerate(real(reader)):
            if i == 0 and Path(reader.path).name == "router.ptx":
                block = b"X" + block[1:]
            yield block

    monkeypatch.setattr(transfer.HashingReader, "__iter__", flipping)
    with pytest.raises(ChecksumMismatchError, match=r"'kernels/router.ptx' arrived corrupted twice: the device "
                                                    r"computed sha256 [0-9a-f]{64}, the manifest says"):
        deploy(b, target, options)
    assert os.readlink(device_dir / "current") == f"bundles/{first.bundle_id}"
    assert remote_tree(device_dir / "current") == remote_tree(a)


def test_local_file_changed_after_build_is_refused_before_staging(tmp_path, target, options, device_dir,
                                                                   shared_bundle, start_from):
    (first,) = start_from([shared_bundle()])
    b = write_bundle(tmp_path / "b", kernel_seed=3)
    path = b / "kernels" / "router.ptx"
    path.write_bytes(b"Y" + path.read_bytes()[1:])  # same size, other content
    listed = json.loads((b / "manifest.json").read_text())["files"]
    router = next(e["sha256"] for e in listed if e["path"] == "kernels/router.ptx")
    with pytest.raises(BundleError, match=r"bundle file 'kernels/router.ptx' changed on this machine: its sha256 "
                                          r"[0-9a-f]{64} differs from the manifest's [0-9a-f]{64}; nothing was "
                                          r"staged, the active bundle was not changed"):
        deploy(b, target, options)
    assert sorted(p.name for p in (device_dir / "bundles").iterdir()) == [first.bundle_id]
    assert not (device_dir / "store" / router).exists()
    assert os.readlink(device_dir / "current") == f"bundles/{first.bundle_id}"


def test_a_changed_file_the_device_already_holds_is_refused_too(tmp_path, target, options, device_dir,
                                                                 shared_bundle, start_from):
    (first,) = start_from([shared_bundle()])
    b = write_bundle(tmp_path / "b", kernel_seed=3)  # the same weights (already on the device), other kernels
    weights = b / "model.colibri"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"bundle file 'model.colibri' changed on this machine"):
        deploy(b, target, options)
    assert os.readlink(device_dir / "current") == f"bundles/{first.bundle_id}"


def test_file_changed_during_the_upload_is_a_bundle_error(tmp_path, target, options, monkeypatch):
    from colibri_sdk.deploy import transfer

    b = write_bundle(tmp_path / "b")
    real = transfer.read_chunks

    def changing(path, offset, chunk=transfer.CHUNK_BYTES):  # the file changes after the check, before the upload
        if Path(path).name == "router.ptx":
            Path(path).write_bytes(b"Y" + Path(path).read_bytes()[1:])
        yield from real(path, offset, chunk)

    monkeypatch.setattr(transfer, "read_chunks", changing)
    with pytest.raises(BundleError, match=r"'kernels/router.ptx' changed on this machine"):
        deploy(b, target, options)


@pytest.fixture
def mount_point(tmp_path):
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    subprocess.run(["umount", str(point)], capture_output=True)


def mount_tmpfs(point: Path, opts: str) -> None:
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to simulate the device's disk: {proc.stderr.strip()}")


def test_disk_full_is_refused_before_sending(tmp_path, target, mount_point):
    mount_tmpfs(mount_point, "size=1m")
    options = DeployOptions(remote_dir=str(mount_point / "colibri"), remote_python=sys.executable)
    with pytest.raises(RemoteDiskFullError, match=r"needs [\d,]+ more bytes under .* but only [\d,]+ are free"):
        deploy(write_bundle(tmp_path / "b"), target, options)


def test_disk_full_during_upload_is_typed(tmp_path, target, mount_point, monkeypatch):
    from colibri_sdk.deploy import deployment

    mount_tmpfs(mount_point, "size=1m")
    monkeypatch.setattr(deployment, "_check_space", lambda *args: None)  # let the upload hit ENOSPC
    options = DeployOptions(remote_dir=str(mount_point / "colibri"), remote_python=sys.executable)
    with pytest.raises(RemoteDiskFullError, match=r"receive in .*: No space left on device .*\(ENOSPC\): the "
                                                  r"device's disk is full"):
        deploy(write_bundle(tmp_path / "b"), target, options)


def test_read_only_file_system_is_permission_denied(tmp_path, target, mount_point):
    mount_tmpfs(mount_point, "ro,size=1m")
    options = DeployOptions(remote_dir=str(mount_point / "colibri"), remote_python=sys.executable)
    with pytest.raises(RemotePermissionError, match=r"plan in .*: Read-only file system .*\(EROFS\): permission "
                                                    r"denied on the device"):
        deploy(write_bundle(tmp_path / "b"), target, options)


def test_immutable_folder_is_permission_denied(tmp_path, target):
    locked = tmp_path / "locked"
    locked.mkdir()
    proc = subprocess.run(["chattr", "+i", str(locked)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"chattr +i is not permitted here (needed to deny writes to root): {proc.stderr.strip()}")
    try:
        options = DeployOptions(remote_dir=str(locked / "colibri"), remote_python=sys.executable)
        with pytest.raises(RemotePermissionError, match=r"Operation not permitted .*\(EPERM\)"):
            deploy(write_bundle(tmp_path / "b"), target, options)
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_missing_remote_python_is_explained(bundle, target, device_dir):
    options = DeployOptions(remote_dir=str(device_dir), remote_python="/nonexistent/python3")
    with pytest.raises(RemoteCommandError, match=r"'/nonexistent/python3' not found on the device: install "
                                                 r"python3 \(>= 3.8\) or pass --remote-python"):
        deploy(bundle, target, options)


def test_a_crash_on_the_device_is_relayed_as_its_last_line_not_its_traceback(bundle, target, device_dir):
    # A device Python that dies with a traceback before the store helper runs.
    crashing = f"{sys.executable} -c 'import json; json.loads(\"{{broken\")'"
    options = DeployOptions(remote_dir=str(device_dir), remote_python=crashing)
    with pytest.raises(RemoteCommandError, match=r"remote plan in .* failed with exit status 1: "
                                                 r"json.decoder.JSONDecodeError: Expecting property name enclosed in "
                                                 r"double quotes: line 1 column 2 \(char 1\)$") as info:
        deploy(bundle, target, options)
    assert "Traceback" not in str(info.value)


def test_unsafe_manifest_path_is_refused_here_and_on_the_device(tmp_path, target, device_dir):
    b = write_bundle(tmp_path / "b")
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../../etc/evil"
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"path '../../etc/evil'"):
        deploy(b, target, DeployOptions(remote_dir=str(device_dir)))
    with Connection(target) as conn:
        agent = RemoteAgent(conn, str(device_dir), sys.executable)
        agent.call("plan")
        with pytest.raises(RemoteCommandError, match=r"unsafe bundle path '../x'"):
            agent.call("stage", "abcd", "", 1, "0" * 64 + ":../x")
