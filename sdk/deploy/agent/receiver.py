"""`receive ROOT (SHA SIZE OFFSET)...`: store objects streamed back to back on stdin.

For each object in turn, SIZE - OFFSET bytes of stdin are appended to store/SHA.partial (splice(2) where
possible) while a second thread hashes the whole file, read back as it grows; on a match it is fsynced and renamed
to store/SHA (read-only), on a mismatch deleted. A later upload resumes a .partial by appending from its size.
"""

import errno
import fcntl
import hashlib
import os
import threading

from .common import CHUNK, AgentError, check_sha, emit, fsync_dir

FLUSH_BYTES = 32 << 20


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
