"""Defects found by attacking the SDK, each pinned: big-endian input, non-finite output, top-k above the kernels'
limit, a checkpoint with both a single file and an index, profile YAML errors and merge keys. (The integrated-GPU
upload failure is tests/fakecuda/test_upload_failure.py.)"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from colibri_sdk import catalog
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.convert import convert
from colibri_sdk.errors import CompileError, ConvertError, InputError, NonFiniteOutputError, ProfileError
from colibri_sdk.format import ColibriFile, Header, write_model
from colibri_sdk.profile import load_profile, packaged_dir
from colibri_sdk.runtime import Runtime
from robustness_helpers import CONFIG, PREFIX, cli_error, write_checkpoint

ORIN = (packaged_dir() / "orin.yaml").read_text()


def _model(path, layers=2, experts=4, top_k=2, hidden=32, inter=32, seed=3, composition=1):
    h = Header(num_layers=layers, num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
               dtype=0, composition=composition)
    rng = np.random.default_rng(seed)
    L, E, H, I = layers, experts, hidden, inter
    return write_model(path, h, rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                       rng.standard_normal((L, E, I, H)) / np.sqrt(H), rng.standard_normal((L, E, H, I)) / np.sqrt(I),
                       rng.standard_normal((L, H, E)))


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A 2-layer residual fp32 model (hidden 32) built for orin: batch 1 x tokens 16."""
    root = tmp_path_factory.mktemp("two_layers")
    return build_bundle(load_profile("orin"), root / "bundle", _model(root / "m.colibri")).path


@pytest.fixture(scope="module")
def runtime(two_layers):
    with Runtime.load(two_layers, backend="cpu") as rt:
        yield rt


def _x(tokens=16, seed=0):
    return np.random.default_rng(seed).standard_normal((1, tokens, 32)).astype(np.float32)


# ---- byte order -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [">f4", ">f2", "<f2"])
def test_other_byte_orders_are_converted(runtime, dtype):
    x = _x().astype(np.float16).astype(np.float32)  # exactly representable in float16 too
    native = runtime.infer(x)
    other = x.astype(dtype)
    assert other.dtype.str == dtype
    y = runtime.infer(other)
    assert y.dtype == np.float32 and y.dtype.isnative
    np.testing.assert_array_equal(y, native)


def test_big_endian_float64_still_names_the_dtype(runtime):
    with pytest.raises(InputError, match=r"^input dtype >f8; allowed: float32, float16 \(little- or big-endian\)$"):
        runtime.infer(_x().astype(">f8"))


# ---- non-finite outputs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("scale", "layer"),
    # SwiGLU squares its input's scale: 1e30 → ~1e60 overflows float32 in layer 0; 1e10 → ~1e20 after layer 0
    # (finite), ~1e40 after layer 1.
    [(1e30, 0), (1e10, 1)],
)
def test_non_finite_output_names_the_first_layer(runtime, scale, layer):
    x = _x()
    x[0, 5] *= np.float32(scale)
    with pytest.raises(NonFiniteOutputError) as info:
        runtime.infer(x)
    assert info.value.layer == layer and info.value.position == (0, 5) and info.value.count == 1
    match = re.fullmatch(
        rf"the output is non-finite \(NaN or Inf\) at 1 valid position, first at \(batch 0, token 5\), from a finite "
        rf"input: layer {layer} is the first whose output is non-finite \(the largest \|value\| of its input is "
        rf"(\S+?)(, the call's (\S+))?; float32's largest value is 3\.4e38\)", str(info.value))
    assert match, str(info.value)
    call = float(np.abs(x[0, 5]).max())
    if layer == 0:  # the call's input is the layer's
        assert match[2] is None and float(match[1]) == pytest.approx(call, rel=1e-2)
    else:  # the layer's input (after layer 0's SwiGLU squared the scale) is named, then the call's
        assert float(match[3]) == pytest.approx(call, rel=1e-2) and float(match[1]) > 1e3 * call


@pytest.mark.parametrize("scale, blamed", [(1.0, True), (1e8, False)])
def test_a_backend_result_the_reference_cannot_reproduce_is_explained_by_scale(runtime, scale, blamed):
    """A non-finite output at a token whose rerun alone is finite: with values near float32's limit on the way
    (1e8 gives about 1e32 by the second layer) another summation order can overflow, so the input's scale is named,
    not the backend (the message had blamed the backend whenever the rerun was finite)."""
    from colibri_sdk.runtime.checks import nonfinite_output

    x = _x()
    x[0, 5] *= np.float32(scale)
    out = np.zeros_like(x)
    out[0, 5, 3] = np.nan  # as a backend whose sums overflowed in another order would give
    error = nonfinite_output(runtime.bundle, "cpu", x, out)
    assert error.layer is None and error.position == (0, 5)
    if blamed:
        assert str(error).endswith("the CPU reference engine gives finite values for that token, so the cpu "
                                   "backend's result is wrong"), str(error)
    else:
        assert re.search(r"finite values for that token run alone, but values up to \S+ on the way, near float32's "
                         r"largest \(3\.4e38\).* the input's scale is the likely cause$", str(error)), str(error)


def test_inputs_of_1e19_are_reported_never_silent(runtime, two_layers, tmp_path, capsys):
    """The field report: finite inputs of 1e19 gave all-NaN output without an error."""
    x = np.full((1, 16, 32), 1e19, np.float32)
    with pytest.raises(NonFiniteOutputError, match=r"at 16 valid positions, first at \(batch 0, token 0\)"):
        runtime.infer(x)
    np.save(tmp_path / "big.npy", x)
    err = cli_error(capsys, "run", str(two_layers), "--backend", "cpu", "--iters", "1", "--input",
                    str(tmp_path / "big.npy"))
    assert "the output is non-finite (NaN or Inf) at 16 valid positions" in err


def test_padding_never_raises(runtime):
    """NaN past a sequence's length is ignored (and zero in the output), so it cannot be reported."""
    x = _x()
    x[0, 10:] = np.nan
    y = runtime.infer(x, input_lengths=[10])
    assert np.isfinite(y).all() and not y[0, 10:].any()


# ---- top-k above the kernels' limit ---------------------------------------------------------------------------------
def test_max_top_k_is_the_kernels_limit():
    """The constant and the kernels' compile-time check name the same limit."""
    text = (catalog.kernel_dir() / "common.cuh").read_text()
    # Either the kernels state the limit as a literal, or they take it from the catalogue (COLI_MAX_TOP_K).
    assert re.search(rf"K_ <= {catalog.MAX_TOP_K}\b", text) or "COLI_MAX_TOP_K" in text, \
        "kernels/common.cuh and catalog.MAX_TOP_K disagree"


def test_build_refuses_top_k_above_the_limit_before_compiling(tmp_path, monkeypatch):
    import colibri_sdk.bundle.writer as writer

    k = catalog.MAX_TOP_K + 1
    weights = _model(tmp_path / "m.colibri", layers=1, experts=k + 1, top_k=k)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although top_k is above MAX_TOP_K")

    monkeypatch.setattr(writer, "compile_catalog", no_compile)
    with pytest.raises(CompileError, match=rf"m\.colibri: top_k = {k}; allowed: 1\.\.{catalog.MAX_TOP_K} \(MAX_TOP_K, "):
        build_bundle(load_profile("orin"), tmp_path / "out", weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.colibri"]


def _checkpoint(folder, experts, top_k):
    from safetensors.numpy import save_file

    folder.mkdir()
    config = {**CONFIG, "num_local_experts": experts, "num_experts_per_tok": top_k}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {PREFIX + "gate.weight": rng.standard_normal((experts, 4)).astype(np.float32)}
    for e in range(experts):
        for name, shape in (("w1", (8, 4)), ("w3", (8, 4)), ("w2", (4, 8))):
            tensors[f"{PREFIX}experts.{e}.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_convert_refuses_top_k_above_the_limit(tmp_path, capsys):
    k = catalog.MAX_TOP_K + 1
    folder = _checkpoint(tmp_path / "ckpt", experts=k + 1, top_k=k)
    err = cli_error(capsys, "convert", str(folder), "-o", str(tmp_path / "m.colibri"))
    assert err.endswith(f"config.json num_experts_per_tok = {k}; allowed: 1..{catalog.MAX_TOP_K} (MAX_TOP_K, the "
                        "most experts per token the kernels are compiled for)")
    assert not (tmp_path / "m.colibri").exists()
    at_limit = _checkpoint(tmp_path / "ok", experts=k, top_k=k - 1)
    assert convert(at_limit, tmp_path / "ok.colibri", dtype="fp32").header.top_k == catalog.MAX_TOP_K


# ---- model.safetensors next to an index -----------------------------------------------------------------------------
def test_single_file_wins_over_an_index_as_in_transformers(tmp_path, caplog):
    """transformers' from_pretrained tries model.safetensors before the index for a local folder (modeling_utils
    `_get_resolved_checkpoint_files`). The index here points at a shard with other values: the converter must read
    the single file, and say that both exist."""
    from safetensors.numpy import load_file, save_file

    folder = write_checkpoint(tmp_path / "ckpt")
    single = load_file(str(folder / "model.safetensors"))
    shard = {name: -2 * value for name, value in single.items()}
    save_file(shard, str(folder / "model-00001-of-00001.safetensors"))
    index = {"weight_map": {name: "model-00001-of-00001.safetensors" for name in shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="colibri_sdk"):
        report = convert(folder, tmp_path / "m.colibri", dtype="fp32")
    with ColibriFile(report.path) as f:
        np.testing.assert_array_equal(f.router(0), single[PREFIX + "gate.weight"].T)
    assert any("both model.safetensors and model.safetensors.index.json exist; reading model.safetensors"
               in record.getMessage() for record in caplog.records), caplog.text


# ---- profile YAML ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "where", "message"),
    [  # orin.yaml: line 11 is "  sm_count: 16", line 16 is "dtype: fp16"
        (("sm_count: 16", "sm_count: [16"), "12:26",
         "not valid YAML: while parsing a flow sequence; expected ',' or ']', but got ':'"),
        (("dtype: fp16", "dtype: fp16\n\tx: 1"), "17:1",
         "not valid YAML: while scanning for the next token; found character '\\t' that cannot start any token"),
        (("dtype: fp16", "dtype: *nowhere"), "16:8", "not valid YAML: found undefined alias 'nowhere'"),
        (("dtype: fp16", "dtype: fp16\ndtype: fp32"), "17:1",
         "duplicate key 'dtype' at line 17 (first at line 16); allowed: each key once"),
    ],
    ids=["unclosed-list", "tab", "undefined-alias", "duplicate"],
)
def test_yaml_errors_are_one_line_with_file_line_column(tmp_path, capsys, edit, where, message):
    lines = ORIN.splitlines()
    assert lines[10] == "  sm_count: 16" and lines[15] == "dtype: fp16"
    path = tmp_path / "board.yaml"
    path.write_text(ORIN.replace(*edit, 1))
    err = cli_error(capsys, "build", "--profile", str(path), "--demo", "-o", str(tmp_path / "out"))
    assert err == f"colibri-sdk build: error: {path}:{where}: {message}"


def test_merge_keys_are_supported(tmp_path):
    """`<<: *anchor` (YAML merge keys) gives the same profile as writing the keys out; a key written in the
    mapping itself overrides the merged one."""
    old = "  gate_up:\n    threads: 256\n    block_n: 64\n    block_k: 32\n  down:\n    threads: 256\n    block_n: 64\n"
    new = "  gate_up: &tile\n    threads: 256\n    block_n: 64\n    block_k: 32\n  down:\n    <<: *tile\n    block_n: 128\n"
    assert old in ORIN
    path = tmp_path / "board.yaml"
    path.write_text(ORIN.replace(old, new, 1).replace("    block_k: 32\n  small_batch:", "  small_batch:", 1))
    expected = load_profile("orin", toolchain=False).to_dict()
    expected["kernels"]["down"] = {"threads": 256, "block_n": 128, "block_k": 32}
    assert load_profile(path, toolchain=False).to_dict() == expected


def test_merge_key_of_a_scalar_is_one_line(tmp_path):
    path = tmp_path / "board.yaml"
    path.write_text(ORIN.replace("hardware:\n", "hardware:\n  <<: 5\n", 1))
    with pytest.raises(ProfileError) as info:
        load_profile(path, toolchain=False)
    assert "\n" not in str(info.value)
    assert re.search(r"board\.yaml:\d+:\d+: not valid YAML: while constructing a mapping; expected a mapping or list "
                     r"of mappings for merging, but found scalar$", str(info.value)), str(info.value)


def test_a_self_test_with_non_finite_output_is_a_failed_result(two_layers, tmp_path):
    """The self-test input scaled to 1e30 (and the manifest rehashed): the result is returned as failed, with
    infinite errors, as for any other mismatch."""
    import shutil

    from robustness_helpers import load_manifest, save_manifest

    bundle = Path(shutil.copytree(two_layers, tmp_path / "bundle"))
    path = bundle / "selftest" / "input.npy"
    np.save(path, np.load(path) * np.float32(1e30))
    save_manifest(bundle, load_manifest(bundle), rehash=("selftest/input.npy",))
    with Runtime.load(bundle, backend="cpu") as rt:
        result = rt.self_test()
    assert not result.passed and result.max_abs_err == float("inf")
    assert str(result).startswith("self-test FAILED on cpu: max abs err inf")
