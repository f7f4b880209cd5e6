"""Host keys, authentication, refused connections, quoting and timeouts of remote commands."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import threading
import time

import pytest
from sshd_server import free_port, keygen
from timeout_support import guard

from colibri_sdk.deploy import (
    AuthenticationError,
    ConnectError,
    Connection,
    ConnectRefusedError,
    ConnectTimeoutError,
    HostKeyChangedError,
    HostKeyUnknownError,
    RemoteAnswerError,
    RemoteTimeoutError,
)
from colibri_sdk.deploy.connection import collect, command_line
from colibri_sdk.deploy.hostkeys import KnownHosts, remove_command

pytestmark = pytest.mark.ssh


def other_key_line(tmp_path, sshd, kind: str) -> str:
    pub = keygen(tmp_path / f"other_{kind}", kind).with_suffix(".pub").read_text().split()
    return f"[127.0.0.1]:{sshd.port} {pub[0]} {pub[1]}\n"


def test_known_host_connects_and_runs_a_command(target):
    with Connection(target) as conn:
        result = conn.run(["echo", "ok"])
    assert (result.exit_status, result.stdout) == (0, b"ok\n")


def test_unknown_host_is_refused(target, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyUnknownError, match=r"host \[127.0.0.1\]:\d+ is not in .*empty_known_hosts "
                                                  r"\(it offers ssh-ed25519 SHA256:"):
        Connection(target.with_(known_hosts=str(empty))).open()
    assert empty.read_text() == ""


def test_accept_new_host_key_stores_it_once_and_says_so(target, tmp_path, sshd, capsys, caplog):
    path = tmp_path / "new" / "known_hosts"
    caplog.set_level("INFO", logger="colibri_sdk")
    with Connection(target.with_(known_hosts=str(path), accept_new_host_key=True)) as conn:
        conn.run(["true"])
    assert path.read_text() == sshd.known_hosts_line()
    notices = [r.getMessage() for r in caplog.records if r.name.startswith("colibri_sdk")]
    assert notices == [f"Permanently added '[127.0.0.1]:{sshd.port}' (ED25519) to the list of known hosts ({path})"]
    assert capsys.readouterr().err == ""  # logged, not printed
    caplog.clear()
    with Connection(target.with_(known_hosts=str(path))) as conn:  # now known, no flag needed
        conn.run(["true"])
    assert path.read_text() == sshd.known_hosts_line()
    assert [r for r in caplog.records if r.name.startswith("colibri_sdk")] == []


def test_changed_key_of_same_type_is_refused_even_with_accept_new(target, tmp_path, sshd):
    path = tmp_path / "known_hosts"
    line = other_key_line(tmp_path, sshd, "ed25519")
    path.write_text(line)
    for accept in (False, True):
        with pytest.raises(HostKeyChangedError, match=r"has CHANGED: the server offers ssh-ed25519 SHA256:.*"
                                                      r"stores ssh-ed25519 SHA256:") as caught:
            Connection(target.with_(known_hosts=str(path), accept_new_host_key=accept)).open()
        assert f"remove the old entry (ssh-keygen -f {path} -R '[127.0.0.1]:{sshd.port}')" in str(caught.value)
    assert path.read_text() == line


def test_remove_hint_names_the_file_only_when_it_is_not_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert remove_command(KnownHosts(), "[127.0.0.1]:2222") == "ssh-keygen -R '[127.0.0.1]:2222'"
    assert remove_command(KnownHosts(tmp_path / "my hosts"), "orin") == f"ssh-keygen -f '{tmp_path}/my hosts' -R orin"


def test_stored_key_of_another_type_is_refused(target, tmp_path, sshd):
    path = tmp_path / "known_hosts"
    line = other_key_line(tmp_path, sshd, "ecdsa")
    path.write_text(line)
    with pytest.raises(HostKeyChangedError, match=r"host key for \[127.0.0.1\]:\d+ has CHANGED: the server offers "
                                                  r"ssh-ed25519 .* only keys of another type \(ecdsa-sha2-nistp256\)"):
        Connection(target.with_(known_hosts=str(path), accept_new_host_key=True)).open()
    assert path.read_text() == line


def test_authentication_failure_is_typed(target, tmp_path):
    stranger = keygen(tmp_path / "stranger")
    with pytest.raises(AuthenticationError, match=r"authentication failed .* tried identity file .*stranger"):
        Connection(target.with_(identity=str(stranger))).open()


def test_missing_identity_file(target, tmp_path):
    with pytest.raises(AuthenticationError, match=r"identity file .*nope not found"):
        Connection(target.with_(identity=str(tmp_path / "nope"))).open()


def test_connection_refused_is_typed(target):
    port = free_port()
    with pytest.raises(ConnectRefusedError, match=r"connection refused") as info:
        Connection(target.with_(port=port)).open()
    message = str(info.value)
    assert "Errno None" not in message
    assert f"port {port}" in message and "\n" not in message


@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 that accepts TCP connections (the kernel's backlog) and never says anything."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_no_ssh_banner_is_a_connect_timeout(target, silent_port):
    with pytest.raises(ConnectTimeoutError, match=rf"127.0.0.1:{silent_port}: port {silent_port} accepted the TCP "
                                                  r"connection but did not speak SSH \(no protocol banner\) within "
                                                  r"1 s \(--connect-timeout\)"):
        Connection(target.with_(port=silent_port, connect_timeout=1.0)).open()


@pytest.fixture
def closing_port():
    """A port on 127.0.0.1 that accepts each TCP connection and closes it at once, before any byte (what a port
    forward with nothing behind it, or an sshd past its MaxStartups, does)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the 0.1 s timeout: look at `stop` again
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    listener.close()


def test_a_port_that_closes_before_the_banner_is_not_called_a_timeout(target, closing_port):
    start = time.perf_counter()
    with pytest.raises(ConnectError) as info:
        Connection(target.with_(port=closing_port, connect_timeout=guard(60))).open()
    # the close is seen at once, not after the connect timeout (its half leaves room for a busy machine)
    assert time.perf_counter() - start < guard(60) / 2
    assert not isinstance(info.value, ConnectTimeoutError)
    assert str(info.value) == (
        f"{target.user}@127.0.0.1:{closing_port}: port {closing_port} accepted the TCP connection and closed it before "
        f"sending an SSH protocol banner; is sshd running there (and not refusing this client: MaxStartups, a "
        f"firewall, a port forward with nothing behind it), and is this its port?"
    )


def test_no_ssh_banner_on_the_command_line_prints_one_line_and_no_traceback(sshd, known_hosts, silent_port):
    # The CLI in a fresh process (no logging set up, as for a user), waiting for paramiko's thread to end, so
    # whatever it logs about the dead banner would be on stderr.
    script = ("import sys, threading\nfrom colibri_sdk.cli import main\ncode = main(sys.argv[1:])\n"
              "[t.join(10) for t in threading.enumerate() if t is not threading.current_thread()]\nsys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, "deploy", "--status", "--host", f"127.0.0.1:{silent_port}",
                           "--connect-timeout", "1", "--identity", str(sshd.user_key), "--known-hosts",
                           str(known_hosts)], capture_output=True, text=True, timeout=guard(600))
    assert proc.returncode == 1
    expected = (f"colibri-sdk deploy: error: {sshd.user}@127.0.0.1:{silent_port}: port {silent_port} accepted the "
                f"TCP connection but did not speak SSH (no protocol banner) within 1 s (--connect-timeout); is sshd "
                f"running there, and is this its port?")
    assert proc.stderr.splitlines() == [expected]


def test_command_timeout(target):
    with Connection(target) as conn:
        with pytest.raises(RemoteTimeoutError, match=r"remote command sleep 5 did not finish within 0.5 s"):
            conn.run(["sleep", "5"], timeout=0.5)


def test_arguments_reach_the_device_unchanged(target):
    hostile = ["a b", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "semi;colon", "back\\slash", "new\nline", ""]
    with Connection(target) as conn:
        result = conn.run(["printf", r"%s\0", *hostile])
    assert result.stdout.split(b"\0")[:-1] == [h.encode() for h in hostile]


def test_command_line_quotes_every_argument():
    assert command_line(["ls", "a b", "$x"]) == "ls 'a b' '$x'"
    assert shlex.split(command_line(["it's", "`id`"])) == ["it's", "`id`"]


class _DroppedOnClose:
    """A real channel whose device drops the connection just as the client closes the channel (what a flooding
    agent's sshd did on a busy machine: the close then fails inside paramiko with EOFError or a broken pipe)."""

    def __init__(self, channel):
        self._channel = channel

    def __getattr__(self, name):
        return getattr(self._channel, name)

    def close(self):
        self._channel.get_transport().sock.close()
        self._channel.close()


def test_an_answer_flood_on_a_dropped_connection_is_the_typed_error(target):
    with Connection(target) as conn:
        channel = conn.exec(["yes"])
        channel.shutdown_write()
        with pytest.raises(RemoteAnswerError, match="wrote more than 1,000 bytes"):
            collect(_DroppedOnClose(channel), guard(60), "dev", ["yes"], max_stdout=1000)
