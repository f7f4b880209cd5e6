"""Deploying bundles made by `colibri-sdk build` (NVRTC, no GPU): first deploy with the self-test run on the
'device', then a kernel-only rebuild (other block sizes) that sends only the kernels."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from deploy_bundles import remote_tree

from colibri_sdk.deploy import DeployOptions, RemoteVerifyError, deploy

pytestmark = pytest.mark.ssh

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "orin.yaml"


def build(profile: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "colibri_sdk", "build", "--profile", str(profile), "--demo", "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"colibri-sdk build failed:\n{proc.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def real_bundles(tmp_path_factory):
    """(bundle, same bundle rebuilt with gate_up/down block_n 32 instead of 64)."""
    root = tmp_path_factory.mktemp("real")
    first = build(PROFILE, root / "orin")
    profile = yaml.safe_load(PROFILE.read_text())
    profile["kernels"]["gate_up"]["block_n"] = 32
    profile["kernels"]["down"]["block_n"] = 32
    variant = root / "orin_bn32.yaml"
    variant.write_text(yaml.safe_dump(profile))
    return first, build(variant, root / "orin_bn32")


def files_of(bundle: Path) -> dict:
    return {e["path"]: e for e in json.loads((bundle / "manifest.json").read_text())["files"]}


def test_real_bundle_verified_on_device_then_kernel_only_rebuild(real_bundles, target, device_dir):
    first, rebuilt = real_bundles
    colibri = f"{sys.executable} -m colibri_sdk"
    options = DeployOptions(remote_dir=str(device_dir), verify=True, remote_colibri=colibri,
                            remote_python=sys.executable, verify_backend="cpu")
    result = deploy(first, target, options)
    assert remote_tree(device_dir / "current") == remote_tree(first)
    # The device's own self-test line comes back, naming the backend that ran it.
    assert result.selftest.startswith("self-test passed on cpu: max abs err ") and result.selftest_backend == "cpu"

    old, new = files_of(first), files_of(rebuilt)
    changed = sorted(p for p in new if old.get(p, {}).get("sha256") != new[p]["sha256"])
    assert changed and all(p.startswith("kernels/") for p in changed)  # weights and self-test unchanged
    again = deploy(rebuilt, target, options)
    assert sorted(again.sent) == changed + ["manifest.json"]
    assert again.bytes_sent == sum(new[p]["size"] for p in changed) + (rebuilt / "manifest.json").stat().st_size
    assert again.bytes_sent < 0.02 * again.total_bytes
    assert os.readlink(device_dir / "current") == f"bundles/{again.bundle_id}" != f"bundles/{result.bundle_id}"
    assert remote_tree(device_dir / "current") == remote_tree(rebuilt)


def test_real_verify_failure_keeps_previous(real_bundles, tmp_path, target, device_dir):
    first, rebuilt = real_bundles
    options = DeployOptions(remote_dir=str(device_dir), verify=True, remote_python=sys.executable,
                            remote_colibri=f"{sys.executable} -m colibri_sdk")
    ok = deploy(first, target, options)
    # A bundle whose self-test expectation is wrong but whose checksums are consistent: the device's
    # `colibri-sdk verify` must fail it and the pointer must stay.
    bad = shutil.copytree(rebuilt, tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_text())
    out = bad / manifest["selftest"]["output"]
    expected = np.load(out)
    np.save(out, expected + 1.0)
    for entry in manifest["files"]:
        if entry["path"] == manifest["selftest"]["output"]:
            entry["sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
            entry["size"] = out.stat().st_size
    (bad / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    with pytest.raises(RemoteVerifyError, match=r"self-test of .* failed \(exit status 1\)"):
        deploy(bad, target, options)
    assert os.readlink(device_dir / "current") == f"bundles/{ok.bundle_id}"
