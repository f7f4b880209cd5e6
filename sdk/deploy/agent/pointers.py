"""current / previous / history: `switch`, `rollback` and `undo`.

    stage ROOT ID FRESH KEEP SHA:PATH...
                            stage bundles/ID (bundles.stage); with KEEP >= 0 and no corrupt object, `switch` to it
                            in the same lock
    switch ROOT ID KEEP     point `current` at bundles/ID; the history gains ID; keep KEEP bundles besides current
                            and previous; delete store objects no bundle uses
    rollback ROOT [ID]      re-hash the bundle before the current one in the history (or bundles/ID) against its
                            manifest, then make it current; without ID the current one leaves the history, so each
                            rollback steps one further back
    undo ROOT ID [MTIME]    if ID is current: step back as `rollback` does, or, with no earlier bundle, remove the
                            `current` pointer (a first deploy whose health check failed); the bundle stepped back
                            to keeps its activation time, and ID gets back MTIME (the time `switch` replaced)

`previous` always names the entry before `current` in the history (absent when there is none). Each operation
first refuses a ROOT holding an entry the store did not make (layout.check_layout), before it takes the lock.
"""

import json
import os
import time

from .bundles import check_bundle, parse_items, prune_bundles, stage
from .common import AgentError, Lock, check_id, emit, fsync_dir, remove_quietly, write_atomic
from .layout import check_layout
from .objects import collect_garbage


def read_pointer(root, name):
    """The bundle id a pointer names, or None."""
    try:
        return os.path.basename(os.readlink(os.path.join(root, name)))
    except FileNotFoundError:
        return None


def set_pointer(root, name, bundle_id):
    """Point `name` at bundles/ID (rename of a new symlink), or remove it when ID is None."""
    if bundle_id is None:
        remove_quietly(os.path.join(root, name))
        return
    tmp = os.path.join(root, ".%s.tmp-%d" % (name, os.getpid()))
    remove_quietly(tmp)
    os.symlink(os.path.join("bundles", bundle_id), tmp)
    os.replace(tmp, os.path.join(root, name))


def read_history(root):
    """Activated bundle ids, oldest first, ending with `current`; rebuilt from the pointers when the file is
    missing or unreadable (a store written before the history existed). Entries whose folder was pruned are
    dropped; a `current` switched by hand to an earlier entry cuts the history there."""
    current, previous = read_pointer(root, "current"), read_pointer(root, "previous")
    try:
        with open(os.path.join(root, "history"), "rb") as f:
            history = [h for h in json.loads(f.read().decode("utf-8")) if isinstance(h, str)]
    except (OSError, ValueError):
        history = [h for h in (previous,) if h]
    history = [h for h in history if os.path.isdir(os.path.join(root, "bundles", h))]
    if current and current in history:  # `current` switched by hand to an earlier bundle: as a rollback would
        history = history[:len(history) - history[::-1].index(current)]
    elif current:
        history.append(current)
    return history


def write_history(root, history):
    """Save the history and make `current` / `previous` its last two entries."""
    write_atomic(os.path.join(root, "history"), (json.dumps(history) + "\n").encode("utf-8"))
    set_pointer(root, "previous", history[-2] if len(history) > 1 else None)
    set_pointer(root, "current", history[-1] if history else None)
    fsync_dir(root)


def touch(root, bundle_id):
    now = time.time()
    os.utime(os.path.join(root, "bundles", bundle_id), (now, now))


def activate(root, bundle_id, keep):
    """Make bundles/ID current (the history gains it), prune to `keep` besides current and previous, collect
    garbage. Caller holds the lock. Returns {"previous", "removed", "freed", "replaced_mtime"} (the activation
    time the bundle had before: what `undo` gives back)."""
    history = read_history(root)
    old = history[-1] if history else None
    if old != bundle_id:
        history.append(bundle_id)
    write_history(root, history)
    replaced = os.stat(os.path.join(root, "bundles", bundle_id)).st_mtime
    touch(root, bundle_id)
    removed = prune_bundles(root, keep, {bundle_id, history[-2] if len(history) > 1 else None})
    if removed:
        write_history(root, [h for h in history if h not in removed])
    return {"previous": old, "removed": removed, "freed": collect_garbage(root), "replaced_mtime": replaced}


def op_stage(root, bundle_id, fresh, keep, *items):
    """Stage bundles/ID; with KEEP >= 0 and no corrupt object, switch to it as well (one lock, one process)."""
    check_id(bundle_id)
    pairs = parse_items(items)
    fresh = set(s for s in fresh.split(",") if s)
    keep = int(keep)
    check_layout(root)  # before the lock, which would create ROOT/.lock
    with Lock(root):
        answer = stage(root, bundle_id, pairs, fresh)
        if keep >= 0 and not answer["corrupt"]:
            answer.update(activate(root, bundle_id, keep))
    emit(answer)


def op_switch(root, bundle_id, keep):
    check_id(bundle_id)
    keep = int(keep)
    check_layout(root)
    with Lock(root):
        if not os.path.isdir(os.path.join(root, "bundles", bundle_id)):
            raise AgentError("no bundle %s under %s" % (bundle_id, os.path.join(root, "bundles")))
        answer = activate(root, bundle_id, keep)
    answer["current"] = bundle_id
    emit(answer)


def step_back(root, history, retouch=True):
    """Drop the current bundle from `history`; re-hash the one before it and make it current (a new activation
    time unless `retouch` is False). Returns it."""
    current = history.pop()
    if not history:
        raise AgentError("nothing to roll back to: %s has no bundle activated before %s" % (root, current))
    target = history[-1]
    check_bundle(root, target)
    write_history(root, history)
    if retouch:
        touch(root, target)
    return target


def op_rollback(root, bundle_id=""):
    if not os.path.isdir(os.path.join(root, "bundles")):  # before the lock, which would create ROOT/.lock
        raise AgentError("nothing to roll back to: no bundles under %s (is --remote-dir right? see --status)" % root)
    check_layout(root)
    with Lock(root):
        history = read_history(root)
        current = history[-1] if history else None
        if bundle_id:
            check_id(bundle_id)
            if bundle_id == current:
                raise AgentError("bundle %s is already active" % bundle_id)
            check_bundle(root, bundle_id)
            history.append(bundle_id)
            write_history(root, history)
            touch(root, bundle_id)
            target = bundle_id
        else:
            if not current:
                raise AgentError("nothing to roll back to: %s has no active bundle" % root)
            target = step_back(root, history)
    emit({"current": target, "previous": current, "history": read_history(root)})


def op_undo(root, bundle_id, mtime=""):
    """Take back the activation of ID (a failed health check): step back, or leave no bundle current."""
    check_id(bundle_id)
    mtime = float(mtime) if mtime else None
    check_layout(root)
    with Lock(root):
        history = read_history(root)
        current = history[-1] if history else None
        if current != bundle_id:
            raise AgentError("bundle %s is not current (%s is): another deploy switched it; not touching it"
                             % (bundle_id, current))
        if len(history) > 1:
            target = step_back(root, history, retouch=False)
        else:
            write_history(root, [])
            target = None
        if mtime is not None:
            os.utime(os.path.join(root, "bundles", bundle_id), (mtime, mtime))
    emit({"current": target, "previous": bundle_id})
