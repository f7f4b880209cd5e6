"""libcolibri with expert capacity, on the fake CUDA driver under AddressSanitizer + UBSan: the capacity launches
of the manifest's plan (kernels/capacity.cu, emulated on the CPU) and colibri_dropped_pairs, against the float64
reference engine with the same capacity in this process."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from c_runtime_support import manifest

from colibri_sdk.bundle import Bundle
from colibri_sdk.capacity import Capacity
from colibri_sdk.reference import ReferenceEngine

SPECS = {
    "soft-score": {"factor": 0.5, "mode": "soft", "policy": "score"},
    # min_capacity a compile-time constant, order choice bit 2 of the launch's flags (replayed as recorded)
    "hard-position-min-choice": {"factor": 0.5, "mode": "hard", "policy": "position", "min_capacity": 2,
                                 "order": "choice"},
}
FLAGS = {"soft-score": 1, "hard-position-min-choice": 6}  # by hand: bit 0 soft, bit 1 position, bit 2 choice
OK, INVALID_ARG, STATE = 0, 1, 7


@pytest.fixture(scope="module", params=list(SPECS))
def capacity_bundle(request, tmp_path_factory, small_weights):
    """The Orin profile (1 x 16 tokens, GEMV path) with a SPECS entry on the small model, its kernels' emulation
    library and the spec."""
    from emulator import build_library

    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": 16}  # one shape: the C runtime runs the top-level one
    spec = SPECS[request.param]
    data["capacity"] = spec
    path = build_bundle(Profile.from_dict(data), tmp_path_factory.mktemp("c_capacity") / "b", small_weights,
                        workers=2).path
    defines = next(k for k in manifest(path)["kernels"] if k["name"] == "capacity")["defines"]
    return path, build_library(defines), request.param


def reference(weights, x, valid, spec):
    """float64 output and dropped pairs of the whole model on x (tokens, hidden); `valid` (tokens,) bool."""
    engine = ReferenceEngine(weights, compute_dtype=np.float64, capacity=Capacity.from_dict(spec))
    engine.valid = valid
    h = x.astype(np.float64)
    for layer in range(engine.header.num_layers):
        h = h + engine.layer(layer, h)
    dropped = engine.dropped
    engine.close()
    return h, dropped


def test_the_c_runtime_drops_and_counts_pairs_as_the_reference(run_c, capacity_bundle, tmp_path):
    """11 of the 16 tokens valid: padding takes no capacity and its output rows are zero."""
    bundle, lib, name = capacity_bundle
    spec = SPECS[name]
    flags = {l["args"][-1]["value"] for l in manifest(bundle)["launch"] if l["symbol"] == "colibri_capacity"}
    assert flags == {FLAGS[name]}
    length = 11
    out = tmp_path / "y.f32"
    run = run_c(["dropped", bundle, out, length], kernels=lib)
    assert run.rc == 0 and run.result and run.result["passed"], run
    x, _ = Bundle.open(bundle).selftest()[:2]
    valid = np.arange(16) < length
    want, dropped = reference(Bundle.open(bundle).weights_path, np.asarray(x, np.float32)[0], valid, spec)
    assert dropped > 0 and run.result["dropped"] == dropped
    y = np.fromfile(out, dtype=np.float32).reshape(16, -1)
    np.testing.assert_allclose(y[valid], want[valid], rtol=1e-3, atol=1e-3)
    assert (y[~valid] == 0).all()
    assert len(run.calls("cuLaunchKernel")) == len(manifest(bundle)["launch"])
