"""`colibri-sdk build --top-k K`: recorded in the manifest, printed by inspect and run, refused out of range, and
the bundle routes to K experts (checked against the reference engine run with K on the source weights)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from colibri_sdk.bundle import Bundle
from colibri_sdk.bundle.top_k import MAX_TOP_K, check_top_k
from colibri_sdk.cli import main
from colibri_sdk.errors import ProfileError
from colibri_sdk.format import Header
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime import Runtime


@pytest.fixture(scope="module")
def top3(tmp_path_factory):
    out = tmp_path_factory.mktemp("topk") / "b3"
    # one of orin's two shapes (1 x 16): half the NVRTC compilations; the override is the same at every shape
    assert main(["build", "--profile", "orin", "--demo", "--batch", "1", "--top-k", "3", "-o", str(out)]) == 0
    return out


def test_override_recorded_and_printed(top3, capsys):
    m = Bundle.open(top3).manifest
    assert (m["weights"]["header"]["top_k"], m["weights"]["model_top_k"], m["profile"]["top_k"]) == (3, 2, 3)
    capsys.readouterr()
    assert main(["inspect", str(top3)]) == 0
    assert "  top-k          3 (override; the model's own k is 2)\n" in capsys.readouterr().out
    assert main(["run", str(top3), "--backend", "cpu", "--iters", "1"]) == 0
    assert "\ntop-k    3 (build override; the model's own k is 2)\n" in capsys.readouterr().out
    assert main(["run", str(top3), "--backend", "cpu", "--iters", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["top_k"], report["model_top_k"]) == (3, 2)
    assert main(["inspect", str(top3), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["top_k"] == {"bundle": 3, "model": 2} and info["capacity"] is None


def test_the_bundle_routes_to_k_experts(top3):
    """The oracle: the float64 reference engine on the same weights with its header's top_k set to 3 (the
    model's routing rule — topk_softmax: softmax over the 3 largest logits — applied to 3 experts)."""
    bundle = Bundle.open(top3)
    x = np.random.default_rng(0).standard_normal((1, 16, 256)).astype(np.float32)
    engine = ReferenceEngine(bundle.weights_path, compute_dtype=np.float64)
    assert engine.header.top_k == 3
    engine.header = dataclasses.replace(engine.header, top_k=2)
    own_k = engine(x)
    engine.header = dataclasses.replace(engine.header, top_k=3)
    expected = engine(x)
    engine.close()
    with Runtime.load(top3, backend="cpu") as rt:
        y = rt.infer(x)
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-3 * float(np.abs(expected).max()))
    assert np.abs(y - own_k).max() > 1e-2, "routing to 3 experts must change the output"


def test_refused_out_of_range(tmp_path, capsys):
    assert main(["build", "--profile", "orin", "--demo", "--top-k", "9", "-o", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "top_k = 9; allowed: 1..8 (the model's experts; the model has 8 experts and routes to 2)" in err
    assert "orin.yaml with --top-k 9: top_k = 9;" in err  # the flag, not the profile file, set the value
    big = Header(num_layers=1, num_experts=256, top_k=2, hidden_size=8, intermediate_size=8, dtype=0, routing=0,
                 composition=0)
    with pytest.raises(ProfileError) as info:
        check_top_k(MAX_TOP_K + 1, big, "p.yaml")
    assert str(info.value) == (f"p.yaml: top_k = {MAX_TOP_K + 1}; allowed: 1..{MAX_TOP_K} (the kernels' limit "
                               "MAX_TOP_K; the model has 256 experts and routes to 2)")
    assert not (tmp_path / "b").exists()
