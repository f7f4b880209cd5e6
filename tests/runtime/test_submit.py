"""`Runtime.submit`: futures, submission order, the bounded queue, errors at submit or in the future."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

from colibri_sdk.errors import BackendError, InputError
from colibri_sdk.runtime import Runtime


def test_results_equal_synchronous_calls_in_order(small_bundle):
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((2, int(t), 64)).astype(np.float32) for t in (8, 3, 8, 5, 1, 8)]
    with Runtime.load(small_bundle, backend="cpu") as rt:
        expected = [rt.infer(x) for x in xs]
    with Runtime.load(small_bundle, backend="cpu", streams=3) as rt:
        buf = rng.standard_normal((2, 8, 64)).astype(np.float32)
        futures = []
        for x in xs:
            buf[:, : x.shape[1]] = x
            futures.append(rt.submit(buf[:, : x.shape[1]].copy()))
            buf[:] = np.nan  # the caller reuses its buffer at once: submit copied the input
        done_order = []
        lock = threading.Lock()
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: (lock.acquire(), done_order.append(i), lock.release()))
        results = [f.result(timeout=guard(600)) for f in futures]
        out = np.empty((2, 8, 64), np.float32)
        assert rt.submit(xs[0], out=out).result(timeout=guard(600)) is out
        assert rt.stats().calls == len(xs) + 1
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, expected[0])
    assert done_order == sorted(done_order)


def test_the_queue_is_bounded_and_errors_are_typed(small_bundle):
    with Runtime.load(small_bundle, backend="cpu", streams=1) as rt:
        gate = threading.Event()
        original = rt._backend.run_layers

        def slow(*args):
            gate.wait(guard(600))
            return original(*args)

        rt._backend.run_layers = slow
        first = rt.submit(np.zeros((1, 8, 64), np.float32))
        with pytest.raises(TimeoutError, match=r"no free slot within 0.2 s: 1 calls in flight"):
            rt.submit(np.zeros((1, 8, 64), np.float32), timeout=0.2)
        gate.set()
        assert first.result(timeout=guard(600)).shape == (1, 8, 64)
        with pytest.raises(InputError, match=r"input dtype float64; allowed: float32, float16"):
            rt.submit(np.zeros((1, 8, 64)))
        nan = np.zeros((1, 8, 64), np.float32)
        nan[0, 5, 3] = np.nan
        with pytest.raises(InputError, match=r"^input has non-finite values \(NaN or Inf\) at 1 valid position, first "
                                             r"at \(batch 0, token 5\); all values at valid positions must be finite$"):
            rt.submit(nan)  # refused by submit itself, as by infer
        past = rt.submit(nan, input_lengths=[5])  # the NaN past the length is never read
        assert (past.result(timeout=guard(600))[0, 5:] == 0).all()
        rt._backend.run_layers = lambda *a: (_ for _ in ()).throw(BackendError("boom"))
        failed = rt.submit(np.zeros((1, 8, 64), np.float32))
        with pytest.raises(BackendError, match="boom"):
            failed.result(timeout=guard(600))
    with pytest.raises(BackendError, match="this Runtime is closed"):
        rt.submit(np.zeros((1, 8, 64), np.float32))
    with pytest.raises(InputError) as info:
        Runtime.load(small_bundle, backend="cpu", streams=0)
    assert str(info.value) == "streams 0; allowed: an int 1..64 (calls in flight)"


def test_streams_from_the_profile(tmp_path, small_bundle):
    import copy
    import json
    import shutil

    from runtime_bundles import write_manifest

    from colibri_sdk.errors import ProfileError
    from colibri_sdk.profile import Profile, load_profile

    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["streams"] = 4
    assert Profile.from_dict(data, "p.yaml", toolchain=False).data["streams"] == 4
    data["streams"] = 0
    with pytest.raises(ProfileError, match=r"p.yaml: streams = 0; allowed: an integer in 1..64"):
        Profile.from_dict(data, "p.yaml", toolchain=False)
    folder = Path(shutil.copytree(small_bundle, tmp_path / "b"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["profile"]["streams"] = 3
    write_manifest(folder, manifest)
    with Runtime.load(folder, backend="cpu") as rt:
        assert rt.streams == 3
    with Runtime.load(folder, backend="cpu", streams=2) as rt:
        assert rt.streams == 2


def _wait_for_the_end_of(worker: threading.Thread) -> None:
    """The pipeline's worker ends (it looks for its Runtime once a second); the guard only catches a hang."""
    import time

    deadline = time.monotonic() + guard(120)
    while worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker.is_alive()


def test_a_forgotten_runtime_is_collected_and_its_worker_ends(small_bundle):
    import gc
    import weakref

    rt = Runtime.load(small_bundle, backend="cpu")
    assert rt.submit(np.zeros((1, 8, 64), np.float32)).result(timeout=guard(600)).shape == (1, 8, 64)
    worker = rt._pipeline._threads[0]
    ref = weakref.ref(rt)
    del rt
    gc.collect()
    assert ref() is None, "the pipeline's worker must not keep the Runtime alive"
    _wait_for_the_end_of(worker)


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), "1", True, 1e10])  # 1e10: queue's OverflowError
def test_a_bad_submit_timeout_is_refused_by_name(small_bundle, timeout):
    x = np.zeros((1, 2, 64), np.float32)
    with Runtime.load(small_bundle, backend="cpu", verify=False) as rt:
        with pytest.raises(InputError, match=r"submit timeout = .*; allowed: None \(wait\) or a finite number of "
                                             r"seconds >= 0"):
            rt.submit(x, timeout=timeout)
        assert rt.submit(x, timeout=0.5).result(timeout=guard(600)).shape == x.shape


def test_a_dropped_runtime_runs_every_accepted_call_as_close_does(small_bundle):
    import gc
    import weakref

    xs = [np.full((1, 8, 64), 0.1 * (i + 1), np.float32) for i in range(3)]
    with Runtime.load(small_bundle, backend="cpu") as rt:
        expected = [rt.infer(x) for x in xs]
    rt = Runtime.load(small_bundle, backend="cpu", streams=3)
    gate = threading.Event()
    original = rt._backend.run_layers

    def slow(*args, **kwargs):
        gate.wait(guard(600))
        return original(*args, **kwargs)

    rt._backend.run_layers = slow
    futures = [rt.submit(x) for x in xs]
    worker = rt._pipeline._threads[0]
    ref = weakref.ref(rt)
    del rt  # forgotten with three calls accepted, the first one running
    gc.collect()
    gate.set()
    results = [f.result(timeout=guard(600)) for f in futures]
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)
    gc.collect()
    assert ref() is None, "a Runtime whose accepted calls have run must be collectable"
    _wait_for_the_end_of(worker)
