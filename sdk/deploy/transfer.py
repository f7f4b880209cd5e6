"""Uploading store objects: incremental, resumable, verified on the device, several streams at once.

Objects are streamed through exec channels into the agent's `receive` (agent.py), which appends each to
`store/<sha256>.partial` from the offset the plan found there and hashes the whole file on the device; only a
match is renamed to `store/<sha256>`. Large objects get a channel each (largest first, `streams` channels at
once on the one SSH connection); small ones (< 4 MB) share one channel back to back, so a bundle of many small
kernels costs one remote command, not one per file. A plain byte stream (no SFTP request/acknowledge round
trips) is what lets paramiko keep up with `scp` (see bench/deploy_bench.py).

Every byte is hashed on the device: it keeps an object only when the sha256 of what it stored is the name the
manifest gives it. The bytes read here to be sent are not hashed as well (on a 2-core machine that pass took CPU
from the cipher: bench/deploy_bench.py); a thread reads each file ahead of the sender (`HashingReader`). Only
when the device reports a mismatch is the local file hashed (`rehash`): one that differs from the manifest is a
bundle changed on this machine (BundleError, nothing sent again); one that matches was damaged on the way and is
sent once more from byte 0, hashed from the reads that send it this time, and a second mismatch raises
ChecksumMismatchError. Every read stops at the manifest's size and refuses a file that is now shorter or longer,
a link, a device or a FIFO (local_bundle.exact_blocks: a BundleError), so a file changed after the bundle's check
is never sent past its size, never blamed on the device and never read without end.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from .connection import close_quietly
from .errors import ChecksumMismatchError, DeployError, RemoteCommandError, RemoteTimeoutError
# read_chunks is looked up here by HashingReader at each read, so a test can put a reader of its own in its place.
from .local_bundle import BundleFile, check_digest, exact_blocks, read_chunks, rehash
from .remote import RemoteAgent

CHUNK_BYTES = 1 << 20
SMALL_BYTES = 4 << 20  # objects below this share one channel
READ_AHEAD = 8  # blocks a HashingReader holds ready for the sender


@dataclass
class Upload:
    """One object to send: the local file and the byte offset to resume from."""

    file: BundleFile
    offset: int = 0


@dataclass
class UploadReport:
    """What was sent. `bytes_sent` counts payload bytes written to the SSH channels."""

    bytes_sent: int = 0
    sent: list = field(default_factory=list)      # paths of the objects stored
    resumed: list = field(default_factory=list)   # paths resumed from a .partial
    retried: list = field(default_factory=list)   # paths sent again after a mismatch
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n


class HashingReader:
    """The blocks of `file` (a BundleFile) from `offset` to its manifest size (local_bundle.exact_blocks: a file
    changed in size, a link, a device or a FIFO is a BundleError raised to the consumer), read by a thread up to
    READ_AHEAD blocks ahead of the consumer (file reads release the GIL, so reading overlaps the sending). With
    `hashing`, `digest` is the sha256 of the whole file, bytes before `offset` included, once every block was taken
    (else it stays None). `close()` stops the thread early."""

    _END = object()

    def __init__(self, file: BundleFile, offset: int, chunk: int = CHUNK_BYTES, hashing: bool = True):
        self.file, self.offset, self.chunk = file, offset, chunk
        self.path = file.local
        self.digest = None
        self.blocks = queue.Queue(READ_AHEAD)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(hashing,), name="read-hash", daemon=True)
        self.thread.start()

    def _read(self, hashing: bool) -> None:
        h = hashlib.sha256() if hashing else None
        try:
            at = 0 if hashing else self.offset  # a hash needs the bytes before `offset` too
            for block in exact_blocks(self.file, at, self.chunk, read_chunks):
                if h is not None:
                    h.update(block)
                if at + len(block) > self.offset:
                    self._put(block[max(0, self.offset - at):])
                at += len(block)
                if self.closed.is_set():
                    return
            self.digest = h.hexdigest() if h is not None else None
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer: it raises it
            self._put(exc)

    def _put(self, item) -> None:
        while not self.closed.is_set():
            try:
                self.blocks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        while True:
            item = self.blocks.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.closed.set()


def batches(uploads: list) -> list:
    """Group uploads into channel loads: each large object alone (largest first), then all small ones."""
    large = sorted((u for u in uploads if u.file.size - u.offset >= SMALL_BYTES),
                   key=lambda u: u.file.size - u.offset, reverse=True)
    small = [u for u in uploads if u.file.size - u.offset < SMALL_BYTES]
    return [[u] for u in large] + ([small] if small else [])


class Uploader:
    """Sends store objects to one device.

    Args:
        agent: the device's RemoteAgent.
        streams: channels used at once (>= 1).
        progress: called with a byte count after each block is handed to SSH (thread-safe callable), or None.
        stop: an Event that stops every stream after its current block when set (the deploy was interrupted);
            the uploader also sets it when one stream fails. None for one of its own.
    """

    def __init__(self, agent: RemoteAgent, streams: int = 2, progress=None, stop: threading.Event | None = None):
        self.agent = agent
        self.streams = max(1, int(streams))
        self.progress = progress
        self.stop = stop if stop is not None else threading.Event()

    def upload(self, uploads: list) -> UploadReport:
        """Send every Upload; returns the report. Raises the first error any stream hit (the others stop)."""
        report = UploadReport()
        loads = batches(uploads)
        if not loads:
            return report
        with ThreadPoolExecutor(max_workers=min(self.streams, len(loads)), thread_name_prefix="upload") as pool:
            futures = [pool.submit(self._send_batch, batch, report) for batch in loads]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # Ctrl-C: stop the streams after their current block, then leave
                self._stop(futures)
                raise
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self._stop(futures)
                raise failed[0].exception()
        return report

    def _stop(self, futures) -> None:
        self.stop.set()
        for f in futures:
            f.cancel()

    def _send_batch(self, batch: list, report: UploadReport) -> None:
        if self.stop.is_set():
            return
        report.resumed += [u.file.path for u in batch if u.offset]
        answers = self._stream(batch, report)
        for upload in batch:
            answer = answers.get(upload.file.sha256, {})
            file = upload.file
            if answer.get("status") == "mismatch":
                check_digest(file, rehash(file))  # changed here: a BundleError, nothing sent again
                report.retried.append(file.path)
                digests = {}
                answer = self._stream([Upload(file, 0)], report, digests).get(file.sha256, {})
                check_digest(file, digests.get(file.sha256, file.sha256))  # changed while it was sent again
                if answer.get("status") == "mismatch":
                    raise ChecksumMismatchError(
                        f"{self.agent.label}: {file.path!r} arrived corrupted twice: the device computed sha256 "
                        f"{answer.get('sha256')}, the manifest says {file.sha256}")
            if answer.get("status") != "stored":
                raise RemoteCommandError(f"{self.agent.label}: upload of {file.path!r} ended early: the device "
                                         f"received {answer.get('size', 0)} of {file.size} bytes")
            report.sent.append(file.path)

    def _stream(self, batch: list, report: UploadReport, digests: dict | None = None) -> dict:
        """Send `batch` back to back on one channel; returns the agent's {sha256: answer}. With `digests`, the
        local sha256 of each object read to its end is put there (computed from the reads that send it)."""
        label = self.agent.label
        channel = self.agent.open_receive([(u.file.sha256, u.file.size, u.offset) for u in batch])
        reader = None
        try:
            for upload in batch:
                reader = HashingReader(upload.file, upload.offset, hashing=digests is not None)
                for block in reader:
                    if self.stop.is_set():
                        raise DeployError(f"{label}: upload of {upload.file.path!r} stopped (another stream failed, "
                                          f"or the deploy was interrupted); the active bundle was not changed")
                    try:
                        # A memoryview: paramiko's sendall slices off what each 32 KiB packet took, and the slice
                        # of a bytes block copies the rest of it (a 1 MiB block was copied 16 times over).
                        channel.sendall(memoryview(block))
                    except TimeoutError:
                        raise RemoteTimeoutError(f"{label}: upload of {upload.file.path!r} stalled for "
                                                 f"{self.agent.conn.target.command_timeout:g} s: "
                                                 f"{self.agent.what('receive')} took no bytes") from None
                    except (OSError, EOFError):
                        return self._finish(channel, batch)  # the agent exited (disk full, ...): ask why
                    report.add_bytes(len(block))
                    if self.progress is not None:
                        self.progress(len(block))
                if digests is not None:
                    digests[upload.file.sha256] = reader.digest
            return self._finish(channel, batch)
        finally:
            if reader is not None:
                reader.close()
            close_quietly(channel)  # a device that dropped the connection must not hide the error raised above

    def _finish(self, channel, batch) -> dict:
        # The agent hashes and fsyncs after the last byte: allow for that on top of the command timeout.
        timeout = self.agent.conn.target.command_timeout + sum(u.file.size for u in batch) / 50e6
        return self.agent.finish(channel, timeout)["objects"]
