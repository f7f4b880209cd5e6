"""Per-call statistics of a Runtime: latency percentiles, shapes chosen, expert-capacity drops.

`Runtime.stats()` returns a `RuntimeStats` snapshot; `colibri-sdk run --json` prints `RuntimeStats.as_dict()`.
Latencies are wall times of the call inside the runtime (input checks, padding, the backend, the output copy), in
milliseconds, over the last `WINDOW` calls; percentiles by linear interpolation (NumPy's default).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

WINDOW = 10_000  # calls kept for the percentiles


@dataclasses.dataclass(frozen=True)
class RuntimeStats:
    """A snapshot of a Runtime's calls.

    Attributes:
        calls: calls so far (infer, layer, layers; device calls included).
        window: how many of the latest calls the percentiles cover (at most WINDOW).
        p50_ms, p99_ms, max_ms, mean_ms: latency over the window in ms; 0.0 before the first call.
        shape: the bundle's largest compiled (batch, tokens).
        shapes: every compiled (batch, tokens), smallest first.
        last_shape: the compiled shape the latest call ran at (the smallest that held it), None before the first.
        shapes_chosen: how many calls ran at each compiled shape, as {"BxT": count}.
        last_input: (batch, tokens) of the latest call's input, None before the first call.
        inputs: how many calls had each input (batch, tokens), as {"BxT": count}.
        dropped_pairs: (token, expert) pairs dropped by expert capacity, summed over all calls (0 when dropless).
        last_dropped_pairs: the same for the latest call.
    """

    calls: int
    window: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    shape: tuple
    last_input: tuple | None
    inputs: dict
    dropped_pairs: int
    last_dropped_pairs: int
    shapes: tuple = ()
    last_shape: tuple | None = None
    shapes_chosen: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-ready: tuples become lists."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["last_input"] = list(self.last_input) if self.last_input else None
        d["shapes"] = [list(bt) for bt in self.shapes]
        d["last_shape"] = list(self.last_shape) if self.last_shape else None
        return d


class StatsRecorder:
    """Collects per-call records; not thread-safe on its own (the Runtime's lock serialises calls)."""

    def __init__(self, shape, shapes=None):
        self.shape = tuple(int(v) for v in shape)
        self.shapes = tuple(tuple(int(v) for v in bt) for bt in (shapes or [shape]))
        self.chosen: collections.Counter = collections.Counter()
        self.last_shape = None
        self.seconds: collections.deque = collections.deque(maxlen=WINDOW)
        self.calls = 0
        self.inputs: collections.Counter = collections.Counter()
        self.last_input = None
        self.dropped = 0
        self.last_dropped = 0

    def record(self, seconds: float, input_shape, dropped: int = 0, shape=None) -> None:
        """One call: its wall time (s), its input (batch, tokens), the pairs capacity dropped, and the compiled
        shape it ran at (None: the largest)."""
        self.last_shape = self.shape if shape is None else tuple(int(v) for v in shape)
        self.chosen[self.last_shape] += 1
        self.calls += 1
        self.seconds.append(float(seconds))
        self.last_input = tuple(int(v) for v in input_shape)
        self.inputs[self.last_input] += 1
        self.last_dropped = int(dropped)
        self.dropped += self.last_dropped

    def snapshot(self) -> RuntimeStats:
        if self.seconds:
            ms = np.fromiter(self.seconds, dtype=np.float64, count=len(self.seconds)) * 1e3
            p50, p99 = (float(v) for v in np.percentile(ms, [50, 99]))
            top, mean = float(ms.max()), float(ms.mean())
        else:
            p50 = p99 = top = mean = 0.0
        return RuntimeStats(
            calls=self.calls,
            window=len(self.seconds),
            p50_ms=p50,
            p99_ms=p99,
            max_ms=top,
            mean_ms=mean,
            shape=self.shape,
            last_input=self.last_input,
            inputs={f"{b}x{t}": n for (b, t), n in sorted(self.inputs.items())},
            dropped_pairs=self.dropped,
            last_dropped_pairs=self.last_dropped,
            shapes=self.shapes,
            last_shape=self.last_shape,
            shapes_chosen={f"{b}x{t}": n for (b, t), n in sorted(self.chosen.items())},
        )
