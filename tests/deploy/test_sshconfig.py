"""~/.ssh/config as OpenSSH users expect (paramiko's SSHConfig): Host aliases, HostName, User, Port, IdentityFile,
ProxyJump; and what an authentication failure says when no key can be used. Against the real sshd on 127.0.0.1."""

from __future__ import annotations

import sys

import pytest
from deploy_bundles import remote_tree, write_bundle
from sshd_server import free_port, keygen

from colibri_sdk.cli import main
from colibri_sdk.deploy import AuthenticationError, ConnectError, Connection, DeployError
from colibri_sdk.deploy.sshconfig import load_config, resolve

pytestmark = pytest.mark.ssh


@pytest.fixture
def ssh_config(tmp_path, sshd):
    path = tmp_path / "ssh_config"
    dead = free_port()
    path.write_text(f"""
Host orin-line1
    HostName 127.0.0.1
    User {sshd.user}
    Port {sshd.port}
    IdentityFile {sshd.user_key}

Host jumpbox
    HostName 127.0.0.1
    User {sshd.user}
    Port {sshd.port}
    IdentityFile {sshd.user_key}

Host behind-the-jump
    HostName 127.0.0.1
    Port {sshd.port}
    User {sshd.user}
    IdentityFile {sshd.user_key}
    ProxyJump jumpbox

Host nothing-behind
    HostName 127.0.0.1
    Port {dead}
    User {sshd.user}
    ProxyJump jumpbox

Host *.line
    Port 2222

Host via-command
    ProxyCommand ssh -W %h:%p gateway
""")
    return path


def test_alias_resolves_hostname_user_port_and_identity(ssh_config, sshd):
    config = load_config(ssh_config)
    t = resolve("orin-line1", config)
    assert (t.host, t.user, t.port, t.identity, t.identities) == ("127.0.0.1", sshd.user, sshd.port, None,
                                                                  (str(sshd.user_key),))
    assert t.alias == "orin-line1" and t.proxy_jump is None
    # What the command line says wins: user@, :port, --port, -i.
    t = resolve("someone@orin-line1:2200", config, port=2300, identity="/k")
    assert (t.user, t.port, t.identity, t.identities) == ("someone", 2200, "/k", ())
    assert resolve("orin-line1", config, port=2300).port == 2300
    assert resolve("cam.line", config).port == 2222 and resolve("cam.line", config).host == "cam.line"
    assert resolve("elsewhere", config).port == 22
    with pytest.raises(DeployError, match="Host via-command uses ProxyCommand, which deploy does not run; use "
                                          "ProxyJump"):
        resolve("via-command", config)


def test_deploy_to_an_alias_from_the_config(tmp_path, ssh_config, known_hosts, device_dir, capsys):
    bundle = write_bundle(tmp_path / "a")
    assert main(["deploy", str(bundle), "--host", "orin-line1", "--ssh-config", str(ssh_config), "--known-hosts",
                 str(known_hosts), "--remote-dir", str(device_dir), "--remote-python", sys.executable, "-q"]) == 0
    assert capsys.readouterr().out.startswith("orin-line1: bundle ")
    assert remote_tree(device_dir / "current") == remote_tree(bundle)


def test_proxy_jump_goes_through_the_jump_host(ssh_config, known_hosts, sshd):
    t = resolve("behind-the-jump", load_config(ssh_config), known_hosts=str(known_hosts))
    assert t.proxy_jump is not None and (t.proxy_jump.host, t.proxy_jump.port) == ("127.0.0.1", sshd.port)
    with Connection(t) as conn:
        assert conn.jump is not None and conn.jump.client.get_transport().is_active()
        assert conn.run(["echo", "through"]).stdout == b"through\n"
    far = resolve("nothing-behind", load_config(ssh_config), known_hosts=str(known_hosts))
    with pytest.raises(ConnectError, match=rf"the jump host {sshd.user}@127.0.0.1:{sshd.port} cannot open a "
                                           rf"connection to 127.0.0.1:{far.port}"):
        Connection(far).open()


def test_inventory_hosts_resolve_through_the_config(tmp_path, ssh_config, sshd):
    from colibri_sdk.deploy import Target
    from colibri_sdk.deploy.inventory import load_inventory

    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("hosts:\n  - orin-line1\n  - {host: orin-line1, port: 2201, name: other-port}\n")
    hosts = load_inventory(inventory, Target(host="-"), config=load_config(ssh_config), port_given=False)
    assert [(h.name, h.target.host, h.target.user, h.target.port) for h in hosts] == [
        (f"{sshd.user}@127.0.0.1:{sshd.port}", "127.0.0.1", sshd.user, sshd.port),
        ("other-port", "127.0.0.1", sshd.user, 2201)]


def test_missing_config_given_explicitly_is_named(tmp_path):
    with pytest.raises(DeployError, match=f"--ssh-config {tmp_path / 'nope'}: no such file"):
        load_config(tmp_path / "nope")


def test_dev_null_and_an_empty_file_are_an_empty_config(tmp_path, sshd, known_hosts, device_dir, capsys):
    empty = tmp_path / "empty_config"
    empty.write_text("")
    for path in ("/dev/null", empty):  # OpenSSH's `ssh -F /dev/null`: no config at all
        config = load_config(path)
        assert resolve(f"{sshd.user}@127.0.0.1:{sshd.port}", config).host == "127.0.0.1"
    bundle = write_bundle(tmp_path / "b")
    assert main(["deploy", str(bundle), "--host", f"{sshd.user}@127.0.0.1:{sshd.port}", "--ssh-config", "/dev/null",
                 "--identity", str(sshd.user_key), "--known-hosts", str(known_hosts), "--remote-dir",
                 str(device_dir), "--remote-python", sys.executable, "--quiet"]) == 0
    assert remote_tree(device_dir / "current") == remote_tree(bundle)
    with pytest.raises(DeployError, match=f"--ssh-config {tmp_path}: a folder; expected an OpenSSH client config"):
        load_config(tmp_path)


@pytest.mark.parametrize("port", ["\u00b2", "\u0663"])  # "²": int() refuses it; "٣" (Arabic-Indic 3): int() gives 3
def test_a_port_of_non_ascii_digits_is_refused_in_one_line(tmp_path, port):
    config = tmp_path / "config"
    config.write_text(f"Host orin\n  Port {port}\n", encoding="utf-8")
    with pytest.raises(DeployError, match=f"Host orin: Port '{port}' is not a number from 1 to 65535"):
        resolve("orin", load_config(config))


def test_a_proxy_jump_hop_in_ssh_uri_form_is_read_as_openssh_reads_it(tmp_path):
    config = tmp_path / "config"
    config.write_text("Host orin\n  ProxyJump ssh://jumper@gateway:2222\n")
    jump = resolve("orin", load_config(config)).proxy_jump
    assert (jump.user, jump.host, jump.port) == ("jumper", "gateway", 2222)


def test_hosts_of_an_included_file_resolve(tmp_path):
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10-orin").write_text("Host orin\n  HostName 10.1.2.3\n  Port 2200\n")
    (tmp_path / "conf.d" / "20-loop").write_text(f"Include {tmp_path / 'config'}\n")  # a cycle: refused, not a hang
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path / 'conf.d' / '10-*'} {tmp_path / 'nothing-*'}\nHost other\n  Port 2201\n")
    target = resolve("orin", load_config(config))
    assert (target.host, target.port) == ("10.1.2.3", 2200)
    assert resolve("other", load_config(config)).port == 2201
    config.write_text(f"include = {tmp_path / 'conf.d' / '*'}\n")
    with pytest.raises(DeployError, match=r"Include nests more than 16 files deep"):
        load_config(config)


def test_a_fifo_or_a_device_as_the_config_is_refused_not_read(tmp_path):
    import os

    fifo = tmp_path / "config"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(DeployError, match=f"^--ssh-config {fifo}: a FIFO; expected an OpenSSH client config file"):
        load_config(fifo)
    with pytest.raises(DeployError, match="^--ssh-config /dev/zero: a device; expected"):  # would never end
        load_config("/dev/zero")


def test_no_usable_key_says_where_it_looked_and_names_dash_i(target, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with pytest.raises(AuthenticationError, match=r"no key to offer: looked in ssh-agent \(not running: "
                                                  r"SSH_AUTH_SOCK is not set\); ~/.ssh/id_\* \(none there\) and "
                                                  r"found none usable; pass the private key with -i KEY "
                                                  r"\(--identity\)"):
        Connection(target.with_(identity=None)).open()
    stranger = keygen(home / ".ssh" / "id_ed25519")  # a key the device does not know
    with pytest.raises(AuthenticationError, match=r"authentication failed .*; tried ssh-agent \(not running: "
                                                  r"SSH_AUTH_SOCK is not set\); ~/.ssh/id_\* \(~/.ssh/id_ed25519\)\. "
                                                  r"Is the public key in the device's ~/.ssh/authorized_keys\? "
                                                  r"Another key: -i KEY \(--identity\)"):
        Connection(target.with_(identity=None)).open()
    assert stranger.exists()
