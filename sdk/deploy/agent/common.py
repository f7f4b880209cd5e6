"""What every agent operation shares: the refusal type, the one-line JSON answer, argument checks, hashing,
fsync and the ROOT/.lock flock."""

import fcntl
import hashlib
import json
import os
import sys
import time

CHUNK = 1 << 20
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


def is_bundle_id(name):
    """Whether `name` is a bundle id as the store names its folders: 1 to 64 lowercase hex digits."""
    return 0 < len(name) <= 64 and set(name) <= HEX


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


def remove_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_atomic(path, data):
    """Replace `path` by `data` (bytes): a temporary file, fsync, rename(2)."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def free_bytes(root):
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


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
