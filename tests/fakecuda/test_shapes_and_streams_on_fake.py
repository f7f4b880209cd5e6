"""Several compiled shapes and pipelined calls on the CUDA backend, on the fake CUDA driver (its kernels run on the
CPU emulation, each shape's module bound to the emulation library built with that shape's -D constants).

The expected values come from the float64 reference engine in this process, never from the backend under test. The
fake runs every driver call at once, so "in flight" is checked on its call log: several graph launches on different
streams before the first of them is synchronised.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
from fakecuda_support import HIDDEN
from timeout_support import guard

from colibri_sdk import catalog
from colibri_sdk.bundle import Bundle
from colibri_sdk.reference import ReferenceEngine

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the fake CUDA driver")

CODE = """
import os
from colibri_sdk.runtime import Runtime
from colibri_sdk.runtime import cuda_backend
LIBS = {libs!r}
fake = ctypes.CDLL("libcuda.so.1")
load_functions = cuda_backend.CudaBackend._load_functions
def bound(self, bundle):  # each shape's modules run on the emulation built with its constants
    fake.colibri_fake_cuda_set_kernels(LIBS["{{}}x{{}}".format(*bundle.shape)].encode())
    return load_functions(self, bundle)
cuda_backend.CudaBackend._load_functions = bound
import threading, time
gate = threading.Event()  # holds every wait for a result until the first calls are all enqueued
finish_call = cuda_backend.CudaBackend.finish_call
def gated(self, out):
    gate.wait({wait})
    return finish_call(self, out)
cuda_backend.CudaBackend.finish_call = gated
def launches_since(name):
    lines = open(os.environ["COLIBRI_FAKE_CUDA_LOG"]).read().splitlines()
    return sum(line.startswith("cuGraphLaunch") for line in lines[lines.index(name):])
def mark(name):
    with open(os.environ["COLIBRI_FAKE_CUDA_LOG"], "a") as f:
        f.write(f"# {{name}}\\n")
x = np.random.default_rng(11).standard_normal((1, 4, {hidden})).astype(np.float32)
with Runtime.load({bundle!r}, backend="cuda", streams=3) as rt:
    shapes = rt.shapes
    mark("infer")
    direct = [rt.infer(x[:, :t]).tolist() for t in (1, 2, 3, 4)]
    chosen = rt.stats().as_dict()["shapes_chosen"]
    errors = []
    try:
        rt.infer(np.zeros((1, 5, {hidden}), np.float32))
    except Exception as exc:
        errors.append(f"{{type(exc).__name__}}: {{exc}}")
    mark("submit")
    futures = [rt.submit(x[:, :t]) for t in {submitted}[:3]]
    deadline = time.monotonic() + {wait}
    while launches_since("# submit") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    in_flight = rt._pipeline.in_flight()
    gate.set()
    futures += [rt.submit(x[:, :t]) for t in {submitted}[3:]]
    submitted = [f.result(timeout={wait}).tolist() for f in futures]
    mark("end")
    selftest = rt.self_test().passed
    stats = rt.stats().as_dict()
emit(in_flight=in_flight, shapes=shapes, direct=direct, chosen=chosen, errors=errors, submitted=submitted, selftest=selftest,
     stats=stats, live=live())
"""
SUBMITTED = (2, 4, 1, 3, 4, 2, 4)


@pytest.fixture(scope="module")
def shapes_bundle(tiny_bundle, tmp_path_factory):
    """tiny_bundle's weights with the Orin profile at batch 1 x tokens [2, 4]."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": [2, 4]}
    out = tmp_path_factory.mktemp("shapes") / "bundle"
    return build_bundle(Profile.from_dict(data), out, tiny_bundle / "model.colibri", workers=2).path


def test_shapes_and_pipelined_calls_on_the_fake_driver(shapes_bundle, tiny_bundle, kernels_lib, run_fake):
    from fakecuda_support import emulation_library

    bundle = Bundle.open(shapes_bundle)
    assert bundle.shapes == [(1, 2), (1, 4)]
    # The largest shape's constants are tiny_bundle's: its emulation library is the session's one.
    assert bundle.kernels[0]["defines"] == Bundle.open(tiny_bundle).kernels[0]["defines"]
    libs = {"1x4": str(kernels_lib), "1x2": str(emulation_library(bundle.for_shape(1, 2).kernels))}
    code = CODE.format(libs=libs, bundle=str(shapes_bundle), hidden=HIDDEN, submitted=SUBMITTED,
                       wait=guard(600))
    run = run_fake(code, timeout=guard(960))
    assert run.rc == 0 and run.result, run
    r = run.result
    x = np.random.default_rng(11).standard_normal((1, 4, HIDDEN)).astype(np.float32)
    engine = ReferenceEngine(shapes_bundle / "model.colibri", compute_dtype=np.float64)
    expected = engine(x).astype(np.float32)
    engine.close()
    assert r["shapes"] == [[1, 2], [1, 4]]
    for t, y in zip((1, 2, 3, 4), r["direct"]):
        np.testing.assert_allclose(np.array(y), expected[:, :t], rtol=1e-2, atol=1e-2)
    assert r["chosen"] == {"1x2": 2, "1x4": 2}  # tokens 1, 2 at 1x2; 3, 4 at 1x4
    assert r["errors"] == ["InputError: input tokens 5 (shape (1, 5, 64)); allowed: 1..4, the bundle's largest "
                           "compiled shape's (batch 1 x tokens 4) tokens"]
    for t, y in zip(SUBMITTED, r["submitted"]):
        np.testing.assert_array_equal(np.array(y), np.array(r["direct"][t - 1]))  # submission order, == infer
    assert r["selftest"] is True
    assert r["stats"]["shapes_chosen"] == {"1x2": 2 + 3 + 1, "1x4": 2 + 4 + 1}
    # The weights are uploaded once: every other backend (the 1x2 shape, 3 slots x 2 shapes) borrows them.
    weights_bytes = bundle.open_weights().header.data_size + catalog.WEIGHTS_TAIL_BYTES  # the GEMV windows' tail
    allocs = [line for line in run.calls("cuMemAlloc") if f"bytes={weights_bytes} " in line]
    assert len(allocs) == 1, allocs
    # In flight: the first three submits (streams=3) are all launched, on three streams, before any wait.
    start, end = run.log.index("# submit"), run.log.index("# end")
    window = [line for line in run.log[start:end] if line.split(" ", 1)[0] in ("cuGraphLaunch", "cuStreamSynchronize")]
    first_wait = next(i for i, line in enumerate(window) if line.startswith("cuStreamSynchronize"))
    assert first_wait == 3 and len({line.rsplit("stream=", 1)[1] for line in window[:3]}) == 3, window[:8]
    assert r["in_flight"] == 3
    launches = [line.rsplit("stream=", 1)[1] for line in window if line.startswith("cuGraphLaunch")]
    own = {line.rsplit("stream=", 1)[1] for line in run.log[run.log.index("# infer"):start]
           if line.startswith("cuGraphLaunch")}  # the Runtime's own backends (infer)
    assert len(launches) == len(SUBMITTED) and 3 <= len(set(launches)) <= 3 * 2  # 3 slots x 2 shapes
    assert own and not own & set(launches), "the slots have streams of their own"
    # Everything is freed at close.
    live = r["live"]
    assert (live["device"], live["host"], live["modules"], live["streams"], live["graphs"], live["execs"]) == \
        ("0", "0", "0", "0", "0", "0"), live
