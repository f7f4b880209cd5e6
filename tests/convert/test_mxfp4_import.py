"""gpt-oss MXFP4 experts: imported as int8 group-32 codes (2·FP4) with power-of-two scales, or dequantized to
float32; both bit-exact against transformers' own MXFP4 dequantization (`integrations/mxfp4.py`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_sdk.convert import mxfp4
from colibri_sdk.format import ColibriFile
from colibri_sdk.reference import ReferenceEngine
from hf_models import HIDDEN, convert_cli, family_output, make_family, rel_err, torch

convert_moe_packed_tensors = pytest.importorskip(
    "transformers.integrations.mxfp4", reason="the MXFP4 reference is transformers' integrations.mxfp4"
).convert_moe_packed_tensors
INTER = 64  # MXFP4 blocks need the reduction dimension in multiples of 32


def save_mxfp4(tmp_path, seed: int = 0, low: int = 118, high: int = 128):
    """A gpt-oss checkpoint whose experts are random MXFP4 blocks (scale bytes in low..high-1), and the model
    holding transformers' dequantization of them."""
    from safetensors.torch import load_file, save_file

    model = make_family("gpt_oss", seed=seed, intermediate_size=INTER)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    g = np.random.default_rng(seed)
    E, H, I = 8, HIDDEN, INTER
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{l}.mlp.experts."
            for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
                blocks = torch.from_numpy(g.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8))
                scales = torch.from_numpy(g.integers(low, high, (E, rows, cols // 32), dtype=np.uint8))
                del tensors[prefix + proj]
                tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = blocks, scales
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
    (folder / "config.json").write_text(json.dumps(config))
    return model, folder


def compare(model, path, tol=1e-5):
    engine = ReferenceEngine(path)
    x = np.random.default_rng(3).standard_normal((2, 12, HIDDEN)).astype(np.float32)
    for layer in range(3):
        expected = family_output(model, layer, x)
        assert rel_err(engine.layer(layer, x.reshape(-1, HIDDEN)).reshape(x.shape), expected) <= tol


@pytest.mark.parametrize("dtype,quant", [("auto", 1), ("fp32", 0)])
def test_mxfp4_is_exact(tmp_path, dtype, quant):
    model, folder = save_mxfp4(tmp_path)
    out = tmp_path / "m.colibri"
    assert convert_cli(folder, out, "--dtype", dtype) == 0
    with ColibriFile(out) as f:
        h = f.header
        assert (h.quant, h.group_size if quant else 0) == (quant, 32 if quant else 0)
        experts = model.model.layers[2].mlp.experts
        for e in (0, 7):
            gate_up = experts.gate_up_proj[e].detach().T.numpy()  # (2I, H), gate/up interleaved rows
            assert np.array_equal(f.weight("gate_proj", 2, e), gate_up[0::2])
            assert np.array_equal(f.weight("up_proj", 2, e), gate_up[1::2])
            assert np.array_equal(f.weight("down_proj", 2, e), experts.down_proj[e].detach().T.numpy())
    compare(model, out)


def test_mxfp4_scales_beyond_fp16_use_fp32_scales(tmp_path):
    model, folder = save_mxfp4(tmp_path, seed=1, low=95, high=130)
    assert convert_cli(folder, tmp_path / "m.colibri") == 0
    h = ColibriFile(tmp_path / "m.colibri").header
    assert (h.quant, h.dtype) == (1, 0)
    compare(model, tmp_path / "m.colibri")


def test_dequantize_matches_transformers_for_every_scale_byte():
    """All 255 finite E8M0 exponents and all 256 byte patterns; only 253/254 overflow float32 at |FP4| = 6, and
    transformers gives inf there too."""
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (255, 1, 1)).reshape(255, 16, 16)[:, :, :]
    blocks = blocks.reshape(255 * 16, 1, 16)
    scales = np.repeat(np.arange(255, dtype=np.uint8), 16).reshape(255 * 16, 1)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks[None]), torch.from_numpy(scales[None]), dtype=torch.float32)
    ref = ref[0].T.numpy()
    with np.errstate(over="ignore"):
        ours = mxfp4.dequantize(blocks, scales)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    codes, group_scales = mxfp4.to_int8(blocks, scales)
    with np.errstate(over="ignore"):
        product = codes.astype(np.float32) * np.repeat(group_scales, 32, axis=1)
    assert np.array_equal(product, ref)  # equal as numbers: -0.0 (nibble 8) becomes +0.0
