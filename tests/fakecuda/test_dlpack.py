"""DLPack-only device arrays (colibri_sdk.runtime.device_io): a producer exposing only `__dlpack__` /
`__dlpack_device__` with a real DLManagedTensor capsule (dlpack_support). The validation and the protocol (stream
argument, capsule rename, deleter) in this process; a whole call on the fake CUDA driver over its device memory,
against the float64 reference output."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from dlpack_support import DLPackArray
from fakecuda_support import HIDDEN, TOKENS

from colibri_sdk.errors import InputError
from colibri_sdk.runtime.device_io import device_view, is_device_array

ADDR = 0x7F0000000000  # never dereferenced by the validation


def test_a_dlpack_array_is_consumed_per_the_protocol():
    a = DLPackArray(ADDR, (TOKENS, HIDDEN), byte_offset=256)
    assert is_device_array(a) and not is_device_array(np.zeros(3, np.float32))
    view = device_view(a, "input", (1, TOKENS), HIDDEN, stream=0)
    assert (view.ptr, view.shape, view.batch, view.tokens) == (ADDR + 256, (TOKENS, HIDDEN), 1, TOKENS)
    assert a.streams == [1], "the legacy default stream is 1 in the DLPack protocol"
    assert a.capsule_names == ["used_dltensor"] and a.deleted == 0
    view.release()
    view.release()
    assert a.deleted == 1, "the deleter is called once, when the call no longer needs the tensor"
    b = DLPackArray(ADDR, (1, TOKENS, HIDDEN), strides=(TOKENS * HIDDEN, HIDDEN, 1))
    assert device_view(b, "out", (1, TOKENS), HIDDEN, stream=0xABC0).batch == 1
    assert b.streams == [0xABC0], "the caller's stream handle"


@pytest.mark.parametrize("array,message", [
    (DLPackArray(ADDR, (TOKENS, HIDDEN), device_type=1),
     "input DLPack device kDLCPU (1); allowed: kDLCUDA (2), a CUDA device array (pass host data as a NumPy array)"),
    (DLPackArray(ADDR, (TOKENS, HIDDEN), dtype=(2, 16, 1)),
     "input DLPack dtype float16 (code 2, bits 16, lanes 1); allowed: float32 (code 2, bits 32, lanes 1)"),
    (DLPackArray(ADDR, (TOKENS, HIDDEN), dtype=(4, 16, 1)),
     "input DLPack dtype bfloat16 (code 4, bits 16, lanes 1); allowed: float32 (code 2, bits 32, lanes 1)"),
    (DLPackArray(ADDR, (TOKENS, HIDDEN), strides=(1, TOKENS)),
     f"input DLPack strides (1, {TOKENS}); allowed: NULL or the C-contiguous ({HIDDEN}, 1) (in elements)"),
    (DLPackArray(ADDR, (TOKENS, 32)), "input shape (4, 32); expected (batch, tokens, 64) or (tokens, 64)"),
    (DLPackArray(ADDR, (2, TOKENS, HIDDEN)),
     "input shape (2, 4, 64); allowed: batch 1, tokens 1..4 (the bundle's fixed shape)"),
], ids=["cpu", "float16", "bfloat16", "non-contiguous", "hidden", "batch"])
def test_dlpack_refusals_name_the_value_and_what_is_allowed(array, message):
    with pytest.raises(InputError) as info:
        device_view(array, "input", (1, TOKENS), HIDDEN)
    assert str(info.value) == message
    if array.device_type == 1:
        assert array.streams == [], "a CPU tensor is refused before any export"
    else:
        assert array.capsule_names == ["used_dltensor"] and array.deleted == 1, "a refused tensor is given back"


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")
def test_dlpack_input_and_output_on_the_fake_driver(run_fake, tiny_bundle, reference_output):
    x, expected = reference_output
    run = run_fake(f"""
        import sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from cuda.bindings import driver as cu
        from dlpack_support import DLPackArray
        from colibri_sdk.runtime import Runtime
        from colibri_sdk.runtime.driver import check
        x = np.random.default_rng(11).standard_normal((1, {TOKENS}, {HIDDEN})).astype(np.float32)
        with Runtime.load({str(tiny_bundle)!r}, backend="cuda") as rt:
            n = x.nbytes
            d_in = int(check(cu.cuMemAlloc(n), "cuMemAlloc"))
            d_out = int(check(cu.cuMemAlloc(n), "cuMemAlloc"))
            check(cu.cuMemcpyHtoD(d_in, x.ctypes.data, n), "cuMemcpyHtoD")
            stream = check(cu.cuStreamCreate(0), "cuStreamCreate")
            src, dst = DLPackArray(d_in, ({TOKENS}, {HIDDEN})), DLPackArray(d_out, ({TOKENS}, {HIDDEN}))
            same = rt.infer(src, out=dst, stream=stream) is dst
            check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            y = np.empty_like(x)
            check(cu.cuMemcpyDtoH(y.ctypes.data, d_out, n), "cuMemcpyDtoH")
            rt.layer(0, src, out=dst)  # the legacy default stream
        emit(same=same, y=y.tolist(), streams=[src.streams, dst.streams], handle=int(stream),
             deleted=[src.deleted, dst.deleted], names=src.capsule_names + dst.capsule_names)
    """)
    assert run.rc == 0 and run.result, run
    r = run.result
    assert r["same"] is True
    np.testing.assert_allclose(np.asarray(r["y"]), expected, rtol=2e-3, atol=2e-3)
    assert r["streams"] == [[r["handle"], 1], [r["handle"], 1]], "the caller's stream, then the legacy default (1)"
    assert r["deleted"] == [2, 2] and r["names"] == ["used_dltensor"] * 4
    assert not [line for line in run.log if line.startswith("!")], "the fake complained"
