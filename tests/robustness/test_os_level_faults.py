"""Faults the operating system reports: paths it refuses to look at, files that are not what their name says.

`Path.is_dir()` / `is_file()` / `exists()` turn only "no such file"-like errors into False; a name longer than the
file system allows (ENAMETOOLONG) or a folder the user may not enter (EACCES) raise OSError from them. Every command
must still answer with one line naming the path, and the library's entry points with their own error type.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from robustness_helpers import cli_error, write_checkpoint, write_small_model
from timeout_support import guard

from colibri_sdk.errors import BundleError, ConvertError, InputError, ProfileError

LONG = "n" * 300  # one path component longer than NAME_MAX (255 on ext4, xfs, btrfs, tmpfs)

COMMANDS = {
    "inspect": lambda d: ["inspect", LONG],
    "verify": lambda d: ["verify", LONG],
    "run": lambda d: ["run", LONG],
    "run --output": lambda d: ["run", str(d["bundle"]), "--backend", "cpu", "--iters", "1",
                               "--output", str(d["tmp"] / f"{LONG}.npy")],
    "convert": lambda d: ["convert", LONG, "-o", str(d["tmp"] / "x.colibri")],
    "convert .gguf": lambda d: ["convert", f"{LONG}.gguf", "-o", str(d["tmp"] / "x.colibri")],
    "convert -o": lambda d: ["convert", str(d["checkpoint"]), "-o", str(d["tmp"] / f"{LONG}.colibri")],
    "build --profile": lambda d: ["build", "--profile", f"{LONG}.yaml", "--demo", "-o", str(d["tmp"] / "b")],
    "build -o": lambda d: ["build", "--profile", "orin", "--demo", "-o", str(d["tmp"] / LONG)],
    "deploy": lambda d: ["deploy", LONG, "--host", "127.0.0.1"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_name_too_long_for_the_file_system_is_one_line(command, small_bundle_dir, tmp_path, capsys):
    paths = {"bundle": small_bundle_dir, "tmp": tmp_path, "checkpoint": write_checkpoint(tmp_path / "ck")}
    err = cli_error(capsys, *COMMANDS[command](paths))
    assert LONG in err and err.endswith("File name too long"), err


def test_the_library_entry_points_raise_their_own_errors():
    from colibri_sdk.bundle.reader import Bundle
    from colibri_sdk.convert.source import open_model
    from colibri_sdk.profile import load_profile

    with pytest.raises(BundleError, match=rf"^{LONG}: cannot examine the bundle folder: File name too long$"):
        Bundle.open(LONG)
    with pytest.raises(ProfileError, match=rf"^profile '{LONG}.yaml': cannot examine it: File name too long$"):
        load_profile(f"{LONG}.yaml", toolchain=False)
    with pytest.raises(ConvertError, match=rf"^{LONG}: cannot examine it: File name too long$"):
        open_model(LONG)


def _as_another_user() -> list[str] | None:
    """A command prefix that runs a program without the rights of root (None: not possible here)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"] if setpriv else None


@pytest.mark.skipif(_as_another_user() is None, reason="runs as root without setpriv (util-linux) to drop the rights")
def test_a_folder_the_user_may_not_enter_or_a_file_not_to_read_is_one_line():
    # Under a fresh world-readable folder (pytest's tmp_path is 0700 to its owner).
    root = Path(tempfile.mkdtemp(prefix="colibri-denied-"))
    try:
        root.chmod(0o755)
        closed = root / "closed"
        closed.mkdir()
        shutil.copytree(write_checkpoint(root / "src"), closed / "ck")
        unreadable = Path(shutil.copytree(root / "src", root / "unreadable"))
        for path in [root / "src", *root.joinpath("src").iterdir(), unreadable]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (unreadable / "model.safetensors").chmod(0o000)
        closed.chmod(0o000)  # nobody but root may enter it, even to look at what is inside
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        probe = subprocess.run([*_as_another_user(), sys.executable, "-c", "import colibri_sdk"], capture_output=True,
                               text=True, timeout=guard(600), env=env, cwd=root)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no message"])[-1]  # the exception's own line
            pytest.skip(f"uid 65534 cannot import colibri_sdk from this checkout (a folder above it closed to other "
                        f"users?): {last[-200:]}")
        prefix = [*_as_another_user(), sys.executable, "-m", "colibri_sdk"]
        cases = {
            ("convert", str(closed / "ck")): f"{closed / 'ck'}: cannot examine it: Permission denied",
            ("verify", str(closed / "bundle")):
                f"{closed / 'bundle'}: cannot examine the bundle folder: Permission denied",
            ("inspect", str(closed / "m.colibri")): f"{closed / 'm.colibri'}: Permission denied",
            # safetensors itself says "No such file or directory" for a file it may not read.
            ("convert", str(unreadable)): f"{unreadable / 'model.safetensors'}: cannot read: Permission denied",
        }
        for argv, expected in cases.items():
            done = subprocess.run([*prefix, *argv, "-o", str(root / "out.colibri")] if argv[0] == "convert"
                                  else [*prefix, *argv], capture_output=True, text=True, timeout=guard(600), env=env,
                                  cwd=root)
            assert done.returncode == 1, (argv, done.stderr)
            assert done.stderr.splitlines() == [f"colibri-sdk {argv[0]}: error: {expected}"], (argv, done.stderr)
    finally:
        for path in (root / "closed", root / "unreadable" / "model.safetensors"):
            if path.exists():
                path.chmod(0o700)
        shutil.rmtree(root)


ALARM_S = 300  # the `alarm` fixture (conftest.py): a hang fails the test after this many seconds (a run that loads
# the CPU backend into an empty numba cache took over 120 s on 2 cores at load average 8)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b""), "an empty file"),
        (lambda p: p.write_text("1 2 3\n"), r"not a .npy file (it starts with b'1 2 3\n')"),
        (lambda p: p.write_bytes(b"\x80\x04K\x01."), r"not a .npy file (it starts with b'\x80\x04K\x01.')"),
        (lambda p: p.write_bytes(b"\x93NUMPY"), "cannot load a .npy array (EOF: reading magic string, expected 8 "
                                               "bytes got 6)"),
        (_fifo, "a FIFO"),
        (lambda p: p.mkdir(), "a folder"),
    ],
    ids=["empty", "text", "pickle", "magic-only", "fifo", "folder"],
)
def test_an_input_that_is_not_a_npy_file_is_named_without_waiting(make, message, small_bundle_dir, tmp_path, capsys,
                                                                   alarm):
    path = tmp_path / "in.npy"
    make(path)
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--input", str(path))
    assert err == f"colibri-sdk run: error: --input {path}: {message}" + (
        "" if message.startswith("cannot load") else "; allowed: a .npy file holding one array")


def test_load_input_reads_a_npy_file_as_np_load_does(tmp_path):
    from colibri_sdk.commands.run import load_input

    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    np.save(tmp_path / "x.npy", x)
    assert np.array_equal(load_input(str(tmp_path / "x.npy")), x)
    with pytest.raises(InputError, match="cannot open"):
        load_input(str(tmp_path / "missing.npy"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a Linux device) to write to")
def test_a_full_standard_output_is_one_line(tmp_path):
    model = write_small_model(tmp_path / "m.colibri")
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "colibri_sdk", "inspect", str(model), "--json"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=guard(600))
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["colibri-sdk inspect: error: No space left on device"]


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (every thread's, from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


@pytest.mark.parametrize("when", ["compiling", "after-the-partial-folder"])
def test_sigterm_during_a_build_leaves_no_partial_folder(tmp_path, when):
    # `timeout`, `kill`, systemd and CI runners stop a program with SIGTERM: without a handler Python ends at once
    # and the build's hidden .NAME.partial-* folder (a copy of the weights) stays behind. "compiling": while NVRTC
    # runs, where NVRTC's own signal handler used to end the process with status 4 or SIGSEGV (no cleanup).
    if when == "compiling" and not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("no /proc/PID/task/TID/children here (Linux with CONFIG_PROC_CHILDREN) to see NVRTC's process")
    model = write_small_model(tmp_path / "m.colibri")
    proc = subprocess.Popen([sys.executable, "-m", "colibri_sdk", "build", "--profile", "orin", "--weights",
                             str(model), "-o", str(tmp_path / "out"), "-q", "--no-cache"],  # NVRTC runs: time to stop it
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + guard(600)
        while not list(tmp_path.glob(".out.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if when == "compiling":
            while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)  # inside nvrtcCompileProgram
        else:
            time.sleep(0.3)  # into the build proper (NVRTC, the weights copy)
        assert proc.poll() is None, f"the build ended before it could be stopped: {proc.stderr.read()}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=guard(600))
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.splitlines()[-1:] == ["colibri-sdk build: terminated (SIGTERM)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.colibri"]


def test_the_cli_puts_back_the_sigterm_handler_it_found(capsys):
    from colibri_sdk import cli

    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["inspect", LONG]) == 1
    capsys.readouterr()
    assert signal.getsignal(signal.SIGTERM) is before
