"""Deploying a bundle to one device, rolling back, and reading its status.

`deploy()` is the whole sequence; the device's active bundle changes only in its last step:

1. plan      which store objects the device has (stored, partial with offset, missing) and its free space
2. upload    the missing bytes only, resuming partials; each object hashed on the device as it is written
3. stage     bundles/<id> built from hard links into the store; every file not hashed in step 2 is hashed
             now, so every file of the folder has been verified on the device (corrupt objects are re-sent)
4. verify    with `verify=True`, `colibri-sdk verify --backend B bundles/<id>` runs on the device (the bundle's
             self-test, B = "cuda" unless verify_backend="cpu"); a pass on another backend than B fails; its
             self-test line, which names the backend that ran it, is kept in the result
5. switch    `current` → bundles/<id> by renaming a new symlink over it; the history gains <id>; bundles
             beyond `keep` (besides current and previous) and store objects no bundle links to are deleted
6. activate  with `on_activate` or `health_cmd`: the command, then the health check; on a failure the previous
             bundle is current again (activation.py)

Before any of this the local bundle is opened with the runtime's own loader (local_bundle.py: all its checks but
the files' sha256, which the device computes from what it receives; a file it found different is hashed here, and
one changed here stops the deploy before step 3): a bundle it refuses is never sent. Killing the deploy at any moment before step 5 leaves `current` and the bundle it names
untouched; Ctrl-C in the caller's thread (`Checkpoint.stop`) stops it before the switch.
"""

from __future__ import annotations

import re
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..bundle import MANIFEST
from .activation import activate_and_check
from .connection import Connection, Target
from .errors import ChecksumMismatchError, DeployError, RemoteDiskFullError
from .local_bundle import ID_HEX_DIGITS, LocalBundle, check_digest, rehash
from .remote import VERIFY_BACKENDS, RemoteAgent, run_verify
from .store import DeviceStore, StoreStatus
from .transfer import Upload, Uploader

DEFAULT_REMOTE_DIR = "~/colibri"
HASH_BYTES_PER_S = 50e6  # a slow device's sha256 rate, for timeouts only
BUNDLE_ID = re.compile("[0-9a-f]{1,64}")  # what the device's agent accepts; --status lists 16 digits


@dataclass(frozen=True)
class DeployOptions:
    """How to deploy (the same for every host).

    Attributes:
        remote_dir: store root on the device (`~` expands there).
        keep: bundles kept on the device besides current and previous (0: only those two).
        verify: run the bundle's self-test on the device before switching.
        remote_python: the device's Python (runs the store agent).
        remote_colibri: the device's colibri-sdk command (runs `verify` and the default health check); None for
            the venv `--install-runtime` recorded on the device, else "colibri-sdk".
        verify_backend: the backend the self-test must run on: "cuda" (a bundle is built for a GPU; a fall back
            to the CPU fails) or "cpu" (accept a check on the CPU).
        streams: upload channels used at once.
        verify_timeout: seconds allowed for the remote self-test, the on-activate command and the health check.
        on_activate: shell command run on the device after the switch (e.g. restart the service), or None.
        health_cmd: shell command whose exit status 0 means healthy, run after on_activate; None for the
            bundle's self-test on the device. The health check runs when either of the two is given.
    """

    remote_dir: str = DEFAULT_REMOTE_DIR
    keep: int = 3
    verify: bool = False
    remote_python: str = "python3"
    remote_colibri: str | None = None
    verify_backend: str = "cuda"
    streams: int = 2
    verify_timeout: float = 600.0
    on_activate: str | None = None
    health_cmd: str | None = None

    def __post_init__(self):
        if not isinstance(self.remote_dir, str) or not self.remote_dir.strip():
            raise DeployError(f"--remote-dir {self.remote_dir!r}: expected a folder path on the device "
                              f"(default {DEFAULT_REMOTE_DIR})")
        if any(ord(c) < 32 or c == "\x7f" for c in self.remote_dir):
            raise DeployError(f"--remote-dir {self.remote_dir!r}: control characters (newline, tab, ...) are not "
                              f"allowed in the path")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 0:
            raise DeployError(f"--keep {self.keep!r}: expected a whole number >= 0 (bundles kept besides current "
                              f"and previous)")
        if self.streams < 1:
            raise DeployError(f"--streams {self.streams}: must be at least 1")
        if self.verify_backend not in VERIFY_BACKENDS:
            raise DeployError(f"--verify-backend {self.verify_backend!r}: must be one of {', '.join(VERIFY_BACKENDS)}")
        for name in ("on_activate", "health_cmd", "remote_python", "remote_colibri"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise DeployError(f"--{name.replace('_', '-')} {value!r}: expected a shell command")


@dataclass
class DeployResult:
    """What one deploy did. Byte counts are payload bytes (file contents, manifest.json included) sent over SSH;
    `sent`, `resumed` and `retried` are bundle-relative paths (manifest.json among them when it was sent).
    With --verify, `selftest` is the device's self-test line ("self-test passed on cuda: max abs err ..."),
    `selftest_backend` the backend it names ("cuda", "cpu"; "" if none) and `verify_notes` the standard error
    lines of `verify` (e.g. why it ran on the CPU). `on_activate` and `health` say how those went ("" when not
    run)."""

    host: str
    bundle_id: str
    remote_path: str = ""
    total_bytes: int = 0
    bytes_sent: int = 0
    sent: list = field(default_factory=list)
    resumed: list = field(default_factory=list)
    retried: list = field(default_factory=list)
    previous: str | None = None
    changed: bool = True
    seconds: float = 0.0
    selftest: str = ""
    selftest_backend: str = ""
    verify_notes: tuple = ()
    on_activate: str = ""
    health: str = ""


@dataclass
class Checkpoint:
    """How far one deploy got, shared with the thread that started it (the CLI, when Ctrl-C reaches it).

    `phase` is "checking" (the local bundle), "sending" (plan, upload, stage), "verifying", "switching" (the
    switch was asked for; the device completes it either way), "switched" (the new bundle is current, complete and
    verified on the device), "activating" (--on-activate and the health check) or "done". `stop.set()` asks the
    deploy to stop at the next step before the switch (a DeployError saying the active bundle was not changed);
    once the switch was asked for, the deploy goes on to its end, so that the activation and the health check (or
    the rollback) are not left half done.
    """

    phase: str = "checking"
    bundle_id: str = ""
    path: str = ""
    stop: threading.Event = field(default_factory=threading.Event)

    def enter(self, phase: str, label: str) -> None:
        """Move to `phase`; before the switch, stop here if asked to."""
        if self.stop.is_set() and phase in ("sending", "verifying", "switching"):
            raise DeployError(f"{label}: interrupted before the switch: the active bundle was not changed (the next "
                              f"deploy resumes what was sent)")
        self.phase = phase

    def describe(self, label: str) -> str:
        """One line saying what is true on the device now, for a deploy that was interrupted."""
        if self.phase in ("checking", "sending", "verifying"):
            return f"{label}: interrupted before the switch: the active bundle was not changed"
        if self.phase == "switching":
            return (f"{label}: interrupted while switching to bundle {self.bundle_id}: the device's current bundle "
                    f"is the previous one or {self.bundle_id}, either complete (see --status)")
        where = f" at {self.path}" if self.path else ""
        if self.phase == "done":
            return (f"{label}: interrupted after the switch; the deploy finished: bundle {self.bundle_id} is "
                    f"active{where}, complete and verified on the device")
        return (f"{label}: interrupted after the switch: bundle {self.bundle_id} is active{where}, complete and "
                f"verified on the device; --on-activate and the health check did not finish")


def remote_colibri(options: DeployOptions, runtime: dict | None) -> str:
    """The device's colibri-sdk command: --remote-colibri, else the recorded venv's, else "colibri-sdk"."""
    if options.remote_colibri:
        return options.remote_colibri
    if runtime and isinstance(runtime.get("python"), str):
        return shlex.join([runtime["python"], "-m", "colibri_sdk"])
    return "colibri-sdk"


def deploy(bundle_path, target: Target, options: DeployOptions = DeployOptions(), progress=None,
           checkpoint: Checkpoint | None = None) -> DeployResult:
    """Put the bundle at `bundle_path` on `target` and make it the active bundle.

    Args:
        progress: called with byte counts as they are sent (e.g. a tqdm bar's `update`), or None.
        checkpoint: records how far the deploy got, and stops it before the switch when its `stop` is set (see
            Checkpoint); None for none.

    Raises:
        BundleError: the runtime's loader refuses the local bundle (checked before connecting), or a file's
            sha256 differs from the manifest (hashed here when the device found it different, or when the device
            already holds it; before anything is staged).
        DeployError subclasses (errors.py): connection, host key, authentication, disk full, permission,
            checksum mismatch, remote timeout, failed self-test (the active bundle is unchanged in these cases);
            HealthCheckError after the switch (the previous bundle is active again).
    """
    start = time.monotonic()
    point = checkpoint if checkpoint is not None else Checkpoint()
    bundle = LocalBundle.open(bundle_path, hash_files=False)  # the files are hashed as they are read to be sent
    point.bundle_id = bundle.bundle_id
    result = DeployResult(target.label, bundle.bundle_id, total_bytes=bundle.total_bytes)
    with Connection(target) as conn:
        store = DeviceStore(RemoteAgent(conn, options.remote_dir, options.remote_python))
        point.enter("sending", target.label)
        colibri, root, switched = _send_and_stage(store, bundle, target, options, progress, result, point)
        if options.verify:
            point.enter("verifying", target.label)
            report = run_verify(conn, colibri, result.remote_path, options.verify_timeout, options.verify_backend)
            result.selftest, result.selftest_backend, result.verify_notes = report.selftest, report.backend, \
                report.notes
            point.enter("switching", target.label)
            switched = store.switch(bundle.bundle_id, options.keep)
        point.path, point.phase = result.remote_path, "switched"
        result.previous = switched.get("previous")
        result.changed = result.previous != bundle.bundle_id
        if options.on_activate or options.health_cmd:
            point.phase = "activating"
            result.on_activate, result.health = activate_and_check(conn, store, bundle.bundle_id, root, options,
                                                                   colibri, result.changed,
                                                                   switched.get("replaced_mtime"))
    point.phase = "done"
    result.seconds = time.monotonic() - start
    return result


def _send_and_stage(store: DeviceStore, bundle: LocalBundle, target: Target, options: DeployOptions, progress,
                    result: DeployResult, point: Checkpoint) -> tuple:
    """Steps 1-3 (and 5 at once without --verify). Returns (the device's colibri-sdk command, the store root, the
    stage answer)."""
    objects = {}
    for f in bundle.files:  # identical contents are one store object
        objects.setdefault(f.sha256, f)
    plan = store.plan({sha: f.size for sha, f in objects.items()})
    uploads = [Upload(f, plan.objects[sha].offset) for sha, f in objects.items()
               if plan.objects[sha].state != "stored"]
    _check_space(target, plan, uploads)
    if hasattr(progress, "add_total"):
        progress.add_total(sum(u.file.size - u.offset for u in uploads))
    uploader = Uploader(store.agent, options.streams, progress, stop=point.stop)
    fresh = set()
    keep_now = -1 if options.verify else options.keep  # without --verify, stage and switch in one call
    sending, abandon = {u.file.sha256 for u in uploads}, threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash") as pool:
        # The files the device already has are not read to be sent: hash them here, beside the upload.
        held = pool.submit(_check_files, [f for f in bundle.files if f.sha256 not in sending], (abandon, point.stop))
        try:
            report = uploader.upload(uploads)
        except BaseException:
            abandon.set()
            raise
        held.result()
    for attempt in range(2):
        if attempt:
            report = uploader.upload(uploads)
        point.enter("sending", target.label)  # streams stopped by an interrupt end here, not in a retry
        _merge(result, report)
        fresh |= {u.file.sha256 for u in uploads}
        if keep_now >= 0:  # this stage switches too
            point.enter("switching", target.label)
        staged = store.stage(bundle.bundle_id, bundle.files, fresh, keep=keep_now,
                             timeout=target.command_timeout + bundle.total_bytes / HASH_BYTES_PER_S)
        if not staged.corrupt:
            break
        if attempt == 1:
            raise ChecksumMismatchError(
                f"{target.label}: store objects {', '.join(staged.corrupt)} failed their sha256 check on the "
                f"device twice; the active bundle was not changed")
        # Stored objects that no longer match their sha256 (bit rot, tampering): deleted there, send again.
        uploads = [Upload(objects[sha], 0) for sha in staged.corrupt]
        result.retried += [objects[sha].path for sha in staged.corrupt]
    result.remote_path = staged.path
    return remote_colibri(options, plan.runtime), plan.root, staged.answer


def rollback(target: Target, options: DeployOptions = DeployOptions(), to: str | None = None) -> dict:
    """Step back one bundle in the device's history (or switch to bundle `to`) after re-hashing all its files.
    Each rollback without `to` goes one further back: the current bundle leaves the history.

    Returns the agent's answer: {"current": id, "previous": the id that was current, "history": [ids]}.

    Raises:
        DeployError: `to` is not a bundle id (lowercase hex digits), checked before connecting.
        RemoteCommandError: nothing to roll back to (no bundles under remote_dir, or no previous bundle),
            unknown id, or the bundle failed its sha256 check.
    """
    if to is not None and not BUNDLE_ID.fullmatch(to):
        raise DeployError(f"--to {to!r}: a bundle id is lowercase hex digits ({ID_HEX_DIGITS}, as --status lists "
                          f"them)")
    with Connection(target) as conn:
        store = DeviceStore(RemoteAgent(conn, options.remote_dir, options.remote_python))
        return store.rollback(to, timeout=target.command_timeout + 8e9 / HASH_BYTES_PER_S)


def status(target: Target, options: DeployOptions = DeployOptions()) -> StoreStatus:
    """The bundles, pointers and store usage on `target`."""
    with Connection(target) as conn:
        return DeviceStore(RemoteAgent(conn, options.remote_dir, options.remote_python)).status()


def _check_files(files, stops) -> None:
    """Hash local bundle files and refuse any that differs from the manifest (local_bundle.check_digest); give
    up between files once one of the `stops` events is set."""
    for file in files:
        if any(stop.is_set() for stop in stops):
            return
        if file.path != MANIFEST:  # hashed from its bytes when the bundle was opened
            check_digest(file, rehash(file))


def _merge(result: DeployResult, report) -> None:
    result.bytes_sent += report.bytes_sent
    result.sent += report.sent
    result.resumed += report.resumed
    result.retried += report.retried


def _check_space(target: Target, plan, uploads) -> None:
    needed = sum(u.file.size - u.offset for u in uploads)
    if needed > plan.free_bytes:
        raise RemoteDiskFullError(
            f"{target.label}: the bundle needs {needed:,} more bytes under {plan.root!r} but only "
            f"{plan.free_bytes:,} are free on the device's disk; free space or lower --keep")
