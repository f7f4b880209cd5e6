"""The real-time inspection loop: capture thread → bounded drop-oldest queue → classify → JSON-lines events.

    capture thread   reads the source at the target rate (frame i is due at start + i / fps), stamps it, queues it
    queue            holds at most `queue_size` frames; when full, the OLDEST frame is dropped and counted, so the
                     classifier always works on the newest frames and latency stays bounded when it falls behind
    main thread      classifies, writes one event per frame, a stats event every `stats_every` frames and a final
                     one; a failure on one frame is logged as an error event and the loop goes on
    stop             a `threading.Event` (set by SIGINT/SIGTERM in qc_loop.py), the end of the source, or
                     `max_frames` captured frames

Events (one JSON object per line):
    {"type": "frame", "frame": 17, "source": "synthetic#17", "verdict": "pass"|"fail", "class": "scratch",
     "p_defect": 0.93, "probs": {...}, "latency_ms": 4.1, "infer_ms": 3.2, "truth": "scratch"}
        latency_ms: capture → decision (queue wait included); infer_ms: preprocess + stem + runtime + head.
    {"type": "error", "frame": 18, "source": ..., "error": "InputError: ..."}
    {"type": "stats", "frames": 250, "captured": 252, "dropped": 0, "errors": 0, "fps": 5.0,
     "latency_ms": {"p50", "p99", "max"}, "infer_ms": {...}, "window": 50}          every `stats_every` frames
    {"type": "stats", "final": true, "stopped_by": "SIGTERM"|"max-frames"|"end of source", ...}   over the run
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from pathlib import Path

import numpy as np

from .dataset import CLASSES

log = logging.getLogger("jetson_qc")


class FrameReadError(RuntimeError):
    """A frame's image could not be read (a corrupt file); the loop reports it and goes on."""


class StopFlag(threading.Event):
    """A stop event that remembers why it was set (e.g. "SIGTERM"), for the final stats event."""

    reason: str | None = None

    def request(self, reason: str) -> None:
        self.reason = reason
        self.set()


class DropOldestQueue:
    """A bounded FIFO between the capture thread and the classifier; when full, `put` drops the oldest item.

    Attributes:
        dropped: items dropped so far.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"queue capacity {capacity}; allowed: >= 1")
        self.capacity = capacity
        self.dropped = 0
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item) -> None:
        with self._cond:
            if len(self._items) >= self.capacity:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            self._cond.notify()

    def get(self, timeout: float):
        """The oldest item, or None after `timeout` seconds, or None at once when closed and empty."""
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            return self._items.popleft() if self._items else None

    def close(self) -> None:
        """No more items will come; `get` returns None once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._closed and not self._items


class EventLog:
    """Writes events as JSON lines to a text stream, one flush per line, safe to call from several threads."""

    def __init__(self, stream):
        self.stream = stream
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        line = json.dumps(event, sort_keys=False)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def summary(values: list[float]) -> dict:
    """p50, p99 and max of a list of milliseconds (NumPy's linear-interpolation percentiles), rounded to 0.01 ms."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(arr, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2), "max": round(float(arr.max()), 2)}


class Stats:
    """Counters and latency samples: per reporting window and over the whole run.

    The achieved rate counts intervals between completed frames: n frames completed over the time from the first
    to the last of them are n - 1 intervals (a later window starts at the previous window's last frame, so it has
    as many intervals as frames).
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.frames = 0
        self.errors = 0
        self.latency: list[float] = []
        self.infer: list[float] = []
        self._first_done: float | None = None
        self._last_done: float | None = None
        self._window_anchor: float | None = None
        self._window_intervals = 0
        self._window_latency: list[float] = []
        self._window_infer: list[float] = []

    def add(self, latency_ms: float, infer_ms: float) -> None:
        now = time.perf_counter()
        if self._first_done is None:
            self._first_done = now
        if self._window_anchor is None:
            self._window_anchor, self._window_intervals = now, -1  # the first frame opens the window
        self._window_intervals += 1
        self._last_done = now
        self.frames += 1
        for values, value in ((self.latency, latency_ms), (self.infer, infer_ms), (self._window_latency, latency_ms),
                              (self._window_infer, infer_ms)):
            values.append(value)

    def window(self, captured: int, dropped: int) -> dict:
        """The stats event for the frames since the last call; starts a new window."""
        count = len(self._window_latency)
        fps = _rate(self._window_intervals, self._window_anchor, self._last_done)
        event = self._event(fps, self._window_latency, self._window_infer, captured, dropped)
        event["window"] = count
        self._window_anchor, self._window_intervals = self._last_done, 0
        self._window_latency, self._window_infer = [], []
        return event

    def final(self, captured: int, dropped: int, stopped_by: str) -> dict:
        fps = _rate(self.frames - 1, self._first_done, self._last_done)
        event = self._event(fps, self.latency, self.infer, captured, dropped)
        event.update(final=True, stopped_by=stopped_by, seconds=round(time.perf_counter() - self.start, 3))
        return event

    def _event(self, fps, latency, infer, captured, dropped) -> dict:
        return {"type": "stats", "frames": self.frames, "captured": captured, "dropped": dropped,
                "errors": self.errors, "fps": fps, "latency_ms": summary(latency), "infer_ms": summary(infer)}


def _rate(intervals: int, start: float | None, end: float | None) -> float | None:
    """Frames per second from `intervals` frame-to-frame intervals between `start` and `end` (None if undefined)."""
    if start is None or end is None or intervals < 1 or end <= start:
        return None
    return round(intervals / (end - start), 2)


class Capture(threading.Thread):
    """Reads frames from `source` at `fps` (<= 0: as fast as the source gives them) into `queue`."""

    def __init__(self, source, queue: DropOldestQueue, fps: float, max_frames: int | None, stop: threading.Event,
                 events: EventLog):
        super().__init__(name="capture", daemon=True)
        self.source, self.queue, self.fps, self.max_frames = source, queue, fps, max_frames
        self.stop, self.events = stop, events
        self.captured = 0
        self.ended = "end of source"

    def run(self) -> None:
        start = time.perf_counter()
        try:
            for frame in self.source:
                if self.stop.is_set():
                    break
                if self.fps > 0:
                    delay = start + self.captured / self.fps - time.perf_counter()
                    if delay > 0 and self.stop.wait(delay):
                        break
                frame.captured = time.perf_counter()
                self.queue.put(frame)
                self.captured += 1
                if self.max_frames is not None and self.captured >= self.max_frames:
                    self.ended = "max-frames"
                    break
        except Exception as exc:  # a camera or file error ends the capture; the loop reports it and finishes
            self.ended = "source error"
            log.error("frame source failed after %d frames: %s: %s", self.captured, type(exc).__name__, exc)
            self.events.write({"type": "error", "frame": self.captured, "source": "capture",
                               "error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.queue.close()


def frame_event(frame, prediction, latency_ms: float) -> dict:
    event = {
        "type": "frame", "frame": frame.index, "source": frame.name,
        "verdict": "pass" if prediction.passed else "fail", "class": prediction.name,
        "p_defect": round(prediction.p_defect, 4),
        "probs": {name: round(float(p), 4) for name, p in zip(CLASSES, prediction.probs)},
        "latency_ms": round(latency_ms, 2), "infer_ms": round(prediction.infer_ms, 2),
    }
    if frame.truth is not None:
        event["truth"] = frame.truth
    return event


def run_loop(source, classifier, events: EventLog, *, fps: float = 5.0, queue_size: int = 4,
             max_frames: int | None = None, stats_every: int = 50, stop: StopFlag | None = None,
             save_dir: str | Path | None = None, save_failures_only: bool = False) -> dict:
    """Run the inspection loop until the source ends, `max_frames` frames were captured, or `stop` is set.

    Args:
        source: an iterable of qc.sources.Frame.
        classifier: anything with `classify(image) -> qc.model.Prediction`.
        events: where the JSON-lines events go.
        fps: target capture rate in frames per second; <= 0 takes frames as fast as the source gives them.
        queue_size: frames the queue holds before it drops the oldest.
        max_frames: stop after capturing this many frames (processed + dropped); None: no limit.
        stats_every: write a stats event after every this many classified frames (0: only the final one).
        stop: `request(reason)` it (e.g. from a signal handler) to stop; the frame being classified is finished
            first and the reason goes into the final stats event.
        save_dir: write annotated PNG frames here (`<frame>_<verdict>_<class>.png`).
        save_failures_only: with save_dir, write only the failed frames.

    Returns:
        The final stats event (also written to `events`).
    """
    stop = stop if stop is not None else StopFlag()
    queue = DropOldestQueue(queue_size)
    stats = Stats()
    if save_dir is not None:
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
    capture = Capture(source, queue, fps, max_frames, stop, events)
    capture.start()
    try:
        while not stop.is_set():
            frame = queue.get(timeout=0.1)
            if frame is None:
                if queue.finished:
                    break
                continue
            try:
                if frame.error is not None:
                    raise FrameReadError(frame.error)
                prediction = classifier.classify(frame.image)
            except Exception as exc:  # one bad frame must not stop the line: log it and go on
                stats.errors += 1
                log.error("frame %d (%s) failed: %s: %s", frame.index, frame.name, type(exc).__name__, exc)
                events.write({"type": "error", "frame": frame.index, "source": frame.name,
                              "error": f"{type(exc).__name__}: {exc}"})
                continue
            latency_ms = (time.perf_counter() - frame.captured) * 1e3
            stats.add(latency_ms, prediction.infer_ms)
            events.write(frame_event(frame, prediction, latency_ms))
            if save_dir is not None and not (save_failures_only and prediction.passed):
                save_annotated(save_dir, frame, prediction)
            if stats_every and stats.frames % stats_every == 0:
                events.write(stats.window(capture.captured, queue.dropped))
    finally:
        stop.set()
        capture.join(timeout=5.0)
    stopped_by = getattr(stop, "reason", None) or capture.ended
    final = stats.final(capture.captured, queue.dropped, stopped_by)
    events.write(final)
    return final


def save_annotated(folder: Path, frame, prediction) -> Path:
    from .images import annotate, write_png

    verdict = "pass" if prediction.passed else "fail"
    image = annotate(frame.image, prediction.passed, prediction.p_defect, prediction.name)
    return write_png(folder / f"{frame.index:06d}_{verdict}_{prediction.name}.png", image)
