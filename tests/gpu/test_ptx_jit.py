"""Every shipped profile's kernels on this GPU: the cubin when the arch matches, else the PTX through the driver's
JIT (a newer GPU), checked with the bundle's own self-test vectors."""

from __future__ import annotations

import copy
import os
import resource

import numpy as np
import pytest

from colibri_sdk.bundle import Bundle
from colibri_sdk.profile import load_profile, packaged_dir

from gpu_support import build, device_compute_capability, retarget_toolkit

pytestmark = pytest.mark.gpu

PROFILES = sorted(p.stem for p in packaged_dir().glob("*.yaml"))


def driver_version() -> int:
    from cuda.bindings import driver as cu

    from colibri_sdk.runtime.driver import check

    check(cu.cuInit(0), "cuInit")
    return int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profile_runs(tmp_path, name):
    from colibri_sdk.aot.nvrtc import nvrtc_version
    from colibri_sdk.driver_version import format_driver_version
    from colibri_sdk.profile import parse_arch
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    data = copy.deepcopy(load_profile(name, toolchain=False).data)
    retarget_toolkit(data, nvrtc_version()[0])  # the installed NVRTC; the arch stays the profile's
    device = device_compute_capability()
    cc = parse_arch(data["target"]["arch"])
    if device < cc:
        pytest.skip(f"profile {name} targets sm_{cc[0]}{cc[1]}, newer than this GPU (sm_{device[0]}{device[1]})")
    expected_kind = "cubin" if device[0] == cc[0] else "ptx"
    nvrtc = nvrtc_version()
    driver = driver_version()
    if expected_kind == "ptx" and driver < 1000 * nvrtc[0] + 10 * nvrtc[1]:
        pytest.skip(f"profile {name} (sm_{cc[0]}{cc[1]}) runs on this sm_{device[0]}{device[1]} GPU only as PTX, and "
                    f"the CUDA driver {format_driver_version(driver)} is older than NVRTC {nvrtc[0]}.{nvrtc[1]}, "
                    f"whose PTX it cannot JIT-compile")
    bundle = Bundle.open(build(data, None, tmp_path / name))
    assert tuple(bundle.compute_capability) == cc
    with CudaBackend(bundle) as backend:
        assert backend.image_kind == expected_kind
        x, expected, rtol, atol = bundle.selftest()
        backend.poison()
        y = backend.infer_padded(np.ascontiguousarray(x, dtype=np.float32))
        np.testing.assert_allclose(y, expected, rtol=rtol, atol=atol, err_msg=f"{name} via {backend.image_kind}")


def test_integrated_gpu_peak_memory(tmp_path):
    """On an integrated GPU (Jetson) the weights must not be resident twice: peak RSS <= 1.1 x weights + baseline."""
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    from gpu_support import profile_for_this_gpu, random_model

    weights = random_model(tmp_path / "big.colibri", experts=8, top_k=2, hidden=1024, inter=4096, layers=4)
    bundle = Bundle.open(build(profile_for_this_gpu(dtype="fp32"), weights, tmp_path / "bundle"))
    size = os.path.getsize(bundle.weights_path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with CudaBackend(bundle) as backend:
        if not backend.integrated:
            pytest.skip(f"{backend.device_name} is a discrete GPU; the single-copy rule is for integrated GPUs")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak - before <= 1.1 * size, f"RSS grew by {peak - before:,} bytes for {size:,} bytes of weights"
