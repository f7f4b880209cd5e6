"""A bundle's self-test verdict: a backend's output against the stored reference output, NumPy's allclose rule."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import BundleError


@dataclasses.dataclass(frozen=True)
class SelfTestResult:
    """Outcome of running a bundle's self-test vectors.

    Attributes:
        passed: every element satisfies |actual - expected| <= atol + rtol * |expected| (NumPy's allclose rule)
            and every output is finite.
        max_abs_err: max |actual - expected|.
        max_rel_err: max |actual - expected| / max(|expected|, atol).
        rtol, atol: the tolerances from the manifest (`selftest.rtol`, `selftest.atol`), chosen by dtype.
        backend: the backend that ran it ("cuda" | "cpu").
        worst: max |actual - expected| / (atol + rtol * |expected|): the verdict's own measure, at most 1 where
            it passed (a max rel err above rtol can pass where atol covers it: small expected values).
    """

    passed: bool
    max_abs_err: float
    max_rel_err: float
    rtol: float
    atol: float
    backend: str = ""
    worst: float = 0.0

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"self-test {verdict} on {self.backend}: max abs err {self.max_abs_err:.3g}, max rel err "
            f"{self.max_rel_err:.3g} (rtol {self.rtol:g}, atol {self.atol:g}); the worst value at {self.worst:.3g} "
            f"of its bound atol + rtol*|expected| (at most 1 passes)"
        )

    def raise_if_failed(self) -> None:
        """Raise BundleError with the numbers when the self-test failed."""
        if not self.passed:
            raise BundleError(str(self))


def compare(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float, backend: str = "") -> SelfTestResult:
    """Compare a backend's output with the stored reference output (both float32, same shape)."""
    if actual.shape != expected.shape:
        raise BundleError(f"self-test output shape {actual.shape}; the stored reference output is {expected.shape}")
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - e)
        finite = bool(np.isfinite(a).all())
        passed = finite and bool((diff <= atol + rtol * np.abs(e)).all())
        max_abs = float(diff.max()) if diff.size else 0.0
        floor = max(float(atol), float(np.finfo(np.float32).tiny))  # atol = 0 must not divide by zero
        max_rel = float((diff / np.maximum(np.abs(e), floor)).max()) if diff.size else 0.0
        bound = np.maximum(atol + rtol * np.abs(e), float(np.finfo(np.float32).tiny))
        worst = float((diff / bound).max()) if diff.size else 0.0
    if not finite:
        max_abs = max_rel = worst = float("inf")
    return SelfTestResult(passed, max_abs, max_rel, float(rtol), float(atol), backend, worst)

