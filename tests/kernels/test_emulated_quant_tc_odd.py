"""int8/int4 rows at every misalignment on the tiled tensor-core path (kernels/expert_quant_tc.cu: the 32-byte
windows of the code rows, each sector once per pass, the sector shared by two rows read once, and the 16-byte
staging of the scales and zero points), emulated on the CPU against the float64 ReferenceEngine, which dequantizes
exactly (colibri_sdk.format.quant.dequantize).

A matrix whose row length in bytes is odd (coprime with 32) and that has at least 32 rows starts its rows at every
byte offset of a 32-byte window (so at every offset mod 16 as well). The sizes below give rows of one stage (no
shared sector), of two to four stages (a shared last sector, read from the next row's head), partial column blocks
(fewer than 32 rows in the last block), int4 padding nibbles and partial last groups. An emulation of the logic on
the CPU, not a GPU run.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import assert_close, make_profile, reference  # noqa: E402
from test_emulated_quant import make_quant_model  # noqa: E402
from test_emulated_quant_tc import check_case  # noqa: E402

# (id, profile kwargs, make_quant_model kwargs, valid tokens); tokens * top-k > max_pairs 32: the tiled path.
# Row bytes: int8 = columns, int4 = (columns + 1) // 2; a stage is 64 code bytes (int8) or 32 (int4).
CASES = [
    # 131-byte gate/up rows (three stages, a shared last sector), 45-byte down rows (one stage, none shared);
    # one fp16 scale per row
    ("int8-per-row-fp16", dict(tokens=24), dict(quant="int8", group=0, experts=4, hidden=131, inter=45, seed=30),
     None),
    # 67- and 45-byte rows, padding nibbles, partial groups (133 = 4*32 + 5, 89 = 2*32 + 25), fp32 scales, atomic
    ("int4-g32-zeros-fp32-atomic", dict(tokens=20, aggregation="atomic"),
     dict(quant="int4", group=32, zeros=True, scales="fp32", experts=4, hidden=133, inter=89, seed=31), None),
    # 131- and 39-byte rows, partial groups (261 = 2*128 + 5; 77 < 128), padded tokens of two sequences
    ("int4-g128-zeros-fp16-padded", dict(batch=2, tokens=12),
     dict(quant="int4", group=128, zeros=True, experts=4, hidden=261, inter=77, seed=32), [11, 6]),
]


@pytest.mark.parametrize("name,profile_kwargs,model_kwargs,valid", CASES, ids=[c[0] for c in CASES])
def test_odd_quantized_rows_on_the_tensor_core_path_match_reference(orin_profile, tmp_path, name, profile_kwargs,
                                                                    model_kwargs, valid):
    check_case(orin_profile, tmp_path, profile_kwargs, model_kwargs, valid)


def expert_sectors(device: EmulatedDevice, x: np.ndarray) -> tuple[int, int]:
    """(sectors touched, minimum sectors) of the weight loads of the quantized tensor-core kernels."""
    records = device.run_recorded(x)
    stats = [s for launch, s in records if launch["kernel"] == "expert_quant"]
    return sum(int(s[0][1]) for s in stats), sum(int(s[0][2]) for s in stats)


def test_odd_rows_read_each_selected_expert_once_in_whole_sectors(orin_profile, tmp_path):
    """Access model (bench/kernel_access.py goals) at odd sizes: 131-byte gate/up and 67-byte down rows starting at
    every offset: the selected experts' codes, scales and zero points read once (32 x weight sectors within 5 % of
    their stored bytes; byte loads read about twice) in fully used sectors (minimum / touched >= 0.95); with
    routing.block_m 128 (every expert's rows padded to 128, two passes of 64 rows, the second one of padding only)
    exactly the same sectors, and the same output."""
    path = make_quant_model(tmp_path / "m.colibri", quant="int4", group=128, zeros=True, experts=8, hidden=261,
                            inter=133, seed=34)
    x = np.random.default_rng(34).standard_normal((40, 261)).astype(np.float32)
    device = EmulatedDevice(make_profile(orin_profile, tokens=40), path)
    sectors, minimum = expert_sectors(device, x)
    h = device.header
    ref, routes, stable = reference(path, x)
    ids = routes[0][0]
    assert np.bincount(ids.reshape(-1), minlength=8).max() <= 64  # one pass of 64 rows per expert at block_m 16
    per_expert = sum(b.tensor_bytes for b in h.blocks() if b.tensor in ("gate_proj", "up_proj", "down_proj"))
    selected = len(np.unique(ids)) * per_expert
    assert selected <= 32 * sectors <= 1.05 * selected, (32 * sectors, selected)
    assert minimum / sectors >= 0.95, (minimum, sectors)

    wide = EmulatedDevice(make_profile(orin_profile, tokens=40, kernels={"routing": {"block_m": 128}}), path)
    assert wide.sizes.quant_tensor_core and wide.sizes.block_m == 128
    assert expert_sectors(wide, x) == (sectors, minimum)
    wide.poison()
    assert_close(wide.run(x), ref, stable)
