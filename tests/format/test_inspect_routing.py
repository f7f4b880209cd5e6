"""The routing facts `inspect` shows (`colibri_sdk.commands.inspect.routing_facts`) against the transformers routers
themselves: for each scheme, "renormalized" is whether the router's k weights (over routed_scaling_factor) sum to 1
(MixtralTopKRouter, Qwen3MoeTopKRouter with and without norm_topk_prob, Qwen2MoeTopKRouter, DeepseekV2TopkRouter,
DeepseekV3TopkRouter, GptOssTopKRouter). The format fields of the DeepSeek, Qwen2-MoE and gpt-oss blocks are the ones
tests/format/test_reference_families.py checks against the same blocks' outputs."""

from __future__ import annotations

import numpy as np
import pytest
from hf_blocks import deepseek_block, gpt_oss_block, qwen2_moe_block, randomise, torch, transformers

from colibri_sdk.commands.inspect import routing_facts


def _mixtral():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=64)
    block = MixtralSparseMoeBlock(config).eval()
    randomise(block, 0)
    return block.gate, dict(routing=0, top_k=2), 1.0


def _qwen3(norm: bool):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=norm, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    randomise(block, 1)
    # the converter's header: softmax then top-k, renormalised = softmax of the k logits (routing 0)
    return block.gate, (dict(routing=0, top_k=2) if norm else dict(routing=1, top_k=2)), 1.0


def _from_block(make):
    block, fields, _ = make()
    router = block.router if hasattr(block, "router") else block.gate
    return router, fields, float(fields.get("routed_scaling_factor", 1.0))


CASES = {
    "mixtral": _mixtral,
    "qwen3_norm": lambda: _qwen3(True),
    "qwen3_no_norm": lambda: _qwen3(False),
    "qwen2_moe": lambda: _from_block(lambda: qwen2_moe_block(seed=2)),
    "qwen2_moe_norm": lambda: _from_block(lambda: qwen2_moe_block(seed=2, norm_topk_prob=True)),
    "deepseek_v2": lambda: _from_block(lambda: deepseek_block(2, seed=3)),
    "deepseek_v3": lambda: _from_block(lambda: deepseek_block(3, seed=4, bias_std=0.1)),
    "gpt_oss": lambda: _from_block(lambda: gpt_oss_block(seed=5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_renormalized_is_what_the_transformers_router_does(case):
    router, fields, scaling = CASES[case]()
    hidden = router.weight.shape[1]
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((12, hidden)).astype(np.float32))
    with torch.no_grad():
        _, weights, _ = router(x)
    sums = weights.double().sum(dim=-1).numpy() / scaling
    renormalised_by_transformers = bool(np.allclose(sums, 1.0, atol=1e-5))
    facts = routing_facts(fields)
    assert facts["renormalized"] is renormalised_by_transformers, (sums, facts)
    assert facts["scaling"] == scaling
