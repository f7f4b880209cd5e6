"""Pipelined calls: `Runtime.submit(x)` returns a concurrent.futures.Future (the source design's stream count).

A Pipeline holds `depth` slots. `submit` validates x at once (a bad input raises there, not in the future), waits
for a free slot — the bounded queue: at most `depth` calls are queued or in flight, a further submit blocks (or
raises TimeoutError after `timeout` s) — copies x into the slot's input buffer (so the caller may reuse x as soon as
submit returns) and queues it. Results complete in submission order and equal synchronous `infer` calls.

On the CUDA backend each slot has its own backends, one per compiled shape (`CudaBackend(share=...)`: its own
stream, pinned input and output, scratch buffers and captured graph; the weights are uploaded once and shared,
read-only). A launcher thread takes the queued calls in order, pads each into its slot's staging buffer and
enqueues it on the slot's stream without waiting (`CudaBackend.enqueue_call`); a completer thread waits for them in
the same order (`finish_call`), checks and copies the output and resolves the future. So up to `depth` calls are in
flight on `depth` streams at once, and one call's copies can overlap another's kernels. No scratch buffer is shared
between slots, so no call can read another's intermediate values.

On the CPU backend one worker thread runs the queued calls in order through `Runtime.infer`: what overlaps is the
caller's work with the runtime's call (docs/runtime.md, "Pipelined calls").
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import weakref

import numpy as np

from ..errors import BackendError, InputError
from .shape_run import ShapeRun, check_finite

MAX_DEPTH = 64
_CLOSED = "this Runtime is closed; load the bundle again"


def check_depth(depth) -> int:
    """Validate a stream count (calls in flight): an int 1..MAX_DEPTH, else InputError naming the value."""
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= MAX_DEPTH:
        raise InputError(f"streams {depth!r}; allowed: an int 1..{MAX_DEPTH} (calls in flight)")
    return int(depth)


class _Slot:
    """One call's worth of resources: the input buffer submit copies into, and (CUDA) one `ShapeRun` per
    compiled shape with its own backend."""

    def __init__(self, size: int, runs: list | None):
        self.input = np.zeros(size, dtype=np.float32)
        self.runs = runs

    def run_for(self, batch: int, tokens: int):
        return next(run for run in self.runs if batch <= run.shape[0] and tokens <= run.shape[1])


def _slot_runs(rt) -> list:
    """A slot's own backends for every compiled shape, sharing the Runtime's weights on the device."""
    from .cuda_backend import CudaBackend

    owner = rt._runs[-1].backend
    runs = []
    try:
        for shape in rt.shapes:
            backend = CudaBackend(rt.bundle.for_shape(*shape), eager=owner.eager, share=owner)
            runs.append(ShapeRun(shape, backend, rt.hidden_size))
    except BaseException:
        for run in runs:
            run.backend.close()
        raise
    return runs


class Pipeline:
    """The submit queue of one Runtime.

    Args:
        runtime: the Runtime whose calls these are.
        depth: slots (calls in flight), 1..MAX_DEPTH.

    Attributes:
        depth: the slots.
        overlapped: True when calls of different slots are in flight together (the CUDA backend), False when one
            worker runs them one after another (the CPU backend).

    Raises:
        InputError: depth out of range or not an int.
        CudaError: allocating a slot's backends failed (those made so far are freed).
    """

    def __init__(self, runtime, depth: int):
        self.depth = check_depth(depth)
        self._runtime = weakref.ref(runtime)  # the threads must not keep a forgotten Runtime alive
        self.overlapped = hasattr(runtime._backend, "enqueue_call")
        size = int(np.prod(runtime.shape)) * runtime.hidden_size
        self._slots: list[_Slot] = []
        try:
            for _ in range(self.depth):
                self._slots.append(_Slot(size, _slot_runs(runtime) if self.overlapped else None))
        except BaseException:
            self._close_backends()
            raise
        self._free: queue.Queue = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)
        self._work: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()  # (CUDA) enqueued calls, oldest first
        self._closed = False
        self._guard = threading.Lock()
        loops = (self._launch_loop, self._complete_loop) if self.overlapped else (self._serial_loop,)
        self._threads = [threading.Thread(target=loop, name=f"colibri-pipeline-{i}", daemon=True)
                         for i, loop in enumerate(loops)]
        for thread in self._threads:
            thread.start()

    def submit(self, x: np.ndarray, input_lengths=None, out=None, timeout: float | None = None):
        """Queue one call; see `Runtime.submit`."""
        rt = self._runtime()
        if rt is None:
            raise BackendError(_CLOSED)
        x3, lengths = rt._check_input(x, input_lengths)
        rt._run_for(x3.shape[0], x3.shape[1])  # larger than every shape: refused here, naming the largest
        check_finite(x3, lengths=lengths)  # NaN / Inf at a valid position: refused here, not by the future
        out3 = rt._check_out(out, x) if out is not None else None
        try:
            slot = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no free slot within {timeout} s: {self.depth} calls in flight") from None
        view = slot.input[: x3.size].reshape(x.shape)
        np.copyto(view, x)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._guard:
            if self._closed:
                self._free.put(slot)
                raise BackendError(_CLOSED)
            # The queued call holds its Runtime: one dropped without close() is not collected before every call it
            # accepted has run (then its finalizer closes this pipeline, as close() does).
            self._work.put((slot, view, lengths, out, out3, future, rt))
        return future

    # ---- CPU: one worker ---------------------------------------------------------------------------------------
    def _serial_loop(self) -> None:
        while (item := self._next(self._work)) is not None:
            slot, view, lengths, out, _, future, rt = item
            item = None  # the Runtime is referenced by `rt` alone, dropped before the future resolves
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = rt.infer(view, input_lengths=lengths, out=out)
                    except BaseException as exc:  # the future carries the error to the caller
                        rt = None
                        future.set_exception(exc)
                    else:
                        rt = None  # no strong reference once the caller can see the result
                        future.set_result(result)
                    result = None
            finally:
                rt = None
                self._free.put(slot)

    # ---- CUDA: launcher and completer ------------------------------------------------------------------------
    def _launch_loop(self) -> None:
        """Pad each queued call into its slot and enqueue it on the slot's stream, in submission order."""
        while (item := self._next(self._work)) is not None:
            slot, view, lengths, out, out3, future, rt = item
            began = time.perf_counter()
            run = error = None
            if future.set_running_or_notify_cancel():
                try:
                    x3 = view if view.ndim == 3 else view[None]
                    run = slot.run_for(x3.shape[0], x3.shape[1])
                    padded = run.pad(x3, lengths)
                    run.backend.enqueue_call(padded, run.valid_counts(x3, lengths))
                except BaseException as exc:
                    error, run = exc, None
            rt = None
            self._done.put((item, run, error, began))  # the item keeps the Runtime until the completer is done
            item = None
        self._done.put(None)

    def _complete_loop(self) -> None:
        """Wait for the enqueued calls oldest first; deliver each output and resolve its future."""
        while (entry := self._done.get()) is not None:
            (slot, view, lengths, out, out3, future, rt), run, error, began = entry
            entry = None
            try:
                if run is not None:
                    try:
                        run.backend.finish_call(run.result)
                        x3 = view if view.ndim == 3 else view[None]
                        with np.errstate(over="ignore", invalid="ignore"):
                            result = rt._deliver(run, x3, lengths, out3)
                        with rt._lock:
                            rt._stats.record(time.perf_counter() - began, x3.shape[:2],
                                             getattr(run.backend, "last_dropped", 0), run.shape)
                    except BaseException as exc:
                        rt = None
                        future.set_exception(exc)
                    else:
                        rt = None  # no strong reference once the caller can see the result
                        future.set_result(out if out is not None else result.reshape(view.shape))
                    result = None
                elif error is not None:
                    rt = None
                    future.set_exception(error)
            finally:
                rt = None
                self._free.put(slot)

    def _next(self, work: queue.Queue):
        """The next queued item, or None to stop (close, or the Runtime was collected without close())."""
        while True:
            try:
                return work.get(timeout=1.0)
            except queue.Empty:
                if self._runtime() is None:
                    return None

    def in_flight(self) -> int:
        """Calls queued or in flight now."""
        return self.depth - self._free.qsize()

    def _close_backends(self) -> None:
        for slot in self._slots:
            for run in slot.runs or []:
                run.backend.close()

    def close(self) -> None:
        """Run what is queued, stop the threads, free the slots' backends. Safe to call more than once."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            self._work.put(None)
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()
        self._close_backends()
