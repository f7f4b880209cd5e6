"""A bundle with expert capacity, built by `colibri-sdk build` (NVRTC): the capacity kernel compiled and checked
(ptxas), its launch after every routing launch, the factor as exact compile-time constants, mode and policy as
launch arguments, the capacity recorded in the manifest and printed by build, `inspect` and `run`."""

from __future__ import annotations

import json

import numpy as np

from colibri_sdk.cli import main
from colibri_sdk.format import Header, write_model


def small_weights(tmp_path):
    rng = np.random.default_rng(0)
    L, E, H, I = 2, 4, 32, 16
    return write_model(tmp_path / "m.colibri", Header(L, E, 2, H, I, dtype=0, routing=0, composition=1),
                       rng.standard_normal((L, E, I, H)), rng.standard_normal((L, E, I, H)),
                       rng.standard_normal((L, E, H, I)), rng.standard_normal((L, H, E)))


def test_a_capacity_bundle_compiles_and_launches_the_capacity_kernel(tmp_path, capsys):
    weights = small_weights(tmp_path)
    out = tmp_path / "b"
    assert main(["build", "--profile", "orin", "--weights", str(weights), "--capacity-factor", "0.6",
                 "--capacity-mode", "soft", "--capacity-policy", "position", "-o", str(out)]) == 0
    assert "expert capacity: factor 0.6, soft, policy position" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["profile"]["capacity"] == {"factor": 0.6, "mode": "soft", "policy": "position"}
    names = [k["name"] for k in m["kernels"]]
    assert names == ["routing", "gate_up", "down", "small_batch", "expert_quant", "capacity"]
    cap = m["kernels"][names.index("capacity")]
    assert cap["symbols"] == ["colibri_capacity"] and cap["resources"]["colibri_capacity"]["spill_store_bytes"] == 0
    # 0.6 = 5404319552844595 / 2**53 exactly (float.as_integer_ratio)
    assert (cap["defines"]["COLI_CAPACITY_FACTOR_NUM"], cap["defines"]["COLI_CAPACITY_FACTOR_SHIFT"]) == (
        5404319552844595, 53)
    assert "COLI_CAPACITY_MIN" not in cap["defines"], "without --capacity-min: the constants of before"
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


def test_min_capacity_and_first_choices_first_in_the_manifest_and_the_launches(tmp_path, capsys):
    """--capacity-min 3 --capacity-order choice: min_capacity a compile-time constant (COLI_CAPACITY_MIN 3), the
    order flags bit 2 (hard, score: flags 4), both recorded in the manifest and printed by build, inspect and run."""
    weights = small_weights(tmp_path)
    out = tmp_path / "b"
    assert main(["build", "--profile", "orin", "--weights", str(weights), "--capacity-factor", "0.5",
                 "--capacity-min", "3", "--capacity-order", "choice", "-o", str(out)]) == 0
    assert "expert capacity: factor 0.5, hard, policy score, min 3, first choices first" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["profile"]["capacity"] == {"factor": 0.5, "mode": "hard", "policy": "score", "min_capacity": 3,
                                        "order": "choice"}
    cap = next(k for k in m["kernels"] if k["name"] == "capacity")
    assert cap["defines"]["COLI_CAPACITY_MIN"] == 3
    flags = [l["args"][-1] for l in m["launch"] if l["symbol"] == "colibri_capacity"]
    assert flags == [{"kind": "i32", "value": 4}] * m["weights"]["header"]["num_layers"]
    assert main(["inspect", str(out)]) == 0
    assert "factor 0.5, hard, policy score, min 3, first choices first" in capsys.readouterr().out
    assert main(["run", str(out), "--backend", "cpu", "--iters", "1"]) == 0
    assert "capacity factor 0.5, hard, policy score, min 3, first choices first;" in capsys.readouterr().out
