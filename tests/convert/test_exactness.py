"""Converted checkpoints compute what the transformers MoE blocks compute.

Each test builds a real transformers model at random initialisation (16 experts), saves it as a checkpoint,
converts it with `colibri-sdk convert`, and compares ReferenceEngine with the transformers MoE block
(`model.model.layers[l].mlp`) on random inputs: fp32 files within 1e-5, fp16 files within 2e-3 (max abs error over
max abs output).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from timeout_support import guard

from colibri_sdk.format import ColibriFile
from colibri_sdk.format.constants import ROUTING_SOFTMAX_TOPK, ROUTING_TOPK_SOFTMAX
from colibri_sdk.reference import ReferenceEngine
from hf_models import HIDDEN, LAYERS, block_output, convert_cli, make_model, rel_err, save_fused, torch

TOL = {"fp32": 1e-5, "fp16": 2e-3}
FAMILIES = [("mixtral", False), ("qwen3", True), ("qwen3", False), ("olmoe", False), ("olmoe", True)]


def inputs(seed: int = 7, batch: int = 2, tokens: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, HIDDEN)).astype(np.float32)


def compare(model, path, tol: float) -> list[float]:
    """Every layer of the file against the module's block on the same input; returns the errors per layer."""
    engine = ReferenceEngine(path)
    x = inputs()
    errors = []
    for layer in range(LAYERS):
        expected = block_output(model, layer, x)
        actual = engine.layer(layer, x.reshape(-1, HIDDEN)).reshape(x.shape)
        assert actual.dtype == np.float32
        errors.append(rel_err(actual, expected))
    engine.close()
    assert max(errors) <= tol, errors
    return errors


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("family,norm", FAMILIES, ids=[f"{f}-norm{int(n)}" for f, n in FAMILIES])
def test_per_expert_checkpoint_matches_transformers(tmp_path, family, norm, top_k, dtype):
    model = make_model(family, top_k, norm_topk_prob=norm, seed=top_k)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "model.colibri"
    assert convert_cli(tmp_path / "ckpt", out, "--dtype", dtype) == 0
    header = ColibriFile(out).header
    assert (header.num_experts, header.top_k, header.hidden_size) == (16, top_k, HIDDEN)
    renormalised = family == "mixtral" or norm
    assert header.routing == (ROUTING_TOPK_SOFTMAX if renormalised else ROUTING_SOFTMAX_TOPK)
    compare(model, out, TOL[dtype])


def test_fp16_file_is_exact_for_fp16_rounded_weights(tmp_path):
    """With the module's weights rounded to fp16 as the file stores them, only fp32 arithmetic differs."""
    model = make_model("qwen3", 2, norm_topk_prob=False, seed=11)
    model.save_pretrained(tmp_path / "ckpt")
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp16") == 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    compare(model, tmp_path / "m.colibri", 1e-5)


@pytest.mark.parametrize("family,norm", [("mixtral", False), ("qwen3", True), ("olmoe", False)])
def test_fused_layout_matches_transformers(tmp_path, family, norm):
    model = make_model(family, 2, norm_topk_prob=norm, seed=3)
    folder = save_fused(model, tmp_path / "fused")
    out = tmp_path / "fused.colibri"
    assert convert_cli(folder, out, "--dtype", "fp32") == 0
    compare(model, out, TOL["fp32"])
    # Same bytes as converting the per-expert checkpoint of the same model.
    model.save_pretrained(tmp_path / "per_expert")
    assert convert_cli(tmp_path / "per_expert", tmp_path / "per_expert.colibri", "--dtype", "fp32") == 0
    assert out.read_bytes() == (tmp_path / "per_expert.colibri").read_bytes()


def test_sharded_checkpoint(tmp_path):
    model = make_model("olmoe", 4, seed=5)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    compare(model, tmp_path / "m.colibri", TOL["fp32"])


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bf16_checkpoint(tmp_path, dtype):
    """A bf16 checkpoint converts exactly: bf16 → fp32 and (within fp16's range) bf16 → fp16 are lossless."""
    model = make_model("mixtral", 2, seed=9).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "np") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.0.w1.weight").get_dtype() == "BF16"
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", dtype) == 0
    compare(model.float(), tmp_path / "m.colibri", 1e-5)


def test_layers_compose_as_residual_stream(tmp_path, saved_mixtral):
    """The default composition: x_{l+1} = x_l + moe_l(x_l), the decoder's residual stream without attention."""
    folder, model = saved_mixtral
    assert convert_cli(folder, tmp_path / "m.colibri", "--dtype", "fp32") == 0
    x = inputs(seed=2)
    expected = x
    for layer in range(LAYERS):
        expected = expected + block_output(model, layer, expected)
    actual = ReferenceEngine(tmp_path / "m.colibri")(x)
    assert rel_err(actual, expected) <= 1e-5

    assert convert_cli(folder, tmp_path / "s.colibri", "--dtype", "fp32", "--composition", "sequential") == 0
    expected = block_output(model, 1, block_output(model, 0, x))
    assert rel_err(ReferenceEngine(tmp_path / "s.colibri")(x), expected) <= 1e-5


def test_expert_order_is_numeric(tmp_path, saved_mixtral):
    """experts.10 is expert 10, not the third name in lexicographic order (0, 1, 10, ...)."""
    from safetensors.numpy import load_file

    folder, _ = saved_mixtral
    assert convert_cli(folder, tmp_path / "m.colibri", "--dtype", "fp32") == 0
    source = load_file(str(folder / "model.safetensors"))
    f = ColibriFile(tmp_path / "m.colibri")
    for expert in (1, 2, 9, 10, 11, 15):
        w1 = source[f"model.layers.1.block_sparse_moe.experts.{expert}.w1.weight"]
        w3 = source[f"model.layers.1.block_sparse_moe.experts.{expert}.w3.weight"]
        w2 = source[f"model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"]
        np.testing.assert_array_equal(f.tensor("gate_proj", 1, expert), w1)
        np.testing.assert_array_equal(f.tensor("up_proj", 1, expert), w3)
        np.testing.assert_array_equal(f.tensor("down_proj", 1, expert), w2)
    np.testing.assert_array_equal(f.router(1), source["model.layers.1.block_sparse_moe.gate.weight"].T)
    f.close()


def test_cli_subprocess(tmp_path, saved_mixtral):
    """The installed entry point (`python -m colibri_sdk`), without torch in the converter's imports."""
    folder, _ = saved_mixtral
    out = tmp_path / "m.colibri"
    code = (
        "import sys; from colibri_sdk.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'convert imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "convert", str(folder), "-o", str(out), "--quiet"],
        capture_output=True, text=True, timeout=guard(600),
    )
    assert proc.returncode == 0, proc.stderr
    assert "mixtral (per-expert experts, F32 → float16)" in proc.stdout
    assert "2 layers × 16 experts, top-2, hidden 32, intermediate 48, routing topk_softmax" in proc.stdout
    assert out.stat().st_size == ColibriFile(out).header.file_size


def test_cli_verbose_lists_each_tensor_and_help_names_gguf(tmp_path, saved_mixtral):
    """`convert -v` prints debug lines (the family, then one line per tensor written); --help names both inputs."""
    folder, _ = saved_mixtral
    proc = subprocess.run(
        [sys.executable, "-m", "colibri_sdk", "convert", str(folder), "-o", str(tmp_path / "m.colibri"), "-v"],
        capture_output=True, text=True, timeout=guard(600),
    )
    assert proc.returncode == 0, proc.stderr
    assert "family mixtral" in proc.stderr
    assert "gate_proj layer 1 [15] <- " in proc.stderr
    usage = subprocess.run([sys.executable, "-m", "colibri_sdk", "convert", "--help"], capture_output=True,
                           text=True, timeout=guard(600)).stdout
    assert "HF_DIR|MODEL.gguf" in usage
