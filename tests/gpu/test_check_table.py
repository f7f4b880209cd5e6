"""The GPU check's table (bench/gpu/table.py) from a results file cut short: what was measured is shown, the phase
that died is named with its reason, and an unreadable line is reported instead of breaking the table. Runs
everywhere (no GPU involved)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from table import print_table  # noqa: E402

LINES = [
    {"phase": "versions", "name": "gpu", "status": "ok", "time": "t", "gpu": "NVIDIA H200", "arch": "sm_90",
     "sm_count": 132, "driver": "13.0"},
    {"phase": "floor", "name": "read_stream", "status": "ok", "time": "t", "gbs": 4123.4, "counted": "read"},
    {"phase": "layer", "name": "kernel", "status": "ok", "time": "t", "tokens": 1, "shape_tokens": 1, "path": "gemv",
     "symbol": "colibri_gate_up_gemv", "median_us": 61.25},
    {"phase": "layer", "name": "forward", "status": "ok", "time": "t", "tokens": 1, "shape_tokens": 1, "path": "gemv",
     "default_path": True, "graph_median_us": 250.0, "eager_median_us": 300.0, "eager_over_graph": 1.2,
     "kernel_sum_us": 240.0, "floor_us": 171.0, "floor_fraction": 0.684, "selected_experts": [3, 5]},
    {"phase": "layer-quant", "name": "kernel", "status": "ok", "time": "t", "tokens": 16, "shape_tokens": 16,
     "path": "gemv", "storage": "int4_g128", "symbol": "colibri_gate_up_gemv", "median_us": 99.0, "est_us": 80.0,
     "registers": 128, "static_shared_bytes": 18320, "resident_blocks_per_sm": 2},
    {"phase": "layer-quant", "name": "forward", "status": "ok", "time": "t", "tokens": 16, "shape_tokens": 16,
     "path": "gemv", "storage": "int4_g128", "default_path": True, "graph_median_us": 500.0, "eager_median_us": 600.0,
     "eager_over_graph": 1.2, "kernel_sum_us": 480.0, "est_layer_us": 410.0, "floor_us": 100.0,
     "floor_fraction": 0.2, "selected_experts": [0, 1, 2]},
    {"phase": "check", "name": "phase", "status": "fail", "time": "t", "phase_name": "layer-min", "seconds": 90,
     "limit_s": 90, "rc": 124, "reason": "timed out after 90 s"},
]


def test_partial_results_render(tmp_path):
    text = "\n".join(json.dumps(line) for line in LINES) + "\n{not json\n"
    (tmp_path / "results.jsonl").write_text(text)
    assert print_table(tmp_path) == 0
    table = (tmp_path / "table.txt").read_text()
    assert "GPU: NVIDIA H200 (sm_90, 132 SMs), driver 13.0" in table
    assert "read_stream 4123.4 GB/s (read)" in table
    row = next(line for line in table.splitlines() if line.startswith("fp16 ") and "gemv*" in line)
    assert row.split() == ["fp16", "1", "gemv*", "250.0", "300.0", "1.20", "240.0", "-", "171.0", "0.684", "2"]
    assert "fp16 t1 gemv: gate_up_gemv 61.2" in table
    quant = next(line for line in table.splitlines() if line.startswith("int4_g128 "))
    assert quant.split()[:3] == ["int4_g128", "16", "gemv*"] and quant.split()[7] == "410.0"  # the estimate
    assert "gate_up_gemv 99.0 (est 80.0) [128 regs, 18320 B smem, 2 blocks/SM]" in table
    phase = next(line for line in table.splitlines() if line.startswith("layer-min"))
    assert phase.split() == ["layer-min", "fail", "90", "90", "124", "timed", "out", "after", "90", "s"]
    assert "fail ?/unreadable line: {not json" in table


def test_no_results_file_still_renders(tmp_path):
    assert print_table(tmp_path) == 0
    assert (tmp_path / "table.txt").read_text() == "\n"
