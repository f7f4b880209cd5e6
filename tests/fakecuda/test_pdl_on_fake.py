"""Programmatic dependent launch (profile `programmatic_dependent_launch`, sm_90) through the Python CUDA backend on
the fake CUDA driver: which launches carry the programmatic stream serialization attribute, and that the output is
the reference's. The fake driver runs launches one after another, so this checks the driver calls and the
numerics, not an overlap (docs/kernels.md, "Programmatic dependent launch").
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
from fakecuda_support import HIDDEN, INTER, TOKENS, emulation_library, log_sections

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

CODE = """
import os
from colibri_sdk.runtime import Runtime
def mark(name):
    with open(os.environ["COLIBRI_FAKE_CUDA_LOG"], "a") as f:
        f.write(f"# {{name}}\\n")
x = np.random.default_rng(11).standard_normal((1, {tokens}, {hidden})).astype(np.float32)
with Runtime.load({bundle!r}, backend="cuda") as rt:
    mark("infer")
    y = rt.infer(x)
    mark("layer")
    h = rt.layer(1, x)
    backend = rt.backend_name
emit(y=y.tolist(), h=h.tolist(), backend=backend)
"""


@pytest.fixture(scope="module")
def pdl_bundle(tmp_path_factory):
    """The h200 profile at 1 x TOKENS (the GEMV path) with programmatic dependent launch, on a random model (the
    compile constants of tests/c_runtime's "pdl" bundle: one NVRTC build and one emulation serve both)."""
    from gpu_support import random_model

    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    root = tmp_path_factory.mktemp("pdl")
    weights = random_model(root / "model.colibri", layers=2, experts=8, top_k=2, hidden=HIDDEN, inter=INTER, seed=3)
    data = copy.deepcopy(load_profile("h200", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": TOKENS}
    data["programmatic_dependent_launch"] = True
    data["target"]["min_driver"] = 12030
    return build_bundle(Profile.from_dict(data), root / "bundle", weights, workers=2).path


def test_launches_after_the_first_carry_the_attribute_and_the_output_is_the_references(run_fake, pdl_bundle):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.reference import ReferenceEngine

    manifest = Bundle.open(pdl_bundle).manifest
    plan = manifest["launch"]
    assert "pdl" not in plan[0] and all(launch["pdl"] is True for launch in plan[1:])
    assert all(k["defines"]["COLI_PDL"] == 1 for k in manifest["kernels"])
    run = run_fake(CODE.format(bundle=str(pdl_bundle), tokens=TOKENS, hidden=HIDDEN),
                   kernels=emulation_library(manifest["kernels"]), cc="9.0", driver=12060)
    assert run.rc == 0 and run.result and run.result["backend"] == "cuda", run
    assert not [line for line in run.log if line.startswith("!")], run.log[:20]
    parts = log_sections(run)
    # The graph is captured at load: the first launch plain (after the input copy), every later one with the
    # attribute; the replay launches the graph only.
    captured = [line for line in parts["load"] if line.startswith("cuLaunchKernel")]
    assert len(captured) == len(plan), captured[:4]
    assert captured[0].startswith("cuLaunchKernel ") and "pdl=1" not in captured[0]
    assert all(line.startswith("cuLaunchKernelEx ") and line.endswith("pdl=1") for line in captured[1:])
    assert not [line for line in parts["infer"] if line.startswith("cuLaunchKernel")]
    # A per-layer call (eager, on the stream the caller's input copy went to): its first launch plain, the rest with
    # the attribute.
    layer = [line for line in parts["layer"] if line.startswith("cuLaunchKernel")]
    per_layer = sum(1 for launch in plan if launch["layer"] == 1)
    assert len(layer) == per_layer and "pdl=1" not in layer[0]
    assert all(line.endswith("pdl=1") for line in layer[1:])

    x = np.random.default_rng(11).standard_normal((1, TOKENS, HIDDEN)).astype(np.float32)
    engine = ReferenceEngine(Bundle.open(pdl_bundle).weights_path, compute_dtype=np.float64)
    expected = engine.forward(x[0].astype(np.float64))
    y = np.asarray(run.result["y"], dtype=np.float32).reshape(expected.shape)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-3 * scale)
    flat = x[0].astype(np.float64)
    expected_h = flat + engine.layer(1, flat)  # residual composition (random_model's)
    h = np.asarray(run.result["h"], dtype=np.float32).reshape(expected_h.shape)
    np.testing.assert_allclose(h, expected_h, rtol=1e-3, atol=1e-3 * float(np.abs(expected_h).max()))
    engine.close()
