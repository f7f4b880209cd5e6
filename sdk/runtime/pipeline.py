"""Pipelined calls: `Runtime.submit(x)` returns a concurrent.futures.Future (the source design's stream count).

A Pipeline holds `depth` slots, each with its own input buffer (float32, the bundle's fixed shape). `submit`
validates x at once (a bad input raises there, not in the future), waits for a free slot — the bounded queue: at
most `depth` calls are queued or running, a further submit blocks (or raises TimeoutError after `timeout` s) — copies
x into the slot (so the caller may reuse x as soon as submit returns) and queues it. One worker thread runs the
queued calls in submission order through `Runtime.infer`, so results complete in submission order and equal
synchronous `infer` calls made in that order.

What overlaps: the caller's work (preparing the next input, reading the previous result) with the runtime's call.
The runtime's calls themselves run one at a time on both backends: per-slot CUDA streams and graph instances, which
would also overlap a call's copies with another's kernels, are not built (docs/runtime.md, "Pipelined calls").
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref

import numpy as np

from ..errors import BackendError, InputError

MAX_DEPTH = 64


def check_depth(depth) -> int:
    """Validate a stream count (calls in flight): an int 1..MAX_DEPTH, else InputError naming the value."""
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= MAX_DEPTH:
        raise InputError(f"streams {depth!r}; allowed: an int 1..{MAX_DEPTH} (calls in flight)")
    return int(depth)


class Pipeline:
    """The submit queue of one Runtime.

    Args:
        runtime: the Runtime whose `infer` runs the calls.
        depth: slots, 1..MAX_DEPTH.

    Raises:
        InputError: depth out of range or not an int.
    """

    def __init__(self, runtime, depth: int):
        self.depth = check_depth(depth)
        self._runtime = weakref.ref(runtime)  # the worker must not keep a forgotten Runtime alive
        size = int(np.prod(runtime.shape)) * runtime.hidden_size
        self._free: queue.Queue = queue.Queue()
        for _ in range(self.depth):
            self._free.put(np.zeros(size, dtype=np.float32))
        self._work: queue.Queue = queue.Queue()
        self._closed = False
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="colibri-pipeline", daemon=True)
        self._thread.start()

    def submit(self, x: np.ndarray, input_lengths=None, out=None, timeout: float | None = None):
        """Queue one call; see `Runtime.submit`."""
        rt = self._runtime()
        if rt is None:
            raise BackendError("this Runtime is closed; load the bundle again")
        x3, lengths = rt._check_input(x, input_lengths)
        if out is not None:
            rt._check_out(out, x)
        try:
            slot = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no free slot within {timeout} s: {self.depth} calls in flight") from None
        view = slot[: x3.size].reshape(x.shape)
        np.copyto(view, x)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._guard:
            if self._closed:
                self._free.put(slot)
                raise BackendError("this Runtime is closed; load the bundle again")
            self._work.put((slot, view, lengths, out, future))
        return future

    def _loop(self) -> None:
        while True:
            try:
                item = self._work.get(timeout=1.0)
            except queue.Empty:
                if self._runtime() is None:  # the Runtime was collected without close()
                    return
                continue
            if item is None:
                return
            slot, view, lengths, out, future = item
            try:
                if future.set_running_or_notify_cancel():
                    rt = self._runtime()
                    try:
                        if rt is None:
                            raise BackendError("this Runtime is closed; load the bundle again")
                        future.set_result(rt.infer(view, input_lengths=lengths, out=out))
                    except BaseException as exc:  # the future carries the error to the caller
                        future.set_exception(exc)
                    finally:
                        rt = None  # no strong reference while waiting for the next call
            finally:
                self._free.put(slot)

    def in_flight(self) -> int:
        """Calls queued or running now."""
        return self.depth - self._free.qsize()

    def close(self) -> None:
        """Run what is queued, then stop the worker. Safe to call more than once."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            self._work.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
