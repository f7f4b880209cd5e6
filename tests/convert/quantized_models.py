"""Helpers for tests/convert: pre-quantized checkpoints made with the quantization libraries themselves.

- compressed-tensors "pack-quantized": a transformers model saved with save_pretrained, every expert (and shared
  expert) Linear replaced by what the library's `PackedQuantizationCompressor.compress` writes (`weight_packed`,
  `weight_scale`, `weight_zero_point`, `weight_shape`), with qparams from the library's `calculate_qparams`, and the
  `quantization_config` llm-compressor writes into config.json.
- GGUF: tiny MoE files written with `gguf.GGUFWriter`, expert tensors quantized with `gguf.quants.quantize`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the quantized-checkpoint tests need torch (the `test` extra)")
ct = pytest.importorskip("compressed_tensors", reason="the pack-quantized tests need compressed-tensors (the `test` extra)")

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

QUANTIZED = re.compile(r"\.(experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)|shared_experts?\.(gate_proj|up_proj|down_proj))\.weight$")


QHIDDEN = 64
QINTER = 64
QEXPERTS = 8


def make_qmodel(family: str, seed: int = 0, top_k: int = 2):
    """A random-init float32 model ("qwen2": with a shared expert, "qwen3", "mixtral") whose matrices divide into
    groups of 64 (compressed-tensors needs whole groups)."""
    from hf_models import COMMON, transformers as t

    common = dict(COMMON, hidden_size=QHIDDEN)
    if family == "qwen2":
        config = t.Qwen2MoeConfig(moe_intermediate_size=QINTER, intermediate_size=64, shared_expert_intermediate_size=QINTER,
                                  num_experts=QEXPERTS, num_experts_per_tok=top_k, **common)
        cls = t.Qwen2MoeForCausalLM
    elif family == "qwen3":
        config = t.Qwen3MoeConfig(moe_intermediate_size=QINTER, intermediate_size=64, num_experts=QEXPERTS,
                                  num_experts_per_tok=top_k, head_dim=16, **common)
        cls = t.Qwen3MoeForCausalLM
    else:
        config = t.MixtralConfig(intermediate_size=QINTER, num_local_experts=QEXPERTS, num_experts_per_tok=top_k, **common)
        cls = t.MixtralForCausalLM
    torch.manual_seed(seed)
    return cls(config).eval()


def scheme(bits: int, group_size: int, symmetric: bool) -> QuantizationScheme:
    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size or None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def qparams(weight: torch.Tensor, s: QuantizationScheme, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    size = s.weights.group_size or cols
    w = weight.reshape(rows, cols // size, size)
    scale, zero = calculate_qparams(w.amin(dim=-1), w.amax(dim=-1), s.weights)
    return scale.to(scale_dtype), zero


def compress(weight: torch.Tensor, s: QuantizationScheme, scale_dtype) -> dict:
    """The tensors compressed-tensors stores for one Linear weight (rows, cols)."""
    scale, zero = qparams(weight.float(), s, scale_dtype)
    state = {"weight": weight.to(scale_dtype), "weight_scale": scale, "weight_zero_point": zero}
    return PackedQuantizationCompressor.compress(state, s)


def decompress(tensors: dict, prefix: str, s: QuantizationScheme) -> torch.Tensor:
    """The library's own dequantization of one stored Linear."""
    state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".weight_")}
    return PackedQuantizationCompressor.decompress(state, s)["weight"]


def save_pack_quantized(model, folder: Path, *, bits=4, group_size=32, symmetric=True, scale_dtype=torch.float32):
    """save_pretrained, then every expert Linear replaced by its pack-quantized form. Returns (tensors, scheme)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    s = scheme(bits, group_size, symmetric)
    out = {}
    for name, value in tensors.items():
        if QUANTIZED.search(name):
            base = name[: -len(".weight")]
            for key, t in compress(value, s, scale_dtype).items():
                out[f"{base}.{key}"] = t.contiguous()
        else:
            out[name] = value
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    weights = s.weights.model_dump(exclude_none=True)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return out, s


def load_dequantized(model, tensors: dict, s: QuantizationScheme) -> None:
    """Put the library's dequantized expert weights into the (float32) model, in its fused in-memory layout."""
    with torch.no_grad():
        for name in [n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")]:
            w = decompress(tensors, name, s).float()
            m = re.search(r"layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)$", name)
            if m:
                layer, block, expert, proj = int(m[1]), m[2], int(m[3]), m[4]
                experts = getattr(model.model.layers[layer], block).experts
                inter = experts.down_proj.shape[-1]
                if proj in ("gate_proj", "w1"):
                    experts.gate_up_proj[expert, :inter] = w
                elif proj in ("up_proj", "w3"):
                    experts.gate_up_proj[expert, inter:] = w
                else:
                    experts.down_proj[expert] = w
            else:
                module = model.get_submodule(name.removeprefix("model.").join(["model.", ""]) if not name.startswith("model.") else name)
                module.weight.copy_(w)
