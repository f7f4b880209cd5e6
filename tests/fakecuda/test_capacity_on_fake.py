"""Expert capacity on the CUDA backend, on the fake CUDA driver: a bundle built by the SDK (NVRTC) with a capacity,
its kernels (kernels/capacity.cu included) emulated on the CPU. The dropped-pair count the runtime reads back from
the device, the output, the dropless self-test, per-layer and device calls, against the float64 reference engine
with the same capacity in this process (never the backend under test).
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
from timeout_support import guard

from colibri_sdk.capacity import Capacity
from colibri_sdk.reference import ReferenceEngine
from fakecuda_support import HIDDEN, INTER

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

SPEC = {"factor": 0.75, "mode": "hard", "policy": "position"}
TOKENS = 8


@pytest.fixture(scope="module")
def capacity_bundle(tmp_path_factory):
    """A bundle with expert capacity (SPEC) at batch 1 x 8 tokens, from a skewed float32 model (3 layers, 8 experts,
    top-2; the router favours experts 0 and 1), and the emulation library of its kernels."""
    from emulator import build_library

    from colibri_sdk.bundle import Bundle
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.format import Header, write_model
    from colibri_sdk.profile import Profile, load_profile

    root = tmp_path_factory.mktemp("capacity")
    rng = np.random.default_rng(5)
    L, E, H, I = 3, 8, HIDDEN, INTER
    router = rng.standard_normal((L, H, E)) / np.sqrt(H)
    router[:, :, :2] += 0.3
    weights = write_model(root / "model.colibri", Header(L, E, 2, H, I, dtype=0, routing=0, composition=1),
                          rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                          rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                          rng.standard_normal((L, E, H, I)) / np.sqrt(I), router)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": TOKENS}
    data["capacity"] = SPEC
    path = build_bundle(Profile.from_dict(data), root / "bundle", weights, workers=2).path
    defines = next(k for k in Bundle.open(path).manifest["kernels"] if k["name"] == "capacity")["defines"]
    return path, Bundle.open(path).weights_path, build_library(defines)  # the bundle's (fp16) weights


def reference(weights, x, layers=range(3), valid=None):
    """float64 output and dropped pairs of `layers` on x (tokens, hidden), residual composition."""
    engine = ReferenceEngine(weights, compute_dtype=np.float64, capacity=Capacity.from_dict(SPEC))
    engine.valid = valid
    h = x.astype(np.float64)
    for layer in layers:
        h = h + engine.layer(layer, h)
    dropped = engine.dropped
    engine.close()
    return h, dropped


def test_the_cuda_backend_drops_and_counts_pairs_as_the_reference(run_fake, capacity_bundle):
    bundle, weights, lib = capacity_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["profile"]["capacity"] == SPEC
    assert [l["symbol"] for l in manifest["launch"]].count("colibri_capacity") == 3
    run = run_fake(f"""
        from cuda.bindings import driver as cu
        from colibri_sdk.runtime import Runtime
        from colibri_sdk.runtime.driver import check
        class Dev:
            def __init__(self, ptr, shape):
                self.__cuda_array_interface__ = {{"shape": shape, "typestr": "<f4", "data": (int(ptr), False),
                                                  "strides": None, "version": 3}}
        x = np.random.default_rng(7).standard_normal((1, {TOKENS}, {HIDDEN})).astype(np.float32)
        out = {{}}
        with Runtime.load({str(bundle)!r}, backend="cuda") as rt:
            out["backend"] = rt.backend_name
            out["whole"] = rt.infer(x).tolist()
            out["dropped"] = rt.stats().last_dropped_pairs
            out["selftest"] = rt.self_test().passed
            out["after_selftest"] = rt.stats().last_dropped_pairs
            out["short"] = rt.infer(x[:, :5]).tolist()
            out["short_dropped"] = rt.stats().last_dropped_pairs
            out["layer1"] = rt.layer(1, x).tolist()
            out["layer1_dropped"] = rt.stats().last_dropped_pairs
            n = x.nbytes
            d_in = check(cu.cuMemAlloc(n), "cuMemAlloc")
            d_out = check(cu.cuMemAlloc(n), "cuMemAlloc")
            check(cu.cuMemcpyHtoD(d_in, x.ctypes.data, n), "cuMemcpyHtoD")
            rt.infer(Dev(d_in, ({TOKENS}, {HIDDEN})), out=Dev(d_out, ({TOKENS}, {HIDDEN})))
            out["device_dropped"] = rt.stats().last_dropped_pairs
            y = np.empty_like(x)
            check(cu.cuMemcpyDtoH(y.ctypes.data, d_out, n), "cuMemcpyDtoH")
            out["device"] = y.tolist()
            out["total"] = rt.stats().dropped_pairs
        emit(**out)
    """, kernels=lib, timeout=guard(600))
    assert run.rc == 0 and run.result, run
    r = run.result
    x = np.random.default_rng(7).standard_normal((1, TOKENS, HIDDEN)).astype(np.float32)
    want, dropped = reference(weights, x[0])
    assert r["backend"] == "cuda" and dropped > 0
    assert r["dropped"] == dropped and r["device_dropped"] == dropped
    np.testing.assert_allclose(np.asarray(r["whole"])[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(r["device"])[0], want, rtol=1e-4, atol=1e-4)
    assert r["selftest"] is True and r["after_selftest"] == 0, "the self-test runs dropless"
    short, short_dropped = reference(weights, x[0, :5])  # padding takes no capacity
    assert r["short_dropped"] == short_dropped
    np.testing.assert_allclose(np.asarray(r["short"])[0], short, rtol=1e-4, atol=1e-4)
    layer1, layer1_dropped = reference(weights, x[0], layers=[1])
    assert r["layer1_dropped"] == layer1_dropped
    np.testing.assert_allclose(np.asarray(r["layer1"])[0], layer1, rtol=1e-4, atol=1e-4)
    assert r["total"] == 2 * dropped + short_dropped + layer1_dropped
    assert not [line for line in run.log if line.startswith("!")], "the fake complained"
