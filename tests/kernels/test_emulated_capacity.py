"""Expert capacity in the kernels (kernels/capacity.cu), emulated on the CPU: the unmodified kernel compiled by g++
(tests/kernels/emu), launched by the launch plan after colibri_routing, against colibri_sdk.capacity (the semantics)
and the float64 ReferenceEngine with the same capacity. Skewed routing (the router favours experts 0 and 1), hard
and soft, both policies, GEMV and tiled paths, padded tokens. An emulation: nothing here ran on a GPU.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest

from colibri_sdk import catalog
from colibri_sdk.capacity import NO_EXPERT, Capacity, apply_capacity
from colibri_sdk.format import Header, write_model
from colibri_sdk.profile import Profile
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime.cuda_backend import POISON_WORD

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the kernels for the CPU")

from emulator import EmulatedDevice  # noqa: E402
from kernel_support import expected_pair_order  # noqa: E402

MARGIN = 1e-4  # router logit gap below which fp32 may legitimately pick another expert than float64


def capacity_profile(orin: dict, capacity: dict | None, batch: int, tokens: int, aggregation="ordered",
                     dtype="fp32") -> dict:
    data = copy.deepcopy(orin)
    data.update(dtype=dtype, aggregation=aggregation, shape={"batch": batch, "tokens": tokens})
    data["kernels"]["small_batch"]["max_pairs"] = 32
    if capacity is not None:
        data["capacity"] = capacity
    return Profile.from_dict(data, toolchain=False).data


def skewed_model(path, layers=1, experts=6, top_k=2, hidden=48, inter=24, seed=0, composition=1, bias=(0.25, 0.25),
                 dtype="fp32"):
    """fp32 (or fp16) weights, N(0, 1/fan_in); the router favours experts 0 and 1 (`bias` added to their columns),
    so they get more pairs than C."""
    rng = np.random.default_rng(seed)
    header = Header(layers, experts, top_k, hidden, inter, dtype=1 if dtype == "fp16" else 0, routing=0,
                    composition=composition)
    router = rng.standard_normal((layers, hidden, experts)) / np.sqrt(hidden)
    router[:, :, 0] += bias[0]
    router[:, :, 1] += bias[1]
    return write_model(path, header, rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden),
                       rng.standard_normal((layers, experts, inter, hidden)) / np.sqrt(hidden),
                       rng.standard_normal((layers, experts, hidden, inter)) / np.sqrt(inter), router)


def valid_mask(batch: int, tokens: int, valid_tokens) -> np.ndarray:
    counts = np.full(batch, tokens) if valid_tokens is None else np.asarray(valid_tokens)
    return (np.arange(tokens)[None, :] < counts[:, None]).reshape(-1)


# (capacity, batch, tokens, valid tokens, aggregation). g++ builds one emulation library per set of -D constants:
# the factor and min_capacity are (mode, policy and order are a launch argument), so these are three libraries,
# GEMV (tokens*k <= 32) and tiled, and GEMV with min_capacity 3 (5 valid tokens: ceil(5 * 2 * 0.8 / 6) = 2 < 3).
CONFIGS = {
    "hard-score-gemv": ({"factor": 0.8, "mode": "hard", "policy": "score"}, 2, 8, None, "ordered"),
    "hard-position-gemv-padded": ({"factor": 0.8, "mode": "hard", "policy": "position"}, 2, 8, [5, 3], "ordered"),
    "soft-score-tiled-padded-atomic": ({"factor": 0.8, "mode": "soft", "policy": "score"}, 2, 16, [16, 9], "atomic"),
    "soft-position-tiled-atomic": ({"factor": 0.8, "mode": "soft", "policy": "position"}, 2, 16, None, "atomic"),
    "hard-position-choice-min-gemv-padded": ({"factor": 0.8, "mode": "hard", "policy": "position", "min_capacity": 3,
                                             "order": "choice"}, 2, 8, [3, 2], "ordered"),
    "soft-score-choice-tiled-atomic": ({"factor": 0.8, "mode": "soft", "policy": "score", "order": "choice"}, 2, 16,
                                       None, "atomic"),
}


def device_for(orin: dict, config: str, path) -> EmulatedDevice:
    spec, batch, tokens, _valid, aggregation = CONFIGS[config]
    return EmulatedDevice(capacity_profile(orin, spec, batch, tokens, aggregation), path)


def routed(device: EmulatedDevice, x: np.ndarray, valid):
    """colibri_routing of layer 0 alone (the plan's first launch): the dropless (ids, weights), (tokens, k)."""
    device._load_input(x, valid)
    function, grid, block, _shared, params, _values = device._launches[0]
    device.lib.launch(function, grid, block, params.ctypes.data)
    k = device.header.top_k
    return device.buffer("topk_ids", np.int32).reshape(-1, k), device.buffer("topk_weights", np.float32).reshape(-1, k)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_kernel_drops_the_pairs_colibri_sdk_capacity_drops(orin_profile, tmp_path, config):
    spec, batch, tokens, valid, _ = CONFIGS[config]
    path = skewed_model(tmp_path / "m.colibri")
    device = device_for(orin_profile, config, path)
    assert device.sizes.small_batch == ("gemv" in config)
    symbols = [launch["symbol"] for launch in device.plan]
    assert symbols[:2] == ["colibri_routing", "colibri_capacity"] and symbols.count("colibri_capacity") == 1
    dropless = catalog.launch_plan({k: v for k, v in device.profile.items() if k != "capacity"}, device.header)
    # Dropless, colibri_routing builds the padded order itself; with capacity colibri_align follows colibri_capacity.
    assert ("colibri_align" in symbols) == (not device.sizes.small_batch)
    assert [launch["symbol"] for launch in dropless] == [s for s in symbols[:1] + symbols[2:] if s != "colibri_align"]
    x = np.random.default_rng(1).standard_normal((batch * tokens, 48)).astype(np.float32)
    ids0, w0 = routed(device, x, valid)
    device.poison()
    y = device.run(x, valid_tokens=valid)
    assert device.damaged_guards() == []
    for buffer in ("capacity_rank", "capacity_dropped", "topk_ids", "topk_weights"):
        assert not (device.buffer(buffer, np.uint32) == POISON_WORD).any(), f"{buffer} not fully written"

    mask = valid_mask(batch, tokens, valid)
    expected, n = apply_capacity(np.where(ids0 == 6, NO_EXPERT, ids0), w0, 6, Capacity.from_dict(spec), mask)
    ids = device.buffer("topk_ids", np.int32).reshape(-1, 2)
    np.testing.assert_array_equal(np.where(ids == 6, NO_EXPERT, ids), expected)
    np.testing.assert_array_equal(device.buffer("topk_weights", np.float32).reshape(-1, 2),
                                  np.where(expected >= 0, w0, 0.0))
    assert n > 0 and (expected[mask] == NO_EXPERT).any(), "skewed routing must overflow experts 0 and 1"
    if device.sizes.small_batch:  # the GEMV blocks' pair order holds the kept pairs only (rebuilt by the capacity)
        np.testing.assert_array_equal(device.buffer(catalog.PAIR_ORDER, np.int32), expected_pair_order(ids, 6))
    if "min" in config:  # min_capacity and the order change the kept pairs here
        base, _ = apply_capacity(np.where(ids0 == 6, NO_EXPERT, ids0), w0, 6, Capacity(0.8, spec["mode"],
                                 spec["policy"]), mask)
        assert (base != expected).any()
    assert device.buffer("capacity_dropped", np.int32).tolist() == [n]
    # The expert kernels skip a dropped pair: the output is x + the kept pairs' weighted experts (float64).
    engine = ReferenceEngine(path, compute_dtype=np.float64)
    want = x.astype(np.float64)
    for t, j in zip(*np.nonzero(expected >= 0)):
        want[t] += float(w0[t, j]) * engine.expert(0, int(expected[t, j]), x[t : t + 1].astype(np.float64))[0]
    engine.close()
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(y - want) / scale).max() <= 1e-4
    np.testing.assert_array_equal(y[~mask], x[~mask])  # padded rows: the input row (residual)


def capacity_reference(path, spec: dict, x: np.ndarray, mask: np.ndarray, layers: int = 2):
    """The float64 reference of `layers` layers (residual added) of the model at `path` with expert capacity `spec`
    over the valid rows `mask` of x (tokens, hidden), asserting that every valid token's top-3 router logits are at
    least MARGIN apart (a stable route). Returns (output float64 (tokens, hidden), dropped pairs)."""
    engine = ReferenceEngine(path, compute_dtype=np.float64, capacity=Capacity.from_dict(spec))
    engine.valid = mask
    flat = x.astype(np.float64)
    for layer in range(layers):
        logits = flat[mask] @ engine.file.router(layer).astype(np.float64)
        top = -np.sort(-logits, axis=-1)[:, :3]
        assert (np.diff(-top, axis=-1) >= MARGIN).all(), "an unstable route: choose another seed"
        flat = flat + engine.layer(layer, flat)
    dropped = engine.dropped
    engine.close()
    return flat, dropped


@pytest.mark.parametrize("config", ["hard-position-gemv-padded", "soft-score-tiled-padded-atomic"])
def test_two_layers_equal_the_reference_engine_with_capacity(orin_profile, tmp_path, config):
    """Policy position (the drop decision depends on the routes, not on weight ties): with every token routed
    stably the kernels keep the reference's pairs, and the output equals the float64 reference."""
    spec, batch, tokens, valid, aggregation = CONFIGS[config]
    spec = dict(spec, policy="position")  # the same emulation library: the policy is a launch argument
    path = skewed_model(tmp_path / "m.colibri", layers=2, seed=2)
    device = EmulatedDevice(capacity_profile(orin_profile, spec, batch, tokens, aggregation), path)
    x = np.random.default_rng(5).standard_normal((batch * tokens, 48)).astype(np.float32)
    y = device.run(x, valid_tokens=valid)
    mask = valid_mask(batch, tokens, valid)
    flat, dropped = capacity_reference(path, spec, x, mask)
    assert dropped > 0
    assert int(device.buffer("capacity_dropped", np.int32).sum()) == dropped
    scale = np.abs(flat).max(axis=-1, keepdims=True)
    assert (np.abs(y - flat) / scale).max() <= 1e-4


def test_the_capacity_defines_give_the_factor_exactly():
    for factor in (1.0, 1.25, 0.6, 0.05, 64.0, 1e-3):
        d = catalog.capacity_defines({"factor": factor, "mode": "soft", "policy": "position"})
        assert d["COLI_CAPACITY_FACTOR_NUM"] * 2.0 ** -d["COLI_CAPACITY_FACTOR_SHIFT"] == factor
        assert catalog.capacity_flags({"factor": factor, "mode": "soft", "policy": "position"}) == 3
    assert catalog.capacity_defines(None) == {}
    assert catalog.capacity_defines({"factor": 2.0})["COLI_CAPACITY_FACTOR_SHIFT"] == 0
    assert catalog.capacity_flags({"factor": 2.0}) == 0 and catalog.capacity_flags({"factor": 1, "mode": "soft"}) == 1
    assert "COLI_CAPACITY_MIN" not in catalog.capacity_defines({"factor": 2.0, "min_capacity": 1})
    assert catalog.capacity_defines({"factor": 2.0, "min_capacity": 8})["COLI_CAPACITY_MIN"] == 8
    assert catalog.capacity_flags({"factor": 1, "order": "choice"}) == 4
    assert catalog.capacity_flags({"factor": 1, "mode": "soft", "policy": "position", "order": "policy"}) == 3


def test_the_kernel_capacity_is_ceil_in_double(orin_profile, tmp_path):
    """C as the kernel computes it, seen through expert 0 when every valid token picks it first (factor 0.8, hard,
    position): it keeps the first C valid tokens. By hand, C = ceil(T * 2 * 0.8 / 6): T 16 → 5; T 15 → 4 (in double
    30 * 0.8 = 24.0 exactly, so 24.0 / 6 = 4.0); T 5 → 2; T 1 → 1. Soft keeps at most 2C."""
    path = skewed_model(tmp_path / "m.colibri", bias=(1.0, 0.0))
    x = (np.abs(np.random.default_rng(0).standard_normal((16, 48))) + 0.5).astype(np.float32)
    device = device_for(orin_profile, "hard-position-gemv-padded", path)
    for valid, c in (([8, 8], 5), ([8, 7], 4), ([5, 0], 2), ([0, 1], 1)):
        mask = valid_mask(2, 8, valid)
        ids0, _ = routed(device, x, valid)
        assert (ids0[mask, 0] == 0).all(), "every valid token picks expert 0 first"
        device.run(x, valid_tokens=valid)
        ids = device.buffer("topk_ids", np.int32).reshape(-1, 2)
        assert c == Capacity(0.8).limit(int(mask.sum()), 2, 6)
        np.testing.assert_array_equal(np.flatnonzero(ids[:, 0] == 0), np.flatnonzero(mask)[:c])
    # Soft: the overflow is bounded. Every valid token's first choice is expert 0, so beyond C it keeps C more of
    # them (2C in all) and drops the rest: T 16, C 5 → the first 10 valid tokens keep expert 0.
    spec = {"factor": 0.8, "mode": "soft", "policy": "position"}
    soft = EmulatedDevice(capacity_profile(orin_profile, spec, 2, 8), path)  # the same library: flags differ
    soft.run(x, valid_tokens=[8, 8])
    ids = soft.buffer("topk_ids", np.int32).reshape(-1, 2)
    np.testing.assert_array_equal(np.flatnonzero(ids[:, 0] == 0), np.arange(10))


def test_a_tiny_factor_keeps_one_pair_per_expert_not_none(orin_profile, tmp_path):
    """C = ceil(T * k * f / E) is at least 1 for any factor > 0 and a call with a valid token, also where the
    product underflows in double (f = 5e-324, the smallest the profile allows): Python and the kernel agree."""
    assert Capacity(5e-324).limit(1, 2, 6) == 1 and Capacity(5e-324).limit(0, 2, 6) == 0
    path = skewed_model(tmp_path / "m.colibri", bias=(1.0, 0.0))
    x = (np.abs(np.random.default_rng(0).standard_normal((16, 48))) + 0.5).astype(np.float32)
    spec = {"factor": 5e-324, "mode": "hard", "policy": "position"}
    device = EmulatedDevice(capacity_profile(orin_profile, spec, 2, 8), path)
    valid = [0, 1]
    mask = valid_mask(2, 8, valid)
    device.run(x, valid_tokens=valid)
    ids = device.buffer("topk_ids", np.int32).reshape(-1, 2)
    np.testing.assert_array_equal(np.flatnonzero(ids[:, 0] == 0), np.flatnonzero(mask)[:1])
