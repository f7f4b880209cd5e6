"""A bundle built from int4 weights, run end to end by the CUDA backend on the fake CUDA driver: the real build
(NVRTC, manifest with the storage), the real backend (upload of the whole v2 data region, the launch plan with the
scale-block arguments, graph replay) and the emulated kernels compiled for the bundle's constants. A CPU run, not a
GPU run."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
from fakecuda_support import HIDDEN, TOKENS

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")


def test_int4_bundle_runs_on_the_fake_driver(run_fake, tmp_path):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile
    from emulator import build_library
    from test_emulated import assert_close, reference
    from test_emulated_quant import make_quant_model

    weights = make_quant_model(tmp_path / "model-int4.colibri", quant="int4", group=32, zeros=False, layers=2,
                               experts=8, top_k=2, hidden=HIDDEN, inter=48, seed=21)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": TOKENS}
    bundle = build_bundle(Profile.from_dict(data), tmp_path / "bundle", weights, workers=2).path
    manifest = Bundle.open(bundle).manifest
    assert manifest["weights"]["header"]["quant"] == 2 and manifest["weights"]["header"]["group_size"] == 32
    lib = build_library(manifest["kernels"][0]["defines"])
    code = f"""
    from colibri_sdk.runtime import Runtime
    x = np.random.default_rng(5).standard_normal(({TOKENS}, {HIDDEN})).astype(np.float32)
    with Runtime.load({str(bundle)!r}, backend="cuda") as rt:
        y = rt.infer(x)
        selftest = rt.self_test()
        emit(y=y.tolist(), selftest=bool(selftest.passed), backend=rt.backend_name)
    """
    run = run_fake(code, kernels=lib)
    assert run.rc == 0 and run.result, run
    assert run.result["backend"] == "cuda" and run.result["selftest"] is True
    x = np.random.default_rng(5).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    ref, _, stable = reference(weights, x)
    assert_close(np.asarray(run.result["y"], dtype=np.float32), ref, stable)


def test_int8_bundle_on_the_tiled_shape_runs_on_the_fake_driver_and_the_cpu_backend(run_fake, tmp_path):
    """64 tokens x top-4 = 256 pairs > the Orin profile's small_batch.max_pairs 128: the tiled path, int8 weights
    with zero points on the tensor-core kernels of kernels/expert_quant_tc.cu (emulated), and the CPU backend on the
    same bundle; both against the float64 reference."""
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile
    from colibri_sdk.runtime import Runtime
    from emulator import build_library
    from test_emulated import assert_close, reference
    from test_emulated_quant import make_quant_model

    tokens = 64
    weights = make_quant_model(tmp_path / "model-int8.colibri", quant="int8", group=64, zeros=True, layers=2,
                               experts=16, top_k=4, hidden=HIDDEN, inter=48, seed=22)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": tokens}
    bundle = build_bundle(Profile.from_dict(data), tmp_path / "bundle", weights, workers=2).path
    manifest = Bundle.open(bundle).manifest
    assert manifest["weights"]["header"]["quant"] == 1 and manifest["weights"]["header"]["zero_points"] == 1
    assert [launch["symbol"] for launch in manifest["launch"] if launch["kernel"] == "expert_quant"] == [
        "colibri_gate_up_qtc", "colibri_down_qtc"] * 2
    lib = build_library(manifest["kernels"][0]["defines"])
    code = f"""
    from colibri_sdk.runtime import Runtime
    x = np.random.default_rng(6).standard_normal(({tokens}, {HIDDEN})).astype(np.float32)
    with Runtime.load({str(bundle)!r}, backend="cuda") as rt:
        y = rt.infer(x)
        emit(y=y.tolist(), selftest=bool(rt.self_test().passed), backend=rt.backend_name)
    """
    run = run_fake(code, kernels=lib)
    assert run.rc == 0 and run.result, run
    assert run.result["backend"] == "cuda" and run.result["selftest"] is True
    x = np.random.default_rng(6).standard_normal((tokens, HIDDEN)).astype(np.float32)
    ref, _, stable = reference(weights, x)
    assert_close(np.asarray(run.result["y"], dtype=np.float32), ref, stable)
    with Runtime.load(bundle, backend="cpu") as rt:
        assert_close(rt.infer(x), ref, stable)
