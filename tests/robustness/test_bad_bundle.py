"""Hostile bundles for `colibri-sdk verify`/`inspect`/`run`, and hostile output folders for `colibri-sdk build`."""

from __future__ import annotations

import os
import pickle
import re
import shutil

import numpy as np
import pytest
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.bundle import Bundle
from colibri_sdk.errors import BundleError
from colibri_sdk.profile import load_profile
from colibri_sdk.runtime import Runtime
from robustness_helpers import cli_error, load_manifest, save_manifest


# ---- colibri-sdk build -o ------------------------------------------------------------------------------------------
def test_build_never_deletes_a_folder_that_only_has_a_manifest_json(tmp_path):
    out = tmp_path / "webapp"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my web app"}')
    (out / "index.html").write_text("precious")
    with pytest.raises(BundleError, match=r"webapp exists and is not a bundle; refusing to replace it .*schema_version"):
        build_bundle(load_profile("orin"), out)
    assert (out / "index.html").read_text() == "precious"


def test_build_never_deletes_files_added_to_an_old_bundle(tmp_path, bundle):
    (bundle / "notes.txt").write_text("precious")
    with pytest.raises(BundleError, match=r"bundle exists and is not a bundle; .*: notes\.txt is not one of its files"):
        build_bundle(load_profile("orin"), bundle)
    assert (bundle / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("output", ["/", "a_file/bundle"])
def test_build_output_root_or_under_a_file(tmp_path, capsys, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    err = cli_error(capsys, "build", "--profile", "orin", "--demo", "-o", output)
    assert "is not a folder name" in err or "cannot create the folder a_file for a_file/bundle" in err
    assert (tmp_path / "a_file").read_text() == "x"


def test_archive_onto_a_folder(tmp_path, small_bundle_dir):
    (tmp_path / "b.tar").mkdir()
    with pytest.raises(BundleError, match=r"cannot write the archive .*/b\.tar: it exists and is not a regular file"):
        build_bundle(load_profile("orin"), tmp_path / "b", small_bundle_dir / "model.colibri", archive=True)
    assert not (tmp_path / "b.tar.partial").exists()


# ---- manifest -------------------------------------------------------------------------------------------------------
def test_manifest_nested_too_deeply(bundle, capsys):
    (bundle / "manifest.json").write_text("[" * 100_000)
    assert "manifest.json: not valid JSON (maximum recursion depth exceeded" in cli_error(capsys, "inspect", str(bundle))


@pytest.mark.parametrize("path", ["/tmp/evil.npy", "../evil.npy", "selftest/../../evil.npy"])
def test_selftest_path_outside_the_bundle(bundle, path):
    manifest = load_manifest(bundle)
    manifest["selftest"]["input"] = path
    save_manifest(bundle, manifest)
    with pytest.raises(BundleError, match=rf"selftest\.input: path '{path}'; allowed: a normalised relative path"):
        Bundle.open(bundle, verify=False)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["weights"]["header"].pop("hidden_size"), r"weights\.header\.hidden_size = None; allowed: int"),
        (lambda m: m["weights"]["header"].update(hidden_size="64"), r"weights\.header\.hidden_size = '64'; allowed: int"),
        (lambda m: m["kernels"][0].update(resources={"k": {}}), r"kernels\[0\]\.resources\.k\.registers = None"),
        (lambda m: m["kernels"][0].update(resources={"k": 5}), r"kernels\[0\]\.resources\.k = 5; allowed: dict"),
        (lambda m: m["shape"].update(batch=-1), r"shape\.batch = -1; allowed: 1\.\.65536"),
        (lambda m: m["shape"].update(tokens=0), r"shape\.tokens = 0; allowed: 1\.\.65536"),
        (lambda m: m["shape"].update(batch=65536, tokens=65536), r"shape batch\*tokens = 4294967296; allowed: at most"),
    ],
    ids=["header-missing", "header-str", "resources-empty", "resources-int", "batch-negative", "tokens-zero",
         "shape-huge"],
)
def test_manifest_values_that_crashed_inspect_or_the_runtime(bundle, capsys, edit, message):
    manifest = load_manifest(bundle)
    edit(manifest)
    save_manifest(bundle, manifest)
    for command in (["inspect", str(bundle)], ["run", str(bundle), "--backend", "cpu", "--iters", "1"]):
        err = cli_error(capsys, *command)
        assert re.search(message, err), err


def test_manifest_header_that_does_not_match_the_weights(bundle):
    manifest = load_manifest(bundle)
    manifest["weights"]["header"]["hidden_size"] = 32
    save_manifest(bundle, manifest)
    with pytest.raises(BundleError, match=r"model\.colibri: header hidden_size = 64, but the manifest's "
                                          r"weights\.header\.hidden_size = 32"):
        Runtime.load(bundle, backend="cpu")


def test_symlinked_kernels_folder_is_refused(bundle, small_bundle_dir):
    shutil.rmtree(bundle / "kernels")
    os.symlink(small_bundle_dir / "kernels", bundle / "kernels")
    for verify in (True, False):
        with pytest.raises(BundleError, match=r"^kernels: a symbolic link; a bundle is read only through regular"):
            Bundle.open(bundle, verify=verify)


# ---- self-test vectors ----------------------------------------------------------------------------------------------
def _replace_selftest(bundle, key: str, write) -> None:
    path = bundle / "selftest" / f"{key}.npy"
    write(path)
    save_manifest(bundle, load_manifest(bundle), rehash=(f"selftest/{key}.npy",))


class _Boom:
    def __reduce__(self):
        return (os.remove, ("/nonexistent-robustness-canary",))


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: np.save(p, np.array([_Boom()], dtype=object), allow_pickle=True),
         r"cannot load the self-test input: Object arrays cannot be loaded when allow_pickle=False"),
        (lambda p: p.write_bytes(pickle.dumps(_Boom())), r"cannot load the self-test input: .*pickled"),
        (lambda p: np.save(p, np.load(p).astype(np.int32)), r"the self-test input is dtype int32; allowed: a float32"),
        (lambda p: np.save(p, np.load(p).astype(np.complex64)), r"the self-test input is dtype complex64; allowed"),
    ],
    ids=["object-array", "raw-pickle", "int32", "complex64"],
)
def test_bad_selftest_input(bundle, capsys, write, message):
    _replace_selftest(bundle, "input", write)
    err = cli_error(capsys, "verify", str(bundle), "--backend", "cpu")
    assert re.search(message, err), err


def test_selftest_output_of_strings(bundle, capsys):
    _replace_selftest(bundle, "output", lambda p: np.save(p, np.array(["a"] * 4)))
    assert "the self-test output is dtype <U1; allowed: a float32 .npy array" in cli_error(
        capsys, "verify", str(bundle), "--backend", "cpu"
    )


def test_manifest_that_is_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(BundleError, match=r"manifest\.json: not a regular file; the manifest must be a JSON file$"):
        Bundle.open(tmp_path)
