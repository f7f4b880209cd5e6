"""Progress bars of the commands: tqdm on stderr, one bar per step, only when stderr is a terminal (tqdm's
`disable=None`) and never with `-q`. Without tqdm installed (a device with NumPy only) there is no bar."""

from __future__ import annotations

import sys


class StepBars:
    """A `progress(step, done, total)` callable (colibri_sdk.bundle.writer.Progress) drawing one tqdm bar per step.

    Use as a context manager; the last bar is closed on exit.
    """

    def __init__(self, quiet: bool = False, desc_prefix: str = ""):
        self.enabled = not quiet
        self.prefix = desc_prefix
        self._step = None
        self._bar = None
        if self.enabled:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                self.enabled = False

    def __call__(self, step: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if step != self._step:
            self._close()
            from tqdm import tqdm

            self._step = step
            self._bar = tqdm(total=total, desc=f"{self.prefix}{step}", unit="B", unit_scale=True,
                             unit_divisor=1000, dynamic_ncols=True, leave=False, file=sys.stderr, disable=None)
        bar = self._bar
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None
        self._step = None

    def __enter__(self) -> "StepBars":
        return self

    def __exit__(self, *exc) -> None:
        self._close()
