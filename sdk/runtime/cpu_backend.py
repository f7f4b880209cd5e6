"""The CPU backend: one engine (colibri_sdk.runtime.cpu_engine) on the bundle's mmap'ed weights, every storage.

Loading maps `model.colibri` read-only and reads only its header: no weight byte is read until a forward pass
touches it, so load time does not grow with the weights' size. A forward pass reads the experts it uses as they
are stored (fp16 widened and int8/int4 dequantized one row at a time inside the compiled products, fp32
accumulation, as on the GPU) and keeps no copy, so the process holds the weights at most once (in the page cache,
shared with any other reader of the file). The mapping asks for 2 MiB pages (madvise MADV_HUGEPAGE,
colibri_sdk.format.pages: an fp32 layer at one token 1.14-1.21x faster where the kernel maps the file so, e.g. a
file first read by `Bundle.verify` or by this mapping on Linux >= 6.16 with ext4). The compiled kernels (numba,
cached on disk) are compiled or loaded from the cache at load (`warm_up`), never on a call.

Threads: each forward pass runs inside `colibri_sdk.blas.LazyBlasThreads(rows)` (the call's batch · tokens), and
splits its experts between `colibri_sdk.blas.threads(rows)` threads, so the BLAS
products of a decode-sized call (experts with many tokens, the NumPy routing path, a shared-expert gate) use one
BLAS thread (the rule and its measurement: colibri_sdk.blas, docs/runtime.md), with no environment variable
needed; the limit is set before the call's first BLAS product (none at a few tokens, where everything runs in
compiled kernels), and the rest of the process keeps its own setting.
"""

from __future__ import annotations

import numpy as np

from ..blas import LazyBlasThreads
from ..blas import threads as call_threads
from ..capacity import Capacity
from ..errors import BackendError
from .cpu_engine import CpuEngine
from .padding import check_valid_tokens


class CpuBackend:
    """Runs a bundle on the CPU (NumPy and the compiled kernels of colibri_sdk.runtime.cpu_kernels).

    Args:
        bundle: an open `colibri_sdk.bundle.Bundle`.
        eager: accepted for symmetry with the CUDA backend; the CPU backend always runs eagerly.

    Attributes:
        name: "cpu".
        shape: the bundle's fixed (batch, tokens).
        hidden_size: the model's hidden size.
        huge_pages: whether the kernel accepted the advice to map the weights in 2 MiB pages (whether it does
            depends on the file's page cache: colibri_sdk.format.pages; `mapped_bytes()` says what it did).
    """

    name = "cpu"

    def __init__(self, bundle, eager: bool = False):
        self.shape = tuple(bundle.shape)
        self._file = bundle.open_weights()
        # 2 MiB pages where the kernel gives them: fewer page walks while the experts stream (format.pages)
        self.huge_pages = self._file.advise_huge_pages()
        self.hidden_size = self._file.header.hidden_size
        self.num_layers = self._file.header.num_layers
        rows = int(np.prod(self.shape))
        # The runtime checks each call's output once and names the first non-finite layer (NonFiniteOutputError).
        self._scratch = CpuEngine(self._file, rows)
        self._scratch.warm_up()  # compiled (or loaded from numba's cache) now, not on the first call
        self._engine = self._scratch
        self._out = np.zeros((rows, self.hidden_size), np.float32)
        spec = getattr(bundle, "manifest", {}).get("profile", {}).get("capacity")
        self.capacity = None if spec is None else Capacity.from_dict(spec, "manifest profile.capacity")
        self.last_dropped = 0  # pairs dropped by expert capacity in the last call (Runtime.stats)

    def infer_padded(self, x: np.ndarray, valid_tokens=None) -> np.ndarray:
        """One forward pass at the fixed shape.

        Args:
            x: float32, C-contiguous, (batch, tokens, hidden) at the bundle's fixed batch and tokens. The caller
                (Runtime) has validated it.
            valid_tokens: (batch,) ints 0..tokens, the valid (first) tokens of each sequence; None: all.

        Returns:
            float32 (batch, tokens, hidden), a new array. As on the GPU, only valid rows are computed; a padded row
            is its input row (residual composition) or zeros.

        Raises:
            BackendError: the backend is closed.
            InputError: valid_tokens of another shape or out of range.
        """
        if self._engine is None:
            raise BackendError("the CPU backend is closed; load the bundle again")
        batch, tokens = self.shape
        counts = check_valid_tokens(valid_tokens, batch, tokens)
        # Runtime checked dtype, shape and finiteness: run the layers without a second pass over x.
        engine = self._engine
        engine.capacity, engine.valid = self.capacity, None
        if (counts == tokens).all():
            rows = x.reshape(-1, self.hidden_size)
            out = np.empty_like(rows)
            with LazyBlasThreads(rows.shape[0]) as engine.blas:
                engine.run_into(rows, out, 0, self.num_layers)
            self.last_dropped = engine.dropped
            return out.reshape(x.shape)
        mask = np.arange(tokens)[None, :] < counts[:, None]  # (batch, tokens)
        out = x.copy() if self._file.header.composition == 1 else np.zeros_like(x)
        if mask.any():
            rows = np.ascontiguousarray(x[mask])
            result = np.empty_like(rows)
            with LazyBlasThreads(rows.shape[0]) as engine.blas:
                engine.run_into(rows, result, 0, self.num_layers)
            self.last_dropped = engine.dropped
            out[mask] = result
        return out

    def run_layers(self, x: np.ndarray, out: np.ndarray, start: int, stop: int, valid_rows=None,
                   capacity: bool = True) -> None:
        """Layers start..stop-1 (composed as the model composes them) into the caller's buffer.

        Args:
            x: float32, C-contiguous, (batch, tokens, hidden), batch · tokens at most the fixed shape's (validated by
                Runtime; without expert capacity it passes only the call's own tokens: `ShapeRun.run_corner`).
            out: float32, C-contiguous, x's shape; overwritten. The engine's scratch is preallocated
                (`cpu_engine`): a call allocates no activation- or weight-sized array.
            start, stop: 0 <= start < stop <= num_layers (validated by Runtime).
            valid_rows: (batch * tokens,) bool, the rows that are real tokens (expert capacity counts only those);
                None: all.
            capacity: False runs dropless even where the bundle sets a capacity (the self-test).

        Raises:
            BackendError: the backend is closed.
        """
        if self._engine is None:
            raise BackendError("the CPU backend is closed; load the bundle again")
        flat_x, flat_out = x.reshape(-1, self.hidden_size), out.reshape(-1, self.hidden_size)
        engine = self._scratch
        engine.threads = call_threads(flat_x.shape[0])  # this call's rows, not the shape's (colibri_sdk.blas)
        engine.capacity = self.capacity if capacity else None
        engine.valid = valid_rows
        engine.dropped = 0
        with LazyBlasThreads(flat_x.shape[0]) as engine.blas:
            engine.run_into(flat_x, flat_out, start, stop)
        self.last_dropped = engine.dropped

    def mapped_bytes(self) -> tuple[int, int] | None:
        """(resident, of which in 2 MiB pages) bytes of the weights' mapping now (`ColibriFile.mapped_bytes`), or
        None where that cannot be read (not Linux).

        Raises:
            BackendError: the backend is closed.
        """
        if self._engine is None:
            raise BackendError("the CPU backend is closed; load the bundle again")
        return self._file.mapped_bytes()

    def close(self) -> None:
        """Unmap the weights. Safe to call more than once."""
        if self._engine is not None:
            self._file.close()
            self._engine = None
            self._file = None
            self._scratch = None
