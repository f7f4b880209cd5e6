"""bench/runtime_cpu_llama.py's GGUF files (the CPU bench's llama.cpp peer), read back with gguf-py; llama.cpp itself
is not needed (nor installed in CI)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the llama.cpp peer's GGUF writer needs gguf (the `convert` extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import runtime_cpu_llama as peer  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype, low, high", [("Q4_0", -8, 7), ("Q8_0", -128, 127)])
def test_quant_blocks_match_gguf_dequantize(qtype, low, high):
    """Codes x block scales packed by quant_blocks dequantize, with gguf-py's own reader of the layout, exactly."""
    rng = np.random.default_rng(0)
    codes = rng.integers(low, high + 1, (2, 3, 96), dtype=np.int8)
    scales = (rng.random((2, 3, 3)) + 0.5).astype(np.float16)
    packed = peer.quant_blocks(codes, scales, qtype)
    assert packed.dtype == np.uint8 and packed.shape == (2, 3, 3 * gguf.GGML_QUANT_SIZES[Q[qtype]][1])
    want = codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=-1)
    np.testing.assert_array_equal(gguf.quants.dequantize(packed, Q[qtype]), want)


@pytest.mark.parametrize("shape, qtype", [("A", "Q4_0"), ("B", "Q8_0")])
def test_written_model_has_the_layer_llama_cpp_loads(tmp_path, shape, qtype):
    """The tiny-expert file of each shape: architecture, hyperparameters, and every tensor's type and shape (GGUF
    order: the row length first) as llama.cpp's load_arch_tensors asks for them."""
    H, _, E, k = peer.SHAPES[shape]
    I, D = peer.TINY_INTERMEDIATE, peer.HEAD_DIM
    arch = peer.ARCH[shape]
    reader = gguf.GGUFReader(str(peer.write_gguf(tmp_path / "m.gguf", shape, qtype, I)))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields["general.architecture"] == arch
    assert fields["tokenizer.ggml.model"] == "none"
    assert {key: fields[f"{arch}.{key}"] for key in ("embedding_length", "block_count", "expert_count",
                                                    "expert_used_count", "vocab_size", "attention.key_length",
                                                    "rope.dimension_count")} == {
        "embedding_length": H, "block_count": 1, "expert_count": E, "expert_used_count": k,
        "vocab_size": peer.VOCAB, "attention.key_length": D, "rope.dimension_count": D}
    assert fields[f"{arch}.expert_feed_forward_length"] == fields[f"{arch}.feed_forward_length"] == I
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape]) for t in reader.tensors}
    want = {
        "token_embd.weight": ("F32", [H, peer.VOCAB]), "output_norm.weight": ("F32", [H]),
        "blk.0.attn_norm.weight": ("F32", [H]), "blk.0.ffn_norm.weight": ("F32", [H]),
        "blk.0.attn_q.weight": ("Q8_0", [H, D]), "blk.0.attn_k.weight": ("Q8_0", [H, D]),
        "blk.0.attn_v.weight": ("Q8_0", [H, D]), "blk.0.attn_output.weight": ("Q8_0", [D, H]),
        "blk.0.ffn_gate_inp.weight": ("F32", [H, E]),
        "blk.0.ffn_gate_exps.weight": (qtype, [H, I, E]), "blk.0.ffn_up_exps.weight": (qtype, [H, I, E]),
        "blk.0.ffn_down_exps.weight": (qtype, [I, H, E]),
    }
    if arch == "qwen3moe":
        want |= {"blk.0.attn_q_norm.weight": ("F32", [D]), "blk.0.attn_k_norm.weight": ("F32", [D])}
    assert tensors == want
