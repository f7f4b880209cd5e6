"""What `colibri-sdk run` and `verify` show on stderr: the CPU fallback notice (logged by the runtime, shown by the
CLI; hidden by -q), and a progress bar while they hash the bundle's files, on a terminal only."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
from timeout_support import guard

from colibri_sdk.cli import main
from colibri_sdk.runtime import cuda_status

needs_no_gpu = pytest.mark.skipif(cuda_status()[0], reason="a CUDA driver is present; this checks the CPU fallback")


@needs_no_gpu
def test_run_shows_the_fallback_notice_unless_quiet(small_bundle, capsys):
    assert main(["run", str(small_bundle), "--iters", "1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("colibri-sdk: running on the CPU backend: no usable CUDA GPU here: ") and err.count("\n") == 1
    assert main(["run", str(small_bundle), "--iters", "1", "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "backend  cpu (NumPy)" in captured.out  # -q hides notices, not the result


def _on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run `python -m colibri_sdk ARGV` with stderr on a pseudo-terminal (100 columns); (exit code, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "colibri_sdk", *argv], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=guard(600)), b"".join(chunks).decode(errors="replace")


def test_verify_shows_a_hashing_bar_on_a_terminal_only(small_bundle, capsys):
    code, err = _on_a_terminal(["verify", str(small_bundle), "--no-selftest"])
    assert code == 0
    assert "verify: sha256: " in err and "%|" in err, err
    code, err = _on_a_terminal(["verify", str(small_bundle), "--no-selftest", "-q"])
    assert code == 0 and err == ""
    assert main(["verify", str(small_bundle), "--no-selftest"]) == 0  # stderr is not a terminal here
    assert capsys.readouterr().err == ""


def test_run_shows_a_hashing_bar_on_a_terminal(small_bundle):
    code, err = _on_a_terminal(["run", str(small_bundle), "--backend", "cpu", "--iters", "1"])
    assert code == 0
    assert "run: sha256: " in err and "%|" in err, err
    code, err = _on_a_terminal(["run", str(small_bundle), "--backend", "cpu", "--iters", "1", "--no-verify"])
    assert code == 0 and err == ""
