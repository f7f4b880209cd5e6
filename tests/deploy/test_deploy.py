"""First deploy, re-deploy, kernel-only re-deploy, rollback, keep/garbage collection, --verify: against a
real sshd on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from dataclasses import replace
import stat
import sys
from pathlib import Path

import pytest
from deploy_bundles import remote_tree, reseal, write_bundle

from colibri_sdk.deploy import (
    DeployError,
    DeployOptions,
    RemoteCommandError,
    RemoteVerifyError,
    deploy,
    rollback,
    status,
)

pytestmark = pytest.mark.ssh


def active(device_dir: Path) -> str:
    return os.readlink(device_dir / "current")


class Progress:
    """Records what a progress bar is told: the announced total and the byte counts."""

    def __init__(self):
        self.total, self.counted = 0, 0

    def add_total(self, n):
        self.total += n

    def __call__(self, n):
        self.counted += n


def test_first_deploy_puts_every_file_and_switches_pointer(bundle, target, options, device_dir):
    progress = Progress()
    result = deploy(bundle, target, options, progress=progress)
    expected = remote_tree(bundle)
    sizes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert result.bytes_sent == sizes == progress.total == progress.counted
    assert active(device_dir) == f"bundles/{result.bundle_id}"
    assert remote_tree(device_dir / "current") == expected
    assert result.remote_path == str(device_dir / "bundles" / result.bundle_id)
    model = device_dir / "current" / "model.colibri"
    assert stat.S_IMODE(model.stat().st_mode) == 0o444  # store objects are read-only
    assert model.stat().st_nlink == 2  # a hard link into the store
    assert not list((device_dir / "store").glob("*.partial"))


def test_hostile_remote_dir_is_used_literally(bundle, target, options, device_dir):
    deploy(bundle, target, options)
    assert (device_dir / "current" / "manifest.json").is_file()
    # Nothing was expanded by a shell: the only folder under remote/ is the literal name.
    assert [p.name for p in device_dir.parent.iterdir()] == [device_dir.name]


def test_redeploy_sends_nothing(bundle, target, options, device_dir, wire):
    first = deploy(bundle, target, options)
    wire["bytes"] = 0
    again = deploy(bundle, target, options)
    assert again.bytes_sent == 0 and again.sent == []
    assert again.changed is False and again.bundle_id == first.bundle_id
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert wire["bytes"] < 0.05 * bundle_bytes, (wire["bytes"], bundle_bytes)


def test_kernel_only_redeploy_sends_only_kernels(tmp_path, target, options, device_dir, wire):
    a = write_bundle(tmp_path / "a", kernel_seed=0)
    b = write_bundle(tmp_path / "b", kernel_seed=1)
    deploy(a, target, options)
    wire["bytes"] = 0
    result = deploy(b, target, options)
    kernels = sorted(str(p.relative_to(b)) for p in (b / "kernels").iterdir())
    assert sorted(result.sent) == sorted(kernels + ["manifest.json"])
    changed_bytes = sum((b / k).stat().st_size for k in kernels) + (b / "manifest.json").stat().st_size
    assert result.bytes_sent == changed_bytes
    assert wire["bytes"] < changed_bytes + 100_000
    assert remote_tree(device_dir / "current") == remote_tree(b)


def test_identical_files_are_one_store_object(tmp_path, target, options, device_dir):
    b = write_bundle(tmp_path / "b")
    data = (b / "selftest" / "input.npy").read_bytes()
    (b / "selftest" / "output.npy").write_bytes(data)
    reseal(b)
    result = deploy(b, target, options)
    assert result.bytes_sent == result.total_bytes - len(data)
    assert remote_tree(device_dir / "current") == remote_tree(b)


def three_bundles(shared_bundle) -> list:
    return [shared_bundle(kernel_seed=i) for i in range(3)]


def test_rollback_steps_back_through_the_history(target, options, device_dir, shared_bundle, start_from):
    bundles = three_bundles(shared_bundle)
    a, b, c = start_from(bundles)
    assert (b.previous, c.previous) == (a.bundle_id, b.bundle_id)
    assert rollback(target, options) == {"current": b.bundle_id, "previous": c.bundle_id,
                                         "history": [a.bundle_id, b.bundle_id]}
    assert active(device_dir) == f"bundles/{b.bundle_id}"
    assert os.readlink(device_dir / "previous") == f"bundles/{a.bundle_id}"
    assert rollback(target, options)["current"] == a.bundle_id  # one further back, not back to c
    assert active(device_dir) == f"bundles/{a.bundle_id}" and not os.path.lexists(device_dir / "previous")
    assert remote_tree(device_dir / "current") == remote_tree(bundles[0])
    with pytest.raises(RemoteCommandError, match=f"nothing to roll back to: .* has no bundle activated before "
                                                 f"{a.bundle_id}"):
        rollback(target, options)
    assert rollback(target, options, to=c.bundle_id)["history"] == [a.bundle_id, c.bundle_id]
    assert active(device_dir) == f"bundles/{c.bundle_id}"
    assert rollback(target, options)["current"] == a.bundle_id
    with pytest.raises(RemoteCommandError, match="no bundle 00000000 under"):
        rollback(target, options, to="00000000")
    with pytest.raises(RemoteCommandError, match=f"bundle {a.bundle_id} is already active"):
        rollback(target, options, to=a.bundle_id)


def test_a_switch_by_hand_on_the_device_counts_as_a_rollback(target, options, device_dir, shared_bundle, start_from):
    a, b, c = start_from(three_bundles(shared_bundle))
    # deploy/README.md's recipe without the deploying machine: current := previous
    os.symlink(os.readlink(device_dir / "previous"), device_dir / ".current.tmp")
    os.replace(device_dir / ".current.tmp", device_dir / "current")
    assert status(target, options).history == (a.bundle_id, b.bundle_id)
    assert rollback(target, options)["current"] == a.bundle_id


def test_rollback_refuses_a_corrupt_bundle(target, options, device_dir, shared_bundle, start_from):
    a, _ = start_from(three_bundles(shared_bundle)[:2])
    victim = device_dir / "bundles" / a.bundle_id / "kernels" / "router.ptx"
    victim.chmod(0o644)
    victim.write_bytes(b"tampered")
    with pytest.raises(RemoteCommandError, match=rf"bundle {a.bundle_id} is corrupt \(kernels/router.ptx\)"):
        rollback(target, options)
    assert active(device_dir) != f"bundles/{a.bundle_id}"


def test_rollback_without_previous_is_refused(target, options, shared_bundle, start_from):
    start_from([shared_bundle()])
    with pytest.raises(RemoteCommandError, match="nothing to roll back to"):
        rollback(target, options)


def test_keep_counts_bundles_besides_current_and_previous(tmp_path, target, device_dir):
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, keep=1)
    bundles = [write_bundle(tmp_path / f"b{i}", kernel_seed=i, model_seed=i, model_bytes=200_000) for i in range(4)]
    ids = [deploy(b, target, options).bundle_id for b in bundles]
    # --keep 1: current (b3), previous (b2) and 1 more (b1); b0 and the store objects only it used are gone.
    assert sorted(p.name for p in (device_dir / "bundles").iterdir()) == sorted(ids[1:])
    wanted = set().union(*(remote_tree(b).values() for b in bundles[1:]))
    assert {p.name for p in (device_dir / "store").iterdir()} == wanted
    st = status(target, options)
    assert (st.current, st.previous) == (ids[3], ids[2])
    assert [b.bundle_id for b in st.bundles] == [ids[3], ids[2], ids[1]]
    assert st.history == (ids[1], ids[2], ids[3])
    assert st.bundles[0].manifest["arch"] == "sm_87" and st.bundles[0].manifest["profile"] == "test-orin"
    assert st.bundles[0].manifest["model"] == {"num_layers": 1, "num_experts": 4, "top_k": 2, "hidden_size": 64,
                                               "intermediate_size": 128}
    assert (st.bundles[0].manifest["dtype"], st.bundles[0].manifest["shape"]) == ("fp16", {"batch": 1, "tokens": 8})
    # files: what the manifest lists (7), manifest.json besides; bytes: all 8 files, as the deploy counts them.
    assert st.bundles[0].files == 7
    assert st.bundles[0].bytes == sum(p.stat().st_size for p in bundles[3].rglob("*") if p.is_file())
    deploy(bundles[0], target, replace(options, keep=0))  # 0: only current and previous stay
    assert sorted(p.name for p in (device_dir / "bundles").iterdir()) == sorted([ids[0], ids[3]])


def test_verify_failure_keeps_the_active_bundle(tmp_path, target, device_dir):
    a = write_bundle(tmp_path / "a", kernel_seed=0)
    b = write_bundle(tmp_path / "b", kernel_seed=1)
    first = deploy(a, target, DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable))
    failing = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, verify=True,
                            remote_colibri="sh -c 'echo self-test failed: max_abs_err 0.5; exit 3' sh")
    with pytest.raises(RemoteVerifyError, match=r"on cuda failed \(exit status 3\): self-test failed: max_abs_err 0.5; "
                                                r"the active bundle was not changed$"):
        deploy(b, target, failing)
    assert active(device_dir) == f"bundles/{first.bundle_id}"


def test_verify_runs_on_the_staged_bundle_before_the_switch(tmp_path, target, device_dir):
    record = tmp_path / "verify args"
    # The probe records its arguments and fails: the pointer must not exist afterwards on this fresh device.
    probe = shlex.join(["sh", "-c", 'printf %s "$*" > "$0"; exit 9', str(record)])
    bundle = write_bundle(tmp_path / "a")
    verifying = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, verify=True)
    with pytest.raises(RemoteVerifyError, match="exit status 9"):
        deploy(bundle, target, replace(verifying, remote_colibri=probe))
    bundle_id = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()[:16]
    assert record.read_text() == f"verify --backend cuda {device_dir}/bundles/{bundle_id}"
    assert not os.path.lexists(device_dir / "current")
    passing = shlex.join(["sh", "-c", "echo '  self-test: self-test passed on cuda: max abs err 0'"])
    result = deploy(bundle, target, replace(verifying, remote_colibri=passing))
    assert active(device_dir) == f"bundles/{bundle_id}" and result.bytes_sent == 0
    assert (result.selftest, result.selftest_backend, result.verify_notes) == (
        "self-test passed on cuda: max abs err 0", "cuda", ())


def test_verify_backend_is_passed_and_the_self_test_line_is_kept(tmp_path, target, device_dir):
    record = tmp_path / "verify args"
    # What `colibri-sdk verify` prints when the self-test fell back to the CPU (see sdk/commands/verify.py).
    script = ('printf %s "$*" > "$0"; echo "B: schema 1, 7 files + manifest, checksums ok"; '
              'echo "  self-test: self-test passed on cpu: max abs err 0, max rel err 0 (rtol 0.01, atol 0.001)"; '
              'echo "colibri-sdk: running on the CPU backend: no CUDA driver" >&2')
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, verify=True,
                            verify_backend="cpu", remote_colibri=shlex.join(["sh", "-c", script, str(record)]))
    result = deploy(write_bundle(tmp_path / "a"), target, options)
    assert record.read_text() == f"verify --backend cpu {result.remote_path}"
    assert result.selftest == "self-test passed on cpu: max abs err 0, max rel err 0 (rtol 0.01, atol 0.001)"
    assert result.selftest_backend == "cpu"
    assert result.verify_notes == ("colibri-sdk: running on the CPU backend: no CUDA driver",)


def test_a_cpu_fallback_fails_the_verify_of_a_gpu_bundle(tmp_path, target, device_dir):
    first = deploy(write_bundle(tmp_path / "a"), target, DeployOptions(remote_dir=str(device_dir),
                                                                      remote_python=sys.executable))
    # What `colibri-sdk verify --backend auto` prints on a device whose CUDA does not work.
    script = ('echo "  self-test: self-test passed on cpu: max abs err 0"; '
              'echo "colibri-sdk: running on the CPU backend: no CUDA driver (libcuda.so.1 not found)" >&2')
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, verify=True,
                            remote_colibri=shlex.join(["sh", "-c", script]))
    with pytest.raises(RemoteVerifyError, match=r"the self-test of .* ran on cpu, not on cuda: the bundle was not "
                                                r"checked on the backend it will run on \(pass --verify-backend cpu to "
                                                r"accept a check on the CPU\); the active bundle was not changed: "
                                                r"colibri-sdk: running on the CPU backend: no CUDA driver"):
        deploy(write_bundle(tmp_path / "b", kernel_seed=1), target, options)
    assert active(device_dir) == f"bundles/{first.bundle_id}"
    result = deploy(write_bundle(tmp_path / "b", kernel_seed=1), target, replace(options, verify_backend="cpu"))
    assert result.selftest_backend == "cpu" and active(device_dir) == f"bundles/{result.bundle_id}"


def test_verify_backend_outside_the_allowed_set_is_refused(device_dir):
    with pytest.raises(DeployError, match=r"--verify-backend 'gpu': must be one of cuda, cpu"):
        DeployOptions(remote_dir=str(device_dir), verify=True, verify_backend="gpu")


def test_colibri_sdk_missing_on_the_device_names_remote_colibri(bundle, target, device_dir):
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, verify=True,
                            remote_colibri="/nonexistent/colibri-sdk")
    with pytest.raises(RemoteVerifyError, match=r"'/nonexistent/colibri-sdk' cannot run on the device \(exit status "
                                                r"127\): colibri-sdk is not installed there, or not on the PATH .* "
                                                r"Install it with --install-runtime, or pass the device's command "
                                                r"with --remote-colibri, e.g. --remote-colibri '/opt/colibri/venv/bin/"
                                                r"python -m colibri_sdk'; the active bundle was not changed"):
        deploy(bundle, target, options)
    assert not os.path.lexists(device_dir / "current")


def test_rollback_on_a_missing_remote_dir_says_there_are_no_bundles(target, options, device_dir):
    with pytest.raises(RemoteCommandError, match=r"rollback in .*: nothing to roll back to: no bundles under "
                                                 + re.escape(str(device_dir)) + r" \(is --remote-dir right\? see "
                                                 r"--status\)$"):
        rollback(target, options)
    assert not device_dir.exists()  # nothing was created there


@pytest.mark.skipif(not any(os.access(p, os.X_OK) for p in ("/usr/bin/python3", "/usr/local/bin/python3")),
                    reason="no python3 on sshd's default PATH to run the store helper with the default setting")
def test_default_remote_python(bundle, target, device_dir):
    result = deploy(bundle, target, DeployOptions(remote_dir=str(device_dir)))
    assert remote_tree(device_dir / "current") == remote_tree(bundle) and result.bytes_sent == result.total_bytes


def test_deploy_reads_each_local_byte_once(tmp_path, target, options):
    """The local check and the upload share one read of every file (/proc/self/io rchar counts every byte this
    process read: files, and the few the SSH socket brought)."""
    bundle = write_bundle(tmp_path / "big", model_bytes=48 << 20)
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())

    def rchar() -> int:
        return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])

    before = rchar()
    deploy(bundle, target, options)
    read = rchar() - before
    assert total <= read < 1.3 * total, (read, total)


def cuda_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(cuda_driver_present(), reason="a CUDA driver is loadable here, so the loopback 'device' has a GPU")
def test_verify_on_a_device_without_a_gpu_names_deploys_verify_backend_flag(tmp_path, target, options, device_dir):
    """This machine has no CUDA driver: the device's `verify --backend cuda` fails, and the error names
    deploy's own --verify-backend cpu, not verify's --backend."""
    bundle = write_bundle(tmp_path / "b")
    colibri = shlex.join([sys.executable, "-m", "colibri_sdk"])
    with pytest.raises(RemoteVerifyError) as caught:
        deploy(bundle, target, replace(options, verify=True, remote_colibri=colibri))
    text = str(caught.value)
    assert "no usable CUDA GPU" in text and "pass --verify-backend cpu to deploy" in text, text
    assert "use the cpu or auto backend" not in text, text
    assert not (device_dir / "current").exists()
