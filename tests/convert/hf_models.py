"""Helpers for tests/convert: tiny transformers MoE models at random initialisation, saved as real checkpoints, and helpers to convert them.

The models are whole `*ForCausalLM` models (save_pretrained needs one) with small dimensions; the MoE block of
layer l is `model.model.layers[l].mlp` (transformers 5.x names it `mlp` for every family in memory).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the exactness tests need torch (the `test` extra)")
transformers = pytest.importorskip("transformers", reason="the exactness tests need transformers (the `test` extra)")

from colibri_sdk import cli  # noqa: E402

HIDDEN = 32
INTER = 48
EXPERTS = 16
LAYERS = 2
COMMON = dict(
    vocab_size=32,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    initializer_range=0.1,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def make_model(family: str, top_k: int = 2, *, norm_topk_prob: bool = False, experts: int = EXPERTS, seed: int = 0):
    """A random-init model of `family` ("mixtral" | "qwen3" | "olmoe" | "qwen2"), eval mode, float32."""
    t = transformers
    if family == "mixtral":
        config = t.MixtralConfig(intermediate_size=INTER, num_local_experts=experts, num_experts_per_tok=top_k, **COMMON)
        cls = t.MixtralForCausalLM
    elif family == "qwen3":
        config = t.Qwen3MoeConfig(
            moe_intermediate_size=INTER, intermediate_size=64, num_experts=experts, num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk_prob, head_dim=16, **COMMON,
        )
        cls = t.Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = t.OlmoeConfig(
            intermediate_size=INTER, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
            **COMMON,
        )
        cls = t.OlmoeForCausalLM
    elif family == "qwen2":
        config = t.Qwen2MoeConfig(
            moe_intermediate_size=INTER, intermediate_size=64, shared_expert_intermediate_size=INTER,
            num_experts=experts, num_experts_per_tok=top_k, **COMMON,
        )
        cls = t.Qwen2MoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return cls(config).eval()


def moe_block(model, layer: int):
    return model.model.layers[layer].mlp


def block_output(model, layer: int, x: np.ndarray) -> np.ndarray:
    """transformers' MoE block output for x (batch, tokens, hidden) float32."""
    with torch.no_grad():
        return moe_block(model, layer)(torch.from_numpy(x)).numpy()


def save_fused(model, folder: Path) -> Path:
    """Write the model in the fused expert layout (the in-memory state dict: experts.gate_up_proj/down_proj)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if ".layers." in k}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(str(folder / "config.json"))
    return folder


def convert_cli(folder: Path, out: Path, *extra: str) -> int:
    """Run `colibri-sdk convert folder -o out ...` in-process; return the exit code."""
    return cli.main(["convert", str(folder), "-o", str(out), "--quiet", *extra])


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| (normwise, so near-zero outputs do not blow it up)."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
