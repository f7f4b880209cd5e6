"""Pre-quantized checkpoints are imported without re-quantizing, and their dequantization is bit-exact against
each format's own library (compressed-tensors, gguf, transformers' MXFP4 code)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.convert import compressed
from colibri_sdk.format import ColibriFile
from colibri_sdk.reference import ReferenceEngine
from hf_models import LAYERS, block_output, convert_cli, rel_err
from quantized_models import QHIDDEN as HIDDEN
from quantized_models import decompress, load_dequantized, make_qmodel, save_pack_quantized, torch

EXPERT = "model.layers.1.mlp.experts.5.down_proj"


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, True), (4, 32, False), (8, 0, True), (8, 64, False)],
                         ids=["w4g32", "w4g32-asym", "w8-channel", "w8g64-asym"])
def test_pack_quantized_is_imported_exactly(tmp_path, bits, group_size, symmetric):
    model = make_qmodel("qwen2", seed=3)
    tensors, s = save_pack_quantized(model, tmp_path / "ckpt", bits=bits, group_size=group_size, symmetric=symmetric)
    out = tmp_path / "m.colibri"
    assert convert_cli(tmp_path / "ckpt", out) == 0
    f = ColibriFile(out)
    h = f.header
    assert (h.quant, h.group_size, h.zero_points) == ({4: 2, 8: 1}[bits], group_size, int(not symmetric))
    assert h.dtype == 0  # the library's fp32 scales are kept as they are (most are not exact in fp16)
    # Bit-exact against the library's own dequantization, for every routed and shared matrix.
    for file_layer in range(LAYERS):
        for e in (0, 5, 7):
            for kind, proj in (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")):
                ref = decompress(tensors, f"model.layers.{file_layer}.mlp.experts.{e}.{proj}", s).numpy()
                assert np.array_equal(f.weight(kind, file_layer, e), ref), (kind, file_layer, e)
        ref = decompress(tensors, f"model.layers.{file_layer}.mlp.shared_expert.down_proj", s).numpy()
        assert np.array_equal(f.weight("shared_down_proj", file_layer, 0), ref)
    f.close()
    # And the converted layers compute the transformers block holding the library's dequantized weights.
    load_dequantized(model, tensors, s)
    engine = ReferenceEngine(out)
    x = np.random.default_rng(1).standard_normal((2, 12, HIDDEN)).astype(np.float32)
    for layer in range(LAYERS):
        expected = block_output(model, layer, x)
        assert rel_err(engine.layer(layer, x.reshape(-1, HIDDEN)).reshape(x.shape), expected) <= 1e-5


def test_bf16_scales_match_the_library_bit_for_bit(tmp_path):
    """With bf16 scales the library dequantizes in bf16; the file's exact float32 product rounds to the same bits,
    and equals the library's dequantization with the scales widened to float32."""
    model = make_qmodel("qwen3", seed=4)
    tensors, s = save_pack_quantized(model, tmp_path / "ckpt", bits=4, group_size=32, scale_dtype=torch.bfloat16)
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri") == 0
    f = ColibriFile(tmp_path / "m.colibri")
    assert f.header.dtype == 1  # bf16 scales of these magnitudes are exact in fp16
    ours = f.weight("down_proj", 1, 5)
    native = decompress(tensors, EXPERT, s)
    assert native.dtype == torch.bfloat16
    assert torch.equal(torch.from_numpy(ours).to(torch.bfloat16), native)
    widened = {k: (v.float() if k.endswith("weight_scale") else v) for k, v in tensors.items()}
    assert np.array_equal(ours, decompress(widened, EXPERT, s).numpy())


def test_pack_quantized_to_fp32_dequantizes(tmp_path):
    model = make_qmodel("qwen3", seed=4)
    tensors, s = save_pack_quantized(model, tmp_path / "ckpt", bits=4, group_size=32)
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "fp32") == 0
    f = ColibriFile(tmp_path / "m.colibri")
    assert f.header.version == 0x0100  # float weights, nothing else of v2: a v1 file
    assert np.array_equal(f.tensor("down_proj", 1, 5), decompress(tensors, EXPERT, s).numpy())


def test_requantizing_is_refused(tmp_path, capsys):
    model = make_qmodel("qwen3", seed=4)
    save_pack_quantized(model, tmp_path / "ckpt", bits=4, group_size=32)
    assert convert_cli(tmp_path / "ckpt", tmp_path / "m.colibri", "--dtype", "int8") == 1
    assert (
        "qwen3_moe: the checkpoint's experts are already int4 g32; re-quantizing is refused; allowed: "
        "--dtype auto (kept as int4 g32), fp16 or fp32 (dequantized)"
    ) in capsys.readouterr().err


def test_unpacking_matches_the_library():
    """compressed.unpack_codes / unpack_zero_points / int4_rows against the library's pack_to_int32 and
    unpack_from_int32, odd column counts included."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    rng = np.random.default_rng(0)
    for bits in (4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
        for cols in (64, 70, 33):
            q = rng.integers(lo, hi, (6, cols)).astype(np.int8)
            packed = pack_to_int32(torch.from_numpy(q), bits).numpy()
            ref = unpack_from_int32(torch.from_numpy(packed), bits, torch.Size((6, cols))).numpy()
            assert np.array_equal(compressed.unpack_codes(packed, bits, cols), ref)
            zp = rng.integers(lo, hi, (13, 3)).astype(np.int8)
            pz = pack_to_int32(torch.from_numpy(zp), bits, packed_dim=0).numpy()
            assert np.array_equal(compressed.unpack_zero_points(pz, bits, 13), zp)
        from colibri_sdk.format import unpack_int4

        q = rng.integers(-8, 8, (5, 33)).astype(np.int8)
        rows = compressed.int4_rows(pack_to_int32(torch.from_numpy(q), 4).numpy(), 33)
        assert np.array_equal(unpack_int4(rows, 33), q)


@pytest.mark.parametrize("name,value,match", [
    ("weight_shape", np.array([64], np.int64), r"weight_shape' = \[64\]; expected \(rows, cols\)"),
    ("weight_shape", np.array([64, 96], np.int64), r"weight_packed' has shape \(64, 8\); expected \(64, 12\) for weight_shape \(64, 96\) at 4 bits"),
    ("weight_scale", np.ones((64, 3), np.float32), r"weight_scale' has shape \(64, 3\); expected \(64, 2\)"),
], ids=["shape-length", "shape-mismatch", "scale-shape"])
def test_malformed_pack_quantized_tensors(tmp_path, name, value, match):
    from safetensors.numpy import load_file, save_file

    from colibri_sdk.convert import convert
    from colibri_sdk.errors import ConvertError

    save_pack_quantized(make_qmodel("qwen3", seed=1), tmp_path / "ckpt", bits=4, group_size=32)
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(path))
    tensors[f"{EXPERT}.{name}"] = value
    save_file(tensors, str(path))
    with pytest.raises(ConvertError, match=match):
        convert(tmp_path / "ckpt", tmp_path / "m.colibri", progress=False)
    assert not (tmp_path / "m.colibri").exists()
