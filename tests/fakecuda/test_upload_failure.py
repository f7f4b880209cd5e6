"""A failing weight upload on an integrated GPU (the fake driver's failure injection) surfaces as its CudaError."""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")


@pytest.mark.parametrize("call", ["cuMemcpyHtoD", "cuMemcpyHtoD@2"])
def test_integrated_upload_failure_is_the_cuda_error(run_fake, tiny_bundle, call):
    """The copy straight from the mapping fails (first chunk, then a later one with 4000-byte chunks): the
    CudaError reaches the caller (not `BufferError: cannot close exported pointers exist` from closing the mapping
    under a live NumPy view), and nothing stays allocated."""
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.errors import CudaError
        from colibri_sdk.runtime import cuda_backend, cuda_upload
        cuda_upload.UPLOAD_CHUNK = 4000
        try:
            cuda_backend.CudaBackend(Bundle.open({str(tiny_bundle)!r}), eager=True).close()
            error = None
        except CudaError as exc:
            error = [type(exc).__name__, str(exc), exc.call, exc.code]
        emit(error=error, live=live())
    """, integrated=1, fail=f"{call}=CUDA_ERROR_ILLEGAL_ADDRESS")
    assert run.rc == 0 and run.result, run
    assert run.result["error"] == ["CudaError", "cuMemcpyHtoD failed: CUDA_ERROR_ILLEGAL_ADDRESS", "cuMemcpyHtoD",
                                   "CUDA_ERROR_ILLEGAL_ADDRESS"], run
    assert set(run.result["live"].values()) == {"0"}, run.result["live"]
    assert "BufferError" not in run.stderr


def test_integrated_upload_failure_through_the_cli(run_fake, tiny_bundle):
    import sys

    run = run_fake(args=[sys.executable, "-m", "colibri_sdk", "run", "--backend", "cuda", "--iters", "1",
                         str(tiny_bundle)], integrated=1, fail="cuMemcpyHtoD=CUDA_ERROR_ILLEGAL_ADDRESS")
    assert run.rc == 1, run
    assert run.stderr.strip().splitlines()[-1] == (
        "colibri-sdk run: error: cuMemcpyHtoD failed: CUDA_ERROR_ILLEGAL_ADDRESS"), run
    assert "Traceback" not in run.stderr
