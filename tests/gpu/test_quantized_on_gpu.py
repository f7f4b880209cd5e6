"""int8 / int4 expert weights on this GPU, GEMV and tiled tensor-core paths (kernels/small_batch.cu with COLI_QUANT,
kernels/expert_quant_tc.cu), against the float64 reference engine's exact dequantization, with poisoned buffers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_sdk.bundle import Bundle

from gpu_support import build, profile_for_this_gpu, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from test_emulated_quant import make_quant_model  # noqa: E402

pytestmark = pytest.mark.gpu

# name: (model kwargs, profile overrides); tokens*top_k above small_batch.max_pairs takes the tiled path
CASES = {
    "t4-int4-g128-gemv": (dict(quant="int4", group=128, hidden=256, inter=512), dict(tokens=4, max_pairs=128)),
    "t64-int4-g32-zeros-tiled": (dict(quant="int4", group=32, zeros=True, experts=16, top_k=4, hidden=256,
                                      inter=192, layers=2), dict(tokens=64, max_pairs=128)),
    "t64-int8-per-row-fp32-tiled-odd": (dict(quant="int8", group=0, scales="fp32", experts=8, top_k=2, hidden=100,
                                             inter=75), dict(tokens=64, max_pairs=64)),
    "t48-int4-g64-fp16-tiled-atomic": (dict(quant="int4", group=64, experts=3, top_k=3, hidden=128, inter=96),
                                       dict(tokens=48, max_pairs=32, aggregation="atomic")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_bundle_matches_reference(tmp_path, name):
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    model_kwargs, p = CASES[name]
    weights = make_quant_model(tmp_path / "model.colibri", seed=len(name), **model_kwargs)
    profile = profile_for_this_gpu(shape={"batch": 1, "tokens": p["tokens"]},
                                   aggregation=p.get("aggregation", "ordered"),
                                   kernels={"small_batch": {"max_pairs": p["max_pairs"]}})
    bundle = Bundle.open(build(profile, weights, tmp_path / "bundle"))
    tiled = p["tokens"] * model_kwargs.get("top_k", 2) > p["max_pairs"]
    symbols = {launch["symbol"] for launch in bundle.manifest["launch"]}
    assert ("colibri_gate_up_qtc" in symbols) == tiled
    rng = np.random.default_rng(len(name))
    with CudaBackend(bundle) as backend:
        for trial in range(3):
            x = rng.standard_normal((1, p["tokens"], backend.hidden)).astype(np.float32)
            backend.poison()
            y = backend.infer_padded(x)
            expected, stable = reference(weights, x)
            assert stable.mean() >= 0.5 and np.isfinite(y).all(), f"{name} trial {trial}"
            scale = np.abs(expected).max(axis=-1, keepdims=True)
            err = (np.abs(y - expected) / scale)[stable]
            assert err.max() <= 1e-3, f"{name} trial {trial}: max relative error {err.max():.3g}"
