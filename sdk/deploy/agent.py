"""Device-side helper of `colibri-sdk deploy`: the whole store logic that runs ON the device.

The deploying machine runs this file's source as `python3 -c SOURCE OP ARG...` over SSH, with every argument
quoted by `shlex.quote`; paths travel as argv entries and are never seen by a shell. Standard library only, and
Python 3.8 compatible (JetPack 5 ships 3.8, JetPack 6 ships 3.10): nothing needs installing on the device.

Layout under ROOT (the --remote-dir):

    ROOT/store/<sha256>            one read-only file per distinct content, stored only after its sha256 was
                                   computed on the device and matched
    ROOT/store/<sha256>.partial    an upload in progress; a later upload resumes by appending from its size
    ROOT/bundles/<id>/...          a bundle folder: hard links into the store; <id> = first 16 hex digits of
                                   the sha256 of the bundle's manifest.json
    ROOT/current -> bundles/<id>   the active bundle; replaced by rename(2) of a new symlink (atomic)
    ROOT/previous -> bundles/<id>  the bundle that was active before; `rollback` swaps the two
    ROOT/.lock                     flock(2) held while a bundle folder is staged or a pointer is switched

Operations (each prints exactly one JSON object on stdout):

    plan ROOT SHA:SIZE...           create the folders; for each object: stored / partial (with offset) / missing;
                                    free bytes of the file system
    receive ROOT (SHA SIZE OFFSET)...
                                    for each object in turn, append SIZE - OFFSET bytes of stdin to
                                    store/SHA.partial (splice(2) where possible) while a second thread hashes
                                    the whole file, read back as it grows; on a match fsync and rename it to
                                    store/SHA, on a mismatch delete it
    stage ROOT ID FRESH KEEP SHA:PATH...
                                    build bundles/ID from store objects and hash every file of it, except the
                                    objects listed in FRESH (comma-separated, hashed by `receive` this session);
                                    a corrupt object is deleted and reported, nothing is switched; otherwise,
                                    with KEEP > 0, `switch` follows at once
    switch ROOT ID KEEP             point `current` at bundles/ID (and `previous` at the old one), keep the KEEP
                                    newest bundles plus current and previous, delete store objects no bundle uses
    rollback ROOT [ID]              re-hash bundles/ID (default: `previous`) against its manifest, then switch
    status ROOT                     the bundles, pointers, store and free space; a bundle's "files" counts the
                                    files its manifest lists (manifest.json besides), its "bytes" all of them

Errors from the operating system print {"error": {"errno": NAME, "path": PATH, "message": TEXT}} and exit 3.
"""

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time

CHUNK = 1 << 20
FLUSH_BYTES = 32 << 20
HEX = set("0123456789abcdef")


class AgentError(Exception):
    """A refusal that is not an OSError (bad argument, corrupt bundle); printed as errno "EINVAL"."""


def emit(obj):
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def root_dir(arg):
    return os.path.abspath(os.path.expanduser(arg))


def check_sha(sha):
    if len(sha) != 64 or not set(sha) <= HEX:
        raise AgentError("not a lowercase sha256 hex digest: %r" % (sha,))
    return sha


def check_rel(path):
    """A bundle-relative posix path: no absolute path, no '..', no empty or control-character parts."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise AgentError("unsafe bundle path %r: must be relative without '.', '..' or empty parts" % (path,))
    if any(ord(c) < 32 for c in path):
        raise AgentError("unsafe bundle path %r: control characters are not allowed" % (path,))
    return parts


def check_id(bundle_id):
    if not bundle_id or not set(bundle_id) <= HEX:
        raise AgentError("not a bundle id (hex digits): %r" % (bundle_id,))
    return bundle_id


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_fd(fd, length):
    h = hashlib.sha256()
    offset = 0
    while offset < length:
        block = os.pread(fd, min(CHUNK, length - offset), offset)
        if not block:
            break
        h.update(block)
        offset += len(block)
    return h, offset


def hash_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        h, _ = hash_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return h.hexdigest()


class Lock:
    """flock(2) on ROOT/.lock, waiting up to `timeout` seconds."""

    def __init__(self, root, timeout=60.0):
        self.path = os.path.join(root, ".lock")
        self.timeout = timeout
        self.fd = None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AgentError("another deploy holds %s for more than %.0f s" % (self.path, self.timeout))
                time.sleep(0.1)

    def __exit__(self, *exc):
        os.close(self.fd)


def make_dirs(root):
    if os.path.lexists(root) and not os.path.isdir(root):
        raise OSError(errno.ENOTDIR, "the remote dir exists but is not a folder", root)
    for sub in ("", "store", "bundles"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)


def free_bytes(root):
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def op_plan(root, *items):
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
    emit({"root": root, "free": free_bytes(root), "objects": objects})


def op_receive(root, *triples):
    """Receive objects back to back on stdin: for each SHA SIZE OFFSET, exactly SIZE - OFFSET bytes."""
    if not triples or len(triples) % 3:
        raise AgentError("receive needs SHA SIZE OFFSET triples, got %r" % (triples,))
    try:  # a 1 MiB pipe (Linux F_SETPIPE_SZ) halves the reads per byte; optional
        fcntl.fcntl(0, getattr(fcntl, "F_SETPIPE_SZ", 1031), CHUNK)
    except OSError:
        pass
    results = {}
    for i in range(0, len(triples), 3):
        sha, size, offset = check_sha(triples[i]), int(triples[i + 1]), int(triples[i + 2])
        results[sha] = receive_one(root, sha, size, offset)
        if results[sha]["status"] == "short":
            break
    emit({"objects": results})


def read_block(limit):
    """Up to `limit` bytes of stdin (fewer only at end of input), gathered from as many reads as it takes."""
    buf = bytearray(limit)
    view = memoryview(buf)
    got = 0
    while got < limit:
        n = os.readv(0, [view[got:]])
        if n == 0:
            break
        got += n
    return view[:got]


class Hasher(threading.Thread):
    """Hashes a file as it grows, reading back what was written (from the page cache), and flushes it to disk
    (fdatasync every FLUSH_BYTES), beside the receiving loop: neither waits for the other, and the final fsync
    finds little left to write. `advance(n)` says the first n bytes are written."""

    def __init__(self, fd, h, start):
        threading.Thread.__init__(self, daemon=True)
        self.fd, self.h = fd, h
        self.hashed = self.available = start
        self.done = False
        self.error = None
        self.cond = threading.Condition()

    def advance(self, available):
        with self.cond:
            self.available = available
            self.cond.notify()

    def run(self):
        unflushed = 0
        try:
            while True:
                with self.cond:
                    while self.available == self.hashed and not self.done:
                        self.cond.wait()
                    end, done = self.available, self.done
                if end == self.hashed and done:
                    return
                while self.hashed < end:
                    block = os.pread(self.fd, min(CHUNK, end - self.hashed), self.hashed)
                    if not block:
                        raise OSError(errno.EIO, "file shorter than written", "")
                    self.h.update(block)
                    self.hashed += len(block)
                    unflushed += len(block)
                if unflushed >= FLUSH_BYTES:
                    os.fdatasync(self.fd)
                    unflushed = 0
        except OSError as exc:
            self.error = exc

    def finish(self):
        with self.cond:
            self.done = True
            self.cond.notify()
        self.join()
        if self.error is not None:
            raise self.error


def copy_stdin(fd, count, use_splice):
    """Move up to `count` bytes from stdin to fd at its offset: splice(2) (no copy through Python) when stdin
    is a pipe and Python has os.splice (3.10+), else read + write. Returns the bytes moved (0 at end of input)."""
    if use_splice[0]:
        try:
            return os.splice(0, fd, count)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            use_splice[0] = False  # stdin is not a pipe, or the file system refuses splice
    block = read_block(count)
    view = block
    while view:
        written = os.write(fd, view)
        view = view[written:]
    return len(block)


def receive_one(root, sha, size, offset):
    final = os.path.join(root, "store", sha)
    partial = final + ".partial"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentError("another deploy is uploading %s" % partial)
        current = os.fstat(fd).st_size
        if current < offset:
            raise AgentError("%s holds %d bytes, fewer than the resume offset %d" % (partial, current, offset))
        if current > offset:
            os.ftruncate(fd, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        h = hashlib.sha256()
        hasher = Hasher(fd, h, 0)
        hasher.start()
        hasher.advance(offset)  # the part already there from an interrupted upload is hashed too
        received = offset
        use_splice = [hasattr(os, "splice")]
        try:
            while received < size:
                moved = copy_stdin(fd, min(CHUNK, size - received), use_splice)
                if not moved:
                    break
                received += moved
                hasher.advance(received)
        finally:
            hasher.finish()
        if received != size:
            return {"status": "short", "size": received}
        os.fsync(fd)
    finally:
        os.close(fd)
    digest = h.hexdigest()
    if digest != sha:
        os.unlink(partial)
        return {"status": "mismatch", "sha256": digest, "size": received}
    os.chmod(partial, 0o444)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(final))
    return {"status": "stored"}


def parse_items(items):
    pairs = []
    for item in items:
        sha, path = item.split(":", 1)
        check_rel(path)
        pairs.append((check_sha(sha), path))
    return pairs


def verify_tree(folder, pairs, skip):
    """sha256 of every file of `folder` against `pairs`; returns the list of mismatching (sha, path)."""
    bad = []
    for sha, path in pairs:
        if sha in skip:
            continue
        full = os.path.join(folder, *path.split("/"))
        if not os.path.isfile(full) or hash_file(full) != sha:
            bad.append((sha, path))
    return bad


def op_stage(root, bundle_id, fresh, keep, *items):
    """Stage bundles/ID; with KEEP > 0 and no corrupt object, switch to it as well (one lock, one process)."""
    check_id(bundle_id)
    pairs = parse_items(items)
    fresh = set(s for s in fresh.split(",") if s)
    keep = int(keep)
    with Lock(root):
        answer = stage(root, bundle_id, pairs, fresh)
        if keep > 0 and not answer["corrupt"]:
            answer["previous"] = switch(root, bundle_id)
            answer["removed"], answer["freed"] = prune(root, keep)
    emit(answer)


def stage(root, bundle_id, pairs, fresh):
    """Build and verify bundles/ID; caller holds the lock. Returns {"path", "reused", "corrupt"}."""
    bundles = os.path.join(root, "bundles")
    final = os.path.join(bundles, bundle_id)
    for name in os.listdir(bundles):
        if name.startswith((".staging-", ".trash-")):
            shutil.rmtree(os.path.join(bundles, name), ignore_errors=True)
    if os.path.isdir(final):
        bad = verify_tree(final, pairs, skip=())
        if not bad:
            return {"path": final, "reused": True, "corrupt": []}
        # A corrupt bundle folder shares its inodes with the store: drop both; the next stage rebuilds it.
        for sha, _ in bad:
            remove_quietly(os.path.join(root, "store", sha))
        os.rename(final, os.path.join(bundles, ".trash-%s-%d" % (bundle_id, os.getpid())))
        return {"path": final, "reused": False, "corrupt": sorted(set(s for s, _ in bad))}
    staging = os.path.join(bundles, ".staging-%s-%d" % (bundle_id, os.getpid()))
    missing = []
    for sha, path in pairs:
        target = os.path.join(staging, *path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(os.path.join(root, "store", sha), target)
        except FileNotFoundError:
            missing.append(sha)
    bad = verify_tree(staging, [p for p in pairs if p[0] not in missing], skip=fresh)
    corrupt = sorted(set(missing) | set(s for s, _ in bad))
    if corrupt:
        for sha in corrupt:
            remove_quietly(os.path.join(root, "store", sha))
        shutil.rmtree(staging)
        return {"path": final, "reused": False, "corrupt": corrupt}
    os.rename(staging, final)
    fsync_dir(bundles)
    return {"path": final, "reused": False, "corrupt": []}


def remove_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_pointer(root, name):
    """The bundle id a pointer names, or None."""
    try:
        return os.path.basename(os.readlink(os.path.join(root, name)))
    except FileNotFoundError:
        return None


def set_pointer(root, name, bundle_id):
    tmp = os.path.join(root, ".%s.tmp-%d" % (name, os.getpid()))
    remove_quietly(tmp)
    os.symlink(os.path.join("bundles", bundle_id), tmp)
    os.replace(tmp, os.path.join(root, name))


def switch(root, bundle_id):
    """Point current at bundles/ID; the old current becomes previous. Caller holds the lock."""
    old = read_pointer(root, "current")
    if old != bundle_id:
        if old is not None:
            set_pointer(root, "previous", old)
        set_pointer(root, "current", bundle_id)
        fsync_dir(root)
    now = time.time()
    os.utime(os.path.join(root, "bundles", bundle_id), (now, now))
    return old


def list_bundles(root):
    """Bundle folders, newest activation first: (id, mtime)."""
    bundles = os.path.join(root, "bundles")
    rows = []
    for name in os.listdir(bundles):
        full = os.path.join(bundles, name)
        if not name.startswith(".") and os.path.isdir(full):
            rows.append((name, os.stat(full).st_mtime))
    rows.sort(key=lambda r: r[1], reverse=True)
    return rows


def prune(root, keep):
    """Keep the `keep` newest bundles plus current and previous; delete store objects no bundle links to."""
    protected = {read_pointer(root, "current"), read_pointer(root, "previous")}
    removed = []
    for index, (name, _) in enumerate(list_bundles(root)):
        if index >= keep and name not in protected:
            shutil.rmtree(os.path.join(root, "bundles", name))
            removed.append(name)
    store = os.path.join(root, "store")
    freed = 0
    for name in os.listdir(store):
        full = os.path.join(store, name)
        if len(name) == 64 and set(name) <= HEX:
            st = os.stat(full)
            if st.st_nlink == 1:
                os.unlink(full)
                freed += st.st_size
    return removed, freed


def op_switch(root, bundle_id, keep):
    check_id(bundle_id)
    keep = int(keep)
    with Lock(root):
        if not os.path.isdir(os.path.join(root, "bundles", bundle_id)):
            raise AgentError("no bundle %s under %s" % (bundle_id, os.path.join(root, "bundles")))
        old = switch(root, bundle_id)
        removed, freed = prune(root, keep)
    emit({"current": bundle_id, "previous": old, "removed": removed, "freed": freed})


def manifest_pairs(folder):
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        raw = f.read()
    files = json.loads(raw.decode("utf-8"))["files"]
    return hashlib.sha256(raw).hexdigest(), [(check_sha(e["sha256"]), e["path"]) for e in files]


def op_rollback(root, bundle_id=""):
    if not os.path.isdir(os.path.join(root, "bundles")):  # before the lock, which would create ROOT/.lock
        raise AgentError("nothing to roll back to: no bundles under %s (is --remote-dir right? see --status)" % root)
    with Lock(root):
        current = read_pointer(root, "current")
        target = bundle_id or read_pointer(root, "previous")
        if not target:
            raise AgentError("nothing to roll back to: %s has no previous bundle" % root)
        check_id(target)
        folder = os.path.join(root, "bundles", target)
        if not os.path.isdir(folder):
            raise AgentError("no bundle %s under %s (see --status)" % (target, os.path.join(root, "bundles")))
        if target == current:
            raise AgentError("bundle %s is already active" % target)
        manifest_sha, pairs = manifest_pairs(folder)
        for _, path in pairs:
            check_rel(path)
        bad = verify_tree(folder, pairs, skip=())
        if not manifest_sha.startswith(target) or bad:
            names = ["manifest.json"] if not manifest_sha.startswith(target) else [p for _, p in bad]
            raise AgentError("bundle %s is corrupt (%s): not switching to it" % (target, ", ".join(names)))
        old = switch(root, target)
    emit({"current": target, "previous": old})


def op_status(root):
    if not os.path.isdir(os.path.join(root, "bundles")):
        emit({"root": root, "exists": False, "bundles": []})
        return
    rows = []
    for name, mtime in list_bundles(root):
        folder = os.path.join(root, "bundles", name)
        row = {"id": name, "activated": mtime, "files": 0, "bytes": 0, "manifest": {}}
        try:
            with open(os.path.join(folder, "manifest.json"), "rb") as f:
                raw = f.read()
            manifest = json.loads(raw.decode("utf-8"))
            row["files"] = len(manifest.get("files", []))  # the files the manifest lists, besides itself
            row["bytes"] = len(raw) + sum(int(e.get("size", 0)) for e in manifest.get("files", []))
            row["manifest"] = {k: manifest.get(k) for k in ("sdk_version", "arch", "dtype", "shape")}
        except (OSError, ValueError, KeyError) as exc:
            row["error"] = str(exc)
        rows.append(row)
    store = os.path.join(root, "store")
    partial = [n for n in os.listdir(store) if n.endswith(".partial")]
    emit({
        "root": root,
        "exists": True,
        "current": read_pointer(root, "current"),
        "previous": read_pointer(root, "previous"),
        "bundles": rows,
        "store_objects": len(os.listdir(store)) - len(partial),
        "store_bytes": sum(os.path.getsize(os.path.join(store, n)) for n in os.listdir(store)),
        "partial": len(partial),
        "free": free_bytes(root),
    })


OPS = {"plan": op_plan, "receive": op_receive, "stage": op_stage, "switch": op_switch,
       "rollback": op_rollback, "status": op_status}


def main(argv):
    if len(argv) < 2 or argv[0] not in OPS:
        emit({"error": {"errno": "EINVAL", "path": "", "message": "usage: OP ROOT ARG... with OP in %s" % sorted(OPS)}})
        return 2
    try:
        OPS[argv[0]](root_dir(argv[1]), *argv[2:])
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        emit({"error": {"errno": name, "path": exc.filename or "", "message": exc.strerror or str(exc)}})
        return 3
    except (AgentError, ValueError, KeyError) as exc:
        emit({"error": {"errno": "EINVAL", "path": "", "message": str(exc)}})
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
