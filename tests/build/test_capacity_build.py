"""A bundle with expert capacity, built by `colibri-sdk build` (NVRTC): the capacity kernel compiled and checked
(ptxas), its launch after every routing launch, the factor as exact compile-time constants, mode and policy as
launch arguments, the capacity recorded in the manifest and printed by `inspect --json`."""

from __future__ import annotations

import json

import numpy as np

from colibri_sdk.cli import main
from colibri_sdk.format import Header, write_model


def test_a_capacity_bundle_compiles_and_launches_the_capacity_kernel(tmp_path, capsys):
    rng = np.random.default_rng(0)
    L, E, H, I = 2, 4, 32, 16
    weights = write_model(tmp_path / "m.colibri", Header(L, E, 2, H, I, dtype=0, routing=0, composition=1),
                          rng.standard_normal((L, E, I, H)), rng.standard_normal((L, E, I, H)),
                          rng.standard_normal((L, E, H, I)), rng.standard_normal((L, H, E)))
    out = tmp_path / "b"
    assert main(["build", "--profile", "orin", "--weights", str(weights), "--capacity-factor", "0.6",
                 "--capacity-mode", "soft", "--capacity-policy", "position", "-o", str(out)]) == 0
    assert "expert capacity: factor 0.6, soft, policy position" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["profile"]["capacity"] == {"factor": 0.6, "mode": "soft", "policy": "position"}
    names = [k["name"] for k in m["kernels"]]
    assert names == ["routing", "gate_up", "down", "small_batch", "capacity"]
    cap = m["kernels"][-1]
    assert cap["symbols"] == ["colibri_capacity"] and cap["resources"]["colibri_capacity"]["spill_store_bytes"] == 0
    # 0.6 = 5404319552844595 / 2**53 exactly (float.as_integer_ratio)
    assert (cap["defines"]["COLI_CAPACITY_FACTOR_NUM"], cap["defines"]["COLI_CAPACITY_FACTOR_SHIFT"]) == (
        5404319552844595, 53)
    layers = m["weights"]["header"]["num_layers"]
    launches = [(l["layer"], l["symbol"]) for l in m["launch"]]
    assert [s for _, s in launches].count("colibri_capacity") == layers
    for i, (layer, symbol) in enumerate(launches):
        if symbol == "colibri_capacity":
            assert launches[i - 1] == (layer, "colibri_routing")
            assert m["launch"][i]["args"][-2:] == [{"kind": "i32", "value": layer}, {"kind": "i32", "value": 3}]
    assert m["buffers"]["capacity_dropped"] == 4 * layers
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity"] == m["profile"]["capacity"]
