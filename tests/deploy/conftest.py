"""Deploy tests run against a real OpenSSH server on 127.0.0.1 (see sshd_server.py); the 'device' is this
machine, so the tests look at the remote store directly on the local file system."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sshd_server import SshServer, sshd_unavailable_reason  # noqa: E402


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A running sshd with an ed25519 host key; `.known_hosts_line()` trusts it."""
    reason = sshd_unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = SshServer.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def known_hosts(tmp_path, sshd):
    path = tmp_path / "known_hosts"
    path.write_text(sshd.known_hosts_line())
    return path


@pytest.fixture
def target(sshd, known_hosts):
    from colibri_sdk.deploy import Target

    return Target(host="127.0.0.1", user=sshd.user, port=sshd.port, identity=str(sshd.user_key),
                  known_hosts=str(known_hosts), connect_timeout=5.0, command_timeout=30.0)


def write_bundle(folder: Path, model_bytes: int = 3 << 20, kernel_seed: int = 0, model_seed: int = 0) -> Path:
    """A bundle folder per the bundle contract: manifest.json with the `files` list, a model.colibri of
    `model_bytes` random bytes (`model_seed`), two kernels (cubin + PTX, content from `kernel_seed`) and the
    self-test vectors."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(model_seed)
    contents = {"model.colibri": rng.integers(0, 256, model_bytes, dtype=np.uint8).tobytes()}
    krng = np.random.default_rng(1000 + kernel_seed)
    for name in ("moe_ffn", "router"):
        contents[f"kernels/{name}.sm_87.cubin"] = b"\x7fELF" + krng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
        contents[f"kernels/{name}.ptx"] = f"// {name} seed {kernel_seed}\n.version 8.0\n".encode() * 200
    contents["selftest/input.npy"] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    contents["selftest/output.npy"] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    files = []
    for rel, data in sorted(contents.items()):
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    manifest = {"schema_version": 1, "arch": "sm_87", "dtype": "fp16", "shape": {"batch": 1, "tokens": 8},
                "kernel_seed": kernel_seed, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    return folder


def remote_tree(root: Path) -> dict:
    """{relative path: sha256} of every regular file under `root` (the 'device' side, read locally)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "bundle_a")


HOSTILE = "dev ice's \"$HOME\" `id` $(id)"


@pytest.fixture
def device_dir(tmp_path):
    """The store root on the 'device': a path with spaces, quotes, `$`, backticks and $(...)."""
    return tmp_path / "remote" / HOSTILE


@pytest.fixture
def options(device_dir):
    from colibri_sdk.deploy import DeployOptions

    # The device's Python: this interpreter (sshd's PATH may not have a python3 with a working stdlib in CI).
    return DeployOptions(remote_dir=str(device_dir), keep=3, remote_python=sys.executable)


@pytest.fixture
def wire(monkeypatch):
    """Counts the bytes paramiko writes to its sockets (encrypted SSH packets), independent of our counters."""
    import paramiko.packet

    counter = {"bytes": 0}
    original = paramiko.packet.Packetizer.write_all

    def counting(self, out):
        counter["bytes"] += len(out)
        return original(self, out)

    monkeypatch.setattr(paramiko.packet.Packetizer, "write_all", counting)
    return counter


def local_files(bundle: Path) -> dict:
    """{relative path: sha256} of the bundle folder's files, hashed here from their bytes."""
    return {k: v for k, v in remote_tree(bundle).items()}
