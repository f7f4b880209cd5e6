"""Seeded byte mutations of a file for the "typed error or a finite answer" tests of tests/robustness."""

from __future__ import annotations

import numpy as np
from colibri_sdk.errors import ColibriError


def mutate(data: bytes, rng: np.random.Generator, head: int, overwrite: bool = False) -> bytes:
    """One mutation of `data`, chosen by `rng`: a flipped bit anywhere, a random byte within the first `head` bytes
    (the header / metadata), a truncation, and with `overwrite` also 4 random bytes anywhere."""
    d = bytearray(data)
    how = int(rng.integers(4 if overwrite else 3))
    if how == 0:
        d[int(rng.integers(len(d)))] ^= 1 << int(rng.integers(8))
    elif how == 1:
        d[int(rng.integers(head))] = int(rng.integers(256))
    elif how == 2:
        d = d[: int(rng.integers(len(d)))]
    else:
        i = int(rng.integers(len(d) - 4))
        d[i : i + 4] = rng.integers(256, size=4, dtype=np.uint8).tobytes()
    return bytes(d)


def mutation_outcomes(data: bytes, rng: np.random.Generator, rounds: int, head: int, attempt,
                      overwrite: bool = False) -> dict[str, int]:
    """Run `attempt(mutated_bytes) -> y` on `rounds` mutations of `data` (`mutate`); count the ColibriErrors
    ("refused") and the finite answers ("finite"). A non-finite answer fails the test (assert); any other exception
    propagates."""
    outcomes = {"refused": 0, "finite": 0}
    for _ in range(rounds):
        d = mutate(data, rng, head, overwrite)
        try:
            y = attempt(d)
        except ColibriError:
            outcomes["refused"] += 1
            continue
        assert np.isfinite(y).all()
        outcomes["finite"] += 1
    return outcomes
