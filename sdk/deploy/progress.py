"""A byte progress bar (tqdm) shared by upload threads: bytes sent, MB/s, time left."""

from __future__ import annotations

import sys
import threading


class ByteProgress:
    """A thread-safe tqdm bar counting bytes; a no-op when `enabled` is False or stderr is not a terminal.

    Use as a context manager; call the object with a byte count.
    """

    def __init__(self, description: str, enabled: bool = True):
        self.description = description
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None
        self.lock = threading.Lock()

    def __enter__(self) -> "ByteProgress":
        if self.enabled:
            from tqdm import tqdm

            # Total unknown until the plan: the bar shows bytes and rate, and the total once `add_total` ran.
            self.bar = tqdm(desc=self.description, unit="B", unit_scale=True, unit_divisor=1000,
                            dynamic_ncols=True, leave=True, file=sys.stderr)
        return self

    def add_total(self, n: int) -> None:
        """Add `n` bytes to the total (each host adds what it will send once its plan is known)."""
        if self.bar is not None:
            with self.lock:
                self.bar.total = (self.bar.total or 0) + n
                self.bar.refresh()

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
