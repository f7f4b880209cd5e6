"""Mutation fuzzing of the deploy client against a device agent that answers badly (no sshd needed).

Each case takes a valid agent answer of one operation (plan, receive, stage, switch, rollback, undo, status,
probe, install, or an {"error": ...} answer), mutates it with a seeded generator (a field set to a value of
another type, out of range, with control characters or a path outside the store; a key deleted; the bytes cut,
flipped or buried under other lines; another exit status) and feeds it, as the `CommandResult` the SSH channel
would give, to `RemoteAgent.answer` through the code that uses it (`DeviceStore`, the uploader's answer
handling, `Device.from_probe`, the CLI's status and rollback lines). The outcome is sorted into the columns of
bench/fuzz.py:

    typed                a DeployError with a one-line message free of control characters
    accepted-correct     accepted, and the independent check below finds the answer well-formed
    crash                any other exception, or a typed message with a newline or a raw control character
    hang                 the case ran past `timeout` seconds (SIGALRM)
    silent-wrong         accepted, but the independent check finds the answer malformed
    read-outside-folder  a file outside `work` was opened while the case ran (the audit hook's "open" event)

The independent check is written here from docs/deploy.md and the agent's code (sdk/deploy/agent/), not with
sdk/deploy/answers.py: required keys, JSON types, sha256 and bundle ids as lowercase hex, absolute paths without
control characters, counts >= 0, offsets within the sizes asked for.

    python bench/fuzz.py --only agent [--scale 0.1] [--seed 7]
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from .cases import Tally, json_paths

SHA_A, SHA_B = "a" * 64, "0123456789abcdef" * 4
ID_A, ID_B = "9c1e0f4b2a7d3e85", "3f9c0a7d51e2b804"
ROOT = "/opt/colibri"
RUNTIME = {"venv": f"{ROOT}/venv", "python": f"{ROOT}/venv/bin/python", "colibri": f"{ROOT}/venv/bin/python -m "
           f"colibri_sdk", "version": "colibri-sdk 0.1.0", "requirement": "colibri-sdk[jetson]==0.1.0",
           "wheels": ["numpy-1.26.4-cp310-cp310-manylinux_2_17_aarch64.whl"], "installed": 1764500000.5}
SUMMARY = {"profile": "jetson-agx-orin-64gb", "arch": "sm_87", "dtype": "fp16", "sdk_version": "0.1.0",
           "shape": {"batch": 1, "tokens": 16}, "model": {"num_layers": 4, "num_experts": 8, "top_k": 2,
                                                          "hidden_size": 256, "intermediate_size": 512}}
SIZES = {SHA_A: 1000, SHA_B: 50}  # the objects a plan asks about, with their sizes
VALID = {
    "plan": {"root": ROOT, "free": 51_320_115_200, "runtime": RUNTIME,
             "objects": {SHA_A: {"state": "partial", "offset": 400}, SHA_B: {"state": "stored", "offset": 50}}},
    "receive": {"objects": {SHA_A: {"status": "stored"}}},
    "stage": {"path": f"{ROOT}/bundles/{ID_A}", "reused": False, "corrupt": [], "previous": ID_B, "removed": [],
              "freed": 0, "replaced_mtime": 1764500000.0},
    "switch": {"current": ID_A, "previous": ID_B, "removed": [ID_B], "freed": 1024},
    "rollback": {"current": ID_B, "previous": ID_A, "history": [ID_B]},
    "undo": {"current": ID_B, "previous": ID_A},
    "status": {"root": ROOT, "exists": True, "current": ID_A, "previous": ID_B, "history": [ID_B, ID_A],
               "bundles": [{"id": ID_A, "activated": 1764500000.0, "files": 11, "bytes": 20_195_602,
                            "manifest": SUMMARY}],
               "store_objects": 19, "store_bytes": 40_391_204, "partial": 0, "free": 51_320_115_200,
               "runtime": RUNTIME},
    "probe": {"machine": "aarch64", "python": [3, 10], "implementation": "cpython", "soabi": "cpython-310-aarch64-"
              "linux-gnu", "debug": False, "libc": ["glibc", "2.35"], "executable": "/usr/bin/python3",
              "markers": {"platform_machine": "aarch64", "sys_platform": "linux"}, "record": None},
    "install": RUNTIME,
}
ERROR = {"error": {"errno": "ENOSPC", "path": f"{ROOT}/store/{SHA_A}.partial", "message": "No space left on device"}}
ODD_VALUES = [None, True, False, 0, -1, 1 << 70, 3.5, -0.0, float("inf"), "", "x" * 70_000, "\x1b[2J\x1b[31mred\n",
              "../../etc/passwd", "/etc/shadow", "relative/path", "A" * 64, "g" * 64, [], [1, "a"], {}, {"k": [None]}]
HEX = set("0123456789abcdef")


# ---- the independent check -------------------------------------------------------------------------------------------
def _is_count(v):
    return type(v) is int and 0 <= v < 1 << 63


def _is_hex(v, n=None):
    return isinstance(v, str) and v and set(v) <= HEX and (len(v) == n if n else len(v) <= 64)


def _is_path(v):
    return isinstance(v, str) and v.startswith("/") and len(v) <= 4096 and not any(ord(c) < 32 or 127 <= ord(c) < 160
                                                                                   for c in v)


def _is_time(v):
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v < 1e11


def _opt(d, key, test):
    return d.get(key) is None or test(d[key])


def _runtime_ok(r):
    return r is None or (isinstance(r, dict) and all(_opt(r, k, lambda v: isinstance(v, str) and len(v) <= 65536)
                                                     for k in ("venv", "python", "colibri", "version", "requirement"))
                         and _opt(r, "wheels", lambda w: isinstance(w, list) and all(isinstance(x, str) for x in w))
                         and _opt(r, "installed", _is_time))


def well_formed(op: str, a) -> bool:
    """Whether `a` is an answer the deploy can use for `op` (docs/deploy.md, sdk/deploy/agent/)."""
    if not isinstance(a, dict):
        return False
    if "error" in a:
        e = a["error"]
        return isinstance(e, dict) and isinstance(e.get("errno"), str) and e["errno"][:1] == "E" \
            and e["errno"][1:].isalnum() and e["errno"].isascii() and e["errno"].upper() == e["errno"] \
            and len(e["errno"]) <= 16 \
            and all(_opt(e, k, lambda v: isinstance(v, str) and len(v) <= 65536) for k in ("path", "message"))
    ids = lambda v: isinstance(v, list) and all(_is_hex(x) for x in v)  # noqa: E731
    if op == "plan":
        objs = a.get("objects")
        return _is_path(a.get("root")) and _is_count(a.get("free")) and _runtime_ok(a.get("runtime")) \
            and isinstance(objs, dict) and set(objs) >= set(SIZES) and all(_is_hex(k, 64) for k in objs) \
            and all(isinstance(v, dict) and v.get("state") in ("stored", "partial", "missing")
                    and _is_count(v.get("offset")) for v in objs.values()) \
            and all(objs[s]["offset"] <= n and (objs[s]["state"] != "stored" or objs[s]["offset"] == n)
                    and (objs[s]["state"] != "missing" or objs[s]["offset"] == 0) for s, n in SIZES.items())
    if op == "receive":
        objs = a.get("objects")
        return isinstance(objs, dict) and all(_is_hex(k, 64) for k in objs) and all(
            isinstance(v, dict) and v.get("status") in ("stored", "mismatch", "short") and _opt(v, "size", _is_count)
            and _opt(v, "sha256", lambda s: _is_hex(s, 64)) for v in objs.values())
    activation = _opt(a, "previous", _is_hex) and _opt(a, "removed", ids) and _opt(a, "freed", _is_count) \
        and _opt(a, "replaced_mtime", _is_time)
    if op == "stage":
        return _is_path(a.get("path")) and type(a.get("reused")) is bool and isinstance(a.get("corrupt"), list) \
            and all(s in SIZES for s in a["corrupt"]) and activation
    if op == "switch":
        return _is_hex(a.get("current")) and activation
    if op == "rollback":
        return _is_hex(a.get("current")) and _opt(a, "previous", _is_hex) and ids(a.get("history"))
    if op == "undo":
        return _opt(a, "current", _is_hex) and _is_hex(a.get("previous"))
    if op == "status":
        if not (_is_path(a.get("root")) and type(a.get("exists")) is bool and isinstance(a.get("bundles"), list)):
            return False
        summary_ok = lambda m: isinstance(m, dict) and all(  # noqa: E731
            _opt(m, k, lambda v: isinstance(v, str) and len(v) <= 65536) for k in ("profile", "arch", "dtype",
                                                                                  "sdk_version"))
        return (not a["exists"] or all(_is_count(a.get(k)) for k in ("store_objects", "store_bytes", "partial",
                                                                       "free"))) \
            and _opt(a, "current", _is_hex) and _opt(a, "previous", _is_hex) and _opt(a, "history", ids) \
            and _runtime_ok(a.get("runtime")) and all(
                isinstance(b, dict) and _is_hex(b.get("id")) and _is_time(b.get("activated"))
                and _is_count(b.get("files")) and _is_count(b.get("bytes")) and _opt(b, "manifest", summary_ok)
                and _opt(b, "error", lambda v: isinstance(v, str) and len(v) <= 65536) for b in a["bundles"])
    if op == "probe":
        libc = a.get("libc", ["glibc", "2.35"])
        return isinstance(a.get("machine"), str) and a["machine"].isascii() and a["machine"].replace("_", "")\
            .isalnum() and len(a["machine"]) <= 32 and isinstance(a.get("python"), list) and len(a["python"]) == 2 \
            and all(_is_count(v) for v in a["python"]) and isinstance(a.get("implementation"), str) \
            and (libc is None or (isinstance(libc, list) and len(libc) == 2 and all(isinstance(x, str) for x in libc)
                                  and (libc[0] != "glibc" or all(p.isdigit() for p in libc[1].split(".")[:2])
                                       and "." in libc[1]))) \
            and _opt(a, "soabi", lambda v: isinstance(v, str)) and _opt(a, "debug", lambda v: type(v) is bool)
    if op == "install":
        return _is_path(a.get("venv")) and _is_path(a.get("python")) and all(
            isinstance(a.get(k), str) for k in ("colibri", "version", "requirement")) \
            and isinstance(a.get("wheels"), list) and all(isinstance(w, str) for w in a["wheels"])
    raise ValueError(op)


# ---- mutations -------------------------------------------------------------------------------------------------------
def mutate(answer: dict, rng: random.Random) -> tuple:
    """(stdout bytes, exit status) of a mutated answer."""
    tree = copy.deepcopy(answer)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = [p for p, _ in json_paths(tree) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
    text = json.dumps(tree)
    kind = rng.randrange(10)
    if kind == 0:
        text = text[:rng.randrange(len(text))]
    elif kind == 1:
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        text = data.decode("utf-8", "replace")
    elif kind == 2:
        text = "Traceback (most recent call last):\n\x1b[31mboom\x1b[0m\n" + text
    elif kind == 3:
        text = text + "\n" + rng.choice(["", "[]", "null", "{", '"x"', "5", '{"error": true}', "[" * 5000])
    status = rng.choice((0, 0, 0, 0, 1, 3, 127, -1))
    return text.encode("utf-8", "surrogatepass"), status


# ---- running a case ------------------------------------------------------------------------------------------------
class _Hang(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` can swallow it."""


def _consume(op: str, result, work: Path):
    """Feed `result` to RemoteAgent.answer through the code that uses the answer; returns the parsed answer."""
    from colibri_sdk.commands.deploy import _rollback, _status
    from colibri_sdk.deploy import DeployOptions, Target
    from colibri_sdk.deploy.local_bundle import BundleFile
    from colibri_sdk.deploy.remote import RemoteAgent
    from colibri_sdk.deploy.store import DeviceStore
    from colibri_sdk.deploy.transfer import Upload, Uploader, UploadReport
    from colibri_sdk.deploy.wheels import Device

    target = Target("127.0.0.1", user="fuzz")
    conn = SimpleNamespace(target=target, run=lambda *a, **k: result)
    agent = RemoteAgent(conn, ROOT)
    store = DeviceStore(agent)
    host = SimpleNamespace(name=target.label, target=target)
    if op == "plan":
        return store.plan(SIZES)
    if op == "receive":
        local = work / "object.bin"
        local.write_bytes(b"x" * 10)
        upload = Upload(BundleFile("model.colibri", SHA_A, 10, local))
        uploader = Uploader(agent)
        uploader._stream = lambda batch, report, digests=None: agent.answer("receive", result)["objects"]
        return uploader._send_batch([upload], UploadReport())
    if op == "stage":
        files = [BundleFile(f"f{i}", s, n, work / "x") for i, (s, n) in enumerate(SIZES.items())]
        return store.stage(ID_A, files, set(), timeout=1.0, keep=3)
    if op == "switch":
        return store.switch(ID_A, 3).get("previous")
    if op == "undo":
        return store.undo(ID_A, timeout=1.0).get("current")
    if op == "rollback":
        answer = store.rollback(None, timeout=1.0)
        with mock.patch("colibri_sdk.deploy.rollback", lambda *a: answer), contextlib.redirect_stdout(io.StringIO()):
            _rollback(host, DeployOptions(), None)
        return answer
    if op == "status":
        with mock.patch("colibri_sdk.deploy.status", lambda *a: store.status()), \
                contextlib.redirect_stdout(io.StringIO()) as out:
            _status(host, DeployOptions())
        if any(ord(c) < 32 and c != "\n" or c == "\x7f" for c in out.getvalue()):
            raise AssertionError(f"--status printed a raw control character: {out.getvalue()[:200]!r}")
        return out.getvalue()
    if op == "probe":
        return Device.from_probe(store.probe())
    if op == "install":
        return store.install(f"{ROOT}/venv", "colibri-sdk[jetson]==0.1.0", [], timeout=1.0)
    raise ValueError(op)


def fuzz_agent(count: int, seed: int, work: Path, timeout: float) -> Tally:
    """`count` seeded mutations of valid agent answers fed to `RemoteAgent.answer` and what uses the answer.

    Returns:
        the tally "agent" of every column of COLUMNS ("tried", "typed", ...).
    """
    from colibri_sdk.deploy import DeployError
    from colibri_sdk.deploy.connection import CommandResult

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    tally = Tally("agent")
    rng = random.Random(seed)
    ops = sorted(VALID)
    opened = []
    watching = [False]
    outside_ok = (str(work.resolve()), sys.prefix, sys.base_prefix, "/usr/lib", "/dev/null", "/proc/self")

    def audit(event, args):
        if watching[0] and event == "open" and isinstance(args[0], (str, bytes, Path)):
            name = str(args[0] if not isinstance(args[0], bytes) else args[0].decode("utf-8", "replace"))
            if not name.startswith(outside_ok) and not name.endswith((".py", ".pyc", ".so")):
                opened.append(name)

    sys.addaudithook(audit)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Hang()))
    for op in ops:  # warm the imports up, outside the watched cases
        try:
            _consume(op, CommandResult(0, (json.dumps(VALID[op]) + "\n").encode(), b""), work)
        except DeployError:
            pass
    try:
        for _ in range(count):
            op = rng.choice(ops)
            base = ERROR if rng.random() < 0.1 else VALID[op]
            stdout, status = mutate(base, rng)
            result = CommandResult(status, stdout, b"\x1b[31mTraceback\nValueError: x\n" if status else b"")
            del opened[:]
            watching[0] = True
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                _consume(op, result, work)
                column = "accepted-correct"
                parsed = _last_json(stdout)
                if status != 0 or not well_formed(op, parsed) or "error" in parsed:
                    column = "silent-wrong"
            except _Hang:
                column = "hang"
            except DeployError as exc:
                message = str(exc)
                column = "typed" if not any(ord(c) < 32 or c == "\x7f" for c in message) else "crash"
            except Exception:  # noqa: BLE001 - anything else escaping is what this counts
                column = "crash"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                watching[0] = False
            tally.add(column if not opened else "read-outside-folder", f"agent#{tally.counts['tried']} ({op})")
    finally:
        signal.signal(signal.SIGALRM, previous)
    return tally


def _last_json(stdout: bytes):
    text = stdout.decode("utf-8", "replace").strip()
    try:
        return json.loads(text.splitlines()[-1]) if text else None
    except (ValueError, RecursionError):
        return None
