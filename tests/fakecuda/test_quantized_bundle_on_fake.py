"""A bundle built from int4 weights, run end to end by the CUDA backend on the fake CUDA driver: the real build
(NVRTC, manifest with the storage), the real backend (upload of the whole v2 data region, the launch plan with the
scale-block arguments, graph replay) and the emulated kernels compiled for the bundle's constants. A CPU run, not a
GPU run."""

from __future__ import annotations

import shutil

import pytest
from fakecuda_support import HIDDEN, TOKENS, orin_profile_data, run_bundle_on_fake

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")


def test_int4_bundle_runs_on_the_fake_driver(run_fake, tmp_path):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile
    from fakecuda_support import emulation_library
    from test_emulated import assert_close, reference
    from test_emulated_quant import make_quant_model

    weights = make_quant_model(tmp_path / "model-int4.colibri", quant="int4", group=32, zeros=False, layers=2,
                               experts=8, top_k=2, hidden=HIDDEN, inter=48, seed=21)
    bundle = build_bundle(Profile.from_dict(orin_profile_data(TOKENS)), tmp_path / "bundle", weights, workers=2).path
    manifest = Bundle.open(bundle).manifest
    assert manifest["weights"]["header"]["quant"] == 2 and manifest["weights"]["header"]["group_size"] == 32
    lib = emulation_library(manifest["kernels"])
    x, y = run_bundle_on_fake(run_fake, bundle, lib, TOKENS, HIDDEN, seed=5)
    ref, _, stable = reference(weights, x)
    assert_close(y, ref, stable)


def test_int8_bundle_on_the_tiled_shape_runs_on_the_fake_driver_and_the_cpu_backend(run_fake, tmp_path):
    """64 tokens x top-4 = 256 pairs > the Orin profile's small_batch.max_pairs (32): the tiled path, int8 weights
    with zero points on the tensor-core kernels of kernels/expert_quant_tc.cu (emulated), and the CPU backend on the
    same bundle; both against the float64 reference."""
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile
    from colibri_sdk.runtime import Runtime
    from fakecuda_support import emulation_library
    from test_emulated import assert_close, reference
    from test_emulated_quant import make_quant_model

    tokens = 64
    weights = make_quant_model(tmp_path / "model-int8.colibri", quant="int8", group=64, zeros=True, layers=2,
                               experts=16, top_k=4, hidden=HIDDEN, inter=48, seed=22)
    bundle = build_bundle(Profile.from_dict(orin_profile_data(tokens)), tmp_path / "bundle", weights, workers=2).path
    manifest = Bundle.open(bundle).manifest
    assert manifest["weights"]["header"]["quant"] == 1 and manifest["weights"]["header"]["zero_points"] == 1
    assert [launch["symbol"] for launch in manifest["launch"] if launch["kernel"] == "expert_quant"] == [
        "colibri_gate_up_qtc", "colibri_down_qtc"] * 2
    lib = emulation_library(manifest["kernels"])
    x, y = run_bundle_on_fake(run_fake, bundle, lib, tokens, HIDDEN, seed=6)
    ref, _, stable = reference(weights, x)
    assert_close(y, ref, stable)
    with Runtime.load(bundle, backend="cpu") as rt:
        assert_close(rt.infer(x), ref, stable)
