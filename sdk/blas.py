"""The BLAS thread count of colibri-sdk's NumPy matrix products (the CPU backend, the build's self-test).

The rule (docs/runtime.md, "BLAS threads"; measured by bench/runtime_cpu_bench.py): a MoE forward pass on the CPU
multiplies the tokens routed to each expert by that expert's weights, one small GEMM after another. When a call
has at most SMALL_ROWS token rows, waking BLAS worker threads for each of these products costs more than it
saves — most of all on a busy machine, where a worker that is not scheduled stalls every product — so such calls
run with one BLAS thread. Larger calls keep the BLAS library's own thread count.

The limit applies only inside `blas_threads(...)` (threadpoolctl, set and restored around the call), never to the
rest of the process. An explicit OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS or BLIS_NUM_THREADS in the
environment is respected: the rule is then not applied.

threadpoolctl (a dependency) is the well-kept way to do this: it finds the BLAS library NumPy loaded (OpenBLAS,
MKL, BLIS, any vendor build) and sets its thread count through that library's own API at run time, which an
environment variable can only do before the library is loaded.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

SMALL_ROWS = 1024  # calls with at most this many token rows run with one BLAS thread
SPLIT_ROWS = 16  # calls with at least this many token rows split their experts between the CPUs (`threads`)
ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")

_lock = threading.Lock()
_blas = None  # threadpoolctl's controllers of the BLAS libraries loaded at the first limited call
_depth = 0  # nested or concurrent blas_threads(1) contexts; the first sets the limit, the last restores it
_restore: list = []  # (controller, its thread count before the limit), for those the limit changed


def _thread_variables() -> list[int]:
    """The positive integers among the thread variables set in the environment; a value that is not one (0, -3,
    "abc", "1,2") counts as unset, as the BLAS libraries fall back to their own count for it."""
    values = []
    for name in ENV_VARS:
        text = os.environ.get(name, "")
        if not text.isascii():  # int() reads other scripts' digits ("٣"), which the BLAS libraries' C parsers do not
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if value > 0:
            values.append(value)
    return values


def threads_for(rows: int) -> int | None:
    """The BLAS thread count for a call on `rows` token rows: 1 when rows <= SMALL_ROWS and no thread variable is
    set in the environment (to a positive integer), else None (the library's own count)."""
    if _thread_variables():
        return None
    return 1 if rows <= SMALL_ROWS else None


def threads(rows: int) -> int:
    """The threads the CPU backend splits a call's experts between (its compiled kernels; BLAS keeps
    `threads_for`): the smallest of the thread variables set in the environment to a positive integer, where one
    is; else the CPUs this process may run on for a call of at least SPLIT_ROWS token rows, and 1 below.

    Splitting costs one hand-off per layer, not one per product as BLAS threads do, and it paid from 16 tokens on
    both a quiet and a fully loaded 2-core machine (demo model, p50 of the compiled path on 1 and 2 threads:
    16 tokens 9.4 -> 6.4 ms quiet, 13.4 -> 8.2 ms beside two busy loops; 64 tokens 20.0 -> 13.7 and 39.8 -> 20.3 ms;
    4 tokens no gain; bench/runtime_cpu_bench.py, 2026-12-07). The CPU backend applies it to each call's own rows
    (`CpuBackend.run_layers`), to the compiled path's experts and to those on the BLAS path alike (each product of
    these with one BLAS thread up to SMALL_ROWS rows: demo model at 1024 tokens 80 -> 46 ms on 2 cores, 2026-12-08)."""
    values = _thread_variables()
    if values:
        return min(values)
    if rows < SPLIT_ROWS:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _set_threads(controller, count: int) -> None:
    """Set one BLAS library's thread count from whichever thread calls (under `_lock`).

    threadpoolctl 3.8 lets only one "controlling" thread change OpenBLAS's count (the first that set it, until
    cleared) and silently ignores the others, so a limit set by a worker thread (`Runtime.submit`'s, a user's) had
    no effect, and a restore from another thread than the one that set it left the count at 1 for the rest of the
    process. `blas_threads` already orders the calls of all threads (the first in sets, the last out restores), so
    each set here takes control and hands it back at once (`clear_controlling_thread`, where the controller has it)."""
    clear = getattr(type(controller), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    controller.set_num_threads(count)
    if clear is not None:
        clear(force=True)


@contextlib.contextmanager
def blas_threads(rows: int) -> Iterator[int | None]:
    """Run the body with `threads_for(rows)` BLAS threads; yields that count (None: unchanged).

    Thread-safe: concurrent bodies share one limit, set by the first to enter and restored by the last to leave.
    """
    limit = threads_for(rows)
    if limit is None:
        yield None
        return
    global _blas, _depth, _restore
    with _lock:
        if _depth == 0:
            if _blas is None:
                from threadpoolctl import ThreadpoolController

                _blas = ThreadpoolController().select(user_api="blas").lib_controllers
            # Each library's own get/set calls (about 1 us each) rather than `ThreadpoolController.limit`, which
            # describes every library again on each call (37 us, a tenth of a one-token layer's fixed cost).
            _restore = [(c, n) for c in _blas if (n := c.num_threads) != limit]
            for c, _ in _restore:
                _set_threads(c, limit)
        _depth += 1
    try:
        yield limit
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for c, n in _restore:
                    _set_threads(c, n)
                _restore = []


class LazyBlasThreads:
    """`blas_threads(rows)` entered only when the body first calls `ensure()` (just before its first BLAS product),
    exited with the body. A body that makes no BLAS product (the CPU backend at a few tokens: routing and experts
    in compiled kernels) neither reads the environment nor asks the BLAS library its thread count: with the caches
    cold, as after a camera frame's other work, those reads cost 0.18 ms a call, a tenth of a one-token int4 layer
    of 8.6 MB (bench/runtime_cpu_moe.py's conditions; 2-core EPYC host, 2026-12-07).

    Use: `with LazyBlasThreads(rows) as limit: ... limit.ensure(); np.matmul(...)`. `ensure` is called from the
    thread that entered (the limit is the process's, shared as `blas_threads` shares it); after the body it does
    nothing (the limit holds inside the body only)."""

    __slots__ = ("rows", "_state")

    def __init__(self, rows: int):
        self.rows = rows
        self._state = None  # None: not applied yet; the blas_threads context once applied; False: body left

    def __enter__(self) -> "LazyBlasThreads":
        self._state = None
        return self

    def ensure(self) -> None:
        """Apply the limit now, if the body has not applied it yet and is still running."""
        if self._state is None:
            context = blas_threads(self.rows)
            context.__enter__()
            self._state = context

    def __exit__(self, *exc) -> bool:
        context, self._state = self._state, False
        if context:
            context.__exit__(*exc)
        return False
