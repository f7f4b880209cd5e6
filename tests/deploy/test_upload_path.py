"""What the upload does per byte on this machine: one read, no sha256 (the device's decides), and blocks handed to
paramiko as memoryviews, whose slicing copies nothing; the SSH keys renegotiated every 4 GiB with AES."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

from colibri_sdk.deploy import Connection, transfer
from colibri_sdk.deploy.connection import REKEY_BYTES_128_BIT_BLOCK
from colibri_sdk.deploy.local_bundle import BundleFile


class RecordingChannel:
    def __init__(self):
        self.kinds, self.data = [], bytearray()

    def sendall(self, block):
        self.kinds.append(type(block))
        self.data += block

    def close(self):
        pass


class StoringAgent:
    """Stands in for RemoteAgent: takes every object and answers "stored"."""

    label = "fake@device:22"

    def __init__(self):
        self.conn = SimpleNamespace(target=SimpleNamespace(command_timeout=10.0))
        self.channel = RecordingChannel()
        self.shas = []

    def open_receive(self, objects):
        self.shas = [sha for sha, _, _ in objects]
        return self.channel

    def finish(self, channel, timeout):
        return {"objects": {sha: {"status": "stored"} for sha in self.shas}}


def test_sent_bytes_are_read_once_not_hashed_and_handed_over_as_memoryviews(tmp_path, monkeypatch):
    data = bytes(range(256)) * (3 * transfer.CHUNK_BYTES // 256 + 7)  # 3 full blocks and a part
    path = tmp_path / "model.colibri"
    path.write_bytes(data)
    file = BundleFile("model.colibri", hashlib.sha256(data).hexdigest(), len(data), Path(path))

    def no_hash(*args):
        raise AssertionError("the upload hashed a file the device stored")

    monkeypatch.setattr(transfer, "hashlib", SimpleNamespace(sha256=no_hash))
    monkeypatch.setattr(transfer, "rehash", no_hash)
    agent = StoringAgent()
    report = transfer.Uploader(agent, streams=1).upload([transfer.Upload(file, offset=5)])
    assert report.sent == ["model.colibri"] and report.bytes_sent == len(data) - 5
    assert bytes(agent.channel.data) == data[5:]
    assert agent.channel.kinds and set(agent.channel.kinds) == {memoryview}


def test_keys_are_renegotiated_every_4_gib_with_aes(target):
    with Connection(target) as conn:
        transport = conn.client.get_transport()
        assert transport.local_cipher == "aes128-gcm@openssh.com"
        assert transport.packetizer.REKEY_BYTES == REKEY_BYTES_128_BIT_BLOCK == 1 << 32
