"""The content-addressed store: `plan ROOT SHA:SIZE...` and garbage collection of unused objects."""

import os

from .common import HEX, check_sha, emit, free_bytes
from .layout import make_dirs


def op_plan(root, *items):
    """Create the folders (after layout.check_layout); for each object: stored / partial (with offset) /
    missing; the free bytes; and the runtime record (runtime.json) when `--install-runtime` wrote one."""
    make_dirs(root)
    objects = {}
    for item in items:
        sha, size = item.split(":", 1)
        sha, size = check_sha(sha), int(size)
        path = os.path.join(root, "store", sha)
        if os.path.isfile(path):
            if os.path.getsize(path) == size:
                objects[sha] = {"state": "stored", "offset": size}
                continue
            os.unlink(path)  # wrong size: corrupt, send it again
        partial = path + ".partial"
        offset = os.path.getsize(partial) if os.path.isfile(partial) else 0
        if offset > size:
            os.unlink(partial)
            offset = 0
        objects[sha] = {"state": "partial" if offset else "missing", "offset": offset}
    from .runtime import read_record

    emit({"root": root, "free": free_bytes(root), "objects": objects, "runtime": read_record(root)})


def collect_garbage(root):
    """Delete store objects no bundle folder (or wheel) links to; returns the bytes freed."""
    store = os.path.join(root, "store")
    freed = 0
    for name in os.listdir(store):
        full = os.path.join(store, name)
        if len(name) == 64 and set(name) <= HEX:
            st = os.stat(full)
            if st.st_nlink == 1:
                os.unlink(full)
                freed += st.st_size
    return freed
