"""Uploading store objects: incremental, resumable, verified on the device, several streams at once.

Objects are streamed through exec channels into the agent's `receive` (agent.py), which appends each to
`store/<sha256>.partial` from the offset the plan found there and hashes the whole file on the device; only a
match is renamed to `store/<sha256>`. Large objects get a channel each (largest first, `streams` channels at
once on the one SSH connection); small ones (< 4 MB) share one channel back to back, so a bundle of many small
kernels costs one remote command, not one per file. A plain byte stream (no SFTP request/acknowledge round
trips) is what lets paramiko keep up with `scp` (see bench/deploy_bench.py).

On a sha256 mismatch the local file is hashed again: if it no longer matches the manifest the bundle itself is
bad (BundleError); otherwise the object is sent once more from byte 0, and a second mismatch raises
ChecksumMismatchError.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from ..errors import BundleError
from .errors import ChecksumMismatchError, DeployError, RemoteCommandError, RemoteTimeoutError
from .local_bundle import BundleFile, rehash
from .remote import RemoteAgent

CHUNK_BYTES = 1 << 20
SMALL_BYTES = 4 << 20  # objects below this share one channel


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


def read_chunks(path, offset: int, chunk: int = CHUNK_BYTES):
    """The bytes of `path` from `offset` to the end, in blocks of at most `chunk` bytes."""
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(chunk):
            yield block


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
    """

    def __init__(self, agent: RemoteAgent, streams: int = 2, progress=None):
        self.agent = agent
        self.streams = max(1, int(streams))
        self.progress = progress
        self.stop = threading.Event()

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
                if rehash(file) != file.sha256:
                    raise BundleError(f"bundle file {file.path!r} changed on this machine: its sha256 no longer "
                                      f"matches the manifest ({file.sha256})")
                report.retried.append(file.path)
                answer = self._stream([Upload(file, 0)], report).get(file.sha256, {})
                if answer.get("status") == "mismatch":
                    raise ChecksumMismatchError(
                        f"{self.agent.label}: {file.path!r} arrived corrupted twice: the device computed sha256 "
                        f"{answer.get('sha256')}, the manifest says {file.sha256}")
            if answer.get("status") != "stored":
                raise RemoteCommandError(f"{self.agent.label}: upload of {file.path!r} ended early: the device "
                                         f"received {answer.get('size', 0)} of {file.size} bytes")
            report.sent.append(file.path)

    def _stream(self, batch: list, report: UploadReport) -> dict:
        """Send `batch` back to back on one channel; returns the agent's {sha256: answer}."""
        label = self.agent.label
        channel = self.agent.open_receive([(u.file.sha256, u.file.size, u.offset) for u in batch])
        try:
            for upload in batch:
                for block in read_chunks(upload.file.local, upload.offset):
                    if self.stop.is_set():
                        raise DeployError(f"{label}: upload of {upload.file.path!r} stopped: another stream failed")
                    try:
                        channel.sendall(block)
                    except TimeoutError:
                        raise RemoteTimeoutError(f"{label}: upload of {upload.file.path!r} stalled for "
                                                 f"{self.agent.conn.target.command_timeout:g} s") from None
                    except OSError:
                        return self._finish(channel, batch)  # the agent exited (disk full, ...): ask why
                    report.add_bytes(len(block))
                    if self.progress is not None:
                        self.progress(len(block))
            return self._finish(channel, batch)
        finally:
            channel.close()

    def _finish(self, channel, batch) -> dict:
        # The agent hashes and fsyncs after the last byte: allow for that on top of the command timeout.
        timeout = self.agent.conn.target.command_timeout + sum(u.file.size for u in batch) / 50e6
        return self.agent.finish(channel, timeout)["objects"]
