"""`run --json` / `inspect --json` name the experts' storage ("storage"), so that no JSON reader takes the
manifest's `dtype` (the activations' and scales' float type) for the storage of int8/int4 experts."""

from __future__ import annotations

import json

import pytest

from colibri_sdk.cli import main


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory):
    """Orin at 1 x 2 on a one-layer int4 (group 32) model with zero points."""
    from v2_bundle_support import random_v2_bundle

    from colibri_sdk.format import HeaderV2

    h = HeaderV2(num_layers=1, num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, dtype=1, routing=0,
                 quant=2, group_size=32, zero_points=1)
    return random_v2_bundle(tmp_path_factory.mktemp("int4"), h, 4, "int4")


INT4 = {"experts": "int4", "group_size": 32, "zero_points": True, "text": "int4 g32 with zero points"}


def _json(capsys, args: list[str]) -> dict:
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_int4_bundle_reports_its_storage_next_to_the_float_dtype(int4_bundle, capsys):
    inspected = _json(capsys, ["inspect", str(int4_bundle), "--json"])
    assert inspected["dtype"] == "fp16" and inspected["storage"] == INT4
    ran = _json(capsys, ["run", str(int4_bundle), "--backend", "cpu", "--iters", "1", "--json"])
    assert ran["dtype"] == "fp16" and ran["storage"] == INT4


def test_float_bundle_storage_is_its_dtype(small_bundle, capsys):
    inspected = _json(capsys, ["inspect", str(small_bundle), "--json"])
    expected = {"experts": "fp16", "group_size": 0, "zero_points": False, "text": "fp16"}
    assert inspected["dtype"] == "fp16" and inspected["storage"] == expected
    ran = _json(capsys, ["run", str(small_bundle), "--backend", "cpu", "--iters", "1", "--json"])
    assert ran["storage"] == expected
