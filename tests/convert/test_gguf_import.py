"""GGUF Q8_0 / Q4_0 MoE files (llama.cpp's layout) are imported as int8 / int4 group 32 without re-quantizing; the
file's dequantization is bit-exact against gguf-py's `gguf.quants.dequantize`, and the converted layers compute
the transformers block holding those dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.convert import convert
from colibri_sdk.errors import ConvertError
from colibri_sdk.format import ColibriFile
from colibri_sdk.reference import ReferenceEngine
from gguf_models import gguf, load_dequantized, write_gguf
from hf_models import LAYERS, block_output, convert_cli, rel_err
from quantized_models import QHIDDEN as HIDDEN
from quantized_models import make_qmodel


@pytest.mark.parametrize("family,qtype", [("qwen2", "Q8_0"), ("qwen2", "Q4_0"), ("mixtral", "Q4_0"), ("qwen3", "Q8_0")])
def test_gguf_is_imported_exactly(tmp_path, family, qtype):
    model = make_qmodel(family, seed=2)
    written = write_gguf(model, family, tmp_path / "m.gguf", qtype)
    out = tmp_path / "m.colibri"
    assert convert_cli(tmp_path / "m.gguf", out) == 0
    f = ColibriFile(out)
    h = f.header
    assert (h.quant, h.group_size, h.dtype) == ({"Q8_0": 1, "Q4_0": 2}[qtype], 32, 1)
    assert h.routing == (1 if family == "qwen2" else 0)
    for layer in range(LAYERS):
        for kind, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            data, kind_ = written[f"blk.{layer}.{name}.weight"]
            ref = gguf.quants.dequantize(data, kind_)
            for e in range(ref.shape[0]):
                assert np.array_equal(f.weight(kind, layer, e), ref[e]), (kind, layer, e)
        if family == "qwen2":
            data, kind_ = written[f"blk.{layer}.ffn_down_shexp.weight"]
            assert np.array_equal(f.weight("shared_down_proj", layer, 0), gguf.quants.dequantize(data, kind_))
    f.close()
    load_dequantized(model, family, written)
    if family == "qwen3":  # llama.cpp always renormalises Qwen3-MoE's top-k weights (src/models/qwen3moe.cpp)
        for layer in model.model.layers:
            layer.mlp.gate.norm_topk_prob = True
    engine = ReferenceEngine(out)
    x = np.random.default_rng(1).standard_normal((2, 12, HIDDEN)).astype(np.float32)
    for layer in range(LAYERS):
        expected = block_output(model, layer, x)
        assert rel_err(engine.layer(layer, x.reshape(-1, HIDDEN)).reshape(x.shape), expected) <= 1e-5


def test_gguf_to_fp32_dequantizes(tmp_path):
    model = make_qmodel("mixtral", seed=2)
    written = write_gguf(model, "mixtral", tmp_path / "m.gguf", "Q4_0")
    assert convert_cli(tmp_path / "m.gguf", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    data, kind = written["blk.1.ffn_down_exps.weight"]
    with ColibriFile(tmp_path / "m.colibri") as f:
        assert np.array_equal(f.tensor("down_proj", 1, 3), gguf.quants.dequantize(data, kind)[3])


def test_gguf_refusals(tmp_path):
    model = make_qmodel("qwen3", seed=2)
    write_gguf(model, "qwen3", tmp_path / "k.gguf", "Q4_1")
    with pytest.raises(ConvertError, match=r"^qwen3_moe: GGUF tensor 'blk\.0\.ffn_gate_exps\.weight' is Q4_1, which is not imported; allowed: F32, F16, BF16, Q8_0, Q4_0 \(re-quantize with llama-quantize"):
        convert(tmp_path / "k.gguf", tmp_path / "k.colibri", progress=False)
    w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"GGUF general\.architecture = 'llama' is not a supported MoE; allowed: llama, qwen3moe, qwen2moe, olmoe, deepseek2 \(llama with experts: Mixtral\)$"):
        convert(tmp_path / "d.gguf", tmp_path / "d.colibri", progress=False)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ConvertError, match=r"bad\.gguf: not a readable GGUF file"):
        convert(tmp_path / "bad.gguf", tmp_path / "b.colibri", progress=False)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_gguf_deepseek2(tmp_path, family):
    """llama.cpp's deepseek2: a leading dense layer, an ungated shared expert, softmax (V2) or sigmoid with the
    selection-only exp_probs_b (V3) routing, weights scaled by expert_weights_scale; one group (llama.cpp's own
    GGUF keys carry no n_group/topk_group here)."""
    from hf_models import HIDDEN as H, family_output, make_family

    groups = {} if family == "deepseek_v2" else dict(n_group=1, topk_group=1)
    model = make_family(family, seed=3, moe_intermediate_size=64, **groups)
    written = write_gguf(model, family, tmp_path / "d.gguf", "Q8_0")
    out = tmp_path / "d.colibri"
    assert convert_cli(tmp_path / "d.gguf", out) == 0
    with ColibriFile(out) as f:
        h = f.header
        assert f.layer_map == (1, 2)
        assert (h.routing, h.correction_bias, h.num_shared_experts) == ((1, 0, 1) if family == "deepseek_v2" else (2, 1, 1))
        data, kind = written["blk.2.ffn_down_shexp.weight"]
        assert np.array_equal(f.weight("shared_down_proj", 1, 0), gguf.quants.dequantize(data, kind))
    load_dequantized(model, family, written)
    engine = ReferenceEngine(out)
    x = np.random.default_rng(2).standard_normal((2, 12, H)).astype(np.float32)
    for file_layer, layer in enumerate((1, 2)):
        expected = family_output(model, layer, x)
        assert rel_err(engine.layer(file_layer, x.reshape(-1, H)).reshape(x.shape), expected) <= 1e-5


def test_gguf_one_tensor_per_expert_is_refused(tmp_path):
    """Old llama.cpp files (one blk.N.ffn_gate.E.weight per expert) are refused with what would work."""
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("expert_count", 2), ("expert_used_count", 1),
                       ("feed_forward_length", 32)):
        getattr(w, f"add_{key}")(value)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((2, 32), np.float32))
    for e in range(2):
        w.add_tensor(f"blk.0.ffn_gate.{e}.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"^mixtral: old\.gguf stores one tensor per expert \(an old GGUF layout\); re-convert it with a current llama\.cpp convert_hf_to_gguf\.py"):
        convert(tmp_path / "old.gguf", tmp_path / "old.colibri", progress=False)
