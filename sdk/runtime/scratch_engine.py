"""The CPU backend's forward pass with preallocated scratch: no activation- or weight-sized allocation per call.

It computes exactly what `colibri_sdk.reference.ReferenceEngine` computes (docs/format.md, "Semantics"; the
reference engine stays the oracle the tests compare against) for the formats it knows — fp16/fp32 weights, routing
topk_softmax / softmax_topk, sequential or residual layers — with every intermediate written into buffers allocated
once at load, sized for the bundle's fixed shape:

    h0, h1     (tokens, hidden) float32        activations, ping-pong between layers
    logits     (tokens, experts) float32       router logits; top-k selection masks the chosen ones to -inf here
    probs      (tokens, experts) float32       softmax over all experts (softmax_topk)
    ids        (tokens, top_k) intp            selected experts, larger logit first, ties to the lower index
    weights    (tokens, top_k) float32         routing weights
    xs, y      (tokens, hidden) float32        the rows routed to one expert, and its output
    acc, wide  (tokens, hidden) float32        the output rows being summed; the routing weights broadcast
    gate, up   (tokens, intermediate) float32  gate/up projections of those rows
    w_gate, w_up (intermediate, hidden), w_down (hidden, intermediate), w_router (hidden, experts) float32:
               one expert's matrices converted from fp16 by np.copyto (fp32 weights are used in place)

What is still allocated per call: NumPy's index arrays of the rows routed to each expert (np.nonzero; O(tokens ·
top_k) integers per layer), the (tokens, experts) temporaries of the softmax's broadcasting and small scalars.
The tracemalloc test in tests/runtime bounds a warm call's traced peak well below one activation tensor.

Top-k here is k rounds of argmax (the first maximum is the lower index, as the reference's stable sort) instead of
a sort, and experts are visited in increasing index like the reference's `np.unique`, so each token's output sums
the same terms in the same order.
"""

from __future__ import annotations

import numpy as np

from ..format.constants import COMPOSITION_RESIDUAL, ROUTING_SOFTMAX_TOPK, ROUTING_TOPK_SOFTMAX


def supports(header) -> bool:
    """Whether this engine computes `header`'s model (else the CPU backend runs the reference engine)."""
    return (
        getattr(header, "dtype", None) in (0, 1)
        and getattr(header, "routing", None) in (ROUTING_TOPK_SOFTMAX, ROUTING_SOFTMAX_TOPK)
        and not getattr(header, "shared_experts", 0)
        and type(header).__name__ == "Header"
    )


class ScratchEngine:
    """Runs layers of an open ColibriFile on float32 rows, writing into preallocated buffers.

    Args:
        model: an open `colibri_sdk.format.ColibriFile` whose header `supports`.
        rows: the most rows (batch · tokens) one call passes.
    """

    def __init__(self, model, rows: int, capacity=None):
        self.file = model
        # Expert capacity (colibri_sdk.capacity), None = dropless: `valid` (rows,) bool marks real tokens, `dropped`
        # counts the pairs dropped since the last run_into. A capacity call allocates its drop bookkeeping.
        self.capacity, self.valid, self.dropped = capacity, None, 0
        h = self.header = model.header
        H, E, I, k = h.hidden_size, h.num_experts, h.intermediate_size, h.top_k
        f32 = np.float32
        self.rows = int(rows)
        n = self.rows
        self.h = (np.zeros((n, H), f32), np.zeros((n, H), f32))
        self.logits = np.zeros((n, E), f32)
        self.probs = np.zeros((n, E), f32)
        self.row_max = np.zeros((n, 1), f32)
        self.row_sum = np.zeros((n, 1), f32)
        self.ids = np.zeros((n, k), np.intp)
        self.flat = np.zeros((n, k), np.intp)
        self.column = np.zeros(n, np.intp)
        self.row_base = (np.arange(n, dtype=np.intp) * E)
        self.weights = np.zeros((n, k), f32)
        self.mask = np.zeros((n, k), bool)
        self.xs = np.zeros((n, H), f32)
        self.y = np.zeros((n, H), f32)
        self.acc = np.zeros((n, H), f32)
        self.wide = np.zeros((n, H), f32)
        self.gate = np.zeros((n, I), f32)
        self.up = np.zeros((n, I), f32)
        self.tmp = np.zeros((n, I), f32)
        self.pair_w = np.zeros((n, 1), f32)
        convert = h.dtype != 0  # fp16 weights are converted into these; fp32 ones are used in place
        self.w = {
            "router": np.zeros((H, E), f32) if convert else None,
            "gate_proj": np.zeros((I, H), f32) if convert else None,
            "up_proj": np.zeros((I, H), f32) if convert else None,
            "down_proj": np.zeros((H, I), f32) if convert else None,
        }

    def _matrix(self, kind: str, layer: int, expert: int | None = None) -> np.ndarray:
        stored = self.file.router(layer) if kind == "router" else self.file.tensor(kind, layer, expert)
        scratch = self.w[kind]
        if scratch is None:
            return stored
        np.copyto(scratch, stored)
        return scratch

    def route(self, layer: int, x: np.ndarray) -> None:
        """Fill ids[:n] and weights[:n] for x (n, hidden), as `reference.topk_route`."""
        n, k = x.shape[0], self.header.top_k
        logits = self.logits[:n]
        np.matmul(x, self._matrix("router", layer), out=logits)
        ids, flat, weights = self.ids[:n], self.flat[:n], self.weights[:n]
        if self.header.routing == ROUTING_SOFTMAX_TOPK:
            probs, mx, sm = self.probs[:n], self.row_max[:n], self.row_sum[:n]
            np.max(logits, axis=1, keepdims=True, out=mx)
            np.subtract(logits, mx, out=probs)
            np.exp(probs, out=probs)
            np.sum(probs, axis=1, keepdims=True, out=sm)
            np.divide(probs, sm, out=probs)
        work = logits.reshape(-1)
        base = self.row_base[:n]
        column = self.column[:n]
        for j in range(k):
            np.argmax(logits, axis=1, out=column)
            ids[:, j] = column
            np.add(column, base, out=column)
            flat[:, j] = column
            if self.header.routing != ROUTING_SOFTMAX_TOPK:
                np.take(work, column, out=weights[:, j], mode="clip")  # the selected logit, before it is masked
            np.put(work, column, -np.inf)
        if self.header.routing == ROUTING_SOFTMAX_TOPK:
            np.take(self.probs[:n].reshape(-1), flat, out=weights, mode="clip")
        else:
            first = self.row_max[:n]
            first[:, 0] = weights[:, 0]
            np.subtract(weights, first, out=weights)
            np.exp(weights, out=weights)
            np.sum(weights, axis=1, keepdims=True, out=self.row_sum[:n])
            np.divide(weights, self.row_sum[:n], out=weights)

    def layer_into(self, layer: int, x: np.ndarray, out: np.ndarray) -> None:
        """out[:] = the MoE block of `layer` on x (n, hidden) float32 (not composed with x)."""
        n = x.shape[0]
        self.route(layer, x)
        if self.capacity is not None:
            from ..capacity import apply_capacity

            valid = None if self.valid is None else self.valid[:n]
            kept, dropped = apply_capacity(self.ids[:n], self.weights[:n], self.header.num_experts, self.capacity,
                                           valid)
            self.ids[:n] = kept
            self.dropped += dropped
        out.fill(0.0)
        ids, weights = self.ids[:n], self.weights[:n]
        mask = self.mask[:n]
        for expert in range(self.header.num_experts):
            np.equal(ids, expert, out=mask)
            count = int(np.count_nonzero(mask))
            if count == 0:
                continue
            tokens, slots = np.nonzero(mask)
            xs, g, u, t, y = self.xs[:count], self.gate[:count], self.up[:count], self.tmp[:count], self.y[:count]
            np.take(x, tokens, axis=0, out=xs, mode="clip")  # "raise" would buffer a copy
            np.matmul(xs, self._matrix("gate_proj", layer, expert).T, out=g)
            np.matmul(xs, self._matrix("up_proj", layer, expert).T, out=u)
            np.negative(g, out=t)
            with np.errstate(over="ignore"):
                np.exp(t, out=t)
            np.add(t, 1.0, out=t)
            np.divide(g, t, out=g)  # silu(g) = g / (1 + exp(-g))
            np.multiply(g, u, out=g)
            np.matmul(g, self._matrix("down_proj", layer, expert).T, out=y)
            pw = self.pair_w[:count]
            np.take(weights.reshape(-1), tokens * weights.shape[1] + slots, out=pw[:, 0], mode="clip")
            wide = self.wide[:count]
            np.copyto(wide, pw)  # a broadcasting multiply would allocate a (count, hidden) temporary; copyto does not
            np.multiply(y, wide, out=y)
            acc = self.acc[:count]
            np.take(out, tokens, axis=0, out=acc, mode="clip")
            np.add(acc, y, out=acc)
            out[tokens] = acc  # each (token, expert) pair occurs once: no duplicate rows

    def run_into(self, x: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
        """out (n, hidden) = layers start..stop-1 composed (sequential: y; residual: x + y) on x (n, hidden)."""
        residual = self.header.composition == COMPOSITION_RESIDUAL
        n = x.shape[0]
        h = x
        self.dropped = 0
        for i, layer in enumerate(range(start, stop)):
            nxt = self.h[i % 2][:n]
            self.layer_into(layer, h, nxt)
            if residual:
                np.add(nxt, h, out=nxt)
            h = nxt
        np.copyto(out, h)
