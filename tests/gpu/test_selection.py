"""CPU-only parts of the CUDA backend: image selection, the driver probe, the error checker. Run everywhere."""

from __future__ import annotations

import pytest

from colibri_sdk.errors import BackendError, CudaError
from colibri_sdk.runtime.cuda_backend import parse_version, select_image
from colibri_sdk.driver_version import format_driver_version
from colibri_sdk.runtime.driver import check, probe_driver


@pytest.mark.parametrize(
    "device,bundle,driver,kind",
    [((8, 7), (8, 7), 12020, "cubin"), ((8, 7), (8, 0), 12020, "cubin"), ((9, 0), (8, 7), 13000, "ptx"),
     ((8, 9), (8, 7), 12090, "cubin"), ((12, 0), (9, 0), 12090, "ptx")],
)
def test_select_image(device, bundle, driver, kind):
    assert select_image(device, bundle, driver, 12020, "12.9") == kind


def test_select_image_refusals():
    with pytest.raises(BackendError, match=r"the GPU is sm_80, the bundle is built for sm_87: .*cannot run on an older"):
        select_image((8, 0), (8, 7), 12090, 12020, "12.9")
    with pytest.raises(BackendError, match=r"needs a CUDA driver >= 12.9, this one is 12.6"):
        select_image((9, 0), (8, 7), 12060, 12020, "12.9")
    with pytest.raises(BackendError, match=r"the CUDA driver is 12.0; the bundle needs at least 12.2"):
        select_image((8, 7), (8, 7), 12000, 12020, "12.9")


def test_versions():
    assert parse_version("12.9") == 12090 and parse_version("13.0") == 13000
    assert format_driver_version(12020) == "12.2"


def test_probe_answers_with_a_reason():
    ok, reason = probe_driver()
    assert isinstance(ok, bool) and reason.strip()
    if not ok:
        assert "driver" in reason or "device" in reason or "cuda" in reason.lower()


def test_check_raises_with_call_and_error_name():
    from cuda.bindings import driver as cu

    assert check((cu.CUresult.CUDA_SUCCESS, 7), "cuDeviceGetCount") == 7
    assert check((cu.CUresult.CUDA_SUCCESS,), "cuInit") is None
    with pytest.raises(CudaError, match=r"cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE") as info:
        check((cu.CUresult.CUDA_ERROR_INVALID_IMAGE, None), "cuModuleLoadData")
    assert info.value.call == "cuModuleLoadData" and info.value.code == "CUDA_ERROR_INVALID_IMAGE"
