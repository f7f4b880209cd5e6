"""Helpers for tests/format: transformers MoE blocks at random initialisation, and their weights written as .colibri
v2 files, so the reference engine can be compared with the transformers code it claims to implement.

Each `*_block` returns (module, header fields, arrays) where arrays map format kinds to (layers=1, ...) NumPy
arrays taken from the module's parameters in the format's layouts (docs/format.md, v2 "Blocks").
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers comparisons need torch (the `test` extra)")
transformers = pytest.importorskip("transformers", reason="the transformers comparisons need transformers (the `test` extra)")


def randomise(module, seed: int, std: float = 0.2) -> None:
    """Fill every parameter (and float buffer) with N(0, std) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _np(t) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().copy()


def deepseek_config(version: int, **kw):
    cls = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    base = dict(
        hidden_size=32, moe_intermediate_size=16, intermediate_size=48, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, num_hidden_layers=1,
        num_attention_heads=4, vocab_size=64,
    )
    if version == 3:
        base.update(norm_topk_prob=True)
    else:
        base.update(topk_method="group_limited_greedy")
    base.update(kw)
    return cls(**base)


def _routed_and_shared(block, shared):
    """(experts E, intermediate I, arrays) of a block with fused experts (`experts.gate_up_proj` (E, 2I, H)
    gate-first, `experts.down_proj` (E, H, I)), a `gate` router and one shared SwiGLU expert module `shared`: the
    .colibri arrays of one layer (`write_arrays` kinds), each with its leading layer axis."""
    E, I = block.experts.gate_up_proj.shape[0], block.experts.gate_up_proj.shape[1] // 2
    gate_up = _np(block.experts.gate_up_proj)
    arrays = {
        "gate_proj": gate_up[None, :, :I], "up_proj": gate_up[None, :, I:], "down_proj": _np(block.experts.down_proj)[None],
        "router": _np(block.gate.weight).T[None],
        "shared_gate_proj": _np(shared.gate_proj.weight)[None, None],
        "shared_up_proj": _np(shared.up_proj.weight)[None, None],
        "shared_down_proj": _np(shared.down_proj.weight)[None, None],
    }
    return E, I, arrays


def deepseek_block(version: int, seed: int = 0, bias_std: float = 0.0, **kw):
    """DeepseekV3MoE / DeepseekV2Moe with random weights; `bias_std` > 0 randomises V3's correction bias."""
    config = deepseek_config(version, **kw)
    if version == 3:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block
    block = Block(config).eval()
    randomise(block, seed)
    E, I, arrays = _routed_and_shared(block, block.shared_experts)
    n_group = config.n_group if (version == 3 or config.topk_method == "group_limited_greedy") else 1
    fields = dict(
        num_experts=E, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size, intermediate_size=I,
        routing=2 if version == 3 else 1, norm_topk=int(bool(version == 3 and config.norm_topk_prob)),
        n_group=n_group, topk_group=config.topk_group if n_group > 1 else 1,
        group_score=(2 if version == 3 else 1) if n_group > 1 else 0,
        routed_scaling_factor=config.routed_scaling_factor,
        num_shared_experts=1, shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
    )
    if version == 3:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * bias_std)
        arrays["correction_bias"] = _np(block.gate.e_score_correction_bias)[None]
        fields["correction_bias"] = 1
    return block, fields, arrays


def qwen2_moe_block(seed: int = 0, norm_topk_prob: bool = False):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = transformers.Qwen2MoeConfig(
        hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=40, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, intermediate_size=48,
    )
    block = Qwen2MoeSparseMoeBlock(config).eval()
    randomise(block, seed)
    E, I, arrays = _routed_and_shared(block, block.shared_expert)
    arrays["shared_expert_gate"] = _np(block.shared_expert_gate.weight)[0][None]
    fields = dict(
        num_experts=E, top_k=2, hidden_size=32, intermediate_size=I, routing=1, norm_topk=int(norm_topk_prob),
        num_shared_experts=1, shared_intermediate_size=40, shared_gate=1,
    )
    return block, fields, arrays


def gpt_oss_block(seed: int = 0, std: float = 0.2):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=3, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
    )
    block = GptOssMLP(config).eval()
    randomise(block, seed, std)
    gate_up = _np(block.experts.gate_up_proj)  # (E, H, 2I), gate/up interleaved along the last axis
    bias = _np(block.experts.gate_up_proj_bias)  # (E, 2I)
    arrays = {
        "gate_proj": gate_up[:, :, 0::2].transpose(0, 2, 1)[None], "up_proj": gate_up[:, :, 1::2].transpose(0, 2, 1)[None],
        "down_proj": _np(block.experts.down_proj).transpose(0, 2, 1)[None],
        "router": _np(block.router.weight).T[None], "router_bias": _np(block.router.bias)[None],
        "gate_bias": bias[:, 0::2][None], "up_bias": bias[:, 1::2][None], "down_bias": _np(block.experts.down_proj_bias)[None],
    }
    fields = dict(
        num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, routing=0, router_bias=1, expert_bias=1,
        activation=1, swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha,
    )
    return block, fields, arrays


def run_block(block, x: np.ndarray) -> np.ndarray:
    """The transformers block's output for x (tokens, hidden) float32."""
    with torch.no_grad():
        out = block(torch.from_numpy(x)[None])
    out = out[0] if isinstance(out, tuple) else out
    return out[0].numpy()
