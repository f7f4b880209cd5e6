"""Hostile input to the runtime (`Runtime.infer`) and to `colibri-sdk run`."""

from __future__ import annotations

import re
import time

import numpy as np
import numpy.lib.format as npy
import pytest
from colibri_sdk.errors import InputError
from colibri_sdk.runtime import Runtime
from robustness_helpers import SMALL, cli_error


@pytest.fixture(scope="module")
def runtime(small_bundle_dir):
    with Runtime.load(small_bundle_dir, backend="cpu") as rt:
        yield rt


def _x(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(
    ("make", "lengths", "message"),
    [
        (lambda: np.ma.masked_array(_x(1, 4, 64), mask=True), None, r"input is a masked array; the mask would be ignored"),
        (lambda: _x(1, 4, 64), [[1], [2, 3]], r"input_lengths is not an array of integers \(.*inhomogeneous"),
        (lambda: _x(1, 4, 64), [], r"input_lengths shape \(0,\); expected \(1,\), one length per sequence"),
        (lambda: np.zeros((1, 1, 4, 64), np.float32), None, r"input shape \(1, 1, 4, 64\); expected"),
        (lambda: _x(1, 4, 64).astype(np.complex64), None, r"input dtype complex64; allowed: float32, float16"),
        (lambda: _x(1, 4, 64).astype(object), None, r"input dtype object; allowed: float32, float16"),
    ],
    ids=["masked", "ragged-lengths", "empty-lengths", "4-d", "complex", "object"],
)
def test_bad_input_to_infer(runtime, make, lengths, message):
    with pytest.raises(InputError, match=message):
        runtime.infer(make(), input_lengths=lengths)


def test_negative_seed(small_bundle_dir, capsys):
    assert cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--seed", "-1").endswith(
        "--seed -1; allowed: 0 or more"
    )


def _npy_header_only(path, shape) -> None:
    with open(path, "wb") as fh:
        npy.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": shape})


def _npz(path) -> None:
    with open(path, "wb") as fh:  # np.savez on a name would append .npz
        np.savez(fh, x=_x(1, 4, 64))


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: _npy_header_only(p, (10**6, 10**6, 64)), r"cannot load a \.npy array \(Unable to allocate"),
        (lambda p: _npz(p), r"a \.npz archive; allowed: a \.npy file holding one array"),
        (lambda p: p.write_bytes(b"\x80\x04K\x01."), r"not a \.npy file \(it starts with b'\\x80"),
        (lambda p: np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True), r"Object arrays cannot be loaded"),
    ],
    ids=["header-claims-931-TiB", "npz", "pickle", "object-array"],
)
def test_bad_input_file(small_bundle_dir, tmp_path, capsys, write, message):
    path = tmp_path / "in.npy"
    write(path)
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--input", str(path))
    assert re.search(message, err), err


def test_output_in_a_missing_folder_fails_before_running(small_bundle_dir, tmp_path, capsys):
    start = time.perf_counter()
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--iters", "100000",
                    "--output", str(tmp_path / "missing" / "y.npy"))
    assert err.endswith("missing does not exist; allowed: a file path in an existing folder")
    assert time.perf_counter() - start < 10


def test_output_is_written_exactly_where_asked(small_bundle_dir, tmp_path, capsys):
    from colibri_sdk import cli

    out = tmp_path / "result"  # no .npy suffix: np.save would have written result.npy
    assert cli.main(["run", str(small_bundle_dir), "--backend", "cpu", "--iters", "1", "--output", str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]
    assert np.load(out).shape == (4, 16, SMALL.hidden_size)  # orin's largest shape: batch 4 x tokens 16


def test_output_that_is_a_fifo_or_an_existing_file(small_bundle_dir, tmp_path, capsys):
    """A FIFO is refused before any work (opening it for writing had blocked forever after the timings); an
    existing file is replaced only with --force, through a new file renamed over it, so a hard link to it (here
    one into the bundle) keeps its bytes."""
    import os

    from colibri_sdk import cli

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.perf_counter()
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--iters", "1", "--output", str(fifo))
    assert err.endswith(f"--output {fifo}: a FIFO; allowed: a new file path in an existing folder, or an existing "
                        "file with --force")
    assert time.perf_counter() - start < 10
    existing = tmp_path / "y.npy"
    os.link(small_bundle_dir / "selftest" / "input.npy", existing)
    before = (small_bundle_dir / "selftest" / "input.npy").read_bytes()
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--iters", "1", "--output", str(existing))
    assert err.endswith("the file exists; allowed: a new file path in an existing folder, or an existing file with "
                        "--force")
    assert cli.main(["run", str(small_bundle_dir), "--backend", "cpu", "--iters", "1", "--output", str(existing),
                     "--force"]) == 0
    capsys.readouterr()
    assert np.load(existing).shape == (4, 16, SMALL.hidden_size)
    assert (small_bundle_dir / "selftest" / "input.npy").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "y.npy"]  # no partial file left


def test_a_control_character_in_an_error_is_escaped(tmp_path, capsys):
    """Errors quote what the user gave: a path holding ESC or a newline is printed escaped, on one line."""
    err = cli_error(capsys, "inspect", str(tmp_path / "a\nb\x1b]0;title\x07"))
    assert "\x1b" not in err and "a\\nb\\x1b]0;title\\x07" in err


def test_output_that_is_a_folder(small_bundle_dir, tmp_path, capsys):
    err = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--output", str(tmp_path))
    assert err.endswith("is a folder; allowed: a file path in an existing folder")


def test_an_archive_given_as_the_bundle_says_to_unpack_it(tmp_path, capsys):
    """`verify b.tar` (what `build --archive` writes beside the folder) says it is an archive to unpack."""
    archive = tmp_path / "b.tar"
    archive.write_bytes(b"\0" * 1024)
    err = cli_error(capsys, "verify", str(archive))
    assert err.endswith(f"{archive} is not a bundle folder (an archive; unpack it first (tar -xf): `build --archive` "
                        "writes the bundle folder beside it)")
