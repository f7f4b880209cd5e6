"""The CPU backend's forward pass: one engine for every storage and every v2 feature, weights read as stored.

It computes what `colibri_sdk.reference.ReferenceEngine` computes (docs/format.md, "Semantics" and "Semantics
v2"; the reference engine stays the float64-capable oracle of the tests) in float32, for fp32 / fp16 expert
matrices and int8 (per row, g32/64/128) / int4 (g32/64/128) ones with or without zero points, with shared experts,
every routing variant, router / correction / expert biases and the clamped SwiGLU.

Per layer, on rows x (tokens, hidden) float32:

    logits, ids, w, pairs                                     cpu_routing.route_grouped: one compiled call
             = x @ R (+ router bias), top-k and weights,      (the NumPy path where it does not apply: matmul,
               the (token, slot) pairs grouped per expert      topk_route / route_v2, capacity, group_pairs)
    out      = sum over pairs of w * expert(x[token])         experts_into (cpu_kernels), or BLAS (below)
    out     += shared experts (gated)                         experts_into on every token

An expert with fewer than BLAS_PAIRS pairs runs in `cpu_kernels.experts_into`: each stored row is decoded once
(float16 widened, int8/int4 dequantized exactly) into an L1-sized buffer and multiplied with all of that expert's
tokens, four rows times four tokens per pass, fused with the SwiGLU and the weighted sum; all such experts of a
layer in one compiled call (an int8 / int4 expert of at most `cpu_direct.direct_tokens` tokens — every such expert
but int4 outside the integer path above 4 tokens — multiplies its codes as stored, no decoded row). An expert with
more pairs is compute-bound: its tokens are gathered and multiplied by BLAS (NumPy matmul), float32 weights in
place, other storages through tiles of TILE_ROWS decoded rows (never a whole widened matrix).

Every buffer is allocated once at load, sized for the bundle's fixed rows (batch · tokens):

    h0, h1        (rows, hidden)        activations, ping-pong between layers
    logits        (rows, experts)       router logits
    order, pair_w (rows · top_k,)       pairs grouped by expert; routing weight of each pair
    starts        (experts + 1,)        where each expert's pairs start in `order`
    gate, up      (rows, intermediate)  gate/up projections (also the shared experts', up to their size)
    xs, y, shared (rows, hidden)        the BLAS path's gathered rows and output; the shared experts' sum
    finite        (rows, hidden) bool   which values of a layer's output are finite
    tile          (TILE_ROWS, widest)   decoded rows for the BLAS path of fp16 / int8 / int4 weights
    xq, xsum, s32                       the direct int8 / int4 path's prepared inputs, group sums, scales
                                        (and zero points of 0)

What is still allocated per call: the routing call's per-token rows (experts,) and pair experts (rows · top_k,) (on
the NumPy path, the routing functions' (rows, experts) temporaries and index arrays), and small scalars (the
tracemalloc test in tests/runtime bounds a warm call's peak well below one activation tensor).

Stored tensors are checked finite, as the reference engine does: a NaN or Inf in the file is a FormatError naming
the tensor. The router, the vectors and the shared experts are checked when a layer is first used. A routed
expert's matrices (or scales) are checked when a layer's output holds a non-finite value, before anything else
sees it: with the SwiGLU, a non-finite stored value always reaches the output (NaN and Inf propagate through every
product, sum, silu and routing weight, 0 · Inf included), so a finite output proves the used experts finite
without a second read of their bytes (which cost a first call of shape B, 8 of 128 experts, about as much as the
product itself: bench/runtime_cpu_bench.py). The clamped SwiGLU can turn an Inf into a finite value, so with it
each expert is checked on first use.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..blas import threads as call_threads
from ..blas import threads_for
from ..errors import FormatError, InputError
from ..format import HeaderV2
from ..format.constants import (
    ACTIVATION_CLAMPED_SWIGLU,
    COMPOSITION_RESIDUAL,
    QUANT_FLOAT,
    QUANT_INT4,
    SCALES_SUFFIX,
    ZEROS_SUFFIX,
)
from ..reference import route_v2, topk_route
from . import cpu_kernels as K
from . import cpu_routing as R

# An expert with at least BLAS_PAIRS pairs in a call runs through BLAS. The compiled kernel's four rows times four
# tokens per pass beat single-threaded BLAS (which packs the weights first) up to at least 64 pairs, for every
# storage (one expert of shape A, bench/runtime_cpu_bench.py's files, 1 thread, kernel / BLAS ms, 2026-12-06: fp32
# 6.7 / 11.8 at 16 pairs, 9.1 / 14.0 at 32, 12.6 / 17.0 at 48, 17.8 / 20.4 at 64; int4 g128 5.6 / 13.3, 8.7 / 16.5,
# 12.2 / 19.9, 15.0 / 22.8); with more threads the kernel path splits the experts between them (shape A at 64 tokens,
# 2 threads: fp16 25 ms on the kernels, fp32 41 ms with the experts from 16 pairs on 2-thread BLAS).
BLAS_PAIRS = 64
EXPERT_COST_PAIRS = 4  # splitting experts between threads: an expert's fixed cost (reading its weights), in pairs
TILE_ROWS = 128  # decoded rows per BLAS tile for fp16 / int8 / int4 weights


def _readonly(array: np.ndarray) -> np.ndarray:
    """`array`, marked read-only: the compiled kernels see one array type for the mmap'ed views and these."""
    array.setflags(write=False)
    return array


class _Matrix:
    """One expert-matrix kind of one layer, as stored: codes (experts, rows, row bytes) uint8 and, for quantized
    storage, scales (experts, rows, groups · scale bytes) uint8 and zeros (experts, rows, groups) int8; `floats`:
    the typed float32 view for BLAS (fp32 storage only)."""

    __slots__ = ("kind", "codes", "scales", "zeros", "floats", "rows", "cols", "typed", "typed_scales")

    def __init__(self, model, kind: str, layer: int, dummies: dict):
        h = model.header
        quant = getattr(h, "quant", QUANT_FLOAT)
        typed = model.experts(kind, layer)
        self.kind, self.typed = kind, typed
        count, self.rows, stored = typed.shape
        self.cols = h.shape(kind)[1]
        self.codes = typed.view(np.uint8)
        self.floats = typed if typed.dtype == np.float32 else None
        if quant == QUANT_FLOAT:
            self.typed_scales = None
            self.scales = dummies.setdefault(("s", count, self.rows), _readonly(np.zeros((count, self.rows, 4), np.uint8)))
            self.zeros = dummies.setdefault(("z", count, self.rows), _readonly(np.zeros((count, self.rows, 1), np.int8)))
            return
        self.typed_scales = model.experts(kind + SCALES_SUFFIX, layer)
        self.scales = self.typed_scales.view(np.uint8)
        if h.zero_points:
            self.zeros = model.experts(kind + ZEROS_SUFFIX, layer)
        else:
            self.zeros = dummies.setdefault(("z", count, self.rows), _readonly(np.zeros((count, self.rows, 1), np.int8)))


class CpuEngine:
    """Runs layers of an open ColibriFile on float32 rows, writing into preallocated buffers.

    Args:
        model: an open `colibri_sdk.format.ColibriFile` (v1 or v2, any storage).
        rows: the most rows (batch · tokens) one call passes.

    Attributes:
        capacity: colibri_sdk.capacity.Capacity or None (dropless); valid: (rows,) bool real-token rows or None;
        dropped: pairs dropped by capacity since the last run_into; blas_pairs: the fewest pairs of an expert
        that go through BLAS (BLAS_PAIRS); threads: the threads the compiled path's experts are split between
        (`colibri_sdk.blas.threads(rows)`); blas: a `colibri_sdk.blas.LazyBlasThreads` applied before each BLAS
        product, or None.
    """

    def __init__(self, model, rows: int, capacity=None):
        self.file = model
        self.capacity, self.valid, self.dropped = capacity, None, 0
        h = self.header = model.header
        self.v2 = isinstance(h, HeaderV2)
        H, E, I, k = h.hidden_size, h.num_experts, h.intermediate_size, h.top_k
        quant = getattr(h, "quant", QUANT_FLOAT)
        self.store = (K.STORE_F32, K.STORE_F16)[h.dtype] if quant == QUANT_FLOAT else (
            K.STORE_Q4 if quant == QUANT_INT4 else K.STORE_Q8)
        self.scale_f16 = quant != QUANT_FLOAT and h.dtype == 1
        self.has_zero = bool(getattr(h, "zero_points", 0))
        self.group = int(getattr(h, "group_size", 0))
        self.has_bias = bool(self.v2 and h.expert_bias)
        self.clamped = bool(self.v2 and h.activation == ACTIVATION_CLAMPED_SWIGLU)
        self.act = K.ACT_CLAMPED if self.clamped else K.ACT_SWIGLU
        self.limit = np.float32(h.swiglu_limit if self.clamped else 0.0)
        self.alpha = np.float32(h.swiglu_alpha if self.clamped else 0.0)
        self.shared_count = int(h.num_shared_experts) if self.v2 else 0
        SI = int(h.shared_intermediate_size) if self.shared_count else 0
        self.rows = n = int(rows)
        self.threads = call_threads(n)
        self.blas_pairs = BLAS_PAIRS
        self.blas = None  # the call's colibri_sdk.blas.LazyBlasThreads (set by CpuBackend around run_into)
        self._helpers: list = []  # (engine sharing this one's weights, its own output rows), one per extra thread
        self._pool, self._pool_workers = None, 0
        f32 = np.float32
        self.h = (np.zeros((n, H), f32), np.zeros((n, H), f32))
        self.logits = np.zeros((n, E), f32)
        self.order = np.zeros(n * k, np.int64)
        self.pair_w = np.zeros(n * k, f32)
        self.starts = np.zeros(E + 1, np.int64)
        self.used = np.zeros(E, np.int64)
        # routing in one compiled call (cpu_routing) unless the scheme limits the selection to expert groups
        self.scheme = None if (self.v2 and h.n_group > 1) or E > R.MAX_EXPERTS else int(h.routing)
        self.norm_topk = bool(self.v2 and h.norm_topk)
        self.scaling = np.float32(h.routed_scaling_factor if self.v2 else 1.0)
        self.all_ones = _readonly(np.ones(E, f32))  # router / correction bias placeholder (unused where there is none)
        self.tok = np.zeros(n, np.int64)
        wide = max(I, SI, H)
        self._gate_flat = np.zeros(n * wide, f32)
        self._up_flat = np.zeros(n * wide, f32)
        self.xs = np.zeros((n, H), f32)
        self.y = np.zeros((n, H), f32)
        self.shared_out = np.zeros((n, H), f32)
        self.finite = np.zeros((n, H), bool)  # the layer output's finiteness (the experts' lazy check)
        self.tile = np.zeros(TILE_ROWS * wide, f32)
        self.tile_out = np.zeros(n * TILE_ROWS, f32)
        self.buf = np.zeros(wide, f32)  # one decoded row
        # int8 / int4 experts of at most direct_tokens tokens (cpu_kernels._project_direct): the prepared inputs,
        # their group sums, one matrix's group scales as float32
        direct = min(n, K.DIRECT_TOKENS)
        self.xq = np.zeros(direct * 2 * (wide + 1), f32)
        self.xsum = np.zeros(direct * wide, f32)
        groups = (lambda cols: h.groups_for(cols) if self.v2 and quant != QUANT_FLOAT else 1)
        most = max(r * groups(c) for r, c in ((I, H), (H, I), (SI, H), (H, SI)) if r and c)
        self.s32 = np.zeros((5 * most + 3) // 4, f32)  # float32 scales, then int8 zero points of 0 (_project_float)
        self._sbufs: dict[int, np.ndarray] = {}
        self.shared_order = np.arange(n, dtype=np.int64)
        self.shared_starts = np.zeros(2, np.int64)
        self.ones = np.ones(n, f32)
        self.all_experts = np.arange(E, dtype=np.int64)
        self.first = np.zeros(1, np.int64)
        self._dummies: dict = {}
        self._layers: list = [None] * h.num_layers
        self._checked = np.zeros((h.num_layers, E), bool)
        self._no_bias_i = _readonly(np.zeros((1, I), f32))
        self._no_bias_h = _readonly(np.zeros((1, H), f32))

    def warm_up(self) -> None:
        """Compile (or load from numba's on-disk cache) every kernel for the argument types a call passes, on tiny
        arrays of those types: no weight byte is read, and no call pays for compilation (the CPU backend runs
        this at load)."""
        f32, i64 = np.float32, np.int64
        codes = _readonly(np.zeros((1, 2, 8), np.uint8))  # one expert, 2 rows of 2 float32 columns
        scales = _readonly(np.zeros((1, 2, 4), np.uint8))
        zeros = _readonly(np.zeros((1, 2, 1), np.int8))
        bias = _readonly(np.zeros((1, 2), f32))
        x, out, gate, up = (np.zeros((1, 2), f32) for _ in range(4))
        buf, sbuf = np.zeros(2, f32), np.zeros(1, f32)
        one, pairs = np.zeros(1, i64), np.array([0, 1], i64)
        K.experts_into(x, one, pairs, np.ones(1, f32), 1, one, K.STORE_F32, False, False, 0, codes, scales, zeros,
                       codes, scales, zeros, codes, scales, zeros, False, bias, bias, bias, K.ACT_SWIGLU, f32(0),
                       f32(0), out, np.zeros(1, i64), gate, up, buf, buf, sbuf, sbuf, one, out, buf, buf, buf)
        K.rows_into(K.STORE_F32, codes[0], scales[0], False, zeros[0], False, 0, 2, 0, 2, np.zeros((2, 2), f32), buf,
                    sbuf)  # rows 0..1 into a (2, 2) tile
        K._activate(gate, up, 1, K.ACT_SWIGLU, f32(0), f32(0))
        K.scatter_add(out, np.zeros(1, i64), np.ones(1, f32), gate, 1, bias[0], False)
        K.group_pairs(np.zeros((1, 1), i64), 1, pairs, one)
        if self.scheme is not None:  # the model's router type: float16 bits (v1 fp16) or float32
            fp16_router = self.header.dtype == 1 and not self.v2
            router = _readonly(np.zeros((1, 1), np.uint16 if fp16_router else f32))
            R.route_grouped(np.zeros((1, 1), f32), router, self.all_ones[:1], False, R.SCHEME_TOPK_SOFTMAX, True, 1,
                            False, f32(1), self.all_ones[:1], False, np.zeros((1, 1), f32), np.zeros(1, f32), pairs,
                            one.copy(), one.copy())
        if self.header.dtype == 1 and not self.v2:  # a v1 fp16 file stores its router as float16
            R.logits_into(x, _readonly(np.zeros((2, 1), np.uint16)), self.all_ones[:1], False, np.zeros((1, 1), f32))

    def _sbuf(self, cols: int) -> np.ndarray:
        """Scratch for one row's group scales, (groups of a row of `cols` columns,) float32."""
        buf = self._sbufs.get(cols)
        if buf is None:
            groups = self.header.groups_for(cols) if self.v2 else 1
            buf = self._sbufs[cols] = np.zeros(max(1, groups), np.float32)
        return buf

    def _inter(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The gate and up buffers as C-contiguous (rows, width) float32."""
        size = self.rows * width
        return (self._gate_flat[:size].reshape(self.rows, width), self._up_flat[:size].reshape(self.rows, width))

    # ---- weights ------------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> dict:
        """The layer's stored views (made once, on first use; nothing is read from the file here)."""
        cached = self._layers[layer]
        if cached is not None:
            return cached
        model, h = self.file, self.header
        w = {kind: _Matrix(model, kind, layer, self._dummies) for kind in ("gate_proj", "up_proj", "down_proj")}
        router = self._finite(model.router(layer), "router", layer)
        w["router"] = router if router.dtype == np.float32 else router.view(np.uint16)
        v2 = self.v2
        w["router_bias"] = self._finite(model.vector("router_bias", layer), "router_bias", layer) \
            if v2 and h.router_bias else None
        w["correction_bias"] = self._finite(model.vector("correction_bias", layer), "correction_bias", layer) \
            if v2 and h.correction_bias else None
        if self.has_bias:
            w.update({kind: self._finite(model.vector(kind, layer), kind, layer)
                      for kind in ("gate_bias", "up_bias", "down_bias")})
        else:
            w.update(gate_bias=self._no_bias_i, up_bias=self._no_bias_i, down_bias=self._no_bias_h)
        if self.shared_count:
            shared = {kind: _Matrix(model, "shared_" + kind, layer, self._dummies)
                      for kind in ("gate_proj", "up_proj", "down_proj")}
            for m in shared.values():
                for s in range(self.shared_count):
                    self._finite_matrix(m, layer, s)
            w["shared"] = shared
            w["shared_gate"] = self._finite(model.vector("shared_expert_gate", layer), "shared_expert_gate", layer) \
                if h.shared_gate else None
        self._layers[layer] = w
        return w

    def _finite(self, values: np.ndarray, kind: str, layer: int, index: int | None = None) -> np.ndarray:
        """`values` unchanged; FormatError if they hold NaN or Inf (as the reference engine's check)."""
        if not np.isfinite(values).all():
            bad = int(np.count_nonzero(~np.isfinite(values)))
            where = f"layer {layer}" + ("" if index is None else f", expert {index}")
            raise FormatError(
                f"{self.file.path}: {kind} ({where}) holds {bad} non-finite value{'s' if bad != 1 else ''} (NaN or "
                f"Inf); allowed: finite values (the file is corrupted)"
            )
        return values

    def _finite_matrix(self, m: _Matrix, layer: int, expert: int) -> None:
        if m.typed_scales is not None:
            self._finite(m.typed_scales[expert], m.kind + SCALES_SUFFIX, layer, expert)
        else:
            self._finite(m.typed[expert], m.kind, layer, expert)

    def _check_experts(self, layer: int, w: dict, used: np.ndarray) -> None:
        """Check the stored values of experts `used` of `layer` that no earlier call has used."""
        fresh = used[~self._checked[layer, used]]
        for e in fresh.tolist():
            for kind in ("gate_proj", "up_proj", "down_proj"):
                self._finite_matrix(w[kind], layer, e)
            self._checked[layer, e] = True

    def _blas_single(self) -> bool:
        """Whether this call's BLAS products run on one thread (colibri_sdk.blas.threads_for: no thread variable set,
        at most SMALL_ROWS rows), the condition for splitting its BLAS-path experts between threads: BLAS products
        of several threads each, called from two threads at once, stalled OpenBLAS for seconds (0.4-3.5 s calls at
        256 tokens on 2 cores with OMP_NUM_THREADS=2)."""
        return self.blas is not None and threads_for(self.blas.rows) == 1

    def _blas_limit(self) -> None:
        """Apply the call's BLAS thread limit (self.blas) before a BLAS product; none outside a CpuBackend call."""
        if self.blas is not None:
            self.blas.ensure()

    # ---- forward ------------------------------------------------------------------------------------------------
    def _logits(self, x: np.ndarray, w: dict) -> np.ndarray:
        """The router logits (tokens, experts) float32 of x (tokens, hidden), the router bias added (v2)."""
        logits = self.logits[: x.shape[0]]
        router = w["router"]
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is named by the output's finiteness check
            if router.dtype == np.float32:
                self._blas_limit()
                np.matmul(x, router, out=logits)
            else:  # a v1 fp16 router, read as stored
                R.logits_into(x, router, self.all_ones, False, logits)
            if self.v2 and w["router_bias"] is not None:
                logits += w["router_bias"]
        return logits

    def route(self, layer: int, x: np.ndarray, w: dict) -> tuple[np.ndarray, np.ndarray]:
        """(ids, weights) (tokens, top_k) for x (tokens, hidden), as the reference engine routes in float32."""
        logits = self._logits(x, w)
        with np.errstate(over="ignore", invalid="ignore"):
            if not self.v2:
                return topk_route(logits, self.header.top_k, self.header.routing)
            return route_v2(logits, self.header, w["correction_bias"])

    def _route_grouped(self, layer: int, x: np.ndarray, w: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """Route x (n, hidden) and group the pairs by expert into self.pair_w, self.order and self.starts.

        Returns (the experts with pairs, increasing; their pair counts or None where every count is below
        blas_pairs). One compiled call (cpu_routing.route_grouped) where the scheme has no expert groups, the call
        no capacity, and the logits are finite; else NumPy (`route`, capacity, `group_pairs`)."""
        n, h = x.shape[0], self.header
        k = h.top_k
        pair_w = self.pair_w[: n * k]
        order, starts = self.order, self.starts
        if self.scheme is not None and self.capacity is None:
            corr, bias = w["correction_bias"], w["router_bias"] if self.v2 else None
            m, most = R.route_grouped(x, w["router"], self.all_ones if bias is None else bias, bias is not None,
                                      self.scheme, not self.v2, k, self.norm_topk, self.scaling,
                                      self.all_ones if corr is None else corr, corr is not None, self.logits,
                                      pair_w, starts, order, self.used)
            if m >= 0:
                return self.used[:m], (None if most < self.blas_pairs else np.diff(starts))
        ids, weights = self.route(layer, x, w)
        if self.capacity is not None:
            from ..capacity import apply_capacity

            valid = None if self.valid is None else self.valid[:n]
            ids, dropped = apply_capacity(ids, weights, h.num_experts, self.capacity, valid)
            self.dropped += dropped
        pair_w[:] = weights.reshape(-1)
        K.group_pairs(np.ascontiguousarray(ids, dtype=np.int64), h.num_experts, starts, order)
        counts = np.diff(starts)
        return np.flatnonzero(counts), counts

    def layer_into(self, layer: int, x: np.ndarray, out: np.ndarray) -> None:
        """out[:] = the MoE block of `layer` on x (n, hidden) float32 (not composed with x)."""
        n, k = x.shape[0], self.header.top_k
        w = self._layer(layer)
        used, counts = self._route_grouped(layer, x, w)
        order, starts, pair_w = self.order, self.starts, self.pair_w[: n * k]
        if self.clamped:
            self._check_experts(layer, w, used)
        out.fill(0.0)
        if counts is None:
            big, small = used[:0], used
        else:
            big = used[counts[used] >= self.blas_pairs]
            small = used if big.size == 0 else used[counts[used] < self.blas_pairs]
        finite = None  # the compiled experts' own check of out, which holds where they are its only writer
        if small.size > 1 and self.threads > 1:
            self._experts_threaded(x, order, starts, pair_w, k, small, np.diff(starts), w, out)
        elif small.size:
            finite = self._experts(x, order, starts, pair_w, k, small, w, out)
        if big.size > 1 and self.threads > 1 and self._blas_single():
            self._blas_limit()  # from this thread, before the helpers' products (blas.LazyBlasThreads)
            self._threaded(big, counts, out, lambda engine, group, rows: [
                engine._expert_blas(x, int(e), w, rows) for e in group.tolist()])
        else:
            for e in big.tolist():
                self._expert_blas(x, int(e), w, out)
        if self.shared_count:
            self._shared(x, w, out)
        if not self.clamped:
            if finite is None or big.size or self.shared_count:
                finite = bool(np.isfinite(out, out=self.finite[:n]).all())
            if not finite:
                self._check_experts(layer, w, used)  # a FormatError when a used expert stores a non-finite value

    def _experts(self, x, order, starts, pair_w, k, chosen, w, out, act=None) -> bool:
        """experts_into for the matrices of w (routed: with biases and the file's activation; shared: act given);
        returns whether every value of out is finite afterwards."""
        g, u, d = w["gate_proj"], w["up_proj"], w["down_proj"]
        gate, up = self._inter(g.rows)
        hidden = self.header.hidden_size
        return K.experts_into(
            x, order, starts, pair_w, k, chosen, self.store, self.scale_f16, self.has_zero, self.group,
            g.codes, g.scales, g.zeros, u.codes, u.scales, u.zeros, d.codes, d.scales, d.zeros,
            self.has_bias and act is None, w["gate_bias"], w["up_bias"], w["down_bias"],
            self.act if act is None else act, self.limit, self.alpha, out, self.tok, gate, up,
            self.buf[:hidden], self.buf[: g.rows], self._sbuf(hidden), self._sbuf(g.rows),
            self.shared_order, self.y, self.xq, self.xsum, self.s32,
        )

    def _experts_threaded(self, x, order, starts, pair_w, k, chosen, counts, w, out) -> None:
        """`_experts` with the chosen experts split between `threads` threads (`_threaded`)."""
        self._threaded(chosen, counts, out, lambda engine, group, rows: engine._experts(
            x, order, starts, pair_w, k, group, w, rows))

    def _threaded(self, chosen: np.ndarray, counts: np.ndarray, out: np.ndarray, work) -> None:
        """work(engine, group, rows) for the chosen experts split between `threads` threads (the compiled kernels
        and BLAS release the GIL; BLAS only with one thread each, `_blas_single`, the limit applied by the caller):
        each part by an engine of its own scratch into rows of its own, added to `out` in part order once all are
        done (so the sum over experts is grouped by part: the same values as one thread within float32 rounding,
        and the same bits from run to run). Parts are balanced by pairs (`counts`) plus a fixed cost per expert
        (its weights' bytes). The helpers run under the calling thread's NumPy error state (np.errstate is per
        thread: Runtime's "ignore" for overflow, reported once as NonFiniteOutputError, must hold there too)."""
        parts = min(self.threads, chosen.size)
        load, groups = [0] * parts, [[] for _ in range(parts)]
        for e in sorted(chosen.tolist(), key=lambda e: (-int(counts[e]), e)):
            i = load.index(min(load))
            groups[i].append(e)
            load[i] += int(counts[e]) + EXPERT_COST_PAIRS
        groups = [np.asarray(sorted(g), np.int64) for g in groups]
        helpers = self._helper_engines(parts - 1)
        n = out.shape[0]
        futures = []
        for group, (engine, rows) in zip(groups[1:], helpers):
            part = rows[:n]
            part.fill(0.0)
            futures.append((part, self._pool.submit(_with_errstate, np.geterr(), work, engine, group, part)))
        error = None
        try:
            work(self, groups[0], out)
        except BaseException as exc:  # noqa: BLE001 - re-raised once no helper still writes
            error = exc
        for part, future in futures:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
            if error is None:
                out += part
        if error is not None:
            raise error

    def _helper_engines(self, count: int) -> list:
        """`count` engines that share this one's file, weights and routing buffers but own the scratch of
        `_experts`, each with output rows of its own; and the thread pool they run on (made on first use)."""
        while len(self._helpers) < count:
            e = copy.copy(self)
            e.tok = np.zeros_like(self.tok)
            e._gate_flat, e._up_flat = np.zeros_like(self._gate_flat), np.zeros_like(self._up_flat)
            e.y, e.buf = np.zeros_like(self.y), np.zeros_like(self.buf)
            e.xq, e.xsum, e.s32 = np.zeros_like(self.xq), np.zeros_like(self.xsum), np.zeros_like(self.s32)
            e.xs, e.tile, e.tile_out = np.zeros_like(self.xs), np.zeros_like(self.tile), np.zeros_like(self.tile_out)
            e._sbufs, e._helpers, e._pool, e.threads = {}, [], None, 1
            self._helpers.append((e, np.zeros_like(self.y)))
        if self._pool is None or self._pool_workers < self.threads - 1:  # the count follows each call's rows
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="colibri-cpu")
            self._pool_workers = self.threads - 1
        return self._helpers[:count]

    def _project_blas(self, m: _Matrix, expert: int, xs: np.ndarray, dst: np.ndarray) -> None:
        """dst (n, rows) = xs (n, cols) @ W.T by BLAS: float32 weights in place, others by decoded tiles."""
        self._blas_limit()
        if m.floats is not None:
            np.matmul(xs, m.floats[expert].T, out=dst)
            return
        n, tile, tile_out = xs.shape[0], self.tile, self.tile_out
        sbuf = self._sbuf(m.cols)
        codes, scales, zeros = m.codes[expert], m.scales[expert], m.zeros[expert]
        for start in range(0, m.rows, TILE_ROWS):
            stop = min(start + TILE_ROWS, m.rows)
            # C-contiguous views: NumPy's matmul takes its slow non-BLAS loop on a strided tile (measured 50x).
            block = tile[: (stop - start) * m.cols].reshape(stop - start, m.cols)
            K.rows_into(self.store, codes, scales, self.scale_f16, zeros, self.has_zero, self.group, m.cols,
                        start, stop, block, self.buf[: m.cols], sbuf)
            part = tile_out[: n * (stop - start)].reshape(n, stop - start)
            np.matmul(xs, block.T, out=part)
            dst[:, start:stop] = part

    def _expert_blas(self, x, e: int, w: dict, out) -> None:
        """One expert's pairs through BLAS (compute-bound sizes): gather, gate/up, SwiGLU, down, weighted sum."""
        p0, p1 = int(self.starts[e]), int(self.starts[e + 1])
        n, k = p1 - p0, self.header.top_k
        pairs = self.order[p0:p1]
        tok = self.tok[:n]
        np.floor_divide(pairs, k, out=tok)
        xs = self.xs[:n]
        np.take(x, tok, axis=0, out=xs, mode="clip")
        gate, up = (a[:n] for a in self._inter(self.header.intermediate_size))
        self._project_blas(w["gate_proj"], e, xs, gate)
        self._project_blas(w["up_proj"], e, xs, up)
        if self.has_bias:
            gate += w["gate_bias"][e]
            up += w["up_bias"][e]
        K._activate(gate, up, n, self.act, self.limit, self.alpha)
        y = self.y[:n]
        self._project_blas(w["down_proj"], e, gate, y)
        pw = self.pair_w[pairs] if n else self.ones[:0]
        K.scatter_add(out, tok, pw.astype(np.float32, copy=False), y, n, w["down_bias"][e if self.has_bias else 0],
                      self.has_bias)

    def _shared(self, x, w: dict, out) -> None:
        """out += the shared experts' sum on every row of x (SwiGLU, no biases), times sigmoid(x @ shared_gate)
        where the file has it (reference: ReferenceEngine.shared)."""
        n = x.shape[0]
        acc = self.shared_out[:n]
        acc.fill(0.0)
        shared = w["shared"]
        for s in range(self.shared_count):
            starts = np.zeros(s + 2, np.int64)  # "expert" s of the shared blocks takes every row once, weight 1
            starts[s + 1] = n
            self.first[0] = s
            matrices = {**shared, "gate_bias": self._no_bias_i, "up_bias": self._no_bias_i,
                        "down_bias": self._no_bias_h}
            self._experts(x, self.shared_order, starts, self.ones, 1, self.first, matrices, acc, act=K.ACT_SWIGLU)
        if w["shared_gate"] is not None:
            self._blas_limit()
            g = x @ w["shared_gate"]
            with np.errstate(over="ignore"):
                acc *= (1.0 / (1.0 + np.exp(-g)))[:, None]
        out += acc

    def run_into(self, x: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
        """out (n, hidden) = layers start..stop-1 composed (sequential: y; residual: x + y) on x (n, hidden).

        Raises:
            InputError: n above the rows the engine was made for (its scratch holds no more)."""
        residual = self.header.composition == COMPOSITION_RESIDUAL
        n = x.shape[0]
        if n > self.rows:
            raise InputError(f"{n} input rows; this CPU engine was made for at most {self.rows}")
        h = x
        self.dropped = 0
        for i, layer in enumerate(range(start, stop)):
            nxt = self.h[i % 2][:n]
            self.layer_into(layer, h, nxt)
            if residual:
                np.add(nxt, h, out=nxt)
            h = nxt
        np.copyto(out, h)


def _with_errstate(state: dict, work, *args):
    """work(*args) under the NumPy error state `state` (np.geterr() of the thread that handed the work over)."""
    with np.errstate(**state):
        return work(*args)
