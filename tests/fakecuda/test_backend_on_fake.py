"""The CUDA backend (sdk/runtime/cuda_backend.py) and the driver probe run against the fake CUDA driver.

What runs is the real backend through the installed cuda-bindings: every driver call, its argument marshalling and
return unpacking, the weight upload (pinned staging or straight from the mapping), the buffers, the graph capture
and replay. The kernels are the emulated ones of tests/kernels (compiled for the bundle's constants), so the output
is checked against the float64 reference engine. Each test runs its code in a subprocess on the fake driver.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from fakecuda_support import HIDDEN, TOKENS, log_sections

from colibri_sdk import catalog

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

# Loads the bundle through the public API and the backend class; prints outputs as float32 bit patterns.
FORWARD = """
import os
from colibri_sdk.bundle import Bundle
from colibri_sdk.runtime import Runtime
from colibri_sdk.runtime.cuda_backend import CudaBackend
def mark(name):  # a '# name' line in the fake's call log (it appends and flushes per line too)
    with open(os.environ["COLIBRI_FAKE_CUDA_LOG"], "a") as f:
        f.write(f"# {{name}}\\n")
path = {bundle!r}
x = np.random.default_rng(11).standard_normal((1, {tokens}, {hidden})).astype(np.float32)
with Runtime.load(path, backend="cuda") as rt:
    api = rt.infer(x[0])
    selftest = rt.self_test()
    backend = rt.backend_name
bundle = Bundle.open(path)
with CudaBackend(bundle) as graph, CudaBackend(bundle, eager=True) as eager:
    after_load = live()
    mark("replays")
    graph.poison()
    replays = [graph.infer_padded(x) for _ in range(3)]
    mark("eager")
    eager.poison()
    y_eager = eager.infer_padded(x)
    info = dict(kind=graph.image_kind, name=graph.device_name, integrated=graph.integrated, cc=graph.compute_capability)
emit(api=api.tolist(), selftest=bool(selftest.passed), backend=backend, after_load=after_load, closed=live(),
     replays=[r.view(np.uint32).tolist() for r in replays], eager=y_eager.view(np.uint32).tolist(), **info)
"""


def forward(run_fake, tiny_bundle, **settings):
    code = FORWARD.format(bundle=str(tiny_bundle), tokens=TOKENS, hidden=HIDDEN)
    run = run_fake(code, **settings)
    assert run.rc == 0 and run.result, run
    return run


def bits(values) -> np.ndarray:
    return np.array(values, dtype=np.uint32).view(np.float32)


def check_matches_reference(y: np.ndarray, expected: np.ndarray) -> None:
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-3 * scale)


def test_discrete_gpu_cubin_graph_and_eager(run_fake, tiny_bundle, reference_output):
    _, expected = reference_output
    run = forward(run_fake, tiny_bundle, cc="8.7", integrated=0)
    r = run.result
    assert r["backend"] == "cuda" and r["selftest"] is True
    assert (r["kind"], r["integrated"], tuple(r["cc"])) == ("cubin", False, (8, 7))
    assert r["name"] == "Colibri Fake Discrete GPU (sm_87)"
    check_matches_reference(np.array(r["api"], np.float32)[None], expected)
    replays = [bits(v) for v in r["replays"]]
    check_matches_reference(replays[0], expected)
    for i, y in enumerate(replays[1:], 1):
        assert np.array_equal(y.view(np.uint32), replays[0].view(np.uint32)), f"replay {i} differs from the first"
    assert np.array_equal(bits(r["eager"]).view(np.uint32), replays[0].view(np.uint32)), "graph != eager bitwise"
    assert not [line for line in run.log if line.startswith("!")], "the fake complained"
    # The driver-call sequence: cubins, staged upload, everything freed, one graph launch per call.
    sections = log_sections(run)
    loads = [line for line in sections["load"] if line.startswith("cuModuleLoadData")]
    assert loads and all(" kind=cubin sm=87 " in line for line in loads), loads
    assert not [line for line in run.log if line.startswith("cuMemcpyHtoD ")], "discrete GPU: no synchronous copy"
    weights = [line for line in sections["load"] if line.startswith("cuMemcpyHtoDAsync") and "captured=0" in line]
    assert weights and all("pinned=1" in line for line in weights)
    assert r["after_load"]["host"] == "4", "2 pinned buffers (input, output) per backend; staging is freed after load"
    assert r["after_load"]["events"] == "0"
    replay_calls = [line.split()[0] for line in sections["replays"]]
    assert replay_calls.count("cuGraphLaunch") == 3 and "cuLaunchKernel" not in replay_calls
    assert replay_calls.count("cuStreamSynchronize") == 3
    eager_calls = [line.split()[0] for line in sections["eager"]]
    assert "cuGraphLaunch" not in eager_calls and eager_calls.count("cuLaunchKernel") > 0
    assert set(r["closed"].values()) == {"0"}, f"leaked: {r['closed']}"


def test_integrated_gpu_copies_from_the_mapping(run_fake, tiny_bundle, reference_output):
    _, expected = reference_output
    run = forward(run_fake, tiny_bundle, cc="8.7", integrated=1)
    r = run.result
    assert r["integrated"] is True and r["name"] == "Colibri Fake Integrated GPU (sm_87)"
    check_matches_reference(bits(r["replays"][0]), expected)
    assert np.array_equal(bits(r["eager"]).view(np.uint32), bits(r["replays"][0]).view(np.uint32))
    from colibri_sdk.bundle import Bundle

    with Bundle.open(tiny_bundle).open_weights() as f:
        data_size = f.header.data_size
    sync = run.calls("cuMemcpyHtoD")
    assert sync and all("pinned=0" in line for line in sync), "weights straight from the mmap, no staging"
    per_backend = sum(int(line.split("bytes=")[1].split()[0]) for line in sync) / 3  # Runtime + 2 backends
    assert per_backend == data_size
    assert len(run.calls("cuMemHostAlloc")) == 3 * 2, "only the pinned input and output, no staging buffers"


@pytest.mark.parametrize(
    "cc,kind",
    [("8.9", "cubin"), ("9.0", "ptx")],
)
def test_compute_capability_picks_the_image(run_fake, tiny_bundle, cc, kind):
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.runtime.cuda_backend import CudaBackend
        x = np.random.default_rng(11).standard_normal((1, {TOKENS}, {HIDDEN})).astype(np.float32)
        with CudaBackend(Bundle.open({str(tiny_bundle)!r})) as b:
            emit(kind=b.image_kind, y=b.infer_padded(x).tolist())
    """, cc=cc)
    assert run.rc == 0, run
    assert run.result["kind"] == kind
    loads = run.calls("cuModuleLoadData")
    assert len(loads) == len(catalog.kernels_for({})) and all(f" kind={kind} sm=87 " in line for line in loads), loads
    assert np.isfinite(np.array(run.result["y"])).all()


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"cc": "8.0"}, r"the GPU is sm_80, the bundle is built for sm_87: its code cannot run on an older GPU"),
        ({"cc": "9.0", "driver": 12060},
         r"the GPU is sm_90, the bundle is built for sm_87: .*needs a CUDA driver >= 12.9, this one is 12.6"),
        ({"cc": "8.7", "driver": 12000}, r"the CUDA driver is 12.0; the bundle needs at least 12.2"),
    ],
)
def test_refusals_name_both_sides(run_fake, tiny_bundle, settings, message):
    run = run_fake(f"""
        from colibri_sdk.errors import BackendError
        from colibri_sdk.runtime import Runtime
        try:
            Runtime.load({str(tiny_bundle)!r}, backend="cuda")
        except BackendError as exc:
            emit(error=str(exc), live=live())
    """, **settings)
    assert run.rc == 0 and run.result, run
    assert re.search(message, run.result["error"]), run.result["error"]
    assert set(run.result["live"].values()) == {"0"}, f"leaked after the refusal: {run.result['live']}"
    assert not run.calls("cuModuleLoadData"), "refused before loading any image"


def test_failing_calls_raise_cuda_error_and_leak_nothing(run_fake, tiny_bundle):
    """Each driver call of the load, failing in turn (the fake's injection hook), gives CudaError(call, error name)
    and frees everything acquired before it."""
    calls = ["cuInit", "cuDevicePrimaryCtxRetain", "cuStreamCreate", "cuModuleLoadData@3", "cuModuleGetFunction@4",
             "cuMemAlloc", "cuMemAlloc@5", "cuMemHostAlloc@2", "cuEventCreate@2", "cuMemcpyHtoDAsync",
             "cuEventRecord", "cuStreamBeginCapture", "cuLaunchKernel@3", "cuMemcpyDtoHAsync", "cuStreamEndCapture",
             "cuGraphInstantiate"]
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.errors import CudaError
        from colibri_sdk.runtime.cuda_backend import CudaBackend
        lib = ctypes.CDLL("libcuda.so.1")
        bundle = Bundle.open({str(tiny_bundle)!r})
        out = {{}}
        for call in {calls!r}:
            lib.colibri_fake_cuda_fail(f"{{call}}=CUDA_ERROR_OUT_OF_MEMORY".encode())
            try:
                CudaBackend(bundle).close()
                out[call] = ("no error", "", "")
            except CudaError as exc:
                out[call] = (str(exc), exc.call, exc.code)
            out[call] += (live(),)
        lib.colibri_fake_cuda_fail(b"")
        emit(**out)
    """)
    assert run.rc == 0 and run.result, run
    for call in calls:
        message, name, code, live = run.result[call]
        base = call.split("@")[0]
        assert name.startswith(base) and code == "CUDA_ERROR_OUT_OF_MEMORY", (call, message)
        assert message.startswith(base) and message.endswith("failed: CUDA_ERROR_OUT_OF_MEMORY"), (call, message)
        assert set(live.values()) == {"0"}, f"{call} failing leaked {live}"


def test_out_of_memory_through_the_runtime_and_close_twice(run_fake, tiny_bundle):
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.errors import BackendError, CudaError
        from colibri_sdk.runtime import Runtime
        from colibri_sdk.runtime.cuda_backend import CudaBackend
        try:
            Runtime.load({str(tiny_bundle)!r}, backend="cuda")
            oom = None
        except CudaError as exc:
            oom = (str(exc), exc.call, exc.code)
        ctypes.CDLL("libcuda.so.1").colibri_fake_cuda_fail(b"")
        b = CudaBackend(Bundle.open({str(tiny_bundle)!r}))
        b.close()
        b.close()
        try:
            b.infer_padded(np.zeros((1, {TOKENS}, {HIDDEN}), np.float32))
            closed = None
        except BackendError as exc:
            closed = str(exc)
        emit(oom=oom, closed=closed, live=live(), repr=repr(b))
    """, fail="cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY")
    assert run.rc == 0 and run.result, run
    oom = ["cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY", "cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert run.result["oom"] == oom
    assert run.result["closed"] == "this CUDA backend is closed; load the bundle again"
    assert set(run.result["live"].values()) == {"0"}, run.result["live"]
    assert run.result["repr"] == "CudaBackend(Colibri Fake Discrete GPU (sm_87), cubin, closed)"
    assert "fake libcuda: cuMemAlloc: injected failure CUDA_ERROR_OUT_OF_MEMORY" in run.stderr


@pytest.mark.parametrize("integrated", [0, 1])
def test_upload_in_many_chunks(run_fake, tiny_bundle, integrated):
    """A 4000-byte upload chunk (instead of 64 MiB): the staging ring reuses its buffers and events, the integrated
    path drops pages chunk by chunk; the output is bitwise that of a one-chunk upload."""
    run = run_fake(f"""
        from colibri_sdk.bundle import Bundle
        from colibri_sdk.runtime import cuda_backend, cuda_upload
        bundle = Bundle.open({str(tiny_bundle)!r})
        x = np.random.default_rng(11).standard_normal((1, {TOKENS}, {HIDDEN})).astype(np.float32)
        with cuda_backend.CudaBackend(bundle, eager=True) as b:
            whole = b.infer_padded(x)
        cuda_upload.UPLOAD_CHUNK = 4000
        with cuda_backend.CudaBackend(bundle, eager=True) as b:
            chunked = b.infer_padded(x)
        emit(same=bool(np.array_equal(whole.view(np.uint32), chunked.view(np.uint32))))
    """, integrated=integrated)
    assert run.rc == 0 and run.result, run
    assert run.result["same"] is True
    from colibri_sdk.bundle import Bundle

    with Bundle.open(tiny_bundle).open_weights() as f:
        chunks = -(-f.header.data_size // 4000)
    copies = run.calls("cuMemcpyHtoD" if integrated else "cuMemcpyHtoDAsync")
    assert sum(" bytes=4000 " in line for line in copies) == chunks - 1, "the weights went up in 4000-byte chunks"
    if not integrated:  # chunk i >= 2 waits for the copy of chunk i - 2 before refilling its staging buffer
        assert len(run.calls("cuEventSynchronize")) == chunks - 2


def test_probe_reports_the_fake_device(run_fake):
    code = "from colibri_sdk.runtime.driver import probe_driver\nemit(probe=probe_driver())"
    assert run_fake(code).result == {"probe": [True, "CUDA driver 12.9, 1 device(s)"]}
    assert run_fake(code, driver=12060, devices=2).result == {"probe": [True, "CUDA driver 12.6, 2 device(s)"]}
    no_device = [False, "cuInit failed with CUresult 100 (CUDA_ERROR_NO_DEVICE)"]
    assert run_fake(code, devices=0).result == {"probe": no_device}


def test_cli_verify_and_run_on_cuda(run_fake, tiny_bundle, tmp_path):
    cli = [sys.executable, "-m", "colibri_sdk"]
    verify = run_fake(args=[*cli, "verify", "--backend", "cuda", str(tiny_bundle)])
    assert verify.rc == 0, verify
    assert "self-test passed on cuda" in verify.stdout
    out = tmp_path / "y.npy"
    graph = run_fake(args=[*cli, "run", "--backend", "cuda", "--iters", "2", "--output", str(out), str(tiny_bundle)])
    assert graph.rc == 0, graph
    assert "backend  cuda (CUDA Graph replay)" in graph.stdout
    assert np.load(out).shape == (1, TOKENS, HIDDEN)
    eager = run_fake(args=[*cli, "run", "--backend", "cuda", "--eager", "--iters", "1", str(tiny_bundle)])
    assert eager.rc == 0 and "backend  cuda (eager launches)" in eager.stdout, eager
    broken = run_fake(args=[*cli, "run", "--backend", "cuda", str(tiny_bundle)],
                      fail="cuGraphInstantiate=CUDA_ERROR_OUT_OF_MEMORY")
    assert broken.rc == 1 and "cuGraphInstantiate failed: CUDA_ERROR_OUT_OF_MEMORY" in broken.stderr, broken


def _edited_copy(bundle: Path, folder: Path, key: str, edit) -> Path:
    """A copy of `bundle` at `folder` whose manifest[key] was changed by `edit` (in the largest `shapes` entry too,
    which must equal the top level) and re-digested: only the rule the edit breaks can refuse it."""
    import json

    from colibri_sdk.bundle import canonical_json, manifest_digest

    folder = Path(shutil.copytree(bundle, folder))
    m = json.loads((folder / "manifest.json").read_text())
    for record in [m] + m.get("shapes", [])[-1:]:
        edit(record[key])
    m["manifest_sha256"] = manifest_digest(m)
    (folder / "manifest.json").write_bytes(canonical_json(m))
    return folder


def _load_refused(run_fake, folder: Path):
    """Runtime.load(folder, backend="cuda") on the fake driver; the run emits the BundleError and the live objects."""
    run = run_fake(f"""
        from colibri_sdk.errors import BundleError
        from colibri_sdk.runtime import Runtime
        try:
            Runtime.load({str(folder)!r}, backend="cuda", eager=True)
        except BundleError as exc:
            emit(error=str(exc), live=live())
    """)
    assert run.rc == 0 and run.result, run
    return run


def test_kernels_compiled_for_another_shape_are_refused_before_any_launch(run_fake, tiny_bundle, tmp_path):
    """kernels[].defines (re-digested after the edit; e.g. another shape's kernel entries moved into this one) must
    be the catalogue's compile constants for the bundle's profile, shape and weights."""
    folder = _edited_copy(tiny_bundle, tmp_path / "b", "kernels",
                          lambda kernels: kernels[1]["defines"].update(COLI_BATCH=2))
    run = _load_refused(run_fake, folder)
    assert run.result["error"].startswith("manifest.json: kernels[1] ("), run
    assert "defines differ from the catalogue's compile constants" in run.result["error"]
    assert set(run.result["live"].values()) == {"0"}, f"leaked after the refusal: {run.result['live']}"
    assert not run.calls("cuModuleLoadData")


@pytest.mark.parametrize("edit", [
    lambda plan: plan[0].update(grid=[1 << 20, 1, 1]),
    lambda plan: plan[0]["args"][0].update(name="nope"),
    lambda plan: plan[0]["args"][1].update(offset=1 << 40),
    lambda plan: plan.__setitem__(0, 5),
])
def test_an_edited_launch_plan_is_refused_before_any_launch(run_fake, tiny_bundle, tmp_path, edit):
    """The manifest's launch plan (re-digested after the edit) must be the catalogue's for the bundle's profile
    and model: a grid, buffer or weights offset of its own would launch the kernels outside their buffers."""
    folder = _edited_copy(tiny_bundle, tmp_path / "b", "launch", edit)
    run = _load_refused(run_fake, folder)
    assert run.result["error"].startswith("manifest.json: launch[0] differs from the catalogue's launch plan"), run
    assert set(run.result["live"].values()) == {"0"}, f"leaked after the refusal: {run.result['live']}"
    assert not run.calls("cuLaunchKernel")
