"""Runtime lifetime: threads, close, finalizer, and a load that does not read the weights."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from colibri_sdk.errors import BackendError
from colibri_sdk.format import Header
from colibri_sdk.runtime import Runtime

from runtime_bundles import write_bundle


def _mapped(path) -> bool:
    """Whether `path` is mmap'ed into this process (Linux /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


def test_threads_give_the_serial_results(small_bundle):
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((2, 1 + i % 8, 64)).astype(np.float32) for i in range(24)]
    lengths = [None if i % 3 else [min(i % 5, 1 + i % 8), 1 + i % 8] for i in range(24)]
    with Runtime.load(small_bundle, backend="cpu") as rt:
        serial = [rt.infer(x, input_lengths=n) for x, n in zip(inputs, lengths)]
        results = [None] * len(inputs)
        start = threading.Barrier(6)

        def work(worker):
            start.wait()
            for i in range(worker, len(inputs), 6):
                results[i] = rt.infer(inputs[i], input_lengths=lengths[i])

        threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for got, want in zip(results, serial):
        np.testing.assert_array_equal(got, want)


def test_close_twice_and_use_after_close(fresh_bundle):
    rt = Runtime.load(fresh_bundle, backend="cpu")
    weights = fresh_bundle / "model.colibri"
    rt.infer(np.zeros((1, 64), np.float32))
    assert _mapped(weights) and not rt.closed
    rt.close()
    rt.close()
    assert rt.closed and not _mapped(weights)
    assert "closed" in repr(rt)
    with pytest.raises(BackendError, match=r"this Runtime is closed; load the bundle again"):
        rt.infer(np.zeros((1, 64), np.float32))


def test_context_manager_and_finalizer_release_the_weights(fresh_bundle):
    weights = fresh_bundle / "model.colibri"
    with Runtime.load(fresh_bundle, backend="cpu") as rt:
        assert _mapped(weights)
    assert rt.closed and not _mapped(weights)
    rt = Runtime.load(fresh_bundle, backend="cpu")
    assert _mapped(weights)
    del rt
    gc.collect()
    assert not _mapped(weights)


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _best_load(bundle, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        rt = Runtime.load(bundle, backend="cpu", verify=False)
        best = min(best, time.perf_counter() - start)
        rt.close()
    return best


def test_load_does_not_read_the_weights(tmp_path, small_bundle):
    """A 1 GiB model (sparse file of zeros) loads as fast as a 100 KiB one and reads none of its bytes."""
    header = Header(num_layers=1, num_experts=6, top_k=2, hidden_size=4096, intermediate_size=8192, dtype=1)
    big = tmp_path / "big.colibri"
    with open(big, "wb") as f:
        f.write(header.pack())
        f.truncate(header.file_size)
    assert header.file_size > 2**30 - 1
    # Zero weights give zero output (router ties → experts 0 and 1, each expert's output is 0; sequential layers).
    # The digest is not computed: this bundle is opened with verify=False, which checks the schema only.
    bundle = write_bundle(tmp_path / "big", big, 1, 1, expected=np.zeros((1, 1, 4096), np.float32),
                          weights_sha256="0" * 64)
    small_s = _best_load(small_bundle)  # also imports everything the load needs
    io0, rss0 = _proc_io(), _rss_bytes()
    rt = Runtime.load(bundle, backend="cpu", verify=False)
    io1, rss1 = _proc_io(), _rss_bytes()
    try:
        assert io1["rchar"] - io0["rchar"] < 1 << 20, "load read() the weights"
        assert rss1 - rss0 < 64 << 20, "load touched the mmap'ed weights"
    finally:
        rt.close()
    big_s = _best_load(bundle)
    assert big_s < 10 * small_s + 0.05, f"load {big_s * 1e3:.1f} ms for 1 GiB vs {small_s * 1e3:.1f} ms for 100 KiB"
