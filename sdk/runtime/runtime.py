"""The on-device runtime: load a bundle, pick a backend, check and pad inputs, run, self-test.

A bundle is compiled for one or more fixed shapes (batch, tokens) — the profile's `shape`, whose batch and tokens
may be lists (docs/build.md, "Several shapes"). Each call runs at the smallest compiled shape that holds it (batch
and tokens both at least the input's; the first in the manifest's `shapes` order, by batch*tokens): the runtime pads
the input with zeros to that shape, runs that shape's backend (the CPU backend without expert capacity on the
call's own (batch, tokens) only: `ShapeRun.run_corner`) and returns the unpadded part; `stats()` records the
shape chosen. An input larger than the largest shape is refused naming it. Per-
sequence lengths (`input_lengths`, as in the source description) zero the positions past each sequence's end, in
the input and in the output. Tokens do not interact in a MoE layer (routing is per token), so padding never changes
the valid positions' values.

Backends (docs/runtime.md): "cuda" (colibri_sdk.runtime.cuda_backend, the CUDA driver API through cuda-bindings,
imported only when asked for) and "cpu" (colibri_sdk.runtime.cpu_backend, the CPU engine: NumPy and compiled
kernels). Around the `Runtime` class here: backends.py chooses and builds the backends, shape_run.py holds one
compiled shape's buffers and padding, checks.py checks a call's arrays, pipeline.py queues `submit` calls, selftest.py
judges a self-test.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import numpy as np

from ..errors import BackendError, BundleError, InputError, NonFiniteOutputError
from .backends import BACKENDS, available_backends, close_all, cuda_status, select_backend, shape_backends
from .checks import INPUT_DTYPES, check_input, check_out, nonfinite_output
from .pipeline import Pipeline, check_depth
from .selftest import SelfTestResult, compare
from .shape_run import ShapeRun
from .stats import RuntimeStats, StatsRecorder

__all__ = ["BACKENDS", "INPUT_DTYPES", "Runtime", "SelfTestResult", "available_backends", "compare", "cuda_status",
           "select_backend", "shape_backends"]

# Notices (the CPU fallback of "auto") are logged here, never printed; `colibri-sdk` shows them on stderr.
log = logging.getLogger(__name__)


def _close(pipelines: list, backends: list) -> None:
    """What close() releases, for the finalizer too: the submit pipeline (its queued calls run first, its threads
    stop), then the backends in the order given."""
    for pipeline in pipelines:
        pipeline.close()
    close_all(backends)


class Runtime:
    """A loaded bundle, ready to run.

    Usage::

        with Runtime.load("bundles/demo") as rt:
            y = rt.infer(x)                      # x (batch, tokens, hidden) or (tokens, hidden)
            y = rt.infer(x, input_lengths=[5])   # sequence 0 is 5 tokens long; the rest is padding
            rt.infer(x, out=buf)                 # into the caller's float32 array (no allocation on the CPU)
            h = rt.layer(l, h)                   # one MoE layer; rt.layers(start, stop, h) a range
            future = rt.submit(x)                # pipelined: a concurrent.futures.Future, submission order
            rt.stats().p99_ms                    # latency percentiles, shapes, dropped pairs

    Attributes:
        bundle: the open `colibri_sdk.bundle.Bundle`.
        backend_name: "cuda" | "cpu".
        shape: the largest compiled (batch, tokens): the most a call may hold.
        shapes: every compiled (batch, tokens), smallest first; each call runs at `shape_for(batch, tokens)`.
        hidden_size: the model's hidden size.
        dtype: the bundle's weight dtype, "fp16" | "fp32".
        num_layers: the model's MoE layers (`layer`, `layers`).
        top_k, model_top_k: experts per token the bundle routes to, and the model's own k (they differ under a
            build's top-k override, docs/build.md).
        streams: calls `submit` keeps in flight.
        notice: None, or the one line logged when backend="auto" fell back to the CPU ("running on the CPU
            backend: <why>").
        load_seconds: wall time of `load`, in seconds.

    Thread safety: calls are serialised by a lock; `infer` from several threads gives the results of running the
    same calls one after another.
    """

    def __init__(self, bundle, backend, notice: str | None = None, streams: int | None = None,
                 backends: dict | None = None):
        self.bundle = bundle
        self._backend = backend  # the largest shape's
        self.backend_name: str = backend.name
        self.shape: tuple[int, int] = tuple(int(n) for n in bundle.shape)
        header = bundle.manifest["weights"]["header"]
        self.hidden_size: int = int(header["hidden_size"])
        self.dtype: str = bundle.dtype
        self.notice = notice
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        self.num_layers: int = int(header["num_layers"])
        self.top_k: int = int(header["top_k"])  # experts per token the bundle routes to
        self.model_top_k: int = int(bundle.manifest["weights"].get("model_top_k", self.top_k))  # the model's own k
        backends = dict(backends or {self.shape: backend})
        backends[self.shape] = backend
        self.shapes: list[tuple[int, int]] = [tuple(int(v) for v in bt) for bt in bundle.shapes]
        missing = [bt for bt in self.shapes if bt not in backends]
        if missing:
            raise BackendError(f"no backend for the compiled shapes {missing}; given: {sorted(backends)}")
        self._runs = [ShapeRun(bt, backends[bt], self.hidden_size) for bt in self.shapes]  # smallest first
        self._stats = StatsRecorder(self.shape, self.shapes)
        default_streams = bundle.manifest["profile"].get("streams", 1)
        self.streams: int = check_depth(streams if streams is not None else default_streams)
        self._pipeline = None
        spec = bundle.manifest["profile"].get("capacity")
        self.capacity = None if spec is None else dict(spec)  # expert capacity the bundle sets (None: dropless)
        # The finalizer does what close() does: the pipeline first (its queued calls keep this Runtime alive, so by
        # then they have all run), then the backends, smallest first (they borrow the largest one's weights).
        self._pipelines: list = []  # the submit pipeline once made, for the finalizer
        self._finalizer = weakref.finalize(self, _close, self._pipelines, [run.backend for run in self._runs])

    def shape_for(self, batch: int, tokens: int) -> tuple[int, int]:
        """The compiled shape a call of `batch` sequences of `tokens` tokens runs at: the first of `shapes`
        (smallest first) with at least that batch and those tokens.

        Raises:
            InputError: batch or tokens not an integer of 1 or more; larger than every compiled shape, naming the
                largest.
        """
        for name, value in (("batch", batch), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"shape_for {name} = {value!r}; allowed: an integer of 1 or more")
        return self._run_for(int(batch), int(tokens)).shape

    def _run_for(self, batch: int, tokens: int) -> ShapeRun:
        for run in self._runs:
            if batch <= run.shape[0] and tokens <= run.shape[1]:
                return run
        b, t = self.shape
        raise InputError(f"input batch {batch} x tokens {tokens} is larger than every compiled shape; the largest "
                         f"is batch {b} x tokens {t} (build with a larger shape.batch / shape.tokens)")

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike, backend: str = "auto", eager: bool = False, verify: bool = True,
             streams: int | None = None):
        """Open a bundle and prepare a backend.

        Args:
            bundle_dir: a bundle folder (manifest.json, model.colibri, kernels/, selftest/).
            backend: "auto" | "cuda" | "cpu". "auto" takes CUDA when `driver.probe_driver()` finds a driver and
                a device that can run the bundle exists, else the CPU, logging the reason as one INFO line on the
                "colibri_sdk.runtime.runtime" logger (and keeping it in `notice`); nothing is printed.
            eager: CUDA only — launch the kernels one by one instead of replaying the captured CUDA Graph.
            verify: check every file's size and SHA-256 against the manifest first. This reads every byte of
                the weights once; pass False for a fast start of a bundle already checked with
                `colibri-sdk verify`.
            streams: calls `submit` keeps in flight, 1..64; None: the profile's `streams` (default 1).

        Raises:
            BundleError: missing or tampered files, unknown schema, a bundle_dir that is not a path.
            BackendError: unknown backend name; "cuda" asked for where it cannot run (the reason is quoted).
            CudaError: a CUDA driver call failed while loading.
        """
        from ..bundle import Bundle

        if not isinstance(bundle_dir, (str, os.PathLike)):
            raise BundleError(f"bundle_dir is {type(bundle_dir).__name__} {bundle_dir!r:.60}; allowed: a path (str or os.PathLike)")
        start = time.perf_counter()
        bundle = Bundle.open(bundle_dir, verify=verify)
        engine, notice = select_backend(bundle.for_shape(*bundle.shape), backend, eager)
        if notice:
            log.info("%s", notice)
        try:
            backends = shape_backends(bundle, engine, eager)
        except BaseException:
            engine.close()
            raise
        try:
            runtime = cls(bundle, engine, notice, streams, backends)
        except BaseException:
            close_all(list(backends.values())[::-1])
            raise
        runtime.load_seconds = time.perf_counter() - start
        return runtime

    # ---- running --------------------------------------------------------------------------------------------
    def infer(self, x, input_lengths=None, out=None, stream=None):
        """Run the model on one input.

        Args:
            x: float32 or float16 (either byte order, e.g. ">f4"; converted to native float32 on the way in),
                C-contiguous, finite at the valid positions; (batch, tokens, hidden) with
                1 <= batch <= the fixed batch and 1 <= tokens <= the fixed tokens, or (tokens, hidden) for one
                sequence. On the CUDA backend also a device array exposing `__cuda_array_interface__` (CuPy,
                PyTorch; float32, C-contiguous), read on `stream` with no host round trip (docs/runtime-cuda.md).
            input_lengths: optional ints, shape (batch,) — or one int for a (tokens, hidden) input: each sequence's
                length, 0..tokens. Positions at or past a sequence's length are ignored in the input (their
                values may be anything) and are zero in the output.
            out: optional float32 C-contiguous writable array of x's shape (a device array when x is one): the
                output is written there and `out` is returned. On the CPU backend such a call allocates no
                activation-sized memory (docs/runtime.md, "Bring your own memory").
            stream: device I/O only — the caller's CUDA stream (an int handle, a CUstream, or an object with
                `cuda_stream` / `ptr` / `handle`, as torch.cuda.Stream and cupy.cuda.Stream); the copies and
                launches are enqueued on it and the call returns without synchronising. None: the legacy default
                stream, synchronised before returning.

        Returns:
            float32 array of x's shape: `out`, or a new array owned by the caller.

        Raises:
            InputError: not a NumPy array (or device array on CUDA); dtype other than float32/float16; wrong rank or
                hidden size; batch or tokens above the fixed shape (or zero); non-contiguous; NaN/Inf at a valid
                position; lengths of the wrong shape or type, negative, or above the input's tokens; `out` of the
                wrong type, dtype, shape or layout.
            NonFiniteOutputError: the output holds NaN/Inf at a valid position (e.g. finite inputs of 1e19 overflow
                float32 inside an expert); it names the position and the first layer whose output is non-finite.
            BackendError: the runtime is closed; a device array on the CPU backend.
        """
        return self._call(x, input_lengths, out, 0, self.num_layers, stream)

    def layer(self, index: int, x, input_lengths=None, out=None, stream=None):
        """Run MoE layer `index` alone: x_{index+1} from x_index, composed as the model composes its layers
        (sequential: the block's output; residual: x + the block's output — docs/format.md, "Semantics").

        Args and returns as `infer`; index: 0..num_layers-1.

        Raises:
            InputError: as `infer`, or an index outside 0..num_layers-1.
        """
        index = self._check_layer_index(index, "layer", self.num_layers - 1)
        return self._call(x, input_lengths, out, index, index + 1, stream)

    def layers(self, start: int, stop: int, x, input_lengths=None, out=None, stream=None):
        """Run layers start..stop-1 (Python range semantics, start < stop) on x; `layers(0, num_layers, x)` equals
        `infer(x)`. Args and returns as `infer`.

        Raises:
            InputError: as `infer`, or start/stop outside 0 <= start < stop <= num_layers.
        """
        start = self._check_layer_index(start, "start", self.num_layers - 1)
        stop = self._check_layer_index(stop, "stop", self.num_layers)
        if stop <= start:
            raise InputError(f"layer range {start}..{stop}; allowed: start < stop <= {self.num_layers}")
        return self._call(x, input_lengths, out, start, stop, stream)

    def submit(self, x, input_lengths=None, out=None, timeout: float | None = None):
        """Queue one `infer` call; returns a concurrent.futures.Future of its result (docs/runtime.md, "Pipelined
        calls").

        x is validated and copied into one of `streams` slots before submit returns, so the caller may reuse it.
        At most `streams` calls are queued or running: a further submit waits for the oldest to finish (or raises
        TimeoutError after `timeout` seconds). Calls run in submission order; each result equals `infer(x)`.

        Args:
            x, input_lengths, out: as `infer` (NumPy arrays only). With `out`, the future's result is `out`, which
                must not be read before the future is done.
            timeout: seconds to wait for a free slot; None waits.

        Returns:
            concurrent.futures.Future resolving to the output (float32, x's shape) or to the call's error.

        Raises:
            InputError: as `infer`, raised by submit itself; `timeout` not None or a number in 0..
                threading.TIMEOUT_MAX.
            BackendError: the runtime is closed. TimeoutError: no slot became free within `timeout`.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                                                           np.floating))
                                    or not 0 <= timeout <= threading.TIMEOUT_MAX):
            raise InputError(f"submit timeout = {timeout!r}; allowed: None (wait) or a finite number of seconds >= 0, "
                             f"at most {threading.TIMEOUT_MAX:g} (the platform's longest wait)")
        if not self._finalizer.alive:
            raise BackendError("this Runtime is closed; load the bundle again")
        if self._pipeline is None:
            with self._lock:
                if self._pipeline is None:
                    self._pipeline = Pipeline(self, self.streams)
                    self._pipelines.append(self._pipeline)
        return self._pipeline.submit(x, input_lengths, out, timeout)

    def _check_layer_index(self, value, name: str, top: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= top:
            raise InputError(f"{name} {value!r}; allowed: an int 0..{top} (the model has {self.num_layers} layers)")
        return int(value)

    def stats(self) -> "RuntimeStats":
        """Latency percentiles and counts of the calls so far (docs/runtime.md, "Stats")."""
        with self._lock:
            return self._stats.snapshot()

    def _call(self, x, input_lengths, out, start: int, stop: int, stream, dropless: bool = False):
        """One call of layers start..stop-1. dropless: without expert capacity (the self-test's: its stored
        reference output is dropless), for this call only; other threads' calls keep the bundle's capacity."""
        from .device_io import is_device_array

        if is_device_array(x):
            return self._call_device(x, input_lengths, out, start, stop, stream)
        if stream is not None:
            raise InputError("stream is for device arrays (__cuda_array_interface__); a NumPy input takes none")
        # Overflow inside the forward pass is reported below as one NonFiniteOutputError, never as NumPy warnings.
        with self._lock, np.errstate(over="ignore", invalid="ignore"):
            if not self._finalizer.alive:
                raise BackendError("this Runtime is closed; load the bundle again")
            began = time.perf_counter()
            x3, lengths = self._check_input(x, input_lengths)
            out3 = check_out(out, x) if out is not None else None
            batch, tokens, _ = x3.shape
            run = self._run_for(batch, tokens)
            backend = run.backend
            padded = run.pad(x3, lengths)
            result = run.result
            if getattr(backend, "capacity", None) is not None:
                backend.run_layers(padded, result, start, stop, valid_rows=run.valid_rows(x3, lengths),
                                   capacity=not dropless)
            elif self.backend_name == "cuda" and hasattr(backend, "run_layers"):
                backend.run_layers(padded, result, start, stop, valid_tokens=run.valid_counts(x3, lengths))
            elif getattr(backend, "name", None) == "cpu":  # any row count: only the call's own tokens are computed
                run.run_corner(batch, tokens, start, stop)
            elif hasattr(backend, "run_layers"):
                backend.run_layers(padded, result, start, stop)
            elif (start, stop) == (0, self.num_layers):  # a backend of the one-call contract (whole model only)
                counts = np.asarray(run.valid_counts(x3, lengths), dtype=np.int32)
                np.copyto(result, backend.infer_padded(padded, valid_tokens=counts))
            else:
                raise BackendError(f"backend {self.backend_name!r} runs the whole model only; layers {start}..{stop}")
            out3 = self._deliver(run, x3, lengths, out3)
            self._stats.record(time.perf_counter() - began, (batch, tokens), getattr(backend, "last_dropped", 0),
                               run.shape)
        return out if out is not None else out3.reshape(np.shape(x))

    def _deliver(self, run: ShapeRun, x3: np.ndarray, lengths, out3: np.ndarray | None) -> np.ndarray:
        """The call's output from the shape's result buffer: its (batch, tokens) corner into `out3` (a new array
        when None), zeros past each sequence's length, checked for NaN/Inf; returns out3.

        Raises:
            NonFiniteOutputError: naming the first non-finite position and layer.
        """
        batch, tokens, _ = x3.shape
        if out3 is None:
            out3 = np.empty((batch, tokens, self.hidden_size), dtype=np.float32)
        np.copyto(out3, run.result[:batch, :tokens])
        if lengths is not None:
            for b, n in enumerate(lengths):
                out3[b, n:] = 0.0
        # One pass over the output into preallocated flags (no allocation per call).
        if not np.isfinite(out3, out=run.finite[:batch, :tokens]).all():
            raise nonfinite_output(self.bundle, self.backend_name, x3, out3)
        return out3

    def _check_input(self, x, input_lengths):
        """Validate x and input_lengths (`checks.check_input`); return x as (batch, tokens, hidden) and lengths."""
        return check_input(x, input_lengths, self.shape, self.hidden_size, len(self.shapes))

    def _check_out(self, out, x) -> np.ndarray:
        return check_out(out, x)

    def _call_device(self, x, input_lengths, out, start: int, stop: int, stream):
        from .device_io import device_view, stream_handle

        if input_lengths is not None:
            raise InputError("input_lengths is for NumPy inputs; a device input is all valid positions")
        if not hasattr(self._backend, "run_device"):
            raise BackendError(
                f"a device array (__cuda_array_interface__) needs the cuda backend; this runtime runs on "
                f"{self.backend_name}: pass a NumPy array"
            )
        if out is None:
            raise InputError("a device input needs out= (a device array of the input's shape, float32)")
        handle = stream_handle(stream)
        src = device_view(x, "input", self.shape, self.hidden_size, handle)
        try:
            dst = device_view(out, "out", self.shape, self.hidden_size, handle)
            try:
                if dst.shape != src.shape:
                    raise InputError(f"out shape {dst.shape}; expected the input's shape {src.shape}")
                with self._lock:
                    if not self._finalizer.alive:
                        raise BackendError("this Runtime is closed; load the bundle again")
                    began = time.perf_counter()
                    run = self._run_for(src.batch, src.tokens)
                    run.backend.run_device(src.ptr, dst.ptr, src.batch, src.tokens, start, stop, handle)
                    self._stats.record(time.perf_counter() - began, (src.batch, src.tokens),
                                       getattr(run.backend, "last_dropped", 0), run.shape)
            finally:
                dst.release()  # a DLPack tensor goes back to its producer (device_io); a no-op for the interface
        finally:
            src.release()
        return out

    def self_test(self) -> SelfTestResult:
        """Run the bundle's self-test input of every compiled shape (each at its own shape) and compare with its
        stored reference output.

        Returns:
            SelfTestResult over all shapes (passed only if every shape passed; the largest errors of any); `passed`
            is False on a mismatch (call `raise_if_failed()` to turn it into an error).

        Raises:
            BundleError: the self-test files are missing or their shapes do not match the bundle.
        """
        results = [self._self_test_at(self.bundle.for_shape(*shape)) for shape in self.shapes]
        if len(results) == 1:
            return results[0]
        first = results[0]
        return SelfTestResult(all(r.passed for r in results), max(r.max_abs_err for r in results),
                              max(r.max_rel_err for r in results), first.rtol, first.atol, self.backend_name,
                              max(r.worst for r in results))

    def _self_test_at(self, view) -> SelfTestResult:
        x, expected, rtol, atol = view.selftest()
        fixed = tuple(view.shape) + (self.hidden_size,)
        if x.shape != fixed:
            raise BundleError(f"self-test input shape {x.shape}; the bundle's fixed shape is {fixed}")
        try:  # dropless: the stored reference output is; expert capacity applies on top of it
            actual = self._call(np.ascontiguousarray(x, dtype=np.float32), None, None, 0, self.num_layers, None,
                                dropless=True)
        except NonFiniteOutputError:  # a failed self-test is returned, not raised
            inf = float("inf")
            return SelfTestResult(False, inf, inf, float(rtol), float(atol), self.backend_name, inf)
        return compare(actual, np.asarray(expected, dtype=np.float32), rtol, atol, self.backend_name)

    # ---- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the backend (device memory, graph, weight mapping). Safe to call more than once. Calls queued by
        `submit` run first. A Runtime garbage-collected without close() does the same once the calls `submit`
        accepted have run (each queued call holds its Runtime until then; docs/runtime.md, "Pipelined calls")."""
        if self._pipeline is not None:
            self._pipeline.close()
        with self._lock:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"Runtime({str(self.bundle.path)!r}, backend={self.backend_name!r}, shapes={self.shapes}, "
            f"hidden={self.hidden_size}, dtype={self.dtype!r}, {state})"
        )
