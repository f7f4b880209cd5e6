"""One fuzz case run and tallied (the columns of bench/fuzz.py), opens outside the folder watched with an audit hook,
and the mutation helpers every surface shares (byte flips, JSON edits, strict canonical JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np

COLUMNS = ("tried", "typed", "accepted-correct", "crash", "hang", "silent-wrong", "read-outside-folder")
BAD = ("crash", "hang", "silent-wrong", "read-outside-folder")
LONG_MESSAGE = 1000  # characters: a typed error quoting more than this is noted (a value should be shortened)


class Hang(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` in the SDK can swallow it."""


class Wrong(Exception):
    """An independent check disagrees with what the SDK accepted."""


# ---- watching opens ---------------------------------------------------------------------------------------------
_WATCH: dict = {"outside": None, "hits": []}


def _audit(event: str, args) -> None:
    root = _WATCH["outside"]
    if root is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if os.path.isabs(path) and os.path.realpath(path).startswith(root):
        _WATCH["hits"].append(path)


sys.addaudithook(_audit)


@dataclasses.dataclass
class Tally:
    """Counts per column, and the first few examples of each bad column (case, detail)."""

    name: str
    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COLUMNS, 0))
    examples: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)

    def note(self, what: str, case: str, detail: str) -> None:
        """Something to fix that is not a column (e.g. a typed error whose message quotes a huge value)."""
        self.notes.setdefault(what, [0, []])
        self.notes[what][0] += 1
        if len(self.notes[what][1]) < 3:
            self.notes[what][1].append((case, detail[:160]))

    def add(self, column: str, case: str, detail: str = "") -> None:
        self.counts["tried"] += 1
        self.counts[column] += 1
        if column in BAD and len(self.examples.setdefault(column, [])) < 5:
            self.examples[column].append((case, detail[:300]))


def run_case(tally: Tally, case: str, action, outside: Path | None, timeout: float) -> None:
    """Run `action()` (returns normally when the SDK accepted and the independent check agreed) and tally it."""
    from colibri_sdk.errors import ColibriError

    def on_alarm(signum, frame):
        raise Hang()

    _WATCH["outside"], _WATCH["hits"] = (str(outside.resolve()) + os.sep if outside else None), []
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    column, detail = "accepted-correct", ""
    try:
        with contextlib.redirect_stdout(io.StringIO()), np.errstate(all="ignore"):
            action()
    except Hang:
        column = "hang"
    except Wrong as exc:
        column, detail = "silent-wrong", str(exc)
    except ColibriError as exc:
        message = str(exc)
        column, detail = ("typed", message) if "\n" not in message else ("crash", message)
        if column == "typed" and len(message) > LONG_MESSAGE:
            tally.note("message over 1,000 characters", case, message)
    except Exception as exc:  # noqa: BLE001 (anything else escaping the SDK is what this counts)
        column, detail = "crash", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        hits, _WATCH["outside"] = list(_WATCH["hits"]), None
    if hits:
        column, detail = "read-outside-folder", hits[0]
    tally.add(column, case, detail)


# ---- shared mutation helpers ------------------------------------------------------------------------------------
INTERESTING_U16 = (0, 1, 2, 3, 7, 8, 9, 16, 255, 256, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF)
JSON_VALUES = (None, True, False, -1, 0, 1, 2, 7, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e-300, "", "x",
               "../x", "/etc/passwd", "a\x00b", "\x1b[31mred", "kernels/../model.colibri", "model.colibri",
               "selftest/input.npy", "kernels", "\u200b", [], {}, [1, 2], [8, 7], {"a": 1}, "x" * 5000)


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    """A few random bit flips, byte overwrites, a truncation or an extension."""
    out = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and out:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind == 1 and out:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
    elif kind == 2:
        del out[rng.randrange(len(out) + 1):]
    elif kind == 3:
        out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif out:
        a = rng.randrange(len(out))
        out[a:a] = out[a:a + rng.randint(1, 64)]
    return bytes(out)


def json_paths(value, prefix=()):
    """Every (path, value) in a JSON tree (paths are tuples of keys / indices)."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_paths(item, prefix + (index,))


def json_set(tree, path, value=None, delete=False):
    node = tree
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def mutate_json(tree, rng: random.Random):
    """Replace, delete or duplicate one node of a JSON tree (in place); returns a description."""
    paths = [p for p, _ in json_paths(tree) if p]
    path = rng.choice(paths)
    if rng.random() < 0.2:
        json_set(tree, path, delete=True)
        return f"delete {path}"
    value = rng.choice(JSON_VALUES)
    json_set(tree, path, value)
    return f"set {path} = {value!r:.40}"


def canonical(manifest: dict) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()
