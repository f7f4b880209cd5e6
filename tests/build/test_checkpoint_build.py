"""A bundle from a checkpoint that transformers itself saved: MixtralForCausalLM.save_pretrained → convert → build.
The bundle's self-test output is checked against transformers' own MoE blocks on the same input."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk import cli
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.bundle import Bundle
from colibri_sdk.profile import Profile, load_profile

torch = pytest.importorskip("torch", reason="the checkpoint test needs torch (the `test` extra)")
transformers = pytest.importorskip("transformers", reason="the checkpoint test needs transformers (the `test` extra)")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A random-init 2-layer MixtralForCausalLM (hidden 40, intermediate 72, 6 experts, top-2) saved by transformers."""
    config = transformers.MixtralConfig(
        vocab_size=32, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(3)
    model = transformers.MixtralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mixtral") / "ckpt"
    model.save_pretrained(folder)
    return model, folder


def transformers_reference(model, x: np.ndarray) -> np.ndarray:
    """x + moe_0(x), then + moe_1(...): the MoE blocks of the decoder layers composed on the residual stream."""
    state = torch.from_numpy(x.astype(np.float32))
    with torch.no_grad():
        for layer in model.model.layers:
            state = state + layer.mlp(state)
    return state.numpy()


def test_saved_checkpoint_to_bundle(mixtral, kernel_dir, tmp_path):
    from colibri_sdk.convert import convert

    model, folder = mixtral
    weights = tmp_path / "mixtral.colibri"
    convert(folder, weights, dtype="fp32", composition="residual", progress=False)
    data = load_profile("orin").to_dict()
    data["dtype"] = "fp32"
    profile = Profile.from_dict(data, "orin-fp32.yaml")
    result = build_bundle(profile, tmp_path / "bundle", weights, kernel_dir=kernel_dir)
    bundle = Bundle.open(result.path)
    header = bundle.manifest["weights"]["header"]
    assert (header["num_layers"], header["num_experts"], header["top_k"]) == (2, 6, 2)
    assert (header["hidden_size"], header["intermediate_size"], header["dtype"]) == (40, 72, 0)
    assert bundle.manifest["kernels"][0]["defines"]["COLI_HIDDEN"] == 40
    x, expected, rtol, atol = bundle.selftest()
    assert x.shape == (4, 16, 40)  # orin's largest shape (batch 4 x tokens 16)
    np.testing.assert_allclose(expected, transformers_reference(model, x), rtol=1e-4, atol=1e-5)
    assert cli.main(["verify", str(result.path), "--backend", "cpu"]) == 0


def test_saved_checkpoint_through_the_cli(mixtral, kernel_dir, tmp_path, capsys):
    _, folder = mixtral
    weights = tmp_path / "m.colibri"
    assert cli.main(["convert", str(folder), "-o", str(weights), "--dtype", "fp16", "--quiet"]) == 0
    out = tmp_path / "orin"
    assert cli.main(["build", "--profile", "orin", "--weights", str(weights), "-o", str(out)]) == 0
    assert "hidden 40, intermediate 72" in capsys.readouterr().out
    bundle = Bundle.open(out)
    assert bundle.dtype == "fp16" and bundle.open_weights().header.num_experts == 6
