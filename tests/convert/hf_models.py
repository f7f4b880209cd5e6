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


# ---- the families of .colibri v2 -----------------------------------------------------------------------------------
SMALL = dict(COMMON, num_hidden_layers=3)
# Each family: a transformers config (3 decoder layers, some dense) and the attribute of the MoE block per layer.
FAMILY_CONFIGS = {
    "qwen2_moe": lambda t, **kw: t.Qwen2MoeConfig(
        moe_intermediate_size=INTER, intermediate_size=64, shared_expert_intermediate_size=40, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], **{**SMALL, **kw}),
    "deepseek_v2": lambda t, **kw: t.DeepseekV2Config(**{**dict(
        moe_intermediate_size=INTER, intermediate_size=64, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **SMALL), **kw}),
    "deepseek_v3": lambda t, **kw: t.DeepseekV3Config(**{**dict(
        moe_intermediate_size=INTER, intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **SMALL), **kw}),
    "glm4_moe": lambda t, **kw: t.Glm4MoeConfig(**{**dict(
        moe_intermediate_size=INTER, intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
        head_dim=16, num_nextn_predict_layers=0, **SMALL), **kw}),
    "gpt_oss": lambda t, **kw: t.GptOssConfig(**{**dict(
        intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2, head_dim=16, **SMALL), **kw}),
    "granitemoe": lambda t, **kw: t.GraniteMoeConfig(**{**dict(
        intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2, residual_multiplier=0.5, **SMALL), **kw}),
}
MODEL_CLASSES = {
    "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
}


def make_family(family: str, seed: int = 0, **config):
    """A random-init model of a v2 family, eval mode, float32. Every parameter is redrawn N(0, 0.2) (so biases and
    DeepSeek's score-correction bias are non-zero and change the selection); gpt-oss's expert weights are scaled so
    that the SwiGLU clamp at ±7 is reached."""
    t = transformers
    model = getattr(t, MODEL_CLASSES[family])(FAMILY_CONFIGS[family](t, **config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".layers." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
        if family == "gpt_oss":
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(8.0)
    return model


def family_block(model, layer: int):
    """The MoE block of model layer `layer` (GraniteMoE: block_sparse_moe; others: mlp)."""
    decoder = model.model.layers[layer]
    return getattr(decoder, "block_sparse_moe", None) or decoder.mlp


def family_output(model, layer: int, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = family_block(model, layer)(torch.from_numpy(x))
    return (out[0] if isinstance(out, tuple) else out).numpy()
