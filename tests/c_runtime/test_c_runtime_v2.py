"""libcolibri loads and runs bundles of v2 weights (docs/c_runtime.md): the v2 header checked against the manifest,
the file size from the v2 block layout, the NaN/Inf scan of its float blocks only, and the launch plan with the
feature arguments (biases, shared experts and their scales); on the fake CUDA driver under AddressSanitizer +
UBSan, the output compared with the self-test output the reference engine wrote at build time."""

from __future__ import annotations

import pytest
from c_runtime_support import manifest
from c_runtime_support import build_bundle_for
from test_emulated_families import DEEPSEEK_V3, GPT_OSS, QWEN2, make_v2_model

pytestmark = pytest.mark.slow  # two bundle builds and emulated runs under the sanitizers

CASES = {
    # int8 g32 experts and shared experts, sigmoid + correction bias + groups + scaling, shared gate, expert biases,
    # clamped SwiGLU: the GEMV path
    "int8-every-feature-gemv": (dict(fields=dict(DEEPSEEK_V3, quant=1, group_size=32, shared_gate=1, expert_bias=1,
                                                 activation=1, swiglu_limit=0.7, swiglu_alpha=1.702, router_bias=1),
                                     experts=16, top_k=4, hidden=64, inter=40, seed=8), dict(shape={"batch": 1,
                                                                                                   "tokens": 4})),
    # fp16 Qwen2-MoE with gpt-oss's biases and clamp, 16 tokens x top-2 on the tiled tensor-core path
    "fp16-shared-biases-tiled": (dict(fields=dict(QWEN2, expert_bias=1, activation=1, swiglu_limit=0.7,
                                                  swiglu_alpha=1.702), hidden=48, inter=32, seed=1),
                                 dict(shape={"batch": 1, "tokens": 16}, kernels={"small_batch": {"max_pairs": 16}})),
}
assert GPT_OSS["activation"] == 1  # the clamp constants above are gpt-oss's activation with a reachable limit


@pytest.mark.parametrize("name", list(CASES))
def test_v2_bundle_runs_against_the_reference(run_c, tmp_path, name):
    from fakecuda_support import emulation_library

    model, profile = CASES[name]
    weights = make_v2_model(tmp_path / "model.colibri", **model)
    bundle = build_bundle_for("orin", tmp_path / "bundle", weights, **profile)
    m = manifest(bundle)
    assert m["weights"]["header"]["version"] == 0x0200
    run = run_c(["run", bundle, "calls=2"], kernels=emulation_library(m["kernels"]))
    assert run.rc == 0, run
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, run
    assert run.result["passed"] is True and run.result["launches"] == len(m["launch"]), run


def test_v2_bundle_whose_manifest_records_another_feature_is_refused(run_c, tmp_path):
    """A v2 header field that differs from the manifest's record is refused, naming the field."""
    from colibri_sdk.bundle.reader import DIGEST_KEY, canonical_json, manifest_digest

    model, profile = CASES["int8-every-feature-gemv"]
    weights = make_v2_model(tmp_path / "model.colibri", **model)
    bundle = build_bundle_for("orin", tmp_path / "bundle", weights, **profile)
    m = manifest(bundle)
    m["weights"]["header"]["norm_topk"] = 0  # a field that leaves the block layout as it is
    m.pop(DIGEST_KEY)
    m[DIGEST_KEY] = manifest_digest(m)
    (bundle / "manifest.json").write_bytes(canonical_json(m))
    run = run_c(["init", bundle, 2, "header norm_topk = 1, but the manifest's weights.header"])  # 2: BUNDLE
    assert run.rc == 0, run
