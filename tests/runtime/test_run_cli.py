"""`colibri-sdk run`: output file, backend line, latency line, errors as exit code 1 with the message."""

from __future__ import annotations

import re

import numpy as np
import pytest

from colibri_sdk.cli import main
from colibri_sdk.runtime import Runtime, cuda_status
from colibri_sdk.runtime.runtime import BACKENDS

LATENCY = re.compile(r"^latency  p50 (\d+\.\d{3}) ms  p99 (\d+\.\d{3}) ms  max (\d+\.\d{3}) ms  \(5 calls\)$", re.M)


def test_run_with_input_and_output(small_bundle, tmp_path, rng, capsys):
    x = rng.standard_normal((2, 5, 64)).astype(np.float16)
    np.save(tmp_path / "in.npy", x)
    code = main(["run", str(small_bundle), "--backend", "cpu", "--input", str(tmp_path / "in.npy"),
                 "--output", str(tmp_path / "out.npy"), "--iters", "5", "--lengths", "5", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\nbackend  cpu (NumPy)\n" in out
    p50, p99, worst = (float(v) for v in LATENCY.search(out).groups())
    assert 0 < p50 <= p99 <= worst
    assert "input    " + str(tmp_path / "in.npy") + "  float16 (2, 5, 64)  lengths [5, 2]" in out
    y = np.load(tmp_path / "out.npy")
    with Runtime.load(small_bundle, backend="cpu") as rt:
        np.testing.assert_array_equal(y, rt.infer(x, input_lengths=[5, 2]))
    assert np.all(y[1, 2:] == 0)


def test_run_random_input(small_bundle, tmp_path, capsys):
    code = main(["run", str(small_bundle), "--backend", "cpu", "--iters", "5", "--output", str(tmp_path / "y.npy"),
                 "--seed", "3", "--no-verify"])
    out = capsys.readouterr().out
    assert code == 0 and LATENCY.search(out)
    assert "input    random N(0, 1), seed 3  float32 (2, 8, 64)" in out
    x = np.random.default_rng(3).standard_normal((2, 8, 64)).astype(np.float32)
    with Runtime.load(small_bundle, backend="cpu") as rt:
        np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), rt.infer(x))


def test_run_auto_names_the_backend(small_bundle, capsys):
    assert main(["run", str(small_bundle), "--iters", "5"]) == 0
    out, err = capsys.readouterr()
    chosen = "cuda" if cuda_status()[0] else "cpu"
    assert re.search(rf"^backend  {chosen} \(", out, re.M)
    assert (err == "") == (chosen == "cuda")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--input", "{tmp}/wide.npy"], r"input hidden size 65 \(shape \(1, 65\)\); expected 64"),
        (["--input", "{tmp}/missing.npy"], r"--input .*/missing\.npy: cannot open \(No such file or directory\)"),
        (["--lengths", "9", "1"], r"input_lengths\[0\] = 9; allowed: 0\.\.8"),
        (["--iters", "0"], r"--iters 0; allowed: 1\.\.1000000"),
    ],
)
def test_run_errors(small_bundle, tmp_path, capsys, extra, message):
    np.save(tmp_path / "wide.npy", np.zeros((1, 65), np.float32))
    args = ["run", str(small_bundle), "--backend", "cpu"] + [a.format(tmp=tmp_path) for a in extra]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("colibri-sdk run: error: ")
    assert re.search(message, err)


@pytest.mark.skipif(cuda_status()[0], reason="a CUDA driver is present; this checks the no-GPU message")
def test_run_cuda_without_gpu(small_bundle, capsys):
    assert main(["run", str(small_bundle), "--backend", "cuda"]) == 1
    assert "colibri-sdk run: error: no usable CUDA GPU here: " in capsys.readouterr().err


def test_run_backend_choices_match_the_runtime():
    assert BACKENDS == ("auto", "cuda", "cpu")


def test_run_refuses_an_output_inside_the_bundle(small_bundle, tmp_path, capsys):
    import shutil

    bundle = shutil.copytree(small_bundle, tmp_path / "bundle")
    manifest = (bundle / "manifest.json").read_bytes()
    target = bundle / "sub" / ".." / "manifest.json"  # the manifest itself, spelled with a detour
    (bundle / "sub").mkdir()
    assert main(["run", str(bundle), "--backend", "cpu", "--iters", "1", "--output", str(target)]) == 1
    err = capsys.readouterr().err
    assert err == f"colibri-sdk run: error: --output {target}: inside the bundle {bundle} (writing it would replace " \
                  "a file of the bundle); allowed: a file path outside the bundle folder\n"
    assert (bundle / "manifest.json").read_bytes() == manifest
