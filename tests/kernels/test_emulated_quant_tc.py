"""int8 and int4 expert weights on the tiled tensor-core path (kernels/expert_quant_tc.cu: colibri_gate_up_qtc,
colibri_down_qtc), emulated on the CPU against the float64 ReferenceEngine, which dequantizes exactly
(colibri_sdk.format.quant.dequantize).

Covers int8 per row and with groups 32/64/128, int4 with groups 32/64/128, fp16 and fp32 scales, zero points, odd
sizes (code rows through shifted 32-byte windows, an int4 padding nibble), partial last groups, several 64-element
stages, more than one pass of 64 rows per expert, any routing.block_m, both aggregations, padded tokens, scales
staged in shared memory or read from global memory, and the magic-number conversion of the codes (common.cuh
codes_pair_sub) for every code and bias (test_emulated_quant_tc_odd.py: rows at every offset). An emulation of the logic on the CPU, not a GPU run.
"""

from __future__ import annotations

import shutil
import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.format import ColibriFile, HeaderV2
from colibri_sdk.format.constants import HEADER_SIZE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulationLibrary, Region, build_library  # noqa: E402
from test_emulated import assert_close, make_profile, reference  # noqa: E402
from test_emulated_quant import make_quant_model, run_case  # noqa: E402
from test_launch_plan import expected_parameter, kernel_parameters  # noqa: E402

QTC_SYMBOLS = ["colibri_gate_up_qtc", "colibri_down_qtc"]

# (id, profile kwargs, model kwargs, valid tokens); every case has tokens*k > max_pairs 32 (or max_pairs_quantized 0):
# the tiled path.
# "odd": rows not 16-byte aligned (shifted windows); "partial": a reduction size not a multiple of the group.
CASES = [
    ("int8-per-row-fp16-aligned", dict(tokens=32), dict(quant="int8", group=0, hidden=128, inter=64), None),
    ("int8-g32-fp32-zeros-odd-atomic", dict(tokens=24, aggregation="atomic"),
     dict(quant="int8", group=32, scales="fp32", zeros=True, hidden=100, inter=75, composition=0, seed=1), None),
    ("int8-g64-partial-two-layers-softmax-all", dict(batch=2, tokens=12),
     dict(quant="int8", group=64, hidden=208, inter=144, layers=2, routing=1, seed=2), None),
    ("int8-g128-partial-block_m4", dict(tokens=32, kernels={"routing": {"block_m": 4}}),
     dict(quant="int8", group=128, hidden=336, inter=80, seed=3), None),
    ("int4-g32-zeros-two-passes", dict(tokens=70), dict(quant="int4", group=32, zeros=True, experts=3, top_k=3,
                                                        hidden=96, inter=64, seed=4), None),
    ("int4-g64-fp32-odd-padded", dict(batch=2, tokens=20),
     dict(quant="int4", group=64, scales="fp32", hidden=101, inter=75, seed=5), [17, 9]),
    ("int4-g128-partial-fp16", dict(tokens=32), dict(quant="int4", group=128, hidden=160, inter=96, layers=2,
                                                     seed=6), None),
    # a one-token shape on the tiles (h200 and a100 ship max_pairs_quantized 0): 2 pairs, one per expert
    ("int4-g128-one-token", dict(tokens=1, kernels={"small_batch": {"max_pairs_quantized": 0}}),
     dict(quant="int4", group=128, hidden=256, inter=128, seed=7), None),
]


def check_case(orin_profile, tmp_path, profile_kwargs, model_kwargs, valid):
    device, x, y, ref, stable = run_case(orin_profile, tmp_path, profile_kwargs, model_kwargs, valid,
                                         path_check=lambda s: s.quant_tensor_core and not s.small_batch)
    assert [launch["symbol"] for launch in device.plan if launch["kernel"] == "expert_quant"] == \
        QTC_SYMBOLS * device.header.num_layers
    if valid is None:
        assert_close(y, ref, stable)
        return
    shape = device.profile["shape"]
    keep = (np.arange(shape["tokens"])[None, :] < np.asarray(valid)[:, None]).reshape(-1)
    ref_valid, _, stable_valid = reference(tmp_path / "m.colibri", x[keep])  # the file run_case wrote
    assert_close(y[keep], ref_valid, stable_valid)
    if device.header.composition == 1:
        np.testing.assert_array_equal(y[~keep], x[~keep])  # padded rows pass through


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs,valid", CASES, ids=[c[0] for c in CASES])
def test_quantized_tensor_core_path_matches_reference(orin_profile, tmp_path, name, profile_kwargs, model_kwargs,
                                                      valid):
    check_case(orin_profile, tmp_path, profile_kwargs, model_kwargs, valid)


def test_global_scale_path_matches_reference(orin_profile, tmp_path, monkeypatch):
    """Scales too many to stage in shared memory (COLI_QUANT_STAGE_MAX 0 forces it): each lane reads its scales and
    zero points from global memory."""
    defines = catalog.compile_defines
    monkeypatch.setattr(catalog, "compile_defines", lambda p, h: {**defines(p, h), "COLI_QUANT_STAGE_MAX": 0})
    check_case(orin_profile, tmp_path, dict(tokens=24), dict(quant="int4", group=32, zeros=True, scales="fp32",
                                                             hidden=96, inter=72, seed=8), None)


@pytest.mark.parametrize("zeros", [0, 1])
def test_tiled_quantized_plan_binds_every_parameter(orin_profile, zeros):
    """The tensor-core quantized kernels get expert_offsets for the rows of each expert, then the scale and
    zero-point blocks of the layer (zero points null when the file has none); grid (experts, ceil(n / 32))."""
    header = HeaderV2(2, 8, 2, 256, 512, dtype=1, quant=2, group_size=64, zero_points=zeros)
    profile = make_profile(orin_profile, tokens=64)
    params = kernel_parameters(quant=True)
    plan = catalog.launch_plan(profile, header)
    assert [launch["symbol"] for launch in plan] == ["colibri_routing", *QTC_SYMBOLS] * 2
    for launch in plan:
        if launch["kernel"] != "expert_quant":
            continue
        symbol, layer = launch["symbol"], launch["layer"]
        n = 512 if symbol == "colibri_gate_up_qtc" else 256
        assert launch["grid"] == [8, n // 32, 1] and launch["block"] == [catalog.TC_THREADS, 1, 1]
        names = [expected_parameter(a, layer) for a in launch["args"]]
        assert len(names) == len(params[symbol]), (symbol, names)
        for name, param, arg in zip(names, params[symbol], launch["args"]):
            assert name == param or (arg["kind"] == "null" and param.endswith("_zeros") and not zeros), (symbol, names)
            if arg["kind"] == "weights":
                assert arg["offset"] == header.tensor_offset(arg["tensor"], layer, 0) - HEADER_SIZE


def test_float_weights_keep_their_tiled_kernels(orin_profile, tmp_path):
    from emulator import EmulatedDevice
    from test_emulated import make_model

    path = make_model(tmp_path / "f.colibri", hidden=64, inter=48)
    device = EmulatedDevice(make_profile(orin_profile, tokens=32), path)
    assert not device.sizes.quant_tensor_core
    assert {launch["symbol"] for launch in device.plan} >= {"colibri_gate_up_tc", "colibri_down_tc"}
    with ColibriFile(make_quant_model(tmp_path / "q.colibri", quant="int8", group=0, hidden=64, inter=48)) as f:
        assert catalog.sizes(make_profile(orin_profile, tokens=32), f.header).quant_tensor_core


PAIR_SUB = r"""
#include "common.cuh"
// out[i] = codes_pair_sub(u[i] & 0x3ff, u[i] >> 16, bias_pair(bias[i])) for 32 lanes.
extern "C" __global__ void pair_sub(const unsigned* __restrict__ u, const int* __restrict__ bias,
                                    unsigned* __restrict__ out) {
    const unsigned v = __ldg(u + threadIdx.x);
    out[threadIdx.x] = codes_pair_sub(v & 0x3ffu, v >> 16, bias_pair(__ldg(bias + threadIdx.x)));
}
"""


def test_magic_number_conversion_is_exact_for_every_code(orin_profile, tmp_path):
    """codes_pair_sub gives the fp16 pair (u_lo - b + 1024, u_hi - b + 1024) exactly for the codes and biases the
    kernel uses: int4 u 0..15 with bias 1032 + zero (zero -8..7), int8 u 0..255 with bias 1152 + zero (-128..127)."""
    (tmp_path / "common.cuh").write_text((catalog.kernel_dir() / "common.cuh").read_text())
    (tmp_path / "pair_sub.cu").write_text(PAIR_SUB)
    defines = catalog.compile_defines(make_profile(orin_profile), HeaderV2(1, 8, 2, 40, 24, dtype=1))
    lib = EmulationLibrary(build_library(defines, tmp_path, [("pair_sub.cu", ("pair_sub",))]))
    lo, hi, biases = [], [], []
    for u_max, offset, zeros in ((16, 8, range(-8, 8)), (256, 128, range(-128, 128))):
        for z in zeros:
            u = np.arange(u_max)
            lo.append(u)
            hi.append(u[::-1])
            biases.append(np.full(u_max, 1024 + offset + z))
    lo, hi, biases = (np.concatenate(a) for a in (lo, hi, biases))
    pad = -len(lo) % 32
    lo, hi, biases = (np.pad(a, (0, pad), constant_values=a[-1]) for a in (lo, hi, biases))
    got = []
    regions = [Region(128) for _ in range(3)]
    fn = lib.function("pair_sub")
    pointers = np.array([r.address for r in regions], dtype=np.uint64)
    params = np.array([pointers.ctypes.data + 8 * i for i in range(3)], dtype=np.uint64)
    for at in range(0, len(lo), 32):
        regions[0].view(np.uint32)[:] = (lo[at:at + 32] | (hi[at:at + 32] << 16)).astype(np.uint32)
        regions[1].view(np.int32)[:] = biases[at:at + 32]
        lib.launch(fn, (1, 1, 1), (32, 1, 1), params.ctypes.data)
        got.append(regions[2].view(np.uint32).copy())
    words = np.concatenate(got)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16).view(np.float16).astype(np.int64)
    want = np.stack([lo, hi], axis=-1) + 1024 - biases[:, None]
    np.testing.assert_array_equal(halves, want)


def test_access_model_reads_each_selected_expert_once(orin_profile, tmp_path):
    """Access model (bench/kernel_access.py goals): the quantized tensor-core kernels read the selected experts'
    codes, scales and zero points once (32 x weight sectors within 5 % of their stored bytes) in fully used sectors
    (minimum sectors / sectors touched >= 0.95). 40 tokens x top-2 over 4 experts: experts with more than one tile
    of 16 rows, all within one pass of 64."""
    from emulator import EmulatedDevice

    path = make_quant_model(tmp_path / "m.colibri", quant="int8", group=32, zeros=True, experts=4, hidden=128,
                            inter=64, seed=9)
    device = EmulatedDevice(make_profile(orin_profile, tokens=40), path)
    x = np.random.default_rng(9).standard_normal((40, 128)).astype(np.float32)
    records = device.run_recorded(x)
    sectors = sum(int(stats[0][1]) for launch, stats in records if launch["kernel"] == "expert_quant")
    minimum = sum(int(stats[0][2]) for launch, stats in records if launch["kernel"] == "expert_quant")
    h = device.header
    _, routes, _ = reference(path, x)
    ids = routes[0][0]
    assert np.bincount(ids.reshape(-1), minlength=4).max() > 16  # some expert spans two 16-row tiles
    chosen = len(np.unique(ids))
    per_expert = sum(b.tensor_bytes for b in h.blocks() if b.tensor in ("gate_proj", "up_proj", "down_proj"))
    selected = chosen * per_expert
    assert selected <= 32 * sectors <= 1.05 * selected, (32 * sectors, selected)
    assert minimum / sectors >= 0.95, (minimum, sectors)
