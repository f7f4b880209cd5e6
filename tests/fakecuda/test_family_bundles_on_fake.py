"""Converted Qwen2-MoE and gpt-oss checkpoints, end to end: a real transformers checkpoint (tests/convert
fixtures), `colibri-sdk convert`, `colibri-sdk build --weights <v2 file>` (NVRTC, the v2 file copied as it is), then
the bundle run by the CUDA backend on the fake CUDA driver (the emulated kernels compiled for the bundle's
constants: shared expert and its gate, router and expert biases, the clamped SwiGLU) and by the CPU backend, both
equal to the reference engine within fp32 rounding; the bundle's own self-test passes on the fake driver. A CPU
run, not a GPU run."""

from __future__ import annotations

import shutil
import sys

import pytest
import yaml
from fakecuda_support import TESTS, orin_profile_data, run_bundle_on_fake

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver"),
    pytest.mark.slow,
]
sys.path.insert(0, str(TESTS / "convert"))
hf_models = pytest.importorskip("hf_models", reason="the converted checkpoints need torch and transformers")

TOKENS = 4


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_converted_family_bundle_runs_on_the_fake_driver_and_the_cpu(run_fake, tmp_path, family):
    from colibri_sdk import cli
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.runtime import Runtime
    from fakecuda_support import emulation_library
    from test_emulated_families import assert_close, reference_v2

    model = hf_models.make_family(family, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "m.colibri"
    assert hf_models.convert_cli(tmp_path / "ckpt", weights, "--dtype", "fp16") == 0
    (tmp_path / "board.yaml").write_text(yaml.safe_dump(orin_profile_data(TOKENS)))
    bundle = tmp_path / "bundle"
    assert cli.main(["build", "--profile", str(tmp_path / "board.yaml"), "--weights", str(weights), "-o",
                     str(bundle), "--quiet"]) == 0
    opened = Bundle.open(bundle)
    recorded = opened.manifest["weights"]["header"]
    if family == "qwen2_moe":
        assert recorded["num_shared_experts"] == 1 and recorded["shared_gate"] == 1
        assert "colibri_shared_down" in [launch["symbol"] for launch in opened.manifest["launch"]]
    else:
        assert recorded["expert_bias"] == 1 and recorded["activation"] == 1 and recorded["router_bias"] == 1
    assert recorded["version"] == 0x0200
    lib = emulation_library(opened.manifest["kernels"])
    x, y = run_bundle_on_fake(run_fake, bundle, lib, TOKENS, recorded["hidden_size"], seed=5)
    ref, _, stable, _ = reference_v2(weights, x)
    assert_close(y, ref, stable)
    with Runtime.load(bundle, backend="cpu") as rt:
        assert_close(rt.infer(x), ref, stable)
