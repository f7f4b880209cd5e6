"""Helpers for tests/convert: tiny GGUF MoE files written with gguf-py (`GGUFWriter`, `gguf.quants.quantize`) from
transformers models, the way llama.cpp's convert_hf_to_gguf.py lays them out (3-D `blk.N.ffn_*_exps` tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF tests need gguf (the `convert` extra)")
torch = pytest.importorskip("torch", reason="the GGUF tests need torch (the `test` extra)")

from gguf import GGMLQuantizationType as Q  # noqa: E402

ARCH = {"mixtral": "llama", "qwen2": "qwen2moe", "qwen3": "qwen3moe", "olmoe": "olmoe", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2"}


def _np(t) -> np.ndarray:
    return t.detach().float().numpy().copy()


def write_gguf(model, family: str, path: Path, qtype: str = "Q8_0", *, extra: dict | None = None) -> dict:
    """Write the MoE part of `model` as a GGUF file; expert matrices in `qtype`, router and shared gate F32.
    Returns {tensor name: (data written, GGML type)}."""
    arch = ARCH[family]
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    moe = [l for l, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    experts = model.model.layers[moe[0]].mlp.experts
    E, twoI, H = experts.gate_up_proj.shape
    I = twoI // 2
    w.add_expert_count(E)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(I)
    w.add_feed_forward_length(getattr(c, "intermediate_size", I))
    if family == "qwen2":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if family.startswith("deepseek"):  # what convert_hf_to_gguf.py writes for DeepseekV2/V3
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(bool(c.norm_topk_prob) if family == "deepseek_v3" else False)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if family == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX)
    for key, value in (extra or {}).items():
        getattr(w, f"add_{key}")(value)
    qt = getattr(Q, qtype)
    written = {}

    def add(name, array, kind):
        data = gguf.quants.quantize(array, kind) if kind not in (Q.F32, Q.F16) else array.astype(
            np.float32 if kind == Q.F32 else np.float16)
        w.add_tensor(name, data, raw_dtype=kind)
        written[name] = (data, kind)

    for l, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if l not in moe:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                add(f"blk.{l}.{name}.weight", _np(getattr(mlp, proj).weight), Q.F32)
            continue
        gu, down = _np(mlp.experts.gate_up_proj), _np(mlp.experts.down_proj)
        add(f"blk.{l}.ffn_gate_inp.weight", _np(mlp.gate.weight), Q.F32)
        add(f"blk.{l}.ffn_gate_exps.weight", np.ascontiguousarray(gu[:, :I]), qt)
        add(f"blk.{l}.ffn_up_exps.weight", np.ascontiguousarray(gu[:, I:]), qt)
        add(f"blk.{l}.ffn_down_exps.weight", down, qt)
        if family == "qwen2":
            add(f"blk.{l}.ffn_gate_shexp.weight", _np(mlp.shared_expert.gate_proj.weight), qt)
            add(f"blk.{l}.ffn_up_shexp.weight", _np(mlp.shared_expert.up_proj.weight), qt)
            add(f"blk.{l}.ffn_down_shexp.weight", _np(mlp.shared_expert.down_proj.weight), qt)
            add(f"blk.{l}.ffn_gate_inp_shexp.weight", _np(mlp.shared_expert_gate.weight)[0], Q.F32)
        if family.startswith("deepseek"):
            for proj, name in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                add(f"blk.{l}.{name}.weight", _np(getattr(mlp.shared_experts, proj).weight), qt)
            if family == "deepseek_v3":
                add(f"blk.{l}.exp_probs_b.bias", _np(mlp.gate.e_score_correction_bias), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def load_dequantized(model, family: str, written: dict) -> None:
    """Put gguf-py's own dequantization of every written tensor into the model (its fused in-memory layout)."""
    def deq(name):
        data, kind = written[name]
        return torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))

    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            if not hasattr(mlp, "experts"):
                continue
            I = mlp.experts.down_proj.shape[-1]
            mlp.experts.gate_up_proj[:, :I] = deq(f"blk.{l}.ffn_gate_exps.weight")
            mlp.experts.gate_up_proj[:, I:] = deq(f"blk.{l}.ffn_up_exps.weight")
            mlp.experts.down_proj[:] = deq(f"blk.{l}.ffn_down_exps.weight")
            if family == "qwen2":
                mlp.shared_expert.gate_proj.weight[:] = deq(f"blk.{l}.ffn_gate_shexp.weight")
                mlp.shared_expert.up_proj.weight[:] = deq(f"blk.{l}.ffn_up_shexp.weight")
                mlp.shared_expert.down_proj.weight[:] = deq(f"blk.{l}.ffn_down_shexp.weight")
            if family.startswith("deepseek"):
                mlp.shared_experts.gate_proj.weight[:] = deq(f"blk.{l}.ffn_gate_shexp.weight")
                mlp.shared_experts.up_proj.weight[:] = deq(f"blk.{l}.ffn_up_shexp.weight")
                mlp.shared_experts.down_proj.weight[:] = deq(f"blk.{l}.ffn_down_shexp.weight")
