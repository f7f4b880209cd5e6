"""Deploy tests run against a real OpenSSH server on 127.0.0.1 (see sshd_server.py); the 'device' is this
machine, so the tests look at the remote store directly on the local file system."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from timeout_support import guard

sys.path.insert(0, str(Path(__file__).parent))
from deploy_bundles import HOSTILE, copy_store, write_bundle  # noqa: E402
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


def loopback_target(sshd, known_hosts: Path):
    """The Target of the loopback sshd, trusting its host key through `known_hosts`; timeouts that only guard
    against hangs."""
    from colibri_sdk.deploy import Target

    return Target(host="127.0.0.1", user=sshd.user, port=sshd.port, identity=str(sshd.user_key),
                  known_hosts=str(known_hosts), connect_timeout=guard(60), command_timeout=guard(600))


@pytest.fixture
def target(sshd, known_hosts):
    return loopback_target(sshd, known_hosts)


@pytest.fixture(scope="session")
def shared_target(sshd, tmp_path_factory):
    """`target` with a known_hosts file of its own, for module fixtures that prepare device stores once."""
    path = tmp_path_factory.mktemp("shared_known_hosts") / "known_hosts"
    path.write_text(sshd.known_hosts_line())
    return loopback_target(sshd, path)


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "bundle_a")


@pytest.fixture
def device_dir(tmp_path):
    """The store root on the 'device': a path with spaces, quotes, `$`, backticks and $(...)."""
    return tmp_path / "remote" / HOSTILE


@pytest.fixture
def options(device_dir):
    from colibri_sdk.deploy import DeployOptions

    # The device's Python: this interpreter (sshd's PATH may not have a python3 with a working stdlib in CI).
    return DeployOptions(remote_dir=str(device_dir), keep=3, remote_python=sys.executable)


@pytest.fixture(scope="session")
def shared_bundle(tmp_path_factory):
    """shared_bundle(**write_bundle arguments): that bundle, written once per session (tests leave it as it is)."""
    made = {}

    def get(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = write_bundle(tmp_path_factory.mktemp("shared_bundle") / "bundle", **kwargs)
        return made[key]

    return get


@pytest.fixture(scope="session")
def deployed_stores(tmp_path_factory, shared_target):
    """deployed_stores(bundles, **DeployOptions fields) -> (store, [DeployResult of each bundle]): the store the
    real agent made by deploying `bundles` in turn (remote_python: this interpreter; keep 3 unless given), made once
    per session; tests start from a copy of it (`start_from`)."""
    from colibri_sdk.deploy import DeployOptions, deploy

    made = {}

    def get(bundles, **fields) -> tuple:
        key = (tuple(str(b) for b in bundles), tuple(sorted(fields.items())))
        if key not in made:
            root = tmp_path_factory.mktemp("deployed_store") / HOSTILE
            options = DeployOptions(remote_dir=str(root), **{"keep": 3, "remote_python": sys.executable, **fields})
            made[key] = root, [deploy(b, shared_target, options) for b in bundles]
        return made[key]

    return get


@pytest.fixture
def start_from(deployed_stores, device_dir):
    """start_from(bundles, **DeployOptions fields) -> [DeployResult of each bundle]: `device_dir` becomes a copy of
    the store those deploys made (deployed_stores), as if they had been made to it (a store records no path of its
    own; the results' remote_path names the original)."""

    def start(bundles, **fields) -> list:
        store, results = deployed_stores(bundles, **fields)
        copy_store(store, device_dir)
        return results

    return start


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


PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "orin.yaml"


def build(profile: Path, out: Path) -> Path:
    """A real bundle of the demo model for `profile` (NVRTC, no GPU), built with the library's build_bundle."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import load_profile

    return build_bundle(load_profile(profile), out).path


@pytest.fixture(scope="session")
def real_bundles(tmp_path_factory):
    """(bundle, same bundle rebuilt with gate_up/down block_n 32 instead of 64)."""
    root = tmp_path_factory.mktemp("real")
    first = build(PROFILE, root / "orin")
    import yaml

    profile = yaml.safe_load(PROFILE.read_text())
    profile["kernels"]["gate_up"]["block_n"] = 32
    profile["kernels"]["down"]["block_n"] = 32
    variant = root / "orin_bn32.yaml"
    variant.write_text(yaml.safe_dump(profile))
    return first, build(variant, root / "orin_bn32")
