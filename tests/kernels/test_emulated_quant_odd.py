"""int8/int4 GEMV rows at every misalignment (kernels/small_batch.cu: the aligned windows over the codes and the
16-byte staging of their scales and zero points), emulated on the CPU against the float64 ReferenceEngine, which
dequantizes exactly (colibri_sdk.format.quant.dequantize).

A matrix whose row length in bytes is odd (coprime with 32) and that has at least 32 rows starts its rows at every
byte offset of a 32-byte window, so each size below runs every shift of the window: vectors that hold the end of
the previous row, vectors across two scale groups, partial last groups, int4 padding nibbles, vectors across two
chunks (rows above 512 columns). Every model runs in one 16-token bundle with 1, 4 and 16 valid tokens (one
compile per model). An emulation of the logic on the CPU, not a GPU run.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from test_emulated import assert_close, make_profile, reference, run_checked  # noqa: E402
from test_emulated_families import assert_close as assert_close_v2  # noqa: E402
from test_emulated_families import make_v2_model, reference_v2  # noqa: E402
from test_emulated_quant import make_quant_model  # noqa: E402

VALID = (1, 4, 16)  # valid tokens of the 16-token bundle (top-2: 32 pairs, the GEMV path at max_pairs 32)

# (id, make_quant_model kwargs); row bytes: int8 = columns, int4 = (columns + 1) // 2
ROUTED = [
    # 67-byte gate/up rows, 45-byte down rows; one fp16 scale per row
    ("int8-per-row-fp16", dict(quant="int8", group=0, hidden=67, inter=45, seed=20)),
    # 67- and 45-byte rows, padding nibbles, partial groups (133 = 4*32 + 5, 89 = 2*32 + 25), fp32 scales
    ("int4-g32-zeros-fp32", dict(quant="int4", group=32, zeros=True, scales="fp32", hidden=133, inter=89, seed=21)),
    # 131- and 39-byte rows, partial groups (261 = 2*128 + 5; 77 < 128: one partial group)
    ("int4-g128-zeros-fp16", dict(quant="int4", group=128, zeros=True, hidden=261, inter=77, seed=22)),
    # gate/up rows of two chunks (549 = 4*128 + 37 columns), vectors across chunk and group boundaries
    ("int8-g128-fp32-chunks", dict(quant="int8", group=128, scales="fp32", hidden=549, inter=45, seed=23)),
    # down rows of two chunks (531 columns), with zero points
    ("int8-g32-zeros-down-chunks", dict(quant="int8", group=32, zeros=True, hidden=37, inter=531, seed=24)),
]


@pytest.fixture(scope="module", params=ROUTED, ids=[c[0] for c in ROUTED])
def routed(request, orin_profile, tmp_path_factory):
    name, model_kwargs = request.param
    path = make_quant_model(tmp_path_factory.mktemp(name) / "m.colibri", **model_kwargs)
    device = EmulatedDevice(make_profile(orin_profile, tokens=16), path)
    assert device.sizes.small_batch and not device.sizes.tensor_core, device.sizes
    x = np.random.default_rng(len(name)).standard_normal((16, device.header.hidden_size)).astype(np.float32)
    return device, path, x


@pytest.mark.parametrize("valid", VALID)
def test_odd_quantized_rows_match_reference(routed, valid):
    device, path, x = routed
    y = run_checked(device, x, valid_tokens=[valid])
    ref, _, stable = reference(path, x[:valid])
    if valid == 1:  # one token: it must route stably (assert_close asks for at least half of the tokens)
        assert stable.all(), "the token's top-3 logits are too close: another seed"
    assert_close(y[:valid], ref, stable)
    np.testing.assert_array_equal(y[valid:], x[valid:])  # residual composition: padded rows pass through


# Shared experts (colibri_shared_gate_up / colibri_shared_down, scales from global memory) at odd sizes: (id, v2 header
# fields, make_v2_model kwargs). Routed rows as above; shared gate/up rows of 67 bytes, shared down rows of 23 or 53.
SHARED = [
    ("int4-g32-fp16-shared-gated", dict(quant=2, group_size=32, routing=1, num_shared_experts=1,
                                         shared_intermediate_size=45, shared_gate=1), dict(hidden=133, inter=45)),
    ("int8-per-row-fp32-shared", dict(quant=1, group_size=0, routing=1, num_shared_experts=1,
                                      shared_intermediate_size=53), dict(hidden=67, inter=45, dtype="fp32")),
]


@pytest.mark.parametrize("name,fields,kwargs", SHARED, ids=[c[0] for c in SHARED])
def test_odd_quantized_shared_experts_match_reference(orin_profile, tmp_path, name, fields, kwargs):
    path = make_v2_model(tmp_path / "m.colibri", fields, seed=30 + len(name), **kwargs)
    device = EmulatedDevice(make_profile(orin_profile, tokens=4), path)
    assert device.sizes.small_batch, device.sizes
    x = np.random.default_rng(len(name)).standard_normal((4, device.header.hidden_size)).astype(np.float32)
    ref, _, stable, _ = reference_v2(path, x)
    assert stable[0], "token 0 selects unstably: another seed"
    for valid in (4, 1):
        y = run_checked(device, x, valid_tokens=[valid])
        assert_close_v2(y[:valid], ref[:valid], stable[:valid])
        np.testing.assert_array_equal(y[valid:], x[valid:])  # padded rows: the input row, no shared expert term
