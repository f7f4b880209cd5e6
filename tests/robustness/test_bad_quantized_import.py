"""Hostile pre-quantized sources for `colibri-sdk convert`: compressed-tensors pack-quantized checkpoints and GGUF
Q8_0 / Q4_0 files, built here with NumPy, safetensors and gguf-py (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from colibri_sdk.convert import convert
from colibri_sdk.errors import ConvertError
from colibri_sdk.reference import ReferenceEngine
from mutation_support import mutation_outcomes

P = "model.layers.0.block_sparse_moe."
W1 = P + "experts.0.w1."
H, I, E = 64, 32, 2


def _pack4(codes: np.ndarray) -> np.ndarray:
    """int4 codes (rows, cols) → int32 (rows, cols/8), compressed-tensors `pack_to_int32` on a little-endian host."""
    u = (codes + 8).astype(np.uint8)
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4)).view("<i4")


def write_pack_quantized(folder: Path, *, weights: dict | None = None, edit=None) -> Path:
    """A Mixtral checkpoint (1 layer, 2 experts, hidden 64, intermediate 32) with W4A16 group-32 symmetric experts;
    `weights` overrides keys of the scheme's `weights`, `edit(tensors)` changes the tensors before saving."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    tensors = {P + "gate.weight": rng.standard_normal((E, H)).astype(np.float32)}
    for e in range(E):
        for name, (rows, cols) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            base = f"{P}experts.{e}.{name}."
            tensors[base + "weight_packed"] = _pack4(rng.integers(-8, 8, (rows, cols)))
            tensors[base + "weight_scale"] = (rng.random((rows, cols // 32)) * 0.01 + 0.001).astype(np.float32)
            tensors[base + "weight_shape"] = np.array([rows, cols], np.int64)
    if edit:
        edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, **(weights or {})}
    config = {
        "model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": E, "num_experts_per_tok": 1,
        "hidden_size": H, "intermediate_size": I,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                                              "input_activations": None}}},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_hand_made_pack_quantized_checkpoint_converts(tmp_path):
    report = convert(write_pack_quantized(tmp_path / "ckpt"), tmp_path / "m.colibri")
    assert report.storage == "int4 g32, fp32 scales" and report.imported == 6
    assert np.isfinite(ReferenceEngine(tmp_path / "m.colibri")(np.ones((2, H), np.float32))).all()


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"symmetric": "false"}, r"weights\.symmetric = 'false'; allowed: true or false \(JSON booleans\)"),
        ({"symmetric": None}, r"weights\.symmetric = None; allowed: true or false"),
        ({"group_size": True}, r"weights\.group_size = True; allowed: a positive integer"),
    ],
    ids=["symmetric-string", "symmetric-null", "group-size-bool"],
)
def test_scheme_values_of_the_wrong_json_type(tmp_path, weights, message):
    """bool("false") is True: a string would silently drop an asymmetric scheme's zero points."""
    folder = write_pack_quantized(tmp_path / "ckpt", weights=weights)
    with pytest.raises(ConvertError, match=r"^mixtral: config\.json quantization_config config_groups\.group_0\." + message):
        convert(folder, tmp_path / "m.colibri")
    assert not (tmp_path / "m.colibri").exists()


def _set_scale(value):
    def edit(tensors):
        tensors[W1 + "weight_scale"][0, 0] = value
    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_scale(np.nan), r"mixtral: scales of '.*experts\.0\.w1\.weight_packed' hold 1 non-finite values \(NaN or "
                             r"Inf\); allowed: finite scales"),
        (_set_scale(3e38), r"experts\.0\.w1\.weight_packed: \d+ weights dequantize to Inf in float32"),
        (lambda t: t.pop(W1 + "weight_scale"), r"mixtral: tensor '.*experts\.0\.w1\.weight_packed' has no "
                                               r".*experts\.0\.w1\.weight_scale; a pack-quantized Linear needs"),
    ],
    ids=["nan-scale", "scale-overflowing-float32", "no-scale"],
)
def test_bad_scales_are_named(tmp_path, edit, message):
    folder = write_pack_quantized(tmp_path / "ckpt", edit=edit)
    with pytest.raises(ConvertError, match=message):
        convert(folder, tmp_path / "m.colibri")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_failed_import_keeps_the_existing_output(tmp_path):
    out = tmp_path / "m.colibri"
    out.write_bytes(b"an older conversion")
    with pytest.raises(ConvertError):
        convert(write_pack_quantized(tmp_path / "ckpt", edit=_set_scale(np.nan)), out)
    assert out.read_bytes() == b"an older conversion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.colibri"]


# ---- GGUF --------------------------------------------------------------------------------------------------------
def write_gguf(path: Path, qtype: str = "Q8_0", *, norm=None) -> Path:
    """A qwen2moe GGUF file: 1 layer, 4 experts, top-2, hidden 64, intermediate 32, a gated shared expert."""
    gguf = pytest.importorskip("gguf", reason="the GGUF import needs gguf (the `convert` extra)")
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_expert_shared_feed_forward_length(32)
    if norm is not None:
        w.add_string("qwen2moe.expert_weights_norm", norm)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((4, 64)).astype(np.float32))
    for name, shape in (("ffn_gate_exps", (4, 32, 64)), ("ffn_up_exps", (4, 32, 64)), ("ffn_down_exps", (4, 64, 32)),
                        ("ffn_gate_shexp", (32, 64)), ("ffn_up_shexp", (32, 64)), ("ffn_down_shexp", (64, 32))):
        data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qt)
        w.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=qt)
    w.add_tensor("blk.0.ffn_gate_inp_shexp.weight", rng.standard_normal((64,)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_string_metadata_that_is_not_utf8(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = data.index(b"general.architecture") + len(b"general.architecture")
    value = key + 4 + 8  # u32 value type (STRING), u64 length, then the bytes of "qwen2moe"
    assert data[value : value + 8] == b"qwen2moe"
    data[value] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match=r"m\.gguf: GGUF metadata general\.architecture is unreadable "
                                           r"\(UnicodeDecodeError: .*\); allowed: a value of its GGUF type"):
        convert(path, tmp_path / "m.colibri")


def test_gguf_expert_weights_norm_as_a_string_is_refused(tmp_path):
    """bool("false") is True: a STRING where gguf-py writes a BOOL must not switch on renormalisation."""
    path = write_gguf(tmp_path / "m.gguf", norm="false")
    with pytest.raises(ConvertError, match=r"qwen2_moe: GGUF qwen2moe\.expert_weights_norm = 'false'; allowed: true or "
                                           r"false \(BOOL\)"):
        convert(path, tmp_path / "m.colibri")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_nan_block_scale_is_named(tmp_path, qtype):
    path = write_gguf(tmp_path / "m.gguf", qtype)
    import gguf

    reader = gguf.GGUFReader(str(path))
    offset = next(t.data_offset for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    del reader
    data = bytearray(path.read_bytes())
    data[offset : offset + 2] = np.array([np.nan], np.float16).tobytes()  # the first block's fp16 scale d
    path.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match=r"qwen2_moe: scales of '.*ffn_up_exps.* hold 1 non-finite values"):
        convert(path, tmp_path / "m.colibri")


def test_mutated_gguf_files_give_a_typed_error_or_a_finite_model(tmp_path):
    """Bit flips, byte edits and truncations of a Q4_0 GGUF file (fixed seed): each conversion either fails with a
    ColibriError or writes a file whose reference output is finite."""
    data = write_gguf(tmp_path / "source.gguf", "Q4_0").read_bytes()
    rng = np.random.default_rng(3)
    target, out = tmp_path / "m.gguf", tmp_path / "m.colibri"
    x = rng.standard_normal((3, 64)).astype(np.float32)

    def attempt(d: bytes):
        target.write_bytes(d)
        out.unlink(missing_ok=True)
        convert(target, out)
        return ReferenceEngine(out)(x)

    outcomes = mutation_outcomes(data, rng, 120, 1200, attempt)  # 1200: the metadata and tensor infos
    assert outcomes["refused"] > 0 and outcomes["finite"] > 0, outcomes


def test_a_source_named_like_the_outputs_temporary_file_is_not_truncated(tmp_path):
    source = write_gguf(tmp_path / "m.colibri.partial")
    before = source.read_bytes()
    with pytest.raises(ConvertError, match=r"output .*/m\.colibri's temporary file m\.colibri\.partial is the "
                                           r"checkpoint's own m\.colibri\.partial; refusing to overwrite the source"):
        convert(source, tmp_path / "m.colibri")
    assert source.read_bytes() == before


def test_layers_under_two_roots_are_refused_by_name(tmp_path):
    """A renamed tensor ('modeL.layers.0...') put a second root beside 'model.layers.N': it was a KeyError."""
    def rename(tensors):
        tensors["modeL.layers.0.block_sparse_moe.gate.weight"] = tensors.pop(P + "gate.weight")
    folder = write_pack_quantized(tmp_path / "ckpt", edit=rename)
    with pytest.raises(ConvertError, match=r"^mixtral: the checkpoint has decoder layers under 2 roots \('modeL\.layers\.N', "
                                           r"'model\.layers\.N'\); expected one"):
        convert(folder, tmp_path / "m.colibri")
