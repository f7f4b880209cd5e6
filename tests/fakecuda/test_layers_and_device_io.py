"""Per-layer calls, caller-owned outputs and device-resident I/O of the CUDA backend, on the fake CUDA driver.

The device arrays are memory allocated through the (fake) driver with cuMemAlloc and wrapped in a small object
exposing `__cuda_array_interface__`, as CuPy and PyTorch arrays do. The expected values come from the float64
reference engine in this process, never from the backend under test.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from fakecuda_support import HIDDEN, TOKENS
from timeout_support import guard

from colibri_sdk.bundle import Bundle
from colibri_sdk.format.constants import COMPOSITION_RESIDUAL
from colibri_sdk.reference import ReferenceEngine

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

CODE = """
import os
from cuda.bindings import driver as cu
from colibri_sdk.runtime import Runtime
from colibri_sdk.runtime.driver import check
def mark(name):
    with open(os.environ["COLIBRI_FAKE_CUDA_LOG"], "a") as f:
        f.write(f"# {{name}}\\n")
class Dev:  # a device array as CuPy / PyTorch expose it
    def __init__(self, ptr, shape):
        self.__cuda_array_interface__ = {{"shape": shape, "typestr": "<f4", "data": (int(ptr), False),
                                          "strides": None, "version": 3}}
x = np.random.default_rng(11).standard_normal((1, {tokens}, {hidden})).astype(np.float32)
with Runtime.load({bundle!r}, backend="cuda", streams=2) as rt:
    whole = rt.infer(x)
    futures = [rt.submit(x[:, :t]) for t in (4, 2, 4, 3)]
    submitted = [f.result(timeout={wait}).tolist() for f in futures]
    out = np.full_like(x, np.nan)
    same = rt.infer(x, out=out) is out
    layer0 = rt.layer(0, x)
    chained = rt.layer(1, layer0)
    ranged = rt.layers(0, 2, x)
    small = rt.layer(0, x[:, :2])
    n = x.nbytes
    d_in = check(cu.cuMemAlloc(n), "cuMemAlloc")
    d_out = check(cu.cuMemAlloc(n), "cuMemAlloc")
    check(cu.cuMemcpyHtoD(d_in, x.ctypes.data, n), "cuMemcpyHtoD")
    stream = check(cu.cuStreamCreate(0), "cuStreamCreate")
    mark("device")
    dev_out = Dev(d_out, ({tokens}, {hidden}))
    returned = rt.infer(Dev(d_in, ({tokens}, {hidden})), out=dev_out, stream=stream) is dev_out
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    mark("device-small")
    rt.layer(0, Dev(d_in, (1, 2, {hidden})), out=Dev(d_out, (1, 2, {hidden})))
    mark("end")
    dev_whole = np.empty_like(x)
    check(cu.cuMemcpyDtoH(dev_whole.ctypes.data, d_out, n), "cuMemcpyDtoH")  # rows 0..1 now hold the small call
    dev_small = dev_whole[:, :2].copy()
    check(cu.cuMemcpyHtoD(d_out, x.ctypes.data, n), "cuMemcpyHtoD")
    rt.infer(Dev(d_in, ({tokens}, {hidden})), out=Dev(d_out, ({tokens}, {hidden})))
    check(cu.cuMemcpyDtoH(dev_whole.ctypes.data, d_out, n), "cuMemcpyDtoH")
    errors = []
    for bad in (lambda: rt.infer(Dev(d_in, ({tokens}, {hidden}))), lambda: rt.layer(2, x),
                lambda: rt.infer(x, out=np.empty((1, {tokens}, {hidden}), np.float64))):
        try:
            bad()
        except Exception as exc:
            errors.append(f"{{type(exc).__name__}}: {{exc}}")
    stats = rt.stats().as_dict()
    check(cu.cuMemFree(d_in), "cuMemFree"); check(cu.cuMemFree(d_out), "cuMemFree")
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
emit(whole=whole.tolist(), same=same, out=out.tolist(), layer0=layer0.tolist(), chained=chained.tolist(),
     ranged=ranged.tolist(), small=small.tolist(), dev_whole=dev_whole.tolist(), dev_small=dev_small.tolist(),
     returned=returned, errors=errors, stats=stats, submitted=submitted)
"""


def expected_layers(bundle, x, start, stop):
    """Layers start..stop-1 composed as the model composes them, by the float64 reference engine."""
    engine = ReferenceEngine(Bundle.open(bundle).weights_path, compute_dtype=np.float64)
    h = x.reshape(-1, HIDDEN).astype(np.float64)
    for layer in range(start, stop):
        y = engine.layer(layer, h)
        h = h + y if engine.header.composition == COMPOSITION_RESIDUAL else y
    engine.close()
    return h.reshape(x.shape)


def close(actual, expected):
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=1e-3, atol=1e-3 * scale)


def test_layers_out_submit_and_device_arrays_on_the_fake_driver(run_fake, tiny_bundle, reference_output):
    x, expected = reference_output
    expected = expected.reshape(x.shape)
    run = run_fake(CODE.format(bundle=str(tiny_bundle), tokens=TOKENS, hidden=HIDDEN, wait=guard(600)))
    assert run.rc == 0 and run.result, run
    r = run.result
    close(r["whole"], expected)
    assert r["same"] is True and r["out"] == r["whole"], "infer(x, out=buf) returns buf holding the output"
    close(r["layer0"], expected_layers(tiny_bundle, x, 0, 1))
    close(r["chained"], expected)
    close(r["ranged"], expected)
    close(r["small"], expected_layers(tiny_bundle, x[:, :2], 0, 1))
    assert r["returned"] is True
    close(r["dev_whole"], expected)
    close(r["dev_small"], expected_layers(tiny_bundle, x[:, :2], 0, 1))
    # Device I/O: device-to-device copies and launches on the caller's stream, no host copy, no sync.
    sections, name = {}, None
    for line in run.log:
        if line.startswith("# "):
            name = line[2:]
            sections[name] = []
        elif name:
            sections[name].append(line.split()[0])
    device = sections["device"]
    assert "cuMemcpyDtoDAsync" in device and "cuLaunchKernel" in device, device
    assert not {"cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyHtoD", "cuMemcpyDtoH"} & set(device), device
    assert device.count("cuStreamSynchronize") == 1, "only the test's own synchronisation"
    assert "cuMemsetD32Async" in sections["device-small"], "a smaller device input zeroes the padding rows"
    assert not [line for line in run.log if line.startswith("!")], "the fake complained"
    assert r["errors"] == [
        "InputError: a device input needs out= (a device array of the input's shape, float32)",
        "InputError: layer 2; allowed: an int 0..1 (the model has 2 layers)",
        "InputError: out dtype float64; allowed: float32",
    ]
    for t, got in zip((4, 2, 4, 3), r["submitted"]):
        assert got == r["whole"] if t == 4 else np.allclose(got, np.asarray(r["whole"])[:, :t], rtol=1e-5, atol=1e-6)
    assert r["stats"]["calls"] == 13 and r["stats"]["shape"] == [1, TOKENS]
