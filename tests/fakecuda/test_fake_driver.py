"""The fake CUDA driver itself: it is found and resolved the way the installed cuda-bindings does it, and it refuses
what a real driver refuses, so the backend tests on it can fail."""

from __future__ import annotations

import shutil

import pytest
from fakecuda_support import HIDDEN, TOKENS

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")


def test_error_names_and_unemulated_functions(run_fake):
    run = run_fake("""
        from cuda.bindings import driver as cu
        names = {}
        for code in cu.CUresult:
            err, name = cu.cuGetErrorName(code)
            if int(err) == 0:
                names[code.name] = name.decode()
        try:
            cu.cuMemGetAddressRange(0)
            missing = None
        except RuntimeError as exc:
            missing = f"{type(exc).__name__}: {exc}"
        emit(names=names, missing=missing)
    """)
    assert run.rc == 0 and run.result, run
    names = run.result["names"]
    assert len(names) >= 20 and all(enum == name for enum, name in names.items()), names
    assert run.result["missing"] == "FunctionNotFoundError: function cuMemGetAddressRange_v2 is not found"


def test_refuses_what_a_driver_refuses(run_fake, tiny_bundle):
    """A cubin for another major, PTX newer than the driver, copies outside an allocation, a write past its end, a
    synchronisation during capture: each is the CUDA error a driver gives, never a silent success."""
    run = run_fake(f"""
        from cuda.bindings import driver as cu
        from colibri_sdk.bundle import Bundle
        bundle = Bundle.open({str(tiny_bundle)!r})
        out = {{}}
        cu.cuInit(0)
        _, dev = cu.cuDeviceGet(0)
        _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        cu.cuCtxSetCurrent(ctx)
        cubin = np.frombuffer(bundle.kernel_image("routing", "cubin"), np.uint8)
        ptx = np.frombuffer(bundle.kernel_image("routing", "ptx") + b"\\0", np.uint8)
        out["cubin"] = cu.cuModuleLoadData(cubin.ctypes.data)[0].name
        out["ptx"] = cu.cuModuleLoadData(ptx.ctypes.data)[0].name
        _, ptr = cu.cuMemAlloc(1000)
        host = np.zeros(2000, np.uint8)
        out["beyond"] = cu.cuMemcpyHtoD(cu.CUdeviceptr(int(ptr) + 8), host.ctypes.data, 1000)[0].name
        ctypes.memset(int(ptr) + 1000, 1, 4)  # a write just past the end, as a faulty kernel would do
        out["canary"] = cu.cuCtxSynchronize()[0].name
        _, stream = cu.cuStreamCreate(0)
        cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        out["sync_in_capture"] = cu.cuStreamSynchronize(stream)[0].name
        out["end_capture"] = cu.cuStreamEndCapture(stream)[0].name
        emit(**out)
    """, cc="9.0", driver=12060)
    assert run.rc == 0 and run.result, run
    assert run.result == {
        "cubin": "CUDA_ERROR_NO_BINARY_FOR_GPU",
        "ptx": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        "beyond": "CUDA_ERROR_INVALID_VALUE",
        "canary": "CUDA_ERROR_ILLEGAL_ADDRESS",
        "sync_in_capture": "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "end_capture": "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    }
    assert "fake libcuda: cuModuleLoadData: cubin for sm_87 cannot run on this sm_90 device" in run.stderr


@pytest.mark.parametrize("mode,refused", [("GLOBAL", True), ("THREAD_LOCAL", False), ("RELAXED", False)])
def test_another_threads_synchronous_call_during_capture(run_fake, mode, refused):
    """CUstreamCaptureMode, as a driver applies it to a synchronous call (cuMemsetD32 on the legacy stream) from
    another thread while a stream captures: a global capture refuses it and is invalidated, a thread-local or
    relaxed one lets it run (libcolibri captures thread-local, while another context may be loading)."""
    run = run_fake(f"""
        import threading
        from cuda.bindings import driver as cu
        cu.cuInit(0)
        _, dev = cu.cuDeviceGet(0)
        _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        cu.cuCtxSetCurrent(ctx)
        _, ptr = cu.cuMemAlloc(64)
        _, stream = cu.cuStreamCreate(0)
        cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_{mode})
        out = {{}}

        def other():
            cu.cuCtxSetCurrent(ctx)
            out["memset"] = cu.cuMemsetD32(ptr, 0, 16)[0].name

        t = threading.Thread(target=other)
        t.start()
        t.join()
        out["end_capture"] = cu.cuStreamEndCapture(stream)[0].name
        emit(**out)
    """)
    assert run.rc == 0 and run.result, run
    if refused:
        assert run.result == {"memset": "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                              "end_capture": "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"}, run.result
    else:
        assert run.result == {"memset": "CUDA_SUCCESS", "end_capture": "CUDA_SUCCESS"}, run.result


def test_graph_keeps_the_parameters_of_capture_time(run_fake, tiny_bundle):
    """After capture, the backend's kernel-argument arrays are zeroed: the graph still runs on the values recorded
    at capture (as a real CUDA Graph does), while an eager launch reads the zeros and faults."""
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.errors import CudaError
        from colibri_sdk.runtime.cuda_backend import CudaBackend
        bundle = Bundle.open({str(tiny_bundle)!r})
        x = np.random.default_rng(11).standard_normal((1, {TOKENS}, {HIDDEN})).astype(np.float32)
        with CudaBackend(bundle) as graph, CudaBackend(bundle, eager=True) as eager:
            before = graph.infer_padded(x)
            for backend in (graph, eager):
                for launch in backend._launches:
                    launch[5][:] = 0
            after = graph.infer_padded(x)
            try:
                eager.infer_padded(x)
                eager_error = None
            except CudaError as exc:
                eager_error = str(exc)
            emit(same=bool(np.array_equal(before.view(np.uint32), after.view(np.uint32))), eager_error=eager_error)
    """)
    assert run.rc == 0 and run.result, run
    assert run.result["same"] is True
    assert run.result["eager_error"] == "cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED"
    assert "memory fault" in run.stderr
