"""Deploying bundles made by `colibri-sdk build` (NVRTC, no GPU): first deploy with the self-test run on the
'device', then a kernel-only rebuild (other block sizes) that sends only the kernels."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from deploy_bundles import remote_tree, reseal

from colibri_sdk.deploy import DeployOptions, RemoteVerifyError, deploy

pytestmark = pytest.mark.ssh


def files_of(bundle: Path) -> dict:
    return {e["path"]: e for e in json.loads((bundle / "manifest.json").read_text())["files"]}


VERIFIED = dict(verify=True, remote_colibri=f"{sys.executable} -m colibri_sdk", verify_backend="cpu")


def test_real_bundle_verified_on_device_then_kernel_only_rebuild(real_bundles, target, device_dir, start_from):
    first, rebuilt = real_bundles
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, **VERIFIED)
    (result,) = start_from([first], **VERIFIED)  # the deploy of `first`, verified on the device
    assert remote_tree(device_dir / "current") == remote_tree(first)
    # The device's own self-test line comes back, naming the backend that ran it.
    assert result.selftest.startswith("self-test passed on cpu: max abs err ") and result.selftest_backend == "cpu"

    old, new = files_of(first), files_of(rebuilt)
    changed = sorted(p for p in new if old.get(p, {}).get("sha256") != new[p]["sha256"])
    assert changed and all(p.startswith("kernels/") for p in changed)  # weights and self-test unchanged
    again = deploy(rebuilt, target, options)
    # Content-addressed: a content two changed paths share (a kernel whose PTX no shape constant touches, in two
    # compiled shapes) is sent once.
    unique = {}
    for p in changed:
        unique.setdefault(new[p]["sha256"], p)
    assert len(again.sent) == len(unique) + 1 and set(again.sent) <= set(changed) | {"manifest.json"}
    assert again.bytes_sent == sum(new[p]["size"] for p in unique.values()) + (rebuilt / "manifest.json").stat().st_size
    assert again.bytes_sent < 0.05 * again.total_bytes  # the kernels (~2.3 % of this bundle), never the weights
    assert os.readlink(device_dir / "current") == f"bundles/{again.bundle_id}" != f"bundles/{result.bundle_id}"
    assert remote_tree(device_dir / "current") == remote_tree(rebuilt)


def test_real_verify_failure_keeps_previous(real_bundles, tmp_path, target, device_dir, start_from):
    first, rebuilt = real_bundles
    options = DeployOptions(remote_dir=str(device_dir), remote_python=sys.executable, **VERIFIED)
    (ok,) = start_from([first], **VERIFIED)
    # A bundle whose self-test expectation is wrong but whose manifest is consistent (resealed as a build would):
    # the local loader accepts it, the device's `colibri-sdk verify` must fail it and the pointer must stay.
    bad = shutil.copytree(rebuilt, tmp_path / "bad")
    out = bad / json.loads((bad / "manifest.json").read_text())["selftest"]["output"]
    np.save(out, np.load(out) + 1.0)
    reseal(bad)
    with pytest.raises(RemoteVerifyError, match=r"self-test of .* on cpu failed \(exit status 1\): colibri-sdk "
                                                r"verify: error: .*self-test failed on the cpu backend: .*; the "
                                                r"active bundle was not changed$") as info:
        deploy(bad, target, options)
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)
    assert os.readlink(device_dir / "current") == f"bundles/{ok.bundle_id}"


def test_gpu_bundle_verified_by_default_on_cuda_fails_without_a_gpu(real_bundles, target, device_dir):
    """No GPU on this 'device': the default --verify (cuda) fails with the device's own one-line error."""
    first, _ = real_bundles
    options = DeployOptions(remote_dir=str(device_dir), verify=True, remote_python=sys.executable,
                            remote_colibri=f"{sys.executable} -m colibri_sdk")
    with pytest.raises(RemoteVerifyError, match=r"on cuda failed \(exit status 1\): colibri-sdk verify: error: "
                                                r"[^\n]*CUDA[^\n]*; the active bundle was not changed$"):
        deploy(first, target, options)
    assert not os.path.lexists(device_dir / "current")
