"""Per-layer calls and device-resident I/O of the CUDA backend (docs/runtime-cuda.md, "Per-layer calls, device
I/O"): a sub-range of the layers on the backend's stream, the caller's device pointers and stream, the pipelined
enqueue / finish of `Runtime.submit`, the dropped-pair counts of expert capacity, and the poison fill tests use.
"""

from __future__ import annotations

import numpy as np

from .. import catalog
from ..errors import BackendError, InputError
from .driver import check, launch_kernel
from .padding import check_valid_tokens

POISON_WORD = 0x7FC00000  # a float32 quiet NaN; as int32 a large positive value no kernel accepts as an index


class DeviceCalls:
    """The call paths of `CudaBackend` beyond the whole-model graph replay (it supplies the device state)."""

    def _enqueue_layers(self, start: int, stop: int, stream, skip=()) -> None:
        """The launches of layers start..stop-1 on `stream`; they read x{start%2} and leave x{stop%2}. `skip`: per
        launch of the plan, True to leave it out (the capacity launches of a dropless run)."""
        cu, after_launch = self._cu, False
        for i, (entry, layer) in enumerate(zip(self._launches, self._launch_layers)):
            if start <= layer < stop and not (skip and skip[i]):
                # a programmatic edge only to a launch of this call (not to the caller's work on its stream)
                launch_kernel(cu, entry, stream, pdl=after_launch and self._launch_pdl[i])
                after_launch = True

    def _read_dropped(self, start: int, stop: int, stream) -> None:
        """`last_dropped` = the pairs dropped by layers start..stop-1 (the capacity_dropped buffer, one int32 per
        layer, written by colibri_capacity on every call), after `stream` has finished the call's launches."""
        if self.capacity is None:
            return
        cu = self._cu
        check(cu.cuMemcpyDtoHAsync(self._dropped_ptr, cu.CUdeviceptr(self._buffers[catalog.CAPACITY_DROPPED]),
                                   self._dropped.nbytes, stream), "cuMemcpyDtoHAsync")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        self.last_dropped = int(self._dropped[start:stop].sum())

    def _write_valid_tokens(self, stream, counts) -> None:
        """Where the launch plan has a `valid_tokens` buffer (`catalog.io_buffers`): entry b = counts[b] (an int
        for every sequence, or one per sequence; sequences past len(counts) get 0), written on `stream` before a
        sub-range's or a device call's launches, which do not run the whole-model input copy."""
        name = self._io.get("valid_tokens")
        if name not in self._buffers:
            return
        cu, fixed_batch = self._cu, self.shape[0]
        values = [int(counts)] * fixed_batch if np.ndim(counts) == 0 else [int(v) for v in counts]
        values += [0] * (fixed_batch - len(values))
        ptr = self._buffers[name]
        for b, value in enumerate(values):
            check(cu.cuMemsetD32Async(cu.CUdeviceptr(ptr + 4 * b), value, 1, stream), "cuMemsetD32Async")

    def enqueue_call(self, x: np.ndarray, valid_tokens=None) -> None:
        """Start the whole model on a host input at the fixed shape without waiting for it: x and the valid-token
        counts into this backend's pinned input, then cuGraphLaunch (or the eager launches) on its own stream.
        `finish_call` waits for it and reads the output. Used by `Runtime.submit`'s pipeline, which gives each slot
        its own backend (stream, pinned I/O, scratch buffers, graph), so calls of different slots are in flight
        together (docs/runtime.md, "Pipelined calls").

        Args:
            x: float32 C-contiguous (batch, tokens, hidden) at the fixed shape (validated by Runtime).
            valid_tokens: (batch,) ints, each sequence's valid tokens, or None (all).

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            self._in[:] = x.reshape(-1).view(np.uint8)
            self._valid[:] = self.shape[1] if valid_tokens is None else valid_tokens
            if self.eager:
                self._enqueue()
            else:
                check(cu.cuGraphLaunch(res.graph_exec, res.stream), "cuGraphLaunch")

    def finish_call(self, out: np.ndarray) -> None:
        """Wait for the call `enqueue_call` started (cuStreamSynchronize on this backend's stream) and copy the
        pinned output into `out` (float32 C-contiguous, the fixed shape).

        Raises:
            BackendError: closed. CudaError: the synchronisation reported a fault.
        """
        cu, res = self._cu, self._res
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
            out.reshape(-1).view(np.uint8)[:] = self._out
            self._read_dropped(0, self.header.num_layers, res.stream)  # capacity bundles: this call's dropped pairs

    def run_layers(self, x: np.ndarray, out: np.ndarray, start: int, stop: int, valid_tokens=None,
                   valid_rows=None, capacity: bool = True) -> None:
        """Layers start..stop-1 on a host input at the fixed shape, into `out` (the Runtime's contract).

        The whole model (0..num_layers) replays the CUDA Graph (or the eager launches); a sub-range enqueues that
        range's launches eagerly: input copy into x{start%2}, the launches, output copy from x{stop%2}.

        Args:
            x, out: float32 C-contiguous (batch, tokens, hidden) at the fixed shape (validated by Runtime).
            valid_tokens: (batch,) ints, each sequence's valid tokens, or None (all); used where the launch plan
                has a `valid_tokens` buffer (padded tokens then select no expert).
            valid_rows: instead of valid_tokens, (batch * tokens,) bool with each sequence's valid rows first (the
                Runtime's call for a bundle with expert capacity, as on the CPU backend).
            capacity: False skips the colibri_capacity launches (eagerly): dropless, for the self-test, whose stored
                reference output is dropless.

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        if valid_rows is not None:
            valid_tokens = np.asarray(valid_rows, dtype=bool).reshape(self.shape).sum(axis=1)
        skip = [] if capacity else self._capacity_launch
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            self._in[:] = x.reshape(-1).view(np.uint8)
            counts = self.shape[1] if valid_tokens is None else valid_tokens
            if hasattr(self, "_valid"):  # the pinned valid-token counts the whole-model input copy sends
                self._valid[:] = counts
            if start == 0 and stop == self.header.num_layers and not any(skip):
                if self.eager:
                    self._enqueue()
                else:
                    check(cu.cuGraphLaunch(res.graph_exec, res.stream), "cuGraphLaunch")
            else:
                src, dst = self._buffers[f"x{start % 2}"], self._buffers[f"x{stop % 2}"]
                check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(src), self._in_ptr, self._io_bytes, res.stream),
                      "cuMemcpyHtoDAsync")
                self._write_valid_tokens(res.stream, counts)
                self._enqueue_layers(start, stop, res.stream, skip)
                check(cu.cuMemcpyDtoHAsync(self._out_ptr, cu.CUdeviceptr(dst), self._io_bytes, res.stream),
                      "cuMemcpyDtoHAsync")
            check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
            out.reshape(-1).view(np.uint8)[:] = self._out
            if capacity:
                self._read_dropped(start, stop, res.stream)
            else:
                self.last_dropped = 0

    def run_device(self, src: int, dst: int, batch: int, tokens: int, start: int, stop: int, stream: int) -> None:
        """Layers start..stop-1 from device memory to device memory on the caller's stream: no host round trip.

        Args:
            src, dst: device addresses of C-contiguous float32 (batch, tokens, hidden) arrays (they may be equal).
            batch, tokens: the arrays' shape, at most the fixed shape; padding rows of the scratch input are zeroed.
            stream: the caller's CUstream handle; 0 is the legacy default stream, synchronised before returning.
                On any other stream the call returns once the work is enqueued (the caller synchronises), so the
                launches can be part of the caller's own stream capture. One Runtime's scratch buffers are shared by
                its calls: issue a Runtime's device calls on one stream at a time.
                With expert capacity, `last_dropped` is read back on stream 0 only (0 on another stream: the
                call has not run yet when this returns).

        Raises:
            BackendError: closed. CudaError: a driver call failed.
        """
        cu, res = self._cu, self._res
        fixed_batch, fixed_tokens = self.shape
        row = self.hidden * 4
        s = cu.CUstream(stream)
        with self._lock:
            if res.released:
                raise BackendError("this CUDA backend is closed; load the bundle again")
            check(cu.cuCtxSetCurrent(res.ctx), "cuCtxSetCurrent")
            x_in, x_out = self._buffers[f"x{start % 2}"], self._buffers[f"x{stop % 2}"]
            if (batch, tokens) != (fixed_batch, fixed_tokens):
                check(cu.cuMemsetD32Async(cu.CUdeviceptr(x_in), 0, self._io_bytes // 4, s), "cuMemsetD32Async")
            whole = tokens == fixed_tokens
            spans = [(0, batch * tokens * row)] if whole else [(b, tokens * row) for b in range(batch)]
            for b, n in spans:
                check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(x_in + b * fixed_tokens * row),
                                           cu.CUdeviceptr(src + b * tokens * row), n, s), "cuMemcpyDtoDAsync")
            self._write_valid_tokens(s, [tokens] * batch)
            self._enqueue_layers(start, stop, s)
            for b, n in spans:
                check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(dst + b * tokens * row),
                                           cu.CUdeviceptr(x_out + b * fixed_tokens * row), n, s), "cuMemcpyDtoDAsync")
            if stream == 0:
                check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
                self._read_dropped(start, stop, s)
            elif self.capacity is not None:
                self.last_dropped = 0  # not read back: the call is still in flight on the caller's stream

    def poison(self) -> None:
        """Fill every scratch buffer and the pinned output with 0x7FC00000 words (float32 NaN), for tests that
        check that every value a call reads was written during that call."""
        cu = self._cu
        with self._lock:
            check(cu.cuCtxSetCurrent(self._res.ctx), "cuCtxSetCurrent")
            sizes = catalog.device_buffers(self.bundle.manifest["profile"], self.header)
            for name, ptr in self._buffers.items():
                check(cu.cuMemsetD32(cu.CUdeviceptr(ptr), POISON_WORD, sizes[name] // 4), "cuMemsetD32")
            self._zero_counters(sizes)
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            self._out.view(np.uint32)[:] = POISON_WORD
