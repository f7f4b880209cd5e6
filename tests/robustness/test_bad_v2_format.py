"""Hostile .colibri v2 files and careless calls to the v2 reader, writer, quantizer and reference engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from timeout_support import guard
from colibri_sdk.errors import FormatError, InputError
from colibri_sdk.format import (
    ColibriFile,
    ColibriWriter,
    Header,
    HeaderV2,
    QuantizedTensor,
    dequantize,
    quantize_rtn,
    write_model,
)
from colibri_sdk.reference import ReferenceEngine
from mutation_support import mutation_outcomes

# Every optional block of a v2 file: int4 with zero points and a partial last group (hidden 40, group 32), sigmoid
# group-limited routing with a correction bias, a gated shared expert, two layers out of five model layers.
INT4 = dict(num_layers=2, num_experts=4, top_k=2, hidden_size=40, intermediate_size=33, dtype=1, routing=2, quant=2,
            group_size=32, zero_points=1, norm_topk=1, n_group=2, topk_group=1, group_score=2, correction_bias=1,
            num_shared_experts=1, shared_intermediate_size=7, shared_gate=1, layer_map=(1, 3), num_model_layers=5,
            routed_scaling_factor=2.5)
# fp16 float experts with router and expert biases and gpt-oss's clamped SwiGLU.
FLOAT = dict(num_layers=1, num_experts=3, top_k=2, hidden_size=9, intermediate_size=5, dtype=1, routing=1,
             router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0, swiglu_alpha=1.702)


def write_v2(path, fields: dict, seed: int = 0, scale: float = 0.3):
    h = HeaderV2(**fields)
    rng = np.random.default_rng(seed)
    with ColibriWriter(path, h) as w:
        for kind, layer, index in w.pending():
            w.write(kind, layer, index, rng.standard_normal(h.shape(kind)).astype(np.float32) * scale)
    return h


def plant(path, header: HeaderV2, block: str, value: float) -> None:
    """Overwrite the first element of `block` (layer 0, first tensor) with `value` in the block's dtype."""
    b = header.block(block)
    data = bytearray(path.read_bytes())
    raw = np.array([value], dtype=b.dtype).tobytes()
    data[b.offset : b.offset + len(raw)] = raw
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("fields", "block"),
    [
        (INT4, "router"),
        (INT4, "gate_proj.scales"),
        (INT4, "down_proj.scales"),
        (INT4, "correction_bias"),
        (INT4, "shared_up_proj.scales"),
        (INT4, "shared_expert_gate"),
        (FLOAT, "router"),
        (FLOAT, "router_bias"),
        (FLOAT, "gate_proj"),
        (FLOAT, "up_bias"),
        (FLOAT, "down_bias"),
    ],
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_value_in_a_block_is_named_not_computed(tmp_path, fields, block, value):
    path = tmp_path / "m.colibri"
    h = write_v2(path, fields)
    plant(path, h, block, value)
    tensor = block.split(".")[0]
    x = np.random.default_rng(1).standard_normal((64, h.hidden_size)).astype(np.float32)
    with pytest.raises(FormatError, match=rf"m\.colibri: {tensor} \(layer 0(, expert 0)?\) holds (1|32) non-finite values? "
                                          rf"\(NaN or Inf\)( once dequantized)?; allowed: finite values"):
        ReferenceEngine(path)(x)


def test_finite_weights_that_overflow_float32_raise_instead_of_returning_inf(tmp_path):
    h = Header(num_layers=1, num_experts=2, top_k=1, hidden_size=4, intermediate_size=8)
    big = np.full((1, 2, 8, 4), 1e30, np.float32)
    path = write_model(tmp_path / "m.colibri", h, big, big, np.full((1, 2, 4, 8), 1e30, np.float32),
                       np.ones((1, 4, 2), np.float32))
    with pytest.raises(InputError, match=r"layer 0: the output overflows float32 on 1 token \(finite input and "
                                         r"weights, non-finite result\)"):
        ReferenceEngine(path)(np.ones((1, 4), np.float32))


@pytest.mark.parametrize("fields", [INT4, FLOAT], ids=["int4-zero-points-shared", "float-biases-clamped"])
def test_mutated_files_give_a_typed_error_or_a_finite_answer(tmp_path, fields):
    """Bit flips, header byte edits, truncations and 4-byte overwrites (fixed seed): the reader and the reference
    engine either refuse the file with a ColibriError or compute a finite output."""
    source = tmp_path / "m.colibri"
    h = write_v2(source, fields)
    data = source.read_bytes()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, h.hidden_size)).astype(np.float32)
    target = tmp_path / "mutated.colibri"

    def attempt(d: bytes):
        target.write_bytes(d)
        with ColibriFile(target) as f:
            return ReferenceEngine(f)(x)

    outcomes = mutation_outcomes(data, rng, 250, 64, attempt, overwrite=True)  # 64: the header
    assert outcomes["refused"] > 0 and outcomes["finite"] > 0, outcomes


def test_a_symlinked_partial_file_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    (tmp_path / "m.colibri.partial").symlink_to(victim)
    with pytest.raises(FormatError, match=r"m\.colibri\.partial: it exists and is a symbolic link \(to .*notes\.txt\)"):
        ColibriWriter(tmp_path / "m.colibri", Header(1, 2, 1, 4, 8))
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "m.colibri").exists()


def test_a_stale_regular_partial_file_is_replaced(tmp_path):
    (tmp_path / "m.colibri.partial").write_bytes(b"left over from an interrupted run")
    h = Header(1, 2, 1, 4, 8)
    write_model(tmp_path / "m.colibri", h, np.zeros((1, 2, 8, 4)), np.zeros((1, 2, 8, 4)), np.zeros((1, 2, 4, 8)),
                np.zeros((1, 4, 2)))
    assert ColibriFile(tmp_path / "m.colibri").header == h
    assert not (tmp_path / "m.colibri.partial").exists()


# Run in a child with 2 GiB of address space: listing 65535 × 65535 × 3 tensors, padding a row to 10^9 columns or
# sizing a 10^20-byte file must be refused, not attempted.
HUGE = textwrap.dedent("""
    import resource, numpy as np
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from colibri_sdk.errors import FormatError
    from colibri_sdk.format import ColibriWriter, Header, HeaderV2, quantize_rtn
    big = dict(num_layers=65535, num_experts=65535, top_k=1, hidden_size=65535, intermediate_size=65535, dtype=1)
    for h in (Header(**big), HeaderV2(**big, quant=2, group_size=32)):
        try:
            ColibriWriter({path!r}, h)
        except FormatError as exc:
            print("refused:", exc)
    try:
        quantize_rtn(np.ones((4, 70), np.float32), 1, 10**9)
    except FormatError as exc:
        print("refused:", exc)
""")


def test_huge_headers_and_group_sizes_are_refused_without_allocating(tmp_path):
    target = tmp_path / "big.colibri"
    run = subprocess.run([sys.executable, "-c", HUGE.format(path=str(target))], capture_output=True, text=True,
                         timeout=guard(600))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 3, run.stdout
    for line in lines[:2]:
        assert re.fullmatch(r"refused: cannot write .*/big\.colibri: its header implies \d+ bytes \(.* GB\); the file "
                            r"system has \d+ bytes \(.* GB\) free", line), line
    assert lines[2] == "refused: group_size 1000000000 for int8; allowed: 0, 32, 64, 128"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w: quantize_rtn(w, 3, 32), r"quant 3; allowed: 1 \(int8\), 2 \(int4\)"),
        (lambda w: quantize_rtn(w, 1, 7), r"group_size 7 for int8; allowed: 0, 32, 64, 128"),
        (lambda w: quantize_rtn(w, 2, 0), r"group_size 0 for int4; allowed: 32, 64, 128"),
        (lambda w: quantize_rtn(w, 1, -1), r"group_size -1 for int8"),
        (lambda w: quantize_rtn(w, 1, 32, np.float64), r"scale dtype .*float64.*; allowed: float16, float32"),
        (lambda w: quantize_rtn(w[:, :0], 1, 32), r"weight of shape \(4, 0\).*rows and cols >= 1"),
    ],
    ids=["quant", "group-7", "int4-per-row", "group-negative", "scale-float64", "no-columns"],
)
def test_quantizer_arguments_outside_the_format(call, message):
    with pytest.raises(FormatError, match=message):
        call(np.ones((4, 70), np.float32))


def test_dequantize_checks_shapes_and_rows():
    t = quantize_rtn(np.random.default_rng(0).standard_normal((4, 70)).astype(np.float32), 1, 32)
    with pytest.raises(FormatError, match=r"rows \[7\] \(dtype int64\); allowed: a 1-D integer array of row indices "
                                          r"in 0\.\.3"):
        dequantize(t, np.array([7]))
    with pytest.raises(FormatError, match=r"rows \[0\.5\]"):
        dequantize(t, np.array([0.5]))
    with pytest.raises(FormatError, match=r"scales of shape \(4, 2\); allowed: \(4, 3\) \(rows, groups\)"):
        dequantize(QuantizedTensor(t.codes, t.scales[:, :2], None, 70, 32, 1))
    with pytest.raises(FormatError, match=r"codes of shape \(4, 70\); allowed: \(rows, 35\) for 70 columns \(packed"):
        dequantize(QuantizedTensor(t.codes.view(np.uint8), t.scales, None, 70, 32, 2, packed=True))


@pytest.mark.parametrize("zero_points", [0, 1])
def test_scales_that_dequantize_to_inf_are_refused(tmp_path, zero_points):
    h = HeaderV2(num_layers=1, num_experts=1, top_k=1, hidden_size=32, intermediate_size=1, dtype=0, quant=2,
                 group_size=32, zero_points=zero_points)
    scales = np.array([[3e38]], np.float32)
    codes = np.zeros((1, 32), np.int8)
    codes[0, :3] = -8
    zeros = np.full((1, 1), 7, np.int8) if zero_points else None
    with pytest.raises(FormatError, match=r"(3|32) weights dequantize to Inf in float32 \(max \|scale\| 3e\+38\); "
                                          r"allowed: \|scale · \(q − zero\)\| <= float32 max"), \
            ColibriWriter(tmp_path / "m.colibri", h) as w:
        w.write("gate_proj", 0, 0, QuantizedTensor(codes, scales, zeros, 32, 32, 2))
    assert os.listdir(tmp_path) == []


def test_a_large_scale_with_small_codes_is_kept(tmp_path):
    """2^126 (an MXFP4 scale byte of 254) times codes up to ±1 is finite: it must be written, not refused."""
    h = HeaderV2(num_layers=1, num_experts=1, top_k=1, hidden_size=32, intermediate_size=1, dtype=0, quant=1,
                 group_size=32)
    scale = np.float32(2.0**126)
    codes = np.tile(np.array([-1, 0, 1, 1], np.int8), 8)[None]
    with ColibriWriter(tmp_path / "m.colibri", h) as w:
        w.write("gate_proj", 0, 0, QuantizedTensor(codes, np.array([[scale]]), None, 32, 32, 1))
        for kind, layer, index in w.pending():
            w.write(kind, layer, index, np.ones(h.shape(kind), np.float32) * 1e-3)
    with ColibriFile(tmp_path / "m.colibri") as f:
        assert f.weight("gate_proj", 0, 0)[0, :4].tolist() == [-(2.0**126), 0.0, 2.0**126, 2.0**126]


@pytest.mark.parametrize(("quant", "low", "top"), [(1, -1e-5, 1e-5), (2, -1e-7, 2e-7), (1, -1e-9, 1e-9)],
                         ids=["int8-subnormal", "int4-underflow-negative-scale", "int8-underflow"])
def test_groups_below_float16s_normal_range_keep_the_half_step_bound(quant, low, top):
    """A group whose float16 scale is subnormal (or underflows) must not clamp its largest values: with the scale
    rounded to nearest, 1e-5 came back as 7.6e-6 (int8) — a 24 % error on the group's largest weight."""
    w = np.linspace(low, top, 32, dtype=np.float32)[None]
    t = quantize_rtn(w, quant, 32)
    step = np.abs(t.scales.astype(np.float32))[0, 0]
    assert np.abs(t.dequantize() - w).max() <= step / 2


def test_an_unknown_compute_dtype_is_an_input_error(tmp_path):
    path = tmp_path / "m.colibri"
    write_v2(path, FLOAT)
    with pytest.raises(InputError, match=r"compute_dtype 'nonsense'; allowed: float32, float64"):
        ReferenceEngine(path, compute_dtype="nonsense")
