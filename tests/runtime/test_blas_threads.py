"""The CPU backend's BLAS thread rule (colibri_sdk.blas): one thread inside decode-sized calls, set and restored
around each call with threadpoolctl, never for the rest of the process; an explicit thread variable wins."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info
from timeout_support import guard

from colibri_sdk import blas
from colibri_sdk.runtime import Runtime


def blas_threads_now() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def no_thread_variables(monkeypatch):
    for name in blas.ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def two_threads():
    """Give the BLAS library 2 threads for the test (as on an unconfigured 2-core machine), whatever CI set."""
    from threadpoolctl import threadpool_limits

    if not blas_threads_now():
        pytest.skip("NumPy here links no BLAS library that threadpoolctl can see")
    limiter = threadpool_limits(limits=2, user_api="blas")
    yield
    limiter.restore_original_limits()


def test_rule(no_thread_variables, monkeypatch):
    assert blas.threads_for(1) == 1
    assert blas.threads_for(blas.SMALL_ROWS) == 1
    assert blas.threads_for(blas.SMALL_ROWS + 1) is None
    cpus = len(os.sched_getaffinity(0))
    assert blas.threads(1) == blas.threads(blas.SPLIT_ROWS - 1) == 1
    assert blas.threads(blas.SPLIT_ROWS) == blas.threads(blas.SMALL_ROWS + 1) == cpus
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas.threads_for(1) is None  # the user's explicit choice is kept
    assert blas.threads(1) == 2
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert blas.threads(blas.SMALL_ROWS + 1) == 1  # the user's one thread, at any size
    for bad in ("many", "0", "-3", "1,2", "\u0663"):  # not a positive integer (an Arabic-Indic 3 included): unset
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", bad)
        assert blas.threads_for(1) == 1 and blas.threads(1) == 1, bad
        assert blas.threads(blas.SMALL_ROWS + 1) == cpus and blas.threads(1) == 1, bad


def test_the_cpu_engine_splits_its_experts_between_the_call_threads(no_thread_variables, monkeypatch, tmp_path):
    """CpuEngine.threads is blas.threads(rows): 1 below SPLIT_ROWS rows, the CPUs from there, the user's thread
    variable where set."""
    from colibri_sdk.format import ColibriFile, Header, write_model
    from colibri_sdk.runtime.cpu_engine import CpuEngine

    h = Header(num_layers=1, num_experts=2, top_k=1, hidden_size=8, intermediate_size=8, dtype=0)
    w = np.zeros((1, 2, 8, 8), np.float32)
    path = write_model(tmp_path / "m.colibri", h, w, w, w, np.zeros((1, 8, 2), np.float32))
    with ColibriFile(path) as model:
        assert CpuEngine(model, blas.SPLIT_ROWS - 1).threads == 1
        assert CpuEngine(model, blas.SPLIT_ROWS).threads == len(os.sched_getaffinity(0))
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert CpuEngine(model, 1).threads == CpuEngine(model, 16).threads == 3


def test_the_split_follows_each_calls_rows_and_the_pool_grows_with_it(no_thread_variables, monkeypatch, tmp_path):
    """CpuBackend sets the engine's thread count from each call's rows (a one-token call on a 16-token shape runs
    on one thread); a thread variable raised after load makes the next call's pool as large as its count (a pool
    made for fewer would run the parts one after another), with the same outputs."""
    from colibri_sdk.format import ColibriFile, Header, write_model
    from colibri_sdk.runtime.cpu_backend import CpuBackend

    rng = np.random.default_rng(3)
    h = Header(num_layers=1, num_experts=8, top_k=2, hidden_size=16, intermediate_size=16, dtype=0)
    w = [rng.standard_normal((1, 8, 16, 16)).astype(np.float32) for _ in range(3)]
    path = write_model(tmp_path / "m.colibri", h, *w, rng.standard_normal((1, 16, 8)).astype(np.float32))

    class Bundle:  # what CpuBackend reads of a bundle
        shape = (1, 32)

        def open_weights(self):
            return ColibriFile(path)

    backend = CpuBackend(Bundle())
    engine = backend._scratch
    x = rng.standard_normal((1, 32, 16)).astype(np.float32)
    out = np.zeros_like(x)
    backend.run_layers(x[:, :1], out[:, :1], 0, 1)
    assert engine.threads == 1
    backend.run_layers(x, out, 0, 1)
    cpus = len(os.sched_getaffinity(0))
    assert engine.threads == cpus
    first = out.copy()
    monkeypatch.setenv("OMP_NUM_THREADS", str(cpus + 2))
    backend.run_layers(x, out, 0, 1)
    assert engine.threads == cpus + 2 and engine._pool._max_workers == cpus + 1
    np.testing.assert_allclose(out, first, rtol=1e-6, atol=1e-6)
    backend.close()


def test_limit_holds_inside_the_call_only(no_thread_variables, two_threads):
    assert set(blas_threads_now()) == {2}
    with blas.blas_threads(16) as limit:
        assert limit == 1 and set(blas_threads_now()) == {1}
        with blas.blas_threads(4):
            assert set(blas_threads_now()) == {1}
        assert set(blas_threads_now()) == {1}  # the inner exit does not restore early
    assert set(blas_threads_now()) == {2}
    with blas.blas_threads(blas.SMALL_ROWS + 1) as limit:
        assert limit is None and set(blas_threads_now()) == {2}


def test_overlapping_calls_from_threads_restore_the_original(no_thread_variables, two_threads):
    """Two threads inside at once share one limit: the first sets it, the last restores it."""
    entered, release = threading.Barrier(3), threading.Event()
    limits = []

    def call():
        with blas.blas_threads(8) as limit:
            limits.append(limit)
            entered.wait()
            release.wait(guard(60))

    workers = [threading.Thread(target=call) for _ in range(2)]
    for w in workers:
        w.start()
    entered.wait()
    assert blas._depth == 2
    release.set()
    for w in workers:
        w.join(guard(60))
    assert limits == [1, 1] and blas._depth == 0
    assert set(blas_threads_now()) == {2}


def test_cpu_backend_runs_its_blas_products_with_one_thread_and_restores(small_bundle, no_thread_variables,
                                                                         two_threads, monkeypatch):
    """Every BLAS product of a decode-sized call runs with one BLAS thread (blas_pairs = 1 sends every expert
    through BLAS); the library's own count is back afterwards."""
    seen = []
    matmul = np.matmul

    def recording(*args, **kwargs):
        seen.append(blas_threads_now())
        return matmul(*args, **kwargs)

    with Runtime.load(small_bundle, backend="cpu", verify=False) as rt:
        rt._backend._scratch.blas_pairs = 1  # the CPU backend's forward pass (sdk/runtime/cpu_engine.py)
        monkeypatch.setattr(np, "matmul", recording)
        y = rt.infer(np.ones((2, 8, rt.hidden_size), np.float32))
        monkeypatch.setattr(np, "matmul", matmul)
    assert y.shape == (2, 8, rt.hidden_size)
    assert seen and all(set(s) == {1} for s in seen), seen
    assert set(blas_threads_now()) == {2}


def test_a_call_without_blas_products_leaves_the_library_alone(small_bundle, no_thread_variables, two_threads,
                                                                monkeypatch):
    """At one token every product runs in compiled kernels: the rule is never evaluated, the count never asked
    (LazyBlasThreads); with every expert through BLAS it is, once per call."""
    asked = []
    rule = blas.threads_for
    monkeypatch.setattr(blas, "threads_for", lambda rows: asked.append(rows) or rule(rows))
    with Runtime.load(small_bundle, backend="cpu", verify=False) as rt:
        x, out = np.ones((1, 1, rt.hidden_size), np.float32), np.empty((1, 1, rt.hidden_size), np.float32)
        asked.clear()  # the load's own (the engine's thread count)
        rt._backend.run_layers(x, out, 0, 1)
        assert asked == []
        rt._backend._scratch.blas_pairs = 1
        rt._backend.run_layers(x, out, 0, 1)
        assert asked == [1]
    assert set(blas_threads_now()) == {2}


def test_lazy_limit_applies_on_ensure_and_only_inside(no_thread_variables, two_threads):
    with blas.LazyBlasThreads(4) as limit:
        assert set(blas_threads_now()) == {2}  # nothing until a BLAS product asks
        limit.ensure()
        limit.ensure()  # once
        assert set(blas_threads_now()) == {1} and blas._depth == 1
    assert set(blas_threads_now()) == {2} and blas._depth == 0
    limit.ensure()  # after the body: nothing
    assert set(blas_threads_now()) == {2} and blas._depth == 0
    with pytest.raises(ZeroDivisionError):
        with blas.LazyBlasThreads(4) as limit:
            limit.ensure()
            1 / 0
    assert set(blas_threads_now()) == {2} and blas._depth == 0


@pytest.mark.parametrize("variable, value, message", [
    ("NUMBA_NUM_THREADS", "0", r"backend 'cpu': numba refuses its environment \(.*\); fix or unset that NUMBA_\* variable"),
    ("NUMBA_DISABLE_JIT", "1", r"backend 'cpu': NUMBA_DISABLE_JIT is set; the CPU kernels run compiled only"),
])
def test_a_numba_variable_the_cpu_kernels_cannot_run_with_is_one_line(small_bundle, variable, value, message):
    """NUMBA_NUM_THREADS=0 had raised numba's ValueError from its import, NUMBA_DISABLE_JIT=1 an IndexError (or
    worse) from a kernel run as Python: a BackendError naming the variable instead, from the API and the CLI."""
    import re
    import subprocess
    import sys

    env = {**os.environ, variable: value}
    code = ("from colibri_sdk.errors import BackendError\nfrom colibri_sdk.runtime import Runtime\n"
            f"try:\n    Runtime.load({str(small_bundle)!r}, backend='cpu')\nexcept BackendError as exc:\n"
            "    print('BackendError:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=guard(300))
    assert done.returncode == 0 and re.search(message, done.stdout), (done.stdout, done.stderr[-2000:])
    cli = subprocess.run([sys.executable, "-m", "colibri_sdk", "run", str(small_bundle), "--backend", "cpu",
                          "--iters", "1"], env=env, capture_output=True, text=True, timeout=guard(300))
    assert cli.returncode != 0 and re.search(message, cli.stderr) and "Traceback" not in cli.stderr, cli.stderr[-2000:]
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


def test_limit_set_and_restored_from_other_threads(no_thread_variables, two_threads):
    """threadpoolctl >= 3.8 lets only one "controlling" thread change OpenBLAS's count and ignores the others: a
    worker thread's call got no limit, and overlapping calls whose last one ended in another thread than the
    first left the count at 1 for good. Each thread's call is limited now, and the count is restored."""
    from threadpoolctl import threadpool_limits

    seen = []

    def worker():
        with blas.LazyBlasThreads(4) as limit:
            limit.ensure()
            seen.append(blas_threads_now())

    t = threading.Thread(target=worker)
    t.start()
    t.join(guard(60))
    assert seen == [[1]] and set(blas_threads_now()) == {2}
    main_in, worker_in, main_out = threading.Event(), threading.Event(), threading.Event()

    def late_worker():
        main_in.wait(guard(60))
        with blas.blas_threads(4):
            seen.append(blas_threads_now())
            worker_in.set()
            main_out.wait(guard(60))

    t = threading.Thread(target=late_worker)
    t.start()
    with blas.blas_threads(4):  # the main thread enters first and leaves first; the worker restores
        main_in.set()
        worker_in.wait(guard(60))
    main_out.set()
    t.join(guard(60))
    assert seen[-1] == [1] and set(blas_threads_now()) == {2} and blas._depth == 0
    with threadpool_limits(limits=1, user_api="blas"):  # the user's own limit still works in the main thread
        assert set(blas_threads_now()) == {1}
    assert set(blas_threads_now()) == {2}


def test_a_lazy_limit_object_serves_again():
    limit = blas.LazyBlasThreads(4)
    for _ in range(2):
        with limit:
            limit.ensure()
            assert limit._state  # applied in each body
        assert limit._state is False
