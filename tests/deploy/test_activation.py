"""After the switch: --on-activate, the health check, and the rollback when either fails (real sshd on
127.0.0.1; the 'device' is this machine, so the commands' traces are read back from local files)."""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
from dataclasses import replace

import pytest
from deploy_bundles import remote_tree, write_bundle

from colibri_sdk.cli import main
from colibri_sdk.deploy import DeployOptions, deploy, status
from colibri_sdk.deploy.errors import HealthCheckError

pytestmark = pytest.mark.ssh


def active(device_dir) -> str:
    return os.path.basename(os.readlink(device_dir / "current"))


@pytest.fixture
def trace(tmp_path):
    """A file each --on-activate run appends its COLIBRI_BUNDLE_ID to."""
    return tmp_path / "activations"


def restart(trace, fail_for: str = "") -> str:
    """An --on-activate command: records the bundle it restarts on; exits 5 for bundle `fail_for`."""
    script = (f'echo "$COLIBRI_BUNDLE_ID" >> {shlex.quote(str(trace))}; '
              'test -f "$COLIBRI_BUNDLE/manifest.json" || exit 6')
    if fail_for:
        script += f'; if [ "$COLIBRI_BUNDLE_ID" = {fail_for} ]; then echo "unit failed to start" >&2; exit 5; fi'
    return script


def bundle_id(folder) -> str:
    return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()[:16]


def base(device_dir) -> DeployOptions:
    return DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable)


def test_on_activate_and_health_check_pass(tmp_path, target, device_dir, trace):
    options = replace(base(device_dir), on_activate=restart(trace),
                      health_cmd='test "$(basename "$(readlink -f "$COLIBRI_BUNDLE")")" = "$COLIBRI_BUNDLE_ID"')
    result = deploy(write_bundle(tmp_path / "a"), target, options)
    assert trace.read_text().split() == [result.bundle_id]
    assert (result.on_activate, result.health) == ("on-activate ok", f"health check {options.health_cmd!r} passed")
    assert active(device_dir) == result.bundle_id


def test_failing_health_check_restores_the_previous_bundle_and_reruns_on_activate(tmp_path, target, device_dir,
                                                                                  trace, shared_bundle, start_from):
    (a,) = start_from([shared_bundle()])
    b = write_bundle(tmp_path / "b", kernel_seed=1)
    options = replace(base(device_dir), on_activate=restart(trace), health_cmd="echo 'no frames for 10 s' >&2; exit 4")
    with pytest.raises(HealthCheckError) as info:
        deploy(b, target, options)
    b_id = bundle_id(b)
    assert str(info.value) == (f"{target.label}: bundle {b_id} was activated, but health check {options.health_cmd!r} "
                               f"failed (exit status 4: no frames for 10 s); rolled back: bundle {a.bundle_id} is "
                               f"current again; --on-activate re-run for it ok")
    assert active(device_dir) == a.bundle_id and remote_tree(device_dir / "current") == remote_tree(shared_bundle())
    assert trace.read_text().split() == [b_id, a.bundle_id]  # restarted on b, then on a again
    assert not (device_dir / "previous").exists()  # a is the only bundle in the history again


def test_failing_on_activate_restores_the_previous_bundle(tmp_path, target, device_dir, trace, shared_bundle,
                                                         start_from):
    (a,) = start_from([shared_bundle()])
    b = write_bundle(tmp_path / "b", kernel_seed=1)
    b_id = bundle_id(b)
    options = replace(base(device_dir), on_activate=restart(trace, fail_for=b_id), health_cmd="true")
    with pytest.raises(HealthCheckError, match=rf"bundle {b_id} was activated, but --on-activate .* failed \(exit "
                                               rf"status 5: unit failed to start\); rolled back: bundle "
                                               rf"{a.bundle_id} is current again; --on-activate re-run for it ok$"):
        deploy(b, target, options)
    assert active(device_dir) == a.bundle_id
    assert trace.read_text().split() == [b_id, a.bundle_id]


def test_failing_health_of_an_unchanged_bundle_is_reported_not_rolled_back(target, device_dir, trace, shared_bundle,
                                                                           start_from):
    bundles = [shared_bundle(), shared_bundle(kernel_seed=1)]
    a, b = start_from(bundles)
    with pytest.raises(HealthCheckError, match=rf"bundle {b.bundle_id} was already the active bundle, and health "
                                               rf"check 'false' failed \(exit status 1: \(no output\)\); nothing "
                                               rf"was rolled back"):
        deploy(bundles[1], target, replace(base(device_dir), health_cmd="false"))
    assert active(device_dir) == b.bundle_id and os.readlink(device_dir / "previous") == f"bundles/{a.bundle_id}"


def test_failing_first_deploy_leaves_no_bundle_current(tmp_path, target, device_dir, trace):
    options = replace(base(device_dir), on_activate=restart(trace), health_cmd="false")
    with pytest.raises(HealthCheckError, match=r"rolled back: no bundle is current now \(this was the first\)$"):
        deploy(write_bundle(tmp_path / "a"), target, options)
    assert not os.path.lexists(device_dir / "current")
    assert len(trace.read_text().split()) == 1  # nothing to restart on


def test_default_health_check_is_the_self_test_of_the_active_bundle(tmp_path, target, device_dir):
    record = tmp_path / "verify args"
    fake = shlex.join(["sh", "-c", 'printf %s "$*" > "$0"; echo "  self-test: self-test passed on cuda: max abs '
                                   'err 0"', str(record)])
    options = replace(base(device_dir), on_activate="true", remote_colibri=fake)
    result = deploy(write_bundle(tmp_path / "a"), target, options)
    assert record.read_text() == f"verify --backend cuda {device_dir}/current"
    assert result.health == "self-test passed on cuda: max abs err 0"


def test_cli_exits_1_and_says_it_rolled_back(tmp_path, sshd, known_hosts, device_dir, capsys, trace):
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", "--identity", str(sshd.user_key), "--known-hosts",
              str(known_hosts), "--remote-dir", str(device_dir), "--remote-python", sys.executable, "--quiet"]
    assert main(["deploy", str(write_bundle(tmp_path / "a")), *common, "--on-activate", restart(trace),
                 "--health-cmd", "true"]) == 0
    out = capsys.readouterr().out
    assert "\n  on-activate ok\n  health: health check 'true' passed" in out
    first = active(device_dir)
    assert main(["deploy", str(write_bundle(tmp_path / "b", kernel_seed=1)), *common, "--on-activate",
                 restart(trace), "--health-cmd", "exit 3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("colibri-sdk deploy: error: ") and len(err.splitlines()) == 1
    assert err.endswith(f"rolled back: bundle {first} is current again; --on-activate re-run for it ok")
    assert active(device_dir) == first


def test_status_keeps_the_last_good_activation_time_after_a_rolled_back_one(target, device_dir, shared_bundle,
                                                                             start_from):
    """An older bundle deployed again, whose health check fails: rolled back, `--status` still shows for it the
    time of its last good activation, and for the bundle made current again its own."""
    bundles = [shared_bundle(), shared_bundle(kernel_seed=1)]
    a, b = start_from(bundles)
    good = {e.bundle_id: e.activated for e in status(target, base(device_dir)).bundles}
    os.utime(device_dir / "bundles" / a.bundle_id, (good[a.bundle_id] - 3600,) * 2)  # an hour ago
    os.utime(device_dir / "bundles" / b.bundle_id, (good[b.bundle_id] - 60,) * 2)
    good = {e.bundle_id: e.activated for e in status(target, base(device_dir)).bundles}
    with pytest.raises(HealthCheckError, match=f"rolled back: bundle {b.bundle_id} is current again"):
        deploy(bundles[0], target, replace(base(device_dir), health_cmd="false"))
    st = status(target, base(device_dir))
    assert (st.current, st.previous) == (b.bundle_id, a.bundle_id)
    assert {e.bundle_id: e.activated for e in st.bundles} == pytest.approx(good, abs=1e-3)
