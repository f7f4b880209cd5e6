"""The content-addressed store on a device, seen from the deploying machine.

The layout and the on-device logic are in the agent/ package (it runs there); this module gives typed answers:

    REMOTE_DIR/store/<sha256>          verified file contents (read-only), `.partial` while uploading
    REMOTE_DIR/bundles/<id>/           bundle folders, hard links into the store
    REMOTE_DIR/current -> bundles/<id> the active bundle (switched by an atomic rename)
    REMOTE_DIR/previous -> bundles/<id> the bundle before it in REMOTE_DIR/history (what `rollback` returns to)
    REMOTE_DIR/runtime.json            the venv `--install-runtime` made (used by --verify and the health check)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RemoteAnswerError
from .remote import RemoteAgent


@dataclass(frozen=True)
class ObjectState:
    """One store object on the device: "stored", "partial" (with `offset` bytes already there) or "missing"."""

    state: str
    offset: int


@dataclass(frozen=True)
class Plan:
    """The device's answer to `plan`: the absolute store root, free bytes, and the state of each object."""

    root: str
    free_bytes: int
    objects: dict  # sha256 -> ObjectState
    runtime: dict | None = None  # runtime.json: {"venv", "python", "colibri", "version", ...} or None


@dataclass(frozen=True)
class Staged:
    """A staged bundle folder: its absolute path on the device, whether it already existed, corrupt objects."""

    path: str
    reused: bool
    corrupt: tuple
    answer: dict


@dataclass(frozen=True)
class BundleEntry:
    """One bundle folder on the device, as `--status` lists it."""

    bundle_id: str
    activated: float  # seconds since the epoch (the folder's mtime, set at each activation)
    files: int  # files the manifest lists, manifest.json besides ("11 files + manifest")
    bytes: int  # all of them, manifest.json included
    manifest: dict
    error: str = ""


@dataclass(frozen=True)
class StoreStatus:
    """What `--status` shows for one device."""

    root: str
    exists: bool
    current: str | None = None
    previous: str | None = None
    bundles: tuple = ()
    store_objects: int = 0
    store_bytes: int = 0
    partial: int = 0
    free_bytes: int = 0
    history: tuple = ()  # activated bundle ids, oldest first, ending with current
    runtime: dict | None = None


class DeviceStore:
    """Typed access to the agent's operations (the agent/ package says what each does on the device). Every
    answer was checked against its schema (answers.py) by RemoteAgent.call; what a schema cannot know (the
    objects asked for) is checked here."""

    def __init__(self, agent: RemoteAgent):
        self.agent = agent

    def _bad(self, op: str, what: str) -> RemoteAnswerError:
        return RemoteAnswerError(f"{self.agent.label}: remote {op} in {self.agent.remote_dir!r}: malformed answer: "
                                 f"{what}; nothing of it was used", 0)

    def plan(self, objects: dict) -> Plan:
        """`objects`: {sha256: size in bytes}. The answer names each of them, with an offset <= its size (the
        size itself when stored, 0 when missing; a partial upload may hold every byte, killed before its rename).

        Raises:
            RemoteAnswerError: an object missing from the answer, or an offset that does not fit its size.
        """
        answer = self.agent.call("plan", *(f"{sha}:{size}" for sha, size in objects.items()))
        states = {sha: ObjectState(v["state"], v["offset"]) for sha, v in answer["objects"].items()}
        for sha, size in objects.items():
            state = states.get(sha)
            if state is None:
                raise self._bad("plan", f"objects has no entry for {sha} (asked for {len(objects)} objects)")
            if state.offset > size or (state.state == "stored" and state.offset != size) \
                    or (state.state == "missing" and state.offset):
                raise self._bad("plan", f"objects[{sha!r}] = {state.state} at offset {state.offset:,}, for an "
                                        f"object of {size:,} bytes")
        return Plan(answer["root"], answer["free"], states, answer.get("runtime"))

    def stage(self, bundle_id: str, files, fresh, timeout: float, keep: int = -1) -> Staged:
        """Build bundles/<bundle_id> from `files` (BundleFile list) and hash every file not in `fresh`; with
        `keep` >= 0 and nothing corrupt, also switch to it (as `switch`); `keep` -1 only stages. The agent's full
        answer is `.answer`."""
        items = [f"{f.sha256}:{f.path}" for f in files]
        answer = self.agent.call("stage", bundle_id, ",".join(sorted(fresh)), keep, *items, timeout=timeout)
        unknown = sorted(set(answer["corrupt"]) - {f.sha256 for f in files})
        if unknown:
            raise self._bad("stage", f"corrupt names {unknown[0]}, which is no file of bundle {bundle_id}")
        return Staged(answer["path"], answer["reused"], tuple(answer["corrupt"]), answer)

    def switch(self, bundle_id: str, keep: int) -> dict:
        """Make bundles/<bundle_id> current; keep `keep` bundles (plus current and previous); collect garbage."""
        return self.agent.call("switch", bundle_id, keep)

    def rollback(self, bundle_id: str | None, timeout: float) -> dict:
        """Re-verify bundles/<bundle_id> (default: the one before current in the history, which current leaves)
        and make it current. Returns {"current", "previous", "history"}."""
        return self.agent.call("rollback", *([bundle_id] if bundle_id else []), timeout=timeout)

    def undo(self, bundle_id: str, timeout: float, replaced_mtime: float | None = None) -> dict:
        """Take back the activation of `bundle_id` (still current): step back in the history, or leave no
        bundle current when there is none before it; the bundle stepped back to keeps its activation time, and
        `bundle_id` gets back `replaced_mtime` (the time its switch replaced) when given. Returns {"current": id
        or None, "previous"}."""
        return self.agent.call("undo", bundle_id, *([repr(float(replaced_mtime))] if replaced_mtime else []),
                               timeout=timeout)

    def probe(self) -> dict:
        """The device's machine, Python version, ABI, C library and PEP 508 markers (agent/runtime.py)."""
        return self.agent.call("probe")

    def install(self, venv: str, requirement: str, wheels, timeout: float) -> dict:
        """Create/refresh the venv from the store objects `wheels` [(sha256, file name)] and record it."""
        return self.agent.call("install", venv, requirement, *(f"{sha}:{name}" for sha, name in wheels),
                               timeout=timeout)

    def status(self) -> StoreStatus:
        answer = self.agent.call("status")
        if not answer.get("exists"):
            return StoreStatus(answer["root"], False)
        bundles = tuple(
            BundleEntry(b["id"], float(b["activated"]), b["files"], b["bytes"], b.get("manifest") or {},
                        b.get("error") or "")
            for b in answer["bundles"])
        return StoreStatus(answer["root"], True, answer.get("current"), answer.get("previous"), bundles,
                           answer["store_objects"], answer["store_bytes"], answer["partial"], answer["free"],
                           tuple(answer.get("history") or ()), answer.get("runtime"))
