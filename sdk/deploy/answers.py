"""The agent's answers: one schema per operation, checked before any field is used; device text made printable.

The device is not trusted to answer well: a broken Python there, a full disk that cut an answer short, or a
hostile machine. Every agent answer is one JSON object on the last line of stdout, at most `MAX_ANSWER_BYTES`
(16 MiB, counted while it is read: connection.collect stops reading past it). `check(op, answer)` holds it against
`SCHEMAS[op]` (types, required keys, sizes, no control characters in paths) and raises `AnswerError` naming the
first field that is wrong, the value seen (escaped and cut short) and what is allowed; RemoteAgent turns that
into a `RemoteAnswerError` naming the host and the operation. Keys an answer has beyond its schema are ignored.

Text that comes from the device and is shown on this machine (error messages, paths, status fields) goes through
`printable()`: control characters (ESC sequences, newlines, ...) are shown escaped, never sent to the terminal.
"""

from __future__ import annotations

import math
import re

MAX_ANSWER_BYTES = 16 << 20  # one agent answer (stdout); past it the command is abandoned
MAX_STDERR_BYTES = 64 << 10  # the tail of a command's stderr that is kept (messages quote its last lines)
MAX_TEXT = 64 << 10  # characters of one text field (an error message, a venv path)
MAX_PATH = 4096  # characters of one path on the device (PATH_MAX)
MAX_ITEMS = 1 << 20  # entries of one list or map (objects of a plan, bundles of a status)
MAX_COUNT = 1 << 63  # bytes, offsets, counts
MAX_SECONDS = 1e11  # a time since the epoch (the year 5138): what time.localtime can show
SHOWN_CHARS = 80  # characters of a bad value quoted in a message

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class AnswerError(ValueError):
    """An answer does not follow its operation's schema; the message names the field and what is allowed."""


def printable(text, limit: int = 2000) -> str:
    """`text` (from the device) safe to print on one terminal line: control characters as escapes (`\\x1b`,
    `\\n`), cut to `limit` characters with "..." at the cut."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def shown(value) -> str:
    """A bad value for a message: its repr (strings quoted), escaped, at most SHOWN_CHARS characters."""
    text = repr(value)
    return printable(text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else ""), limit=SHOWN_CHARS + 3)


# ---- field types: each is a callable (value, where) that raises AnswerError ----------------------------------------
def _fail(where: str, value, allowed: str):
    raise AnswerError(f"{where} = {shown(value)}; expected {allowed}")


def count(value, where):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        _fail(where, value, "a whole number >= 0")


def seconds(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value < MAX_SECONDS:
        _fail(where, value, "seconds since the epoch (0 to 1e11)")


def flag(value, where):
    if not isinstance(value, bool):
        _fail(where, value, "true or false")


def text(value, where):
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        _fail(where, value, f"a string of at most {MAX_TEXT:,} characters")


def path(value, where):
    """An absolute path on the device, without control characters."""
    if not isinstance(value, str) or not value.startswith("/") or len(value) > MAX_PATH or _CONTROL.search(value):
        _fail(where, value, f"an absolute path (at most {MAX_PATH} characters, no control characters)")


def sha256(value, where):
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        _fail(where, value, "a sha256 (64 lowercase hex digits)")


def bundle_id(value, where):
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{1,64}", value):
        _fail(where, value, "a bundle id (1 to 64 lowercase hex digits)")


def errno_name(value, where):
    if not isinstance(value, str) or not re.fullmatch(r"E[A-Z0-9]{1,15}", value):
        _fail(where, value, "an errno name (EIO, ENOSPC, ...)")


def matching(pattern: str, allowed: str):
    def check_matching(value, where):
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            _fail(where, value, allowed)
    return check_matching


def one_of(*allowed):
    def check_one(value, where):
        if not isinstance(value, str) or value not in allowed:
            _fail(where, value, "one of " + ", ".join(allowed))
    return check_one


def nullable(kind):
    def check_nullable(value, where):
        if value is not None:
            kind(value, where)
    return check_nullable


def list_of(kind, max_items: int = MAX_ITEMS, min_items: int = 0):
    def check_list(value, where):
        if not isinstance(value, list) or not min_items <= len(value) <= max_items:
            _fail(where, value, f"a list of {min_items} to {max_items:,} entries")
        for i, item in enumerate(value):
            kind(item, f"{where}[{i}]")
    return check_list


def map_of(key, kind, max_items: int = MAX_ITEMS):
    def check_map(value, where):
        if not isinstance(value, dict) or len(value) > max_items:
            _fail(where, value, f"an object of at most {max_items:,} entries")
        for k, v in value.items():
            key(k, f"{where} key")
            kind(v, f"{where}[{k!r}]")
    return check_map


def record(fields: dict):
    """An object with `fields` {name: type}; a name ending in "?" may be missing (or null)."""
    def check_record(value, where):
        if not isinstance(value, dict):
            _fail(where or "the answer", value, "a JSON object")
        for name, kind in fields.items():
            key = name.rstrip("?")
            inner = f"{where}.{key}" if where else key
            if key not in value:
                if name.endswith("?"):
                    continue
                raise AnswerError(f"{inner} is missing")
            if name.endswith("?") and value[key] is None:
                continue
            kind(value[key], inner)
    return check_record


def any_json(value, where):
    """Anything JSON gives (nested sizes are bounded by MAX_ANSWER_BYTES)."""


# ---- the answers ----------------------------------------------------------------------------------------------------
RUNTIME = record({"venv?": text, "python?": text, "colibri?": text, "version?": text, "requirement?": text,
                  "wheels?": list_of(text), "installed?": seconds})
ACTIVATION = {"previous?": bundle_id, "removed?": list_of(bundle_id), "freed?": count, "replaced_mtime?": seconds}
SUMMARY = record({"profile?": text, "arch?": text, "dtype?": text, "sdk_version?": text, "shape?": any_json,
                  "model?": any_json})  # agent/status.py summary(): what --status shows of a manifest
BUNDLE = record({"id": bundle_id, "activated": seconds, "files": count, "bytes": count, "manifest?": SUMMARY,
                 "error?": text})

ERROR = record({"errno": errno_name, "path?": text, "message?": text})
SCHEMAS = {
    "plan": record({"root": path, "free": count, "runtime?": RUNTIME,
                    "objects": map_of(sha256, record({"state": one_of("stored", "partial", "missing"),
                                                      "offset": count}))}),
    "receive": record({"objects": map_of(sha256, record({"status": one_of("stored", "mismatch", "short"),
                                                         "size?": count, "sha256?": sha256}))}),
    "stage": record({"path": path, "reused": flag, "corrupt": list_of(sha256), **ACTIVATION}),
    "switch": record({"current": bundle_id, **ACTIVATION}),
    "rollback": record({"current": bundle_id, "previous?": bundle_id, "history": list_of(bundle_id)}),
    "undo": record({"current?": bundle_id, "previous": bundle_id}),
    "status": record({"root": path, "exists": flag, "current?": bundle_id, "previous?": bundle_id,
                      "history?": list_of(bundle_id), "bundles": list_of(BUNDLE), "store_objects?": count,
                      "store_bytes?": count, "partial?": count, "free?": count, "runtime?": RUNTIME}),
    "probe": record({"machine": matching(r"[A-Za-z0-9_]{1,32}", "a machine name (x86_64, aarch64, ...)"),
                     "python": list_of(count, 2, 2), "implementation": text, "soabi?": text, "debug?": flag,
                     "libc?": list_of(matching(r"(|[a-z]{1,16}|[0-9]{1,4}\.[0-9]{1,4}(\.[0-9]{1,4})?)",
                                               "a C library name or version (glibc, 2.35)"), 2, 2),
                     "executable?": text, "markers?": map_of(text, text, 64), "record?": RUNTIME}),
    "install": record({"venv": path, "python": path, "colibri": text, "version": text, "requirement": text,
                       "wheels": list_of(text), "installed?": seconds}),
}


def check(op: str, answer) -> dict:
    """`answer` (parsed JSON) if it follows SCHEMAS[op]; an {"error": ...} answer is checked against ERROR.

    Raises:
        AnswerError: the first field that is wrong, its value and what is allowed.
    """
    if isinstance(answer, dict) and "error" in answer:
        ERROR(answer["error"], "error")
        return answer
    SCHEMAS[op](answer, "")
    if op == "status" and answer["exists"]:
        for key in ("store_objects", "store_bytes", "partial", "free", "bundles"):
            if answer.get(key) is None:
                raise AnswerError(f"{key} is missing (the answer says the store exists)")
    return answer
