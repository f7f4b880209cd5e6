"""libcolibri (sdk/libcolibri, docs/c_runtime.md) on the fake CUDA driver, under AddressSanitizer + UBSan.

End to end: every shipped profile's bundle (and a batch-2 fp32 tiled-kernel variant) runs its self-test input and is
compared with the self-test output the reference engine wrote at build time. Then every status code from bad calls,
every refusal of a tampered or hostile bundle, the device checks (cubin vs PTX, too old), the integrated-GPU upload,
injected driver failures (error paths leak nothing: LeakSanitizer), and no allocation per call.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from c_runtime_support import SHIPPED, captured_launches, manifest
from timeout_support import guard

from colibri_sdk.bundle.reader import canonical_json, manifest_digest

OK, INVALID_ARG, BUNDLE, NO_DRIVER, UNSUPPORTED_DEVICE, CUDA, OUT_OF_MEMORY, STATE, ABI = range(9)


def clean(run) -> None:
    """No sanitizer report and no complaint of the fake driver (lines starting with "fake libcuda:")."""
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, run
    assert "LeakSanitizer" not in run.stderr, run


# ---- end to end -------------------------------------------------------------------------------------------------
def check_graph_run(run, launches: int, calls: int, captured_total: int | None = None) -> None:
    """Each shape's graph was captured once (`captured_total` launches over all shapes; default `launches`: one
    shape) and replayed per call; nothing was allocated after the first replay."""
    assert run.result["passed"] is True and run.result["allocs_per_call"] == 0, run
    assert run.result["launches"] == launches
    captured = run.calls("cuLaunchKernel")
    assert len(captured) == (captured_total or launches), run.log[:20]
    assert all(line.endswith("captured=1") for line in captured), run.log[:20]
    assert len(run.calls("cuGraphLaunch")) == calls
    first = next(i for i, line in enumerate(run.log) if line.startswith("cuGraphLaunch"))
    assert not [line for line in run.log[first:] if line.startswith(("cuMemAlloc", "cuMemHostAlloc"))]


# Orin, the product's device, in the default run; the other profiles differ only in their constants (block sizes,
# arch), which tests/kernels emulates on their own and tests/build compiles: `bash scripts/test_full.sh` runs them here.
@pytest.mark.parametrize("name", [name if name == "orin" else pytest.param(name, marks=pytest.mark.full)
                                  for name in SHIPPED])
def test_shipped_profile_end_to_end_against_the_reference(run_c, bundles, name):
    """The profile as shipped (arch, fp16, 1 x 16, its block sizes, GEMV path) on a small model; the plain build."""
    major, minor = manifest(bundles[name])["compute_capability"]
    run = run_c(["run", bundles[name], "calls=2"], kernels=name, asan=False, cc=f"{major}.{minor}")
    assert run.rc == 0, run
    assert run.result["image_kind"] == "cubin", run
    check_graph_run(run, len(manifest(bundles[name])["launch"]), 2, captured_launches(manifest(bundles[name])))


@pytest.mark.skipif(not os.environ.get("COLIBRI_C_FULL"),
                    reason="one emulated forward pass of the demo model takes 30-70 s; `bash scripts/c_runtime.sh test` "
                           "runs these (COLIBRI_C_FULL=1)")
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_bundle_as_the_cli_builds_it(run_c, tmp_path, name):
    """`colibri-sdk build --profile NAME` (the embedded demo model), unchanged, one call on the plain build."""
    import subprocess
    import sys

    from emulator import build_library

    bundle = tmp_path / name
    subprocess.run([sys.executable, "-m", "colibri_sdk", "build", "--profile", name, "--demo", "-o", str(bundle)], check=True,
                   capture_output=True)
    m = manifest(bundle)
    major, minor = m["compute_capability"]
    run = run_c(["run", bundle, "calls=1"], kernels=build_library(m["kernels"][0]["defines"]), asan=False,
                cc=f"{major}.{minor}", timeout=guard(1200))
    assert run.rc == 0, run
    check_graph_run(run, len(m["launch"]), 1, captured_launches(m))


def test_end_to_end_under_address_sanitizer(run_c, bundles):
    """Batch 2 x 8, fp32, atomic aggregation, tiled kernels; AddressSanitizer + UBSan + LeakSanitizer."""
    run = run_c(["run", bundles["tiled"]])
    assert run.rc == 0, run
    clean(run)
    check_graph_run(run, len(manifest(bundles["tiled"])["launch"]), 5)


def test_programmatic_dependent_launch_on_sm_90(run_c, bundles):
    """h200 (1 x 4, the GEMV path) with `programmatic_dependent_launch`: the captured plan's first launch
    goes through cuLaunchKernel (it follows the input copy), every later one through cuLaunchKernelEx with the
    programmatic stream serialization attribute; the self-test output is met. Under the sanitizers. (The fake
    driver runs launches in order: this checks the calls, not an overlap.)"""
    m = manifest(bundles["pdl"])
    assert all(launch.get("pdl") for launch in m["launch"][1:]) and "pdl" not in m["launch"][0]
    run = run_c(["run", bundles["pdl"], "calls=2"], kernels="pdl", cc="9.0", driver=12060)
    assert run.rc == 0 and run.result["passed"], run
    clean(run)
    ex, plain = run.calls("cuLaunchKernelEx"), run.calls("cuLaunchKernel")
    assert len(plain) == 1 and len(ex) == len(m["launch"]) - 1, run.log[:20]
    assert all(line.endswith("captured=1 pdl=1") for line in ex), ex[:3]
    assert "pdl=1" not in plain[0]
    assert len(run.calls("cuGraphLaunch")) == 2


def test_input_lengths_zero_the_padding_and_ignore_what_lies_there(run_c, bundles):
    run = run_c(["run", bundles["tiled"], "lengths"])  # NaN past each length in the input
    assert run.rc == 0 and run.result["passed"], run
    clean(run)


def test_eager_mode_launches_every_kernel_per_call(run_c, bundles):
    run = run_c(["run", bundles["tiled"], "eager", "noverify"])
    assert run.rc == 0 and run.result["passed"], run
    assert not run.calls("cuGraphLaunch") and not run.calls("cuStreamBeginCapture")
    assert len(run.calls("cuLaunchKernel")) == 5 * run.result["launches"]


def test_caller_device_pointers_and_stream(run_c, bundles):
    run = run_c(["bind", bundles["tiled"]])
    assert run.rc == 0 and run.result["passed"], run
    clean(run)
    assert run.calls("cuMemcpyDtoDAsync"), "the bound graph copies device to device"


def test_threads_own_and_shared_contexts(run_c, bundles):
    run = run_c(["threads", bundles["tiled"]])
    assert run.rc == 0 and run.result["passed"], run
    clean(run)


# ---- status codes -----------------------------------------------------------------------------------------------
def test_every_status_code_from_bad_calls(run_c, bundles):
    run = run_c(["errors", bundles["tiled"]])
    assert run.rc == 0 and run.result["passed"], run
    clean(run)


@pytest.mark.parametrize("asan", [True, False], ids=["asan", "plain"])
def test_a_stale_output_and_a_freed_or_foreign_handle_are_refused(run_c, bundles, asan):
    # get_output after a new set_input and no infer returned the previous call's output with COLIBRI_OK; a double
    # colibri_free or a call after it was a heap use-after-free (under ASan: a report and exit 1). The plain build
    # runs the same sequence on glibc's allocator, which keeps the freed context in its free lists.
    run = run_c(["handles", bundles["tiled"]], asan=asan)
    assert run.rc == 0 and run.result["passed"], run
    clean(run)


# ---- device checks ----------------------------------------------------------------------------------------------
def test_newer_gpu_jit_compiles_the_ptx(run_c, bundles):
    run = run_c(["run", bundles["tiled"], "noverify"], cc="9.0", driver=12090)
    assert run.rc == 0 and run.result["image_kind"] == "ptx" and run.result["passed"], run
    assert all("kind=ptx" in line for line in run.calls("cuModuleLoadData"))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"cc": "7.5"}, "the GPU is sm_75, the bundle is built for sm_87: its code cannot run on an older GPU"),
        ({"driver": 12000}, "the CUDA driver is 12.0; the bundle needs at least 12.2 (manifest min_driver 12020)"),
        ({"cc": "9.0", "driver": 12040}, "JIT-compiling the PTX (NVRTC 12.9) needs a CUDA driver >= 12.9"),
    ],
)
def test_device_that_cannot_run_the_bundle(run_c, bundles, settings, message):
    run = run_c(["init", bundles["orin"], UNSUPPORTED_DEVICE, message], **settings)
    assert run.rc == 0, run
    clean(run)


def test_integrated_gpu_uploads_from_the_mapping(run_c, bundles):
    run = run_c(["run", bundles["tiled"], "noverify"], integrated=1)
    assert run.rc == 0 and run.result["passed"] and run.result["integrated"] == 1, run
    assert run.calls("cuMemcpyHtoD"), "weights copied straight from the mapping"
    assert len(run.calls("cuMemHostAlloc")) == 3, "only the pinned input, output and lengths; no staging"


def test_discrete_gpu_uploads_through_two_pinned_stages_then_frees_them(run_c, bundles):
    run = run_c(["run", bundles["tiled"], "noverify"])
    assert run.rc == 0, run
    assert len(run.calls("cuMemHostAlloc")) == 5 and len(run.calls("cuMemFreeHost")) == 5  # 2 stages + 3 at free
    assert not run.calls("cuMemcpyHtoD")


@pytest.mark.parametrize(
    "fail, code, message",
    [
        ("cuInit=CUDA_ERROR_NO_DEVICE", NO_DRIVER, "cuInit: CUDA_ERROR_NO_DEVICE"),
        ("cuMemAlloc@3=CUDA_ERROR_OUT_OF_MEMORY", OUT_OF_MEMORY, "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"),
        ("cuModuleLoadData@2=CUDA_ERROR_INVALID_IMAGE", CUDA, "cuModuleLoadData(gate_up.cubin): CUDA_ERROR_INVALID_IMAGE"),
        ("cuMemHostAlloc@4=CUDA_ERROR_OUT_OF_MEMORY", OUT_OF_MEMORY, "cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY"),
        ("cuGraphInstantiate=CUDA_ERROR_INVALID_VALUE", CUDA, "cuGraphInstantiateWithFlags: CUDA_ERROR_INVALID_VALUE"),
    ],
)
def test_driver_failures_are_reported_and_leak_nothing(run_c, bundles, fail, code, message):
    run = run_c(["init", bundles["orin"], code, message], fail=fail)
    assert run.rc == 0, run
    clean(run)  # LeakSanitizer: every error path frees what it allocated


# ---- refusals: the same as the Python bundle reader ------------------------------------------------------------
def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(bundle: Path, change) -> None:
    """Apply `change` to the manifest dict, then write it canonically with a recomputed digest: only the rule the
    change breaks can refuse it."""
    m = manifest(bundle)
    change(m)
    m["manifest_sha256"] = manifest_digest(m)
    (bundle / "manifest.json").write_bytes(canonical_json(m))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_listed_file_is_refused_naming_it(run_c, bundles, tmp_path):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    for i, entry in enumerate(manifest(bundles["orin"])["files"]):
        bundle = copy_bundle(bundles["orin"], tmp_path / f"b{i}")
        flip(bundle / entry["path"], entry["size"] // 2 + 1)
        run = run_c(["init", bundle, BUNDLE, f"{entry['path']}: sha256 "])
        assert run.rc == 0, (entry["path"], run)
        with pytest.raises(BundleError):  # the Python reader refuses it too
            Bundle.open(bundle)


def _nan_rtol(b: Path) -> None:
    text = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text(text.replace('"rtol": 0.01', '"rtol": NaN', 1))


def _duplicate_key(b: Path) -> None:
    text = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text(text.replace('  "arch": "sm_87",\n', '  "arch": "sm_87",\n  "arch": "sm_80",\n', 1))


def _edited_value(b: Path) -> None:  # canonical, but the digest was not recomputed
    m = manifest(b)
    m["sdk_version"] = "9.9.9"
    (b / "manifest.json").write_bytes(canonical_json(m))


def _symlinked_manifest(b: Path) -> None:
    outside = b.parent / f"{b.name}-outside.json"
    shutil.move(b / "manifest.json", outside)
    os.symlink(outside, b / "manifest.json")


def _symlinked_folder(b: Path) -> None:
    outside = b.parent / f"{b.name}-kernels"
    shutil.move(b / "kernels", outside)
    os.symlink(outside, b / "kernels")


def _fifo(b: Path) -> None:
    (b / "selftest" / "input.npy").unlink()
    os.mkfifo(b / "selftest" / "input.npy")


def _truncated_weights(b: Path) -> None:
    with open(b / "model.colibri", "r+b") as f:
        f.truncate(1000)


def top_and_largest(m: dict, key: str) -> list:
    """m[key] and the last `shapes` entry's (which must equal it): what an edit of the largest shape's plan changes."""
    return [m[key]] + [m["shapes"][-1][key]] * ("shapes" in m)


def _add_i32_out_of_range(m: dict) -> None:
    m["launch"][0]["args"].append({"kind": "i32", "value": 1 << 40})


def _control_character(m: dict) -> None:
    m["selftest"]["input"] = "selftest/in\x01put.npy"


HOSTILE = {
    "manifest byte": (lambda b: flip(b / "manifest.json", 40), "manifest.json"),
    "NaN in the manifest": (_nan_rtol, "manifest.json: not valid JSON"),
    "duplicate key": (_duplicate_key, 'manifest.json: duplicate key "arch"'),
    "edited, digest kept": (_edited_value, "differs from the recorded manifest_sha256"),
    "unlisted file": (lambda b: (b / "kernels" / "extra.bin").write_bytes(b"x"), "kernels/extra.bin: not listed"),
    "symlinked manifest": (_symlinked_manifest, "manifest.json: a symlink"),
    "symlinked folder": (_symlinked_folder, "a symlink"),
    "FIFO": (_fifo, "selftest/input.npy: not a regular file"),
    "truncated weights": (_truncated_weights, "model.colibri: 1000 bytes; the manifest records"),
}

HOSTILE_MANIFESTS = {
    "control character in a path": (_control_character, "holds a control character"),
    "kernel image not listed": (lambda m: m["kernels"][0].update(cubin="kernels/missing.cubin"),
                                'kernels[0].cubin = "kernels/missing.cubin" is not a listed file'),
    "path outside": (lambda m: m["kernels"][0].update(ptx="../outside.ptx"), "allowed: a normalised relative path"),
    "weights header differs": (lambda m: m["weights"]["header"].update(top_k=3),
                               "header top_k = 2, but the manifest's weights.header.top_k = 3"),
    "unknown key": (lambda m: m.update(extra=1), "manifest.json: unknown key 'extra'"),
    "schema version": (lambda m: m.update(schema_version=2), "schema_version = 2"),
    "float where an int belongs": (lambda m: m.update(min_driver=12020.0), "min_driver = 12020; allowed: int"),
    "no buffers (an older build)": (lambda m: m.pop("buffers"), "rebuild it"),
    "unknown argument kind": (lambda m: m["launch"][0]["args"][0].update(kind="float"), "kind float; allowed"),
    "unknown buffer": (lambda m: m["launch"][1]["args"][0].update(name="nope"), "names buffer nope"),
    "weights offset outside": (lambda m: m["launch"][0]["args"][1].update(offset=1 << 40), "args[1].offset"),
    "i32 out of range": (_add_i32_out_of_range, "].value; allowed: an int32"),
    "io buffer too small": (lambda m: m["buffers"].update(x0=4), "io_buffers.input is buffer x0 of 4 bytes"),
    "unknown symbol": (lambda m: [plan[0].update(symbol="colibri_nope") for plan in top_and_largest(m, "launch")],
                       "names colibri_nope"),
    "shapes: unknown key": (lambda m: m["shapes"][0].update(extra=1), "manifest.json: shapes[0]: unknown key 'extra'"),
    "shapes: kernel image not listed": (lambda m: m["shapes"][0]["kernels"][1].update(ptx="kernels/missing.ptx"),
                                        'kernels[1].ptx = "kernels/missing.ptx" is not a listed file'),
    "shapes: tokens 0": (lambda m: m["shapes"][0].update(tokens=0), "shapes[0] batch 1 x tokens 0; allowed: 1..65536"),
    "shapes: empty": (lambda m: m.update(shapes=[]), "manifest.json: shapes is empty; allowed: 1..64 entries"),
    "shapes: not an object": (lambda m: m["shapes"].append(3), "manifest.json: shapes[2] is not an object"),
    "shapes: 65 entries": (lambda m: m.update(shapes=m["shapes"][:1] * 65), "manifest.json: shapes has 65 entries; "
                           "allowed: 1..64"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundle_is_refused(run_c, bundles, tmp_path, case):
    change, message = HOSTILE[case]
    bundle = copy_bundle(bundles["orin"], tmp_path / "b")
    change(bundle)
    run = run_c(["init", bundle, BUNDLE, message])
    assert run.rc == 0, run
    clean(run)


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_refused(run_c, bundles, tmp_path, case):
    change, message = HOSTILE_MANIFESTS[case]
    bundle = copy_bundle(bundles["orin"], tmp_path / "b")
    rewrite(bundle, change)
    run = run_c(["init", bundle, BUNDLE, message])
    assert run.rc == 0, run
    clean(run)


def test_mutated_manifests_are_refused_never_a_crash(run_c, bundles, tmp_path):
    """200 single-byte changes and truncations of manifest.json, under AddressSanitizer: every one is refused."""
    bundle = copy_bundle(bundles["tiled"], tmp_path / "b")
    run = run_c(["fuzz", bundle, 200, 20261201])
    assert run.rc == 0 and run.result == {"passed": True, "refused": 200, "mutations": 200}, run
    clean(run)


# ---- the conventions a launch plan may use beyond pointers -------------------------------------------------------
def test_i32_arguments_and_a_valid_tokens_buffer_are_honoured(run_c, bundles, tmp_path):
    """{"kind": "i32", "value": N} passes an int32 by value; io_buffers.valid_tokens names an int32 (batch,) buffer
    the graph fills with the input lengths before the input copy."""
    bundle = copy_bundle(bundles["tiled"], tmp_path / "b")

    def change(m):
        m["launch"][-1]["args"].append({"kind": "i32", "value": 7})  # beyond the kernel's parameters: ignored
        m["buffers"]["valid_tokens"] = 4 * m["shape"]["batch"]
        m["io_buffers"]["valid_tokens"] = "valid_tokens"
        for key in ("launch", "buffers", "io_buffers"):  # the largest shape's entry equals the top-level keys
            m["shapes"][-1][key] = m[key]

    rewrite(bundle, change)
    run = run_c(["run", bundle])
    assert run.rc == 0 and run.result["passed"], run
    nodes = [line for line in run.calls("cuStreamEndCapture")]
    assert nodes == [f"cuStreamEndCapture nodes={run.result['launches'] + 3}"], nodes  # lengths, input, output
    assert [line for line in run.calls("cuMemAlloc") if "bytes=8 " in line], "valid_tokens: batch 2 x int32"


# ---- the example -------------------------------------------------------------------------------------------------
def test_camera_loop_example_runs_paced_frames(run_c, bundles):
    run = run_c([bundles["tiled"], "--frames", "3", "--fps", "50"], program="qc_loop")
    assert run.rc == 0, run
    frames = [json.loads(line) for line in run.stdout.splitlines()]
    assert [f["frame"] for f in frames] == [0, 1, 2] and all(f["latency_ms"] > 0 for f in frames), frames
    assert "3 frames, latency p50" in run.stderr


def test_camera_loop_reads_raw_frames_from_stdin(run_c, bundles):
    import numpy as np

    from colibri_sdk.bundle import Bundle

    x, _, _, _ = Bundle.open(bundles["tiled"]).selftest()
    frames = np.concatenate([x, x]).astype("<f4").tobytes()
    run = run_c([bundles["tiled"], "--source", "stdin", "--frames", "5", "--fps", "100"], program="qc_loop",
                stdin=frames)
    assert run.rc == 0, run
    scores = [json.loads(line)["score"] for line in run.stdout.splitlines()]
    assert len(scores) == 2 and scores[0] == scores[1] > 0, scores  # the end of input ends the loop


def test_camera_loop_refuses_a_bad_bundle_in_one_line(run_c, tmp_path):
    run = run_c([tmp_path / "missing", "--frames", "1"], program="qc_loop")
    assert run.rc == 1 and run.stderr.strip().count("\n") == 0, run
    assert "is not a bundle folder" in run.stderr and "COLIBRI_ERR_BUNDLE" in run.stderr
