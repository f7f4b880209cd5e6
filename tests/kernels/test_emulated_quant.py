"""int8 and int4 expert weights on the GEMV path (kernels/small_batch.cu, COLI_QUANT), emulated on the CPU against
the float64 ReferenceEngine, which dequantizes exactly (colibri_sdk.format.quant.dequantize).

Covers int8 per row and with groups 32/64/128, int4 with groups 32/64/128, fp16 and fp32 scales, zero points, odd
sizes (scalar loads, an int4 padding nibble), partial last groups on the 16-byte vector path, several staging
chunks, several passes per expert and padded tokens. An emulation of the logic on the CPU, not a GPU run.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.format import ColibriFile, HeaderV2, QuantizedTensor, write_arrays
from colibri_sdk.format.constants import QUANT_INT4, QUANT_INT8

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import assert_close, make_profile, reference, run_checked  # noqa: E402

QUANT = {"int8": QUANT_INT8, "int4": QUANT_INT4}


def make_quant_model(path, *, quant="int4", group=128, scales="fp16", zeros=False, layers=1, experts=8, top_k=2,
                     hidden=40, inter=24, routing=0, composition=1, seed=0):
    """A random quantized .colibri v2 file. Symmetric: N(0, 1/fan_in) float weights quantized by the writer's
    round-to-nearest (int4 scales come out negative: m / -8). With zero points: random codes, zero points and
    scales of both signs, written as QuantizedTensor."""
    rng = np.random.default_rng(seed)
    header = HeaderV2(layers, experts, top_k, hidden, inter, dtype=1 if scales == "fp16" else 0, routing=routing,
                      composition=composition, quant=QUANT[quant], group_size=group, zero_points=int(zeros))
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    arrays = {"router": rng.standard_normal((layers, hidden, experts)) / np.sqrt(hidden)}
    lo, hi = (-8, 7) if quant == "int4" else (-128, 127)
    sdtype = np.float16 if scales == "fp16" else np.float32
    for kind, (rows, cols) in shapes.items():
        if not zeros:
            arrays[kind] = rng.standard_normal((layers, experts, rows, cols)) / np.sqrt(cols)
            continue
        g = header.groups_for(cols)
        arrays[kind] = [[QuantizedTensor(
            codes=rng.integers(lo, hi + 1, (rows, cols)).astype(np.int8),
            scales=(rng.uniform(0.5, 1.5, (rows, g)) * rng.choice([-1, 1], (rows, g)) / (hi * np.sqrt(cols))
                    ).astype(sdtype),
            zeros=rng.integers(lo, hi + 1, (rows, g)).astype(np.int8),
            cols=cols, group_size=group, quant=QUANT[quant]) for _ in range(experts)] for _ in range(layers)]
    return write_arrays(path, header, arrays)


# (id, profile kwargs, model kwargs); "partial": hidden or intermediate not a multiple of the group, on rows that are
# 16-byte aligned (vector path); "odd": rows not 16-byte aligned (scalar path). Every case takes the GEMV path (tokens*k <= max_pairs 32).
CASES = [
    ("int8-per-row-fp16-aligned", dict(tokens=2), dict(quant="int8", group=0, hidden=256, inter=128)),
    ("int8-g32-fp32-odd", dict(batch=3, tokens=1), dict(quant="int8", group=32, scales="fp32", hidden=100, inter=75,
                                                        layers=2, routing=1, composition=0, seed=1)),
    ("int8-g64-zeros-partial", dict(tokens=4), dict(quant="int8", group=64, zeros=True, hidden=208, inter=96, seed=2)),
    ("int8-g128-partial-two-chunks", dict(tokens=3), dict(quant="int8", group=128, hidden=560, inter=144, seed=3)),
    ("int4-g32-fp16-passes", dict(tokens=12), dict(quant="int4", group=32, experts=3, hidden=96, inter=64, seed=4)),
    ("int4-g64-zeros-fp32-odd", dict(tokens=2), dict(quant="int4", group=64, scales="fp32", zeros=True, hidden=101,
                                                     inter=75, seed=5)),
    ("int4-g128-partial-three-chunks", dict(tokens=2), dict(quant="int4", group=128, hidden=1088, inter=160,
                                                            layers=2, seed=6)),
    ("int4-g128-zeros-1024-threads", dict(tokens=6, kernels={"small_batch": {"threads": 1024}}),
     dict(quant="int4", group=128, zeros=True, experts=4, hidden=384, inter=200, seed=7)),
    # rows starting inside a 16-byte vector over several chunks (aligned windows: vectors across two groups)
    ("int4-g32-zeros-odd-windows-passes", dict(tokens=12),
     dict(quant="int4", group=32, zeros=True, experts=3, hidden=1030, inter=45, seed=10)),
    ("int8-g64-odd-windows", dict(tokens=3), dict(quant="int8", group=64, hidden=530, inter=77, seed=11)),
]




def run_case(orin, tmp_path, profile_kwargs, model_kwargs, valid_tokens=None, path_check=None):
    """Write the model to tmp_path / "m.colibri", run it emulated (checked) and the reference; `path_check(sizes)`
    must hold (default: the GEMV path)."""
    profile = make_profile(orin, **profile_kwargs)
    path = make_quant_model(tmp_path / "m.colibri", **model_kwargs)
    device = EmulatedDevice(profile, path)
    check = path_check or (lambda s: s.small_batch and not s.tensor_core)
    assert check(device.sizes), device.sizes
    rng = np.random.default_rng(len(str(model_kwargs)))
    x = rng.standard_normal((device.sizes.tokens, device.header.hidden_size)).astype(np.float32)
    ref, _, stable = reference(path, x)
    y = run_checked(device, x, valid_tokens=valid_tokens)
    return device, x, y, ref, stable


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs", CASES, ids=[c[0] for c in CASES])
def test_quantized_gemv_matches_reference(orin_profile, tmp_path, name, profile_kwargs, model_kwargs):
    _, _, y, ref, stable = run_case(orin_profile, tmp_path, profile_kwargs, model_kwargs)
    assert_close(y, ref, stable)


def test_int4_scales_are_negative_in_the_rtn_files(tmp_path):
    """The symmetric int4 cases above run on scales of both signs (the format's RTN: m / -8, m the signed value of
    largest magnitude of the group)."""
    path = make_quant_model(tmp_path / "m.colibri", quant="int4", group=32, hidden=64, inter=32)
    with ColibriFile(path) as f:
        scales = np.asarray(f.tensor("gate_proj.scales", 0, 0), dtype=np.float32)
    assert 0.2 < (scales < 0).mean() < 0.8


def test_padded_tokens_with_int4(orin_profile, tmp_path):
    device, x, y, ref, stable = run_case(orin_profile, tmp_path, dict(batch=2, tokens=4),
                                         dict(quant="int4", group=64, hidden=128, inter=96, seed=9), [3, 1])
    valid = np.array([1, 1, 1, 0, 1, 0, 0, 0], dtype=bool)
    ref_valid, _, stable_valid = reference(tmp_path / "m.colibri", x[valid])
    assert_close(y[valid], ref_valid, stable_valid)
    np.testing.assert_array_equal(y[~valid], x[~valid])  # residual composition: padded rows pass through


def test_plan_passes_scale_and_zero_blocks_after_the_float_args(orin_profile, tmp_path):
    profile = make_profile(orin_profile, tokens=1)
    path = make_quant_model(tmp_path / "m.colibri", quant="int8", group=64, zeros=True, hidden=128, inter=64)
    with ColibriFile(path) as f:
        h = f.header
    plan = catalog.launch_plan(profile, h)
    gate_up, down = plan[1], plan[2]
    want = [("gate_proj.scales", 0), ("up_proj.scales", 0), ("gate_proj.zeros", 0), ("up_proj.zeros", 0)]
    assert [(a["tensor"], a["layer"]) for a in gate_up["args"][6:]] == want
    assert [a["offset"] for a in gate_up["args"][6:]] == [h.block(t).offset - 64 for t, _ in want]
    assert [a["tensor"] for a in down["args"][6:]] == ["down_proj.scales", "down_proj.zeros"]
    defines = catalog.compile_defines(profile, h)
    assert (defines["COLI_QUANT"], defines["COLI_GROUP_SIZE"], defines["COLI_ZERO_POINTS"]) == (1, 64, 1)


def test_plan_without_zero_points_passes_null(orin_profile, tmp_path):
    profile = make_profile(orin_profile, tokens=1)
    path = make_quant_model(tmp_path / "m.colibri", quant="int4", group=32, hidden=64, inter=32)
    with ColibriFile(path) as f:
        plan = catalog.launch_plan(profile, f.header)
    assert [a["kind"] for a in plan[1]["args"][6:]] == ["weights", "weights", "null", "null"]
    assert [a["kind"] for a in plan[2]["args"][6:]] == ["weights", "null"]


def test_quantized_weights_on_the_tiled_shape_take_the_quantized_tensor_core_kernels(orin_profile, tmp_path):
    profile = make_profile(orin_profile, tokens=32)  # 64 pairs > max_pairs 32
    path = make_quant_model(tmp_path / "m.colibri", quant="int4", group=128, hidden=128, inter=64)
    with ColibriFile(path) as f:
        plan = catalog.launch_plan(profile, f.header)
    assert [launch["symbol"] for launch in plan] == ["colibri_routing", "colibri_gate_up_qtc", "colibri_down_qtc"]


@pytest.mark.parametrize("name", ["int4-g128-zeros-1024-threads", "int8-g64-zeros-partial"])
def test_global_scale_path_matches_reference(orin_profile, tmp_path, monkeypatch, name):
    """Scales too many to stage in shared memory (COLI_QUANT_STAGE_MAX 0 forces it): each lane reads its scales."""
    defines = catalog.compile_defines
    monkeypatch.setattr(catalog, "compile_defines", lambda p, h: {**defines(p, h), "COLI_QUANT_STAGE_MAX": 0})
    _, profile_kwargs, model_kwargs = next(c for c in CASES if c[0] == name)
    _, _, y, ref, stable = run_case(orin_profile, tmp_path, profile_kwargs, model_kwargs)
    assert_close(y, ref, stable)
