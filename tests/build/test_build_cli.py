"""`colibri-sdk build` as a user meets it: --weights or --demo, --force, the dtype line, the resource table once,
progress reported per step, and the streamed self-test equal to the reference engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri_sdk import cli
from colibri_sdk.bundle import selftest_vectors as selftest_module
from colibri_sdk.bundle import writer
from colibri_sdk.bundle.writer import build_bundle, selftest_vectors
from colibri_sdk.errors import BundleError
from colibri_sdk.format import Header, write_model
from colibri_sdk.profile import load_profile
from colibri_sdk.reference import ReferenceEngine

TABLE_HEAD = "  kernel       symbol"


def odd_weights(path: Path, dtype: int) -> Path:
    """2 layers x 4 experts, top-2, hidden 40, intermediate 72 (sizes that leave tails in every chunk)."""
    header = Header(num_layers=2, num_experts=4, top_k=2, hidden_size=40, intermediate_size=72, dtype=dtype,
                    composition=1)
    rng = np.random.default_rng(11)
    return write_model(path, header, rng.standard_normal((2, 4, 72, 40)) * 0.2,
                       rng.standard_normal((2, 4, 72, 40)) * 0.2, rng.standard_normal((2, 4, 40, 72)) * 0.2,
                       rng.standard_normal((2, 40, 4)))


def test_build_needs_weights_or_demo(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["build", "--profile", "orin", "-o", str(tmp_path / "b")])
    assert exc.value.code == 2
    assert "error: one of the arguments --weights --demo is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["build", "--profile", "orin", "--demo", "--weights", "m.colibri", "-o", str(tmp_path / "b")])
    assert exc.value.code == 2
    assert "argument --weights: not allowed with argument --demo" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_fp32_weights_into_fp16_profile(tmp_path, capsys, kernel_dir):
    """One build, checked for everything it prints: the dtype change, the table once, no bar off a terminal,
    debug lines with -v; then -o onto it is refused without --force and replaced with it."""
    weights = odd_weights(tmp_path / "m32.colibri", dtype=0)
    out = tmp_path / "b"
    args = ["build", "--profile", "orin", "--weights", str(weights), "-o", str(out), "--kernels", str(kernel_dir)]
    assert cli.main(args + ["-v"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert "  dtype: the weights are stored as fp32; converted to the profile's fp16 (every value rounded to fp16)" \
        in lines
    assert len([line for line in lines if line.startswith(TABLE_HEAD)]) == 1  # the resource table, once
    assert captured.out.count("colibri_gate_up ") == 1
    err = captured.err.splitlines()
    assert "%|" not in captured.err  # stderr is not a terminal: no progress bar
    assert any(line.startswith("colibri-sdk: debug: weights: ") and "converted fp32 → fp16 in" in line for line in err)
    assert any(line.startswith("colibri-sdk: debug: kernels: ") for line in err)

    manifest = (out / "manifest.json").read_bytes()
    assert cli.main(args) == 1
    assert capsys.readouterr().err == (
        f"colibri-sdk build: error: {out} exists (a bundle); refusing to replace it without --force "
        "(or choose another -o)\n"
    )
    assert (out / "manifest.json").read_bytes() == manifest
    assert cli.main(args + ["--force", "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # -q: no notices, no debug lines
    assert captured.out == ""  # ... and no summary: errors only
    assert (out / "manifest.json").read_bytes() == manifest  # reproducible


def test_same_dtype_prints_no_dtype_line_and_reports_progress(tmp_path, kernel_dir, capsys):
    weights = odd_weights(tmp_path / "m16.colibri", dtype=1)
    calls = []
    result = build_bundle(load_profile("orin").for_shape(1, 16), tmp_path / "b", weights, kernel_dir=kernel_dir,
                          progress=lambda step, done, total: calls.append((step, done, total)))
    assert result.source_dtype == "fp16" and not result.converted
    steps = list(dict.fromkeys(step for step, _, _ in calls))
    assert steps == ["weights", "self-test"]  # copied and hashed in one pass: no "sha256" step
    for step in steps:
        seen = [(done, total) for s, done, total in calls if s == step]
        assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] > 0
        assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert [t for s, _, t in calls if s == "weights"][0] == weights.stat().st_size
    assert cli.main(["build", "--profile", "orin", "--weights", str(weights), "-o", str(tmp_path / "c"),
                     "--kernels", str(kernel_dir)]) == 0
    out = capsys.readouterr().out
    assert "  weights: " in out and "dtype:" not in out


def test_force_never_replaces_a_folder_that_is_not_a_bundle(tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"precious")
    with pytest.raises(BundleError, match=r"photos exists and is not a bundle; refusing to replace it"):
        build_bundle(load_profile("orin"), out, force=True)
    assert (out / "cat.jpg").read_bytes() == b"precious"


def test_an_existing_archive_needs_force(tmp_path):
    (tmp_path / "b.tar").write_bytes(b"old archive")
    with pytest.raises(BundleError, match=r"b\.tar exists; refusing to replace the archive without --force"):
        build_bundle(load_profile("orin"), tmp_path / "b", archive=True)
    assert (tmp_path / "b.tar").read_bytes() == b"old archive" and not (tmp_path / "b").exists()


@pytest.mark.parametrize("dtype", [0, 1])
def test_streamed_selftest_equals_the_reference_engine(tmp_path, monkeypatch, dtype):
    weights = odd_weights(tmp_path / "m.colibri", dtype=dtype)
    monkeypatch.setattr(selftest_module, "CHUNK_BYTES", 7 * 40 * 8)  # 7 rows of gate/up per chunk: many chunks, a tail
    x, y, seed = selftest_vectors(weights, 2, 5)
    assert x.shape == y.shape == (2, 5, 40) and x.dtype == y.dtype == np.float32
    assert seed >= writer.SELFTEST_SEED
    # No mapping of the weights outlives the self-test (each chunk's mapping is closed after its read).
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(weights) not in maps.read_text()
    engine = ReferenceEngine(weights, compute_dtype=np.float64)
    np.testing.assert_allclose(y, engine.forward(x).astype(np.float32), rtol=1e-6, atol=1e-6)
    engine.close()


@pytest.mark.parametrize(("flags", "message"), [
    (["--tokens", "1,x"], "colibri-sdk build: error: --tokens '1,x'; allowed: positive integers separated by commas, "
                          "e.g. 1,16,64"),
    (["--batch", ""], "colibri-sdk build: error: --batch ''; allowed: positive integers separated by commas"),
    (["--tokens", "0,16"], "shape.tokens = [0, 16]; allowed: an integer in 1..65536, or a list of 1..8 such integers"),
    (["--tokens", ",".join(str(t) for t in range(1, 10))], "shape.tokens = [1, 2, 3, 4, 5, 6, ...]; allowed: an "
                                                            "integer in 1..65536, or a list of 1..8"),
    (["--batch", "256", "--tokens", "512"], "shape batch*tokens = 131072; allowed: at most 65536"),
    (["--tokens", "9" * 5000], "colibri-sdk build: error: --tokens '" + "9" * 57 + "'...: a value above 65536; "
                               "allowed: integers in 1..65536"),
    (["--batch", "0" * 6000], "shape.batch = 0; allowed: an integer in 1..65536"),
])
def test_bad_shape_flags_are_refused_in_one_line(tmp_path, capsys, flags, message):
    out = tmp_path / "b"
    assert cli.main(["build", "--profile", "orin", "--demo", "-o", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--tokens", "0,16"], "orin.yaml with --tokens 0,16: shape.tokens = [0, 16]; allowed:"),
    (["--capacity-factor", "-1", "--capacity-mode", "soft"],
     "orin.yaml with --capacity-factor -1.0, --capacity-mode soft: capacity.factor = -1.0; allowed:"),
])
def test_a_bad_flag_value_is_blamed_on_the_flag(tmp_path, capsys, flags, message):
    out = tmp_path / "b"
    assert cli.main(["build", "--profile", "orin", "--demo", "-o", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def _quantized_bundle(tmp_path, seed: int, *quantize_args) -> Path:
    """`build --profile orin --batch 1 --tokens 4` of a one-layer model (4 experts, hidden = intermediate = 64,
    N(0, 1) fp32 weights from `seed`) quantized by `quantize_file(..., *quantize_args)`. Returns the bundle folder."""
    from colibri_sdk.quantize import quantize_file

    rng = np.random.default_rng(seed)
    layers, experts, hidden, inter = 1, 4, 64, 64
    src = write_model(tmp_path / "m.colibri", Header(num_layers=layers, num_experts=experts, top_k=2,
                                                     hidden_size=hidden, intermediate_size=inter, dtype=0,
                                                     routing=0, composition=0),
                      rng.standard_normal((layers, experts, inter, hidden), dtype=np.float32),
                      rng.standard_normal((layers, experts, inter, hidden), dtype=np.float32),
                      rng.standard_normal((layers, experts, hidden, inter), dtype=np.float32),
                      rng.standard_normal((layers, hidden, experts), dtype=np.float32))
    quantize_file(src, tmp_path / "q.colibri", *quantize_args)
    out = tmp_path / "b"
    assert cli.main(["build", "--profile", "orin", "--weights", str(tmp_path / "q.colibri"), "-o", str(out),
                     "--batch", "1", "--tokens", "4"]) == 0  # no -q: the callers read the summary
    return out


def test_build_and_inspect_name_int_expert_storage(tmp_path, capsys):
    out = _quantized_bundle(tmp_path, 3, "int4", 32)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{out}: jetson-agx-orin-64gb (sm_87, int4 g32, fp16 scales, batch 1 x tokens 4, "), lines
    assert "intermediate 64, int4 g32 experts)" in lines[1]
    assert cli.main(["inspect", str(out)]) == 0
    assert "  experts        int4 g32 (the weights' own storage" in capsys.readouterr().out
    assert cli.main(["run", str(out), "--backend", "cpu", "--iters", "1", "-q"]) == 0
    out_text = capsys.readouterr().out
    assert "\nexperts  int4 g32 (the weights' own storage)\n" in out_text
    assert out_text.startswith(f"bundle   {out}  (int4 g32, fp16 scales, batch 1 x tokens 4, hidden 64)\n")
    # a batch the bundle has no shape for: the argument error alone, before any backend notice or checksum
    assert cli.main(["run", str(out), "--batch", "5"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "colibri-sdk run: error: --batch 5; allowed: 1 (the largest compiled shape's)\n"
    assert captured.out == ""
    assert cli.main(["run", str(out), "--tokens", "5", "--backend", "cuda"]) == 1
    assert capsys.readouterr().err == ("colibri-sdk run: error: --tokens 5; allowed: 1..4 (the largest compiled "
                                       "shape's)\n")


def test_build_and_run_name_the_files_own_scale_type(tmp_path, capsys):
    """fp32 scales (as a compressed-tensors import keeps them) in an fp16 profile's bundle: the summaries say fp32."""
    out = _quantized_bundle(tmp_path, 4, "int8", 32, "fp32")
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{out}: jetson-agx-orin-64gb (sm_87, int8 g32, fp32 scales, batch 1 x tokens 4, "), first
    assert cli.main(["run", str(out), "--backend", "cpu", "--iters", "1", "-q"]) == 0
    assert capsys.readouterr().out.startswith(f"bundle   {out}  (int8 g32, fp32 scales, batch 1 x tokens 4, hidden 64)\n")
