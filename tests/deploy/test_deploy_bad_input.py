"""Bad input to `colibri-sdk deploy`, as a careless or hostile user gives it: every case is a typed error that
names the bad value and what is allowed, refused before anything on the device changes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from colibri_sdk.bundle import Bundle
from colibri_sdk.cli import main
from colibri_sdk.deploy import (
    AuthenticationError,
    DeployError,
    DeployOptions,
    LocalBundle,
    Target,
)
from colibri_sdk.deploy.connection import check_identity
from colibri_sdk.deploy.hostkeys import KnownHosts
from colibri_sdk.deploy.inventory import load_inventory
from colibri_sdk.errors import BundleError
from deploy_bundles import write_bundle


def run_cli(capsys, *argv) -> tuple[int, str]:
    """Exit status and the last line of stderr of `colibri-sdk deploy ARGV` (no traceback may escape)."""
    code = main(["deploy", *map(str, argv)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


# ---- [user@]host[:port] and the numbers around it ------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("@127.0.0.1", "host '@127.0.0.1': no user before '@'"),
    ("127.0.0.1:0", "host '127.0.0.1:0': port '0' is not a number from 1 to 65535"),
    ("127.0.0.1:70000", "host '127.0.0.1:70000': port '70000' is not a number from 1 to 65535"),
    ("127.0.0.1:-5", "host '127.0.0.1:-5': port '-5' is not a number from 1 to 65535"),
    ("127.0.0.1:", "host '127.0.0.1:': no port after ':'"),
    ("[::1", "host '[::1': expected [user@][ADDRESS]:PORT for an IPv6 address"),
    ("[::1]22", "host '[::1]22': expected [user@][ADDRESS]:PORT for an IPv6 address"),
    ("a b;rm -rf x", "host 'a b;rm -rf x': expected a host name or IP address"),
    ("orin\n01", "host 'orin\\n01': expected a host name or IP address"),
])
def test_bad_host_spec_is_refused(spec, message):
    with pytest.raises(DeployError, match=re.escape(message)):
        Target.parse(spec)


def test_ipv6_literals_parse():
    assert (Target.parse("u@[::1]:2222").host, Target.parse("u@[::1]:2222").port) == ("::1", 2222)
    assert Target.parse("fe80::1%eth0").host == "fe80::1%eth0"


@pytest.mark.parametrize("flag, value, message", [
    ("--port", "0", "port 0: expected a whole number from 1 to 65535"),
    ("--port", "70000", "port 70000: expected a whole number from 1 to 65535"),
    ("--timeout", "nan", "--timeout nan: expected a finite number of seconds > 0"),
    ("--connect-timeout", "0", "--connect-timeout 0.0: expected a finite number of seconds > 0"),
    ("--parallel", "0", "--parallel 0: must be at least 1"),
    ("--remote-dir", "", "--remote-dir '': expected a folder path on the device (default ~/colibri)"),
    ("--remote-dir", "/tmp/a\nb", "--remote-dir '/tmp/a\\nb': control characters"),
    # An empty --remote-python made the device's shell run "-c ..." and answer "-abefhkmnptuvxBCEHPT or -o option".
    ("--remote-python", "", "--remote-python '': expected a shell command"),
    ("--remote-colibri", " ", "--remote-colibri ' ': expected a shell command"),
])
def test_bad_numbers_and_remote_dir_exit_1_before_connecting(capsys, flag, value, message):
    # Port 9 on loopback: nothing listens; reaching it would be a connection error, not this message.
    code, line = run_cli(capsys, "--status", "--host", "127.0.0.1:9", flag, value)
    assert code == 1 and line.startswith(f"colibri-sdk deploy: error: {message}"), line


@pytest.mark.parametrize("to", ["../x", "$(id)", "", "ABCDEF0123456789", "0123456789abcdeg", "-h"])
def test_hostile_rollback_id_is_refused_before_connecting(capsys, to):
    code, line = run_cli(capsys, "--rollback", f"--to={to}", "--host", "127.0.0.1:9")
    assert code == 1
    assert line == (f"colibri-sdk deploy: error: --to {to!r}: a bundle id is lowercase hex digits (16, as --status "
                    f"lists them)")


def test_bundle_with_rollback_is_refused(capsys, tmp_path):
    code, line = run_cli(capsys, tmp_path, "--rollback", "--host", "127.0.0.1:9")
    assert code == 1 and "does not go with --rollback or --status" in line


# ---- --hosts inventory ---------------------------------------------------------------------------------------------
# The "billion laughs" YAML: nine levels of nine aliases each (9**9 leaves if expanded).
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{a}: &{a} [{', '.join([f'*{p}'] * 9)}]\n" for p, a in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text, message", [
    ("hosts:\n  - {host: a, port: abc}\n", "hosts[0]: port 'abc': expected a whole number from 1 to 65535"),
    ("hosts:\n  - {host: a, port: .inf}\n", "hosts[0]: port inf: expected a whole number from 1 to 65535"),
    ("hosts:\n  - {host: a, port: true}\n", "hosts[0]: port True: expected a whole number from 1 to 65535"),
    ("hosts:\n  - {host: a, port: 70000}\n", "port 70000: expected a whole number from 1 to 65535"),
    ("hosts:\n  - {host: [1, 2]}\n", "hosts[0]: host [1, 2]: expected a non-empty string"),
    ("hosts:\n  - {host: null}\n", "hosts[0]: host None: expected [user@]host[:port] as a string"),
    ("hosts:\n  - {host: a, identity: 5}\n", "hosts[0]: identity 5: expected a non-empty string"),
    ("hosts:\n  - {host: a, remote_dir: ''}\n", "hosts[0]: remote_dir '': expected a non-empty string"),
    ("hosts:\n  - {host: a, user: {x: 1}}\n", "hosts[0]: user {'x': 1}: expected a non-empty string"),
    ("hosts: [a, {host: a, name: b}]\n", "hosts[1] (b) is the same device and remote_dir as"),
    ("defaults: &d [[1, 2], [3]]\nhosts: [a]\n", "defaults must be a mapping, got [[1, 2], [3]]"),
])
def test_bad_inventory_field_is_named(tmp_path, text, message):
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    with pytest.raises(DeployError, match=re.escape(f"inventory {path}: ") + ".*" + re.escape(message)):
        load_inventory(path, Target("-"))


def test_an_inventory_that_is_a_fifo_or_a_device_is_refused_not_read(tmp_path):
    import os

    fifo = tmp_path / "inventory.yaml"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(DeployError, match=f"^inventory {fifo}: a FIFO; expected a YAML file$"):
        load_inventory(fifo, Target("-"))
    with pytest.raises(DeployError, match="^inventory /dev/zero: a device; expected a YAML file$"):
        load_inventory("/dev/zero", Target("-"))


def test_inventory_that_is_not_text_or_is_an_alias_bomb(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00hosts")
    with pytest.raises(DeployError, match=f"inventory {binary}: cannot read it \\('utf-8' codec can't decode"):
        load_inventory(binary, Target("-"))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB + "hosts: [*i]\n")
    with pytest.raises(DeployError, match=r"unknown key\(s\) \['a', 'b'"):  # refused in well under a second
        load_inventory(bomb, Target("-"))
    nested = "&a [x, x, x, x, x, x, x, x, x]"  # the same bomb inside hosts[0]: anchors defined where first used
    for prev, name in zip("abcdefgh", "bcdefghi"):
        nested = f"&{name} [{nested}, {', '.join([f'*{prev}'] * 8)}]"
    bomb.write_text(f"hosts: [{nested}]\n")
    with pytest.raises(DeployError, match=r"hosts\[0\] is \[\[\[\[\[\[.*\]; expected a string or a mapping"):
        load_inventory(bomb, Target("-"))


# ---- --identity and --known-hosts ----------------------------------------------------------------------------------
def keygen(path, *extra):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-C", "t", "-f", str(path), *extra], check=True,
                   stdin=subprocess.DEVNULL)
    return path


@pytest.mark.skipif(subprocess.run(["which", "ssh-keygen"], capture_output=True).returncode != 0,
                    reason="ssh-keygen not found (apt-get install openssh-client)")
def test_identity_that_is_not_a_usable_private_key(tmp_path):
    t = Target("h", user="u")
    key = keygen(tmp_path / "id", "-N", "")
    check_identity(t, str(key))  # a good one passes
    cases = [
        (tmp_path, f"identity {tmp_path} is a folder; expected a private key file"),
        (tmp_path / "nope", f"identity file {tmp_path / 'nope'} not found"),
        (tmp_path / "id.pub", f"identity file {tmp_path / 'id.pub'} is a public key; pass the private key"),
        (keygen(tmp_path / "enc", "-N", "secret-pass"), f"key {tmp_path / 'enc'} is encrypted; load it into ssh-agent"),
    ]
    garbage = tmp_path / "garbage"
    garbage.write_text("not a key\n")
    cases.append((garbage, f"identity file {garbage} is not a private key paramiko can read"))
    for path, message in cases:
        with pytest.raises(AuthenticationError, match=re.escape("u@h:22: " + message)):
            check_identity(t, str(path))


def test_known_hosts_that_is_a_folder_or_binary(tmp_path):
    from colibri_sdk.deploy import HostKeyError

    with pytest.raises(HostKeyError, match=f"known_hosts {tmp_path} is not a file \\(a folder\\?\\)"):
        KnownHosts(tmp_path)
    binary = tmp_path / "known_hosts"
    binary.write_bytes(b"\xff\xfe\x00 garbage\n")
    with pytest.raises(HostKeyError, match=f"cannot read known_hosts file {binary}: 'utf-8' codec"):
        KnownHosts(binary)


# ---- BUNDLE --------------------------------------------------------------------------------------------------------
def loader_error(path) -> str:
    """What the runtime's own loader says about `path` (deploy must refuse with exactly that)."""
    with pytest.raises(BundleError) as info:
        Bundle.open(path, verify=True)
    return str(info.value)


def test_bundle_that_is_a_file_or_missing(tmp_path):
    archive = tmp_path / "bundle.tar"
    archive.write_bytes(b"ustar")
    for path in (archive, tmp_path / "nope"):
        with pytest.raises(BundleError, match=re.escape(str(path))) as info:
            LocalBundle.open(path)
        assert str(info.value) == loader_error(path)


@pytest.mark.parametrize("change", [
    lambda m: m.update(files=5),
    lambda m: m["files"][0].update(path=5),
    lambda m: m["files"][0].update(sha256=None),
    lambda m: m["files"][0].update(size="20004"),
    lambda m: m["files"][0].update(size=-1),
    lambda m: m["files"][0].update(path=m["files"][0]["path"] + "/"),
    lambda m: m["files"][0].update(path=m["files"][0]["path"].replace("/", "//")),
    lambda m: m["files"].append(dict(m["files"][0])),
    lambda m: m["files"].clear(),
    lambda m: m.clear() or m.update(files=[]),  # {"files": []}: the manifest that once deployed
])
def test_malformed_manifest_is_refused_by_the_runtimes_loader(tmp_path, change):
    bundle = write_bundle(tmp_path / "b", model_bytes=100)
    manifest = json.loads((bundle / "manifest.json").read_text())
    change(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as info:
        LocalBundle.open(bundle)
    assert str(info.value) == loader_error(bundle)


def test_symlinked_file_is_refused_before_connecting(tmp_path):
    bundle = write_bundle(tmp_path / "b", model_bytes=100)
    outside = tmp_path / "outside.ptx"
    (bundle / "kernels" / "router.ptx").rename(outside)
    (bundle / "kernels" / "router.ptx").symlink_to(outside)  # same bytes, read from outside the folder
    with pytest.raises(BundleError, match="kernels/router.ptx") as info:
        LocalBundle.open(bundle)
    assert str(info.value) == loader_error(bundle)


def test_deploy_options_refuse_an_empty_remote_dir():
    with pytest.raises(DeployError, match="--remote-dir '  ': expected a folder path on the device"):
        DeployOptions(remote_dir="  ")


# ---- on the device -------------------------------------------------------------------------------------------------
@pytest.mark.ssh
def test_remote_dir_that_is_a_file_is_named_and_left_alone(tmp_path, sshd, known_hosts, capsys):
    afile = tmp_path / "not a folder"
    afile.write_text("keep me")
    common = ["--host", f"{sshd.user}@127.0.0.1:{sshd.port}", "--identity", sshd.user_key, "--known-hosts",
              known_hosts, "--remote-python", sys.executable, "--quiet"]
    code, line = run_cli(capsys, write_bundle(tmp_path / "b", model_bytes=100), *common, "--remote-dir", afile)
    assert code == 1
    assert line.endswith(f"plan in {str(afile)!r}: the remote dir exists but is not a folder {str(afile)!r} "
                         f"(ENOTDIR)"), line
    assert afile.read_text() == "keep me"
    code, line = run_cli(capsys, "--status", *common[:4], "--known-hosts", tmp_path, "--remote-dir", tmp_path / "d")
    assert code == 1 and line.endswith(f"known_hosts {tmp_path} is not a file (a folder?); expected a known_hosts "
                                       f"file, which need not exist yet"), line


def test_inventory_with_a_duplicate_key_is_refused(tmp_path):
    inventory = tmp_path / "lines.yaml"
    inventory.write_text("hosts:\n  - host: root@127.0.0.1\n    port: 22\n    port: 2222\n")
    with pytest.raises(DeployError, match=r"inventory .*lines\.yaml:4:5: duplicate key 'port' at line 4 \(first at line 3\)"):
        load_inventory(inventory, Target(host="127.0.0.1"))


def test_identity_and_known_hosts_that_are_a_fifo_or_a_device(tmp_path):
    import os

    from colibri_sdk.deploy import HostKeyError

    t = Target("h", user="u")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a device")):
        with pytest.raises(AuthenticationError, match=re.escape(
                f"u@h:22: identity {path} is {kind}; expected a private key file (a regular file, e.g. "
                f"~/.ssh/id_ed25519)")):
            check_identity(t, str(path))
        with pytest.raises(HostKeyError, match=re.escape(
                f"known_hosts {path} is {kind}; expected a known_hosts file (a regular file), which need not exist "
                f"yet")):
            KnownHosts(path)
