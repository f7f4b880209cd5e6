"""`colibri-sdk run --json`: one JSON object with the latency and `Runtime.stats()`."""

from __future__ import annotations

import json

import numpy as np

from colibri_sdk.cli import main


def test_run_json(small_bundle, tmp_path, capsys):
    code = main(["run", str(small_bundle), "--backend", "cpu", "--iters", "4", "--json", "--seed", "2",
                 "--lengths", "8", "3", "--output", str(tmp_path / "y.npy")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1, lines
    report = json.loads(lines[0])
    assert report["backend"] == "cpu" and report["shape"] == {"batch": 2, "tokens": 8}
    assert report["input"] == {"source": "random N(0, 1), seed 2", "dtype": "float32", "shape": [2, 8, 64],
                               "lengths": [8, 3]}
    assert report["iters"] == 4
    stats = report["stats"]
    assert stats["calls"] == 5 and stats["inputs"] == {"2x8": 5} and stats["dropped_pairs"] == 0
    assert 0 < stats["p50_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert report["output"] == {"path": str(tmp_path / "y.npy"), "dtype": "float32", "shape": [2, 8, 64]}
    assert np.load(tmp_path / "y.npy")[1, 3:].max() == 0.0
