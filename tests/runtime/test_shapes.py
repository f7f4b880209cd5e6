"""Several fixed shapes in one bundle (docs/build.md, "Several shapes"; docs/runtime.md, "Shapes"): the build
compiles one kernel set, launch plan and self-test per batch x tokens pair, the runtime runs each call at the
smallest shape that holds it, refuses a call larger than every shape naming the largest, and records the shape."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

from colibri_sdk.bundle import Bundle, canonical_json, manifest_digest
from colibri_sdk.cli import main
from colibri_sdk.errors import BundleError, InputError
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime import Runtime
from runtime_bundles import ORIN, build, write_bundle

HIDDEN = 64
SHAPES = [(1, 2), (2, 2), (1, 8), (2, 8)]  # --batch 1,2 --tokens 2,8, smallest first by batch*tokens


@pytest.fixture(scope="module")
def shapes_bundle(small_bundle, tmp_path_factory) -> Path:
    """small_bundle's weights (fp16, 2 sequential layers, hidden 64) built with `--batch 1,2 --tokens 2,8`."""
    out = tmp_path_factory.mktemp("shapes") / "bundle"
    args = ["build", "--profile", str(ORIN), "--weights", str(small_bundle / "model.colibri"), "-o", str(out),
            "--batch", "2,1", "--tokens", "8,2", "-q"]
    assert main(args) == 0
    return out


def reference(bundle: Path, x: np.ndarray) -> np.ndarray:
    """The float64 reference engine on the bundle's weights (tokens are independent: no padding needed)."""
    engine = ReferenceEngine(bundle / "model.colibri", compute_dtype=np.float64)
    try:
        return engine(x.astype(np.float32)).astype(np.float32)
    finally:
        engine.close()


def test_the_manifest_lists_every_shape(shapes_bundle):
    bundle = Bundle.open(shapes_bundle)
    m = bundle.manifest
    assert bundle.shapes == SHAPES and bundle.shape == (2, 8)
    assert [(s["batch"], s["tokens"]) for s in m["shapes"]] == SHAPES
    assert m["profile"]["shape"] == {"batch": [1, 2], "tokens": [2, 8]}
    for s in m["shapes"]:
        defines = s["kernels"][0]["defines"]
        assert (defines["COLI_BATCH"], defines["COLI_SEQ_TOKENS"]) == (s["batch"], s["tokens"])
        x, expected, _, _ = bundle.for_shape(s["batch"], s["tokens"]).selftest()
        assert x.shape == (s["batch"], s["tokens"], HIDDEN)
        np.testing.assert_allclose(expected, reference(shapes_bundle, x), rtol=1e-5, atol=1e-5)
    assert m["shapes"][0]["kernels"][0]["cubin"] == "kernels/routing.b1t2.sm_87.cubin"
    assert m["shapes"][-1]["kernels"][0]["cubin"] == "kernels/routing.sm_87.cubin"  # the largest: single-shape names


@pytest.mark.parametrize(("batch", "tokens", "chosen"), [
    (1, 1, (1, 2)), (1, 2, (1, 2)), (2, 1, (2, 2)), (1, 3, (1, 8)), (2, 5, (2, 8)), (2, 8, (2, 8)),
])
def test_each_call_runs_at_the_smallest_shape_that_holds_it(shapes_bundle, batch, tokens, chosen):
    x = np.random.default_rng(batch * 10 + tokens).standard_normal((batch, tokens, HIDDEN)).astype(np.float32)
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        assert rt.shape_for(batch, tokens) == chosen
        y = rt.infer(x)
        stats = rt.stats()
    assert stats.last_shape == chosen and stats.shapes_chosen == {f"{chosen[0]}x{chosen[1]}": 1}
    assert stats.shapes == tuple(SHAPES) and stats.as_dict()["last_shape"] == list(chosen)
    np.testing.assert_allclose(y, reference(shapes_bundle, x), rtol=2e-3, atol=2e-3)


def test_lengths_and_out_work_at_a_smaller_shape(shapes_bundle):
    x = np.random.default_rng(5).standard_normal((2, 2, HIDDEN)).astype(np.float32)
    out = np.full((2, 2, HIDDEN), np.nan, np.float32)
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        assert rt.infer(x, input_lengths=[2, 1], out=out) is out
        assert rt.stats().last_shape == (2, 2)
    expected = reference(shapes_bundle, x)
    np.testing.assert_allclose(out[0], expected[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out[1, :1], expected[1, :1], rtol=2e-3, atol=2e-3)
    assert (out[1, 1:] == 0).all()


def test_the_cpu_backend_computes_only_the_calls_own_tokens(shapes_bundle, monkeypatch):
    """Without expert capacity the CPU backend runs the call's (batch, tokens) corner, not the shape's padding rows
    (their outputs are never returned): the rows it is given, recorded, and the outputs against the reference in
    a sequence of calls of other sizes (a larger call's rows do not leak into a smaller one's), with input_lengths
    (NaN past a length stays out) and with `out`."""
    from colibri_sdk.runtime.cpu_backend import CpuBackend

    given = []
    run_layers = CpuBackend.run_layers

    def recording(self, x, out, start, stop, **kw):
        given.append(x.shape[:2])
        assert x.flags.c_contiguous and out.flags.c_contiguous and out.shape == x.shape
        return run_layers(self, x, out, start, stop, **kw)

    monkeypatch.setattr(CpuBackend, "run_layers", recording)
    rng = np.random.default_rng(11)
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        for batch, tokens in [(2, 8), (1, 3), (2, 5), (1, 8), (1, 1), (2, 2)]:
            given.clear()
            x = rng.standard_normal((batch, tokens, HIDDEN)).astype(np.float32)
            y = rt.infer(x)
            assert given == [(batch, tokens)]
            np.testing.assert_allclose(y, reference(shapes_bundle, x), rtol=2e-3, atol=2e-3)
        x = rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)
        x[1, 2:] = np.nan  # past sequence 1's length: never read
        out = np.full((2, 5, HIDDEN), 7.0, np.float32)
        given.clear()
        assert rt.infer(x, input_lengths=[5, 2], out=out) is out
        assert given == [(2, 5)]
    expected = reference(shapes_bundle, np.nan_to_num(x))
    np.testing.assert_allclose(out[0], expected[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out[1, :2], expected[1, :2], rtol=2e-3, atol=2e-3)
    assert (out[1, 2:] == 0).all()


@pytest.mark.parametrize(("shape", "message"), [
    ((3, 2, HIDDEN), r"input batch 3 \(shape \(3, 2, 64\)\); allowed: 1\.\.2, the bundle's largest compiled shape's "
                     r"\(batch 2 x tokens 8\) batch"),
    ((1, 9, HIDDEN), r"input tokens 9 \(shape \(1, 9, 64\)\); allowed: 1\.\.8, the bundle's largest compiled shape's "
                     r"\(batch 2 x tokens 8\) tokens"),
])
def test_a_call_larger_than_every_shape_is_refused_naming_the_largest(shapes_bundle, shape, message):
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        with pytest.raises(InputError, match=message):
            rt.infer(np.zeros(shape, np.float32))
        with pytest.raises(InputError, match=message):
            rt.submit(np.zeros(shape, np.float32))
        with pytest.raises(InputError, match=r"^input batch 3 x tokens 1 is larger than every compiled shape; the "
                                             r"largest is batch 2 x tokens 8 \(build with a larger"):
            rt.shape_for(3, 1)
        assert rt.stats().calls == 0


def test_a_length_over_the_input_names_the_largest_shape(shapes_bundle):
    """A bundle of several shapes has no one fixed tokens: the message names the largest compiled shape's."""
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        with pytest.raises(InputError, match=r"^input_lengths\[1\] = 3; allowed: 0\.\.2 \(the input's tokens; the "
                                             r"bundle's largest compiled shape's tokens are 8\)$"):
            rt.infer(np.zeros((2, 2, HIDDEN), np.float32), input_lengths=[1, 3])


def test_self_test_runs_every_shape(shapes_bundle, tmp_path):
    with Runtime.load(shapes_bundle, backend="cpu") as rt:
        result = rt.self_test()
        assert result.passed, str(result)
        assert rt.stats().shapes_chosen == {f"{b}x{t}": 1 for b, t in SHAPES}
    # A wrong stored output for the smallest shape alone fails the self-test.
    folder = Path(shutil.copytree(shapes_bundle, tmp_path / "b"))
    path = folder / "selftest" / "b1t2" / "output.npy"
    np.save(path, np.load(path) + 1.0)
    with Runtime.load(folder, backend="cpu", verify=False) as rt:
        assert not rt.self_test().passed


def test_verify_says_every_shape_was_self_tested(shapes_bundle, capsys):
    assert main(["verify", str(shapes_bundle), "--backend", "cpu"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if "self-test:" in l]
    assert len(line) == 1 and line[0].endswith(f" (every shape: {len(SHAPES)})"), line


def test_submit_picks_the_shape_per_call_in_order(shapes_bundle):
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(shape + (HIDDEN,)).astype(np.float32) for shape in [(1, 1), (2, 8), (1, 3), (2, 2)]]
    with Runtime.load(shapes_bundle, backend="cpu", streams=2) as rt:
        futures = [rt.submit(x) for x in xs]
        results = [f.result(timeout=guard(600)) for f in futures]
        assert rt.stats().shapes_chosen == {"1x2": 1, "2x8": 1, "1x8": 1, "2x2": 1}
        for x, y in zip(xs, results):
            np.testing.assert_array_equal(y, rt.infer(x))


def test_inspect_and_run_show_the_shapes(shapes_bundle, capsys):
    assert main(["inspect", str(shapes_bundle), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(s["batch"], s["tokens"]) for s in info["shapes"]] == SHAPES
    assert info["shapes"][0]["selftest"] == {"input": "selftest/b1t2/input.npy", "output": "selftest/b1t2/output.npy"}
    assert all(s["launches"] == 6 for s in info["shapes"])  # 2 layers x 3 GEMV-path launches
    assert main(["inspect", str(shapes_bundle)]) == 0
    text = capsys.readouterr().out
    assert "  shapes         1x2 (6 launches), 2x2 (6 launches), 1x8 (6 launches), 2x8 (6 launches)" in text
    assert main(["run", str(shapes_bundle), "--backend", "cpu", "--iters", "1", "--batch", "1", "--tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "shape    batch 1 x tokens 8 (the smallest compiled shape that holds the input)" in text
    assert "shapes   1x2, 2x2, 1x8, 2x8 (batch x tokens)" in text
    assert main(["run", str(shapes_bundle), "--backend", "cpu", "--iters", "1", "--tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shape_chosen"] == {"batch": 2, "tokens": 2} and report["stats"]["shapes_chosen"] == {"2x2": 2}
    assert report["shapes"][0] == {"batch": 1, "tokens": 2}


def test_a_bundle_without_shapes_keeps_loading(tmp_path, small_bundle):
    """A manifest from before `shapes` (only the top-level shape) is one shape."""
    folder = write_bundle(tmp_path / "old", small_bundle / "model.colibri", 2, 8)
    assert "shapes" not in json.loads((folder / "manifest.json").read_text())
    with Runtime.load(folder, backend="cpu") as rt:
        assert rt.shapes == [(2, 8)] and rt.self_test().passed
        rt.infer(np.zeros((1, 3, HIDDEN), np.float32))
        assert rt.stats().last_shape == (2, 8)
    assert Bundle.open(folder).for_shape(2, 8).manifest["shape"] == {"batch": 2, "tokens": 8}


def _tampered(folder: Path, edit) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    m["manifest_sha256"] = manifest_digest(m)
    (folder / "manifest.json").write_bytes(canonical_json(m))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["shapes"].reverse(), r"shapes must be sorted smallest first \(by batch\*tokens, batch, tokens\) "
                                      r"without duplicates; got \[\(2, 8\), \(1, 8\), \(2, 2\), \(1, 2\)\]"),
    (lambda m: m["shapes"][0].update(extra=1), r"shapes\[0\] keys: missing \[\], unknown \['extra'\]"),
    (lambda m: m["shapes"][0].update(tokens=0), r"shapes\[0\]\.tokens = 0; allowed: 1\.\.65536"),
    (lambda m: m["shapes"][0].update(batch=True), r"shapes\[0\]\.batch = True; allowed: int"),
    (lambda m: m["shapes"][2].update(tokens=16, batch=1), r"shapes\[2\] is batch 1 x tokens 16, beyond the largest "
                                                          r"\(last\) shape batch 2 x tokens 8"),
    (lambda m: m["shapes"][-1]["launch"].pop(), r"shapes\[3\]\.launch differs from the top-level launch"),
    (lambda m: m["shapes"][0]["kernels"][0].update(cubin="../x.cubin"),
     r"shapes\[0\]\.kernels\[0\]\.cubin: path '\.\./x\.cubin'; allowed: a normalised relative path"),
    (lambda m: m["shapes"][0]["selftest"].update(input="selftest/other.npy"),
     r"shapes\[0\]\.selftest\.input = 'selftest/other\.npy' is not in files"),
    (lambda m: m.update(shapes=[]), r"shapes has 0 entries; allowed: 1\.\.64"),
])
def test_bad_shapes_are_refused_by_name(shapes_bundle, tmp_path, edit, message):
    folder = Path(shutil.copytree(shapes_bundle, tmp_path / "b"))
    _tampered(folder, edit)
    with pytest.raises(BundleError, match=message):
        Bundle.open(folder, verify=False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1", None, True, float("nan")])
def test_shape_for_refuses_a_size_that_is_not_a_positive_integer(shapes_bundle, bad):
    with Runtime.load(shapes_bundle, backend="cpu", verify=False) as rt:
        with pytest.raises(InputError, match=r"shape_for batch = .*; allowed: an integer of 1 or more"):
            rt.shape_for(bad, 2)
        with pytest.raises(InputError, match=r"shape_for tokens = .*; allowed: an integer of 1 or more"):
            rt.shape_for(1, bad)
        assert rt.shape_for(np.int64(2), 3) == (2, 8)


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch", "100000", "--tokens", "100000"], r"--batch 100000; allowed: 1\.\.2 \(the largest compiled shape's\)"),
    (["--tokens", "9"], r"--tokens 9; allowed: 1\.\.8 \(the largest compiled shape's\)"),
])
def test_run_refuses_a_random_input_larger_than_every_shape_before_making_it(shapes_bundle, capsys, flags, message):
    assert main(["run", str(shapes_bundle), "--backend", "cpu", "--iters", "1", "--no-verify", *flags]) != 0
    err = capsys.readouterr().err
    assert err.startswith("colibri-sdk run: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
