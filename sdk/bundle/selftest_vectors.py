"""A bundle's self-test vectors: a seeded random input whose routing is unambiguous (every token's k-th and
(k+1)-th router logits at least SELFTEST_MIN_MARGIN apart), and the expected output computed in float64 on the
stored weights and rounded to float32.

Memory: the weights are read in row chunks of at most CHUNK_BYTES (as float64), each mapped only while it is read.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from .. import catalog
from ..blas import blas_threads
from ..format import ColibriFile, Header, HeaderV2
from ..format.constants import COMPOSITION_RESIDUAL
from ..reference import silu, topk_route
from .weights import CHUNK_BYTES, Progress, no_progress

log = logging.getLogger(__name__)

SELFTEST_SEED = 20261130
SELFTEST_ATTEMPTS = 32
SELFTEST_MIN_MARGIN = 1e-3  # smallest gap between the k-th and (k+1)-th router logit the self-test input may have
# Self-test tolerances per dtype: |actual - expected| <= atol + rtol * |expected|. The expected output is exact
# (float64) on the stored weights; the GPU accumulates in fp32, and fp16 profiles may round activations to fp16.
SELFTEST_TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2)}


class _RowChunks:
    """Row chunks of a .colibri file's tensors as float64, each chunk read through a mapping opened and closed for
    it alone, so at most one chunk of the file is resident at a time (the page cache keeps the rest for the OS)."""

    def __init__(self, path: Path):
        self.path = path
        with ColibriFile(path) as f:
            self.header = f.header

    def read(self, kind: str, layer: int, expert: int | None, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of one tensor, float64 (a copy; int8/int4 matrices dequantized exactly)."""
        with ColibriFile(self.path) as f:
            if catalog.quant(self.header) and kind != "router":
                return f.weight(kind, layer, expert, rows=np.arange(start, stop)).astype(np.float64)
            view = f.tensor(kind, layer, expert)[start:stop]
            rows = view.astype(np.float64)
            del view
        return rows

    def chunks(self, kind: str) -> list[tuple[int, int]]:
        """(start, stop) row ranges of a `kind` tensor, each at most CHUNK_BYTES as float64."""
        rows, cols = self.header.shape(kind)
        step = max(1, CHUNK_BYTES // (cols * 8))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _expert_forward(weights: _RowChunks, layer: int, expert: int, xs: np.ndarray) -> np.ndarray:
    """One SwiGLU expert in float64 on xs (n, hidden): down(silu(gate(xs)) * up(xs)), as in colibri_sdk.reference,
    with gate/up read in chunks of intermediate rows and down in chunks of hidden rows."""
    h = weights.header
    act = np.empty((xs.shape[0], h.intermediate_size), dtype=np.float64)
    for start, stop in weights.chunks("gate_proj"):
        gate = weights.read("gate_proj", layer, expert, start, stop)
        up = weights.read("up_proj", layer, expert, start, stop)
        act[:, start:stop] = silu(xs @ gate.T) * (xs @ up.T)
    y = np.empty((xs.shape[0], h.hidden_size), dtype=np.float64)
    for start, stop in weights.chunks("down_proj"):
        y[:, start:stop] = act @ weights.read("down_proj", layer, expert, start, stop).T
    return y


def reference_with_margin(
    weights: _RowChunks, x: np.ndarray, progress: Progress = no_progress, step: str = "self-test"
) -> tuple[np.ndarray, float]:
    """The reference engine's forward pass (docs/format.md, "Semantics"; colibri_sdk.reference) in float64, read
    in chunks, and the smallest gap between the k-th and (k+1)-th largest router logit over all tokens and layers
    (inf when top_k == num_experts).

    Args:
        x: (batch, tokens, hidden) float32.

    Returns:
        (output float64 of x's shape, margin).
    """
    h = weights.header
    if _needs_v2_semantics(h):
        return _reference_v2(weights.path, x, progress, step)
    state = x.reshape(-1, h.hidden_size).astype(np.float64)
    expert_bytes = sum(int(np.prod(h.shape(k))) for k in ("gate_proj", "up_proj", "down_proj")) * h.itemsize
    total, done = h.num_layers * h.num_experts * expert_bytes, 0
    progress(step, 0, total)
    margin = np.inf
    for layer in range(h.num_layers):
        logits = state @ weights.read("router", layer, None, 0, h.hidden_size)
        if h.top_k < h.num_experts:
            ordered = np.sort(logits, axis=-1)[:, ::-1]
            margin = min(margin, float((ordered[:, h.top_k - 1] - ordered[:, h.top_k]).min()))
        indices, routing = topk_route(logits, h.top_k, h.routing)
        y = np.zeros_like(state)
        for expert in range(h.num_experts):
            tokens, slots = np.nonzero(indices == expert)
            if tokens.size:
                # Each (token, expert) pair occurs once, so this scatter has no duplicate indices.
                y[tokens] += routing[tokens, slots][:, None] * _expert_forward(weights, layer, expert, state[tokens])
            done += expert_bytes
            progress(step, done, total)
        state = state + y if h.composition == COMPOSITION_RESIDUAL else y
    return state.reshape(x.shape), margin


def _needs_v2_semantics(header: Header) -> bool:
    """True for a v2 header with routing or expert features beyond v1 (the int8/int4 storage alone is read by the
    chunked v1 path above, which dequantizes exactly)."""
    if not isinstance(header, HeaderV2):
        return False
    return bool(dataclasses.replace(header, quant=0, group_size=0, zero_points=0).v1_gaps()) or bool(header.norm_topk)


def _reference_v2(
    path: Path, x: np.ndarray, progress: Progress = no_progress, step: str = "self-test"
) -> tuple[np.ndarray, float]:
    """`reference_with_margin` for a file with v2 features: the reference engine in float64 (docs/format.md
    "Semantics v2"; it reads one expert at a time), the margin taken at every selection boundary
    (`colibri_sdk.reference.selection_margin`: group scores and the k-th score)."""
    from ..reference import ReferenceEngine, selection_margin

    engine = ReferenceEngine(path, compute_dtype=np.float64, check_overflow=False)
    try:
        h = engine.header
        state = x.reshape(-1, h.hidden_size).astype(np.float64)
        margin = np.inf
        progress(step, 0, h.num_layers)
        for layer in range(h.num_layers):
            logits = state @ engine.file.router(layer).astype(np.float64)
            if h.router_bias:
                logits = logits + engine.file.vector("router_bias", layer).astype(np.float64)
            correction = engine.file.vector("correction_bias", layer) if h.correction_bias else None
            margin = min(margin, float(selection_margin(logits, h, correction).min()))
            y = engine.layer(layer, state)
            state = state + y if h.composition == COMPOSITION_RESIDUAL else y
            progress(step, layer + 1, h.num_layers)
    finally:
        engine.close()
    return state.reshape(x.shape), margin


def selftest_vectors(
    weights_path: Path, batch: int, tokens: int, progress: Progress = no_progress
) -> tuple[np.ndarray, np.ndarray, int]:
    """A seeded input and the reference engine's output for it.

    The input is N(0, 1) from NumPy's PCG64 with seed SELFTEST_SEED + attempt, for the first attempt whose router
    logits leave a gap of at least SELFTEST_MIN_MARGIN at the top-k boundary in every layer, so rounding
    differences between backends cannot flip an expert choice (else the attempt with the largest gap).
    The output is computed in float64 and rounded to float32. Memory: CHUNK_BYTES of weights at a time.

    Returns:
        (input float32 (batch, tokens, hidden), output float32 (batch, tokens, hidden), seed used).
    """
    weights = _RowChunks(Path(weights_path))
    hidden = weights.header.hidden_size
    with blas_threads(batch * tokens):
        best = _search(weights, batch, tokens, hidden, progress)
    _, x, y, seed = best
    return x, y.astype(np.float32), seed


def _search(weights: _RowChunks, batch: int, tokens: int, hidden: int, progress: Progress):
    """(margin, input, output float64, seed) of the first self-test attempt with a margin, else the best."""
    best = None
    for attempt in range(SELFTEST_ATTEMPTS):
        seed = SELFTEST_SEED + attempt
        x = np.random.default_rng(seed).standard_normal((batch, tokens, hidden)).astype(np.float32)
        step = "self-test" if attempt == 0 else f"self-test, input {attempt + 1}"
        y, margin = reference_with_margin(weights, x, progress, step)
        if best is None or margin > best[0]:
            best = (margin, x, y, seed)
        if margin >= SELFTEST_MIN_MARGIN:
            break
        log.debug("self-test input %d: router margin %.3g < %g; trying the next seed", attempt + 1, margin,
                  SELFTEST_MIN_MARGIN)
    return best
