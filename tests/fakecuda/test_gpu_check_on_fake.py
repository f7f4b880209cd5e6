"""scripts/gpu_check.sh end to end on the fake driver (`--fake`: tiny shapes, the kernels on the CPU emulation), so a
broken check is caught before a GPU window is spent on it.

One run, with the install fallback forced (PYTHONPATH on the source tree) and one driver call made to fail (the
device-to-device copy): every phase must report, every line must follow the results schema, the failed measurement
must be a recorded failure while the rest of its phase and the later phases still run, and the numbers that can be
checked on the emulation are checked (routing on the host agrees with the kernels; the launch plan's output agrees
with transformers' MixtralSparseMoeBlock on the same device-filled weights)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from timeout_support import guard, guard_whole

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")]

PHASES = ["install", "versions", "floor", "layer-max", "layer-min", "layer-quant", "layers", "correctness",
          "transformers"]
LIMIT_SCALE = 4  # the emulated kernels (and their first builds) on shared cores: every phase limit and the budget x 4
FILES = {"results.jsonl", "stdout.log", "stderr.log", "correctness.log", "table.txt"}


@pytest.fixture(scope="module")
def check_run(fake_driver, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLIBRI_FAKE_CUDA_", "COLIBRI_GPU_CHECK_"))}
    env.update(PYTHON=sys.executable, COLIBRI_GPU_CHECK_FAKE_LIB=str(fake_driver),
               COLIBRI_GPU_CHECK_INSTALL="pythonpath", COLIBRI_FAKE_CUDA_FAIL="cuMemcpyDtoDAsync=CUDA_ERROR_UNKNOWN",
               COLIBRI_GPU_CHECK_LIMIT_SCALE=str(guard_whole(LIMIT_SCALE)))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fake", str(out)], capture_output=True,
                          text=True, timeout=guard(450 * LIMIT_SCALE + 120), env=env, cwd=str(ROOT))
    lines = [json.loads(text) for text in (out / "results.jsonl").read_text().splitlines()]
    return done, out, lines


def test_every_phase_reports_and_the_output_is_small(check_run):
    done, out, lines = check_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = {l["phase_name"]: l for l in lines if l["phase"] == "check" and l["name"] == "phase"}
    assert list(phases) == PHASES, phases
    assert all(p["status"] == "ok" for p in phases.values()), phases
    assert "pythonpath" in phases["install"]["reason"]
    assert {p.name for p in out.iterdir()} == FILES  # the device tool returns at most 8 files, no folders needed
    assert "FAKE DRIVER" in done.stdout and "One layer" in done.stdout and "Phases" in done.stdout
    assert (out / "table.txt").read_text() in done.stdout


def test_preflight_first_and_limits_add_up_to_the_budget(check_run):
    _, _, lines = check_run
    first = lines[0]
    assert (first["phase"], first["name"], first["status"]) == ("preflight", "driver", "ok"), first
    assert first["driver_version"] == 12080 and first["cuInit"] == 0 and first["cuda_bindings"], first
    (limits,) = [l for l in lines if l["phase"] == "check" and l["name"] == "limits"]
    assert limits["sum_s"] == limits["budget_s"] == 450 * LIMIT_SCALE, limits


def test_quantized_layer_with_resources_beside_the_times(check_run):
    _, _, lines = check_run
    forward = [l for l in lines if l["phase"] == "layer-quant" and l["name"] == "forward"]
    assert {(l["storage"], l["tokens"]) for l in forward} == {("int8", 1), ("int4_g128", 1)}, forward
    for f in forward:
        assert f["status"] == "ok" and f["output_finite"] is True, f
        assert f["selected_experts"] == f["device_selected_experts"], f
    kernels = [l for l in lines if l["name"] == "kernel" and l["phase"] in ("layer", "layer-quant")]
    assert kernels and all(k["registers"] > 0 and k["static_shared_bytes"] >= 0 and k["resident_blocks_per_sm"] >= 1
                           for k in kernels), kernels[:3]
    weights = [l for l in lines if l["phase"] == "layer-quant" and l["name"] == "weights"]
    assert [w["storage"] for w in weights] == ["int8", "int4_g128"]
    # the weights buffer holds the data and the catalogue's tail bytes, as the CUDA backend allocates it
    from colibri_sdk import catalog
    fp16 = [l for l in lines if l["phase"] == "layer" and l["name"] == "weights"][0]
    assert fp16["bytes"] == 2 * (3 * 64 * 32 * 4 + 64 * 4) + catalog.WEIGHTS_TAIL_BYTES, fp16


def test_lines_follow_the_schema(check_run):
    _, _, lines = check_run
    for line in lines:
        assert {"phase", "name", "status", "time"} <= set(line), line
        assert line["status"] in ("ok", "skip", "fail"), line
        if line["status"] != "ok":
            assert line.get("reason"), line
    versions = {l["name"]: l for l in lines if l["phase"] == "versions"}
    assert versions["gpu"]["arch"] == "sm_90" and versions["gpu"]["driver"] == "12.8"
    assert versions["software"]["nvrtc"].startswith("12.") and versions["software"]["fake_driver"] is True
    assert versions["software"]["colibri_sdk"] == str(ROOT / "sdk")


def test_a_failed_measurement_is_recorded_and_the_phase_goes_on(check_run):
    _, _, lines = check_run
    floor = {l["name"]: l for l in lines if l["phase"] == "floor"}
    assert floor["copy_dtod"]["status"] == "fail"
    assert floor["copy_dtod"]["reason"] == "CudaError: cuMemcpyDtoDAsync failed: CUDA_ERROR_UNKNOWN"
    assert floor["read_stream"]["status"] == "ok" and floor["read_stream"]["bytes"] > 0


def test_layer_on_every_path_with_per_kernel_times(check_run):
    _, _, lines = check_run
    every = [l for l in lines if l["phase"] == "layer" and l["name"] == "forward"]
    forward = [l for l in every if l["tokens"] == l["shape_tokens"]]
    assert {l["path"] for l in forward} == {"gemv", "tiled"}, forward
    assert sum(l["default_path"] for l in forward) == 1
    # the plan has a valid_tokens buffer, so one valid token in a padded shape is measured too, on the default path
    padded = [l for l in every if l["tokens"] != l["shape_tokens"]]
    assert len(padded) == 1 and padded[0]["tokens"] == 1 and padded[0]["shape_tokens"] > 1, padded
    assert padded[0]["default_path"] and padded[0]["status"] == "ok", padded
    for f in forward:
        assert f["status"] == "ok" and f["output_finite"] is True, f
        assert f["graph_median_us"] > 0 and f["eager_median_us"] > 0 and f["selected_bytes"] > 0
        # the experts chosen by the host routing are those the routing kernel wrote
        assert f["selected_experts"] == f["device_selected_experts"], f
        kernels = [l for l in lines if l["phase"] == "layer" and l["name"] == "kernel" and l["path"] == f["path"]
                   and l["tokens"] == f["tokens"] and l["shape_tokens"] == f["shape_tokens"]]
        assert [k["index"] for k in kernels] == list(range(f["launches"]))
        assert all(k["median_us"] > 0 for k in kernels)
    stack = [l for l in lines if l["phase"] == "layers" and l["name"] == "forward"]
    assert len(stack) == 1 and stack[0]["layers"] == 2 and stack[0]["launches"] == 2 * forward[0]["launches"]
    # the fake device is sm_90 with a 12.8 driver: the same layers with programmatic dependent launch, every launch
    # but the first with the attribute, the same output bits
    (pdl,) = [l for l in lines if l["phase"] == "layers" and l["name"] == "forward_pdl"]
    assert pdl["status"] == "ok" and pdl["bitwise_equal"] is True, pdl
    assert pdl["launches"] == stack[0]["launches"] and pdl["pdl_launches"] == pdl["launches"] - 1, pdl
    assert pdl["graph_median_us"] > 0 and pdl["off_over_on"] > 0, pdl


def test_correctness_cases_and_transformers(check_run):
    _, _, lines = check_run
    cases = [l for l in lines if l["phase"] == "correctness" and l["name"] == "case"]
    assert len(cases) == 2 and sum(c["status"] == "ok" for c in cases) == 1, cases
    (skipped,) = [c for c in cases if c["status"] == "skip"]
    assert "older than NVRTC 12.9" in skipped["reason"] and "[a100]" in skipped["case"]
    (block,) = [l for l in lines if l["phase"] == "transformers" and l["name"] == "moe_block"]
    assert block["status"] == "ok" and block["match"] is True and block["relative_err"] < 1e-2, block
