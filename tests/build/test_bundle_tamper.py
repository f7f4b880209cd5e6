"""Bundle integrity: a changed byte anywhere (manifest.json included), a missing, truncated or extra file is refused
with the file's name, by `Bundle.open` and by `colibri-sdk verify`."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from colibri_sdk import catalog, cli
from colibri_sdk.bundle import Bundle, canonical_json, manifest_digest
from colibri_sdk.errors import BundleError


@pytest.fixture(scope="module")
def bundle_copy(built, tmp_path_factory):
    """A private copy of the orin bundle; each test restores what it changes."""
    path = tmp_path_factory.mktemp("tamper") / "orin"
    shutil.copytree(built["orin"].path, path)
    return path


def files_of(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


def test_every_file_is_covered(bundle_copy):
    """Flip one byte in the middle of each file in turn: each is refused naming that file."""
    names = files_of(bundle_copy)
    # orin compiles batch 1 and 4 x tokens 16: per shape a cubin + PTX per compiled kernel (no capacity) and 2
    # self-test files; the weights; the manifest
    per_shape = 2 * len(catalog.kernels_for({})) + 2
    assert len(names) == 2 * per_shape + 2 and "manifest.json" in names
    assert "kernels/routing.b1t16.sm_87.cubin" in names
    for rel in names:
        target = bundle_copy / rel
        data = bytearray(target.read_bytes())
        original = bytes(data)
        middle = len(data) // 2
        data[middle] ^= 0x01
        target.write_bytes(bytes(data))
        try:
            with pytest.raises(BundleError) as info:
                Bundle.open(bundle_copy)
            assert str(info.value).startswith(f"{rel}:") or f"{rel}:" in str(info.value), str(info.value)
        finally:
            target.write_bytes(original)
    Bundle.open(bundle_copy)  # restored: valid again


def test_manifest_value_edit_in_canonical_form_is_refused(bundle_copy):
    path = bundle_copy / "manifest.json"
    original = path.read_bytes()
    manifest = json.loads(original)
    manifest["selftest"]["rtol"] = 0.5  # loosen the self-test, keep canonical form
    manifest["shapes"][-1]["selftest"]["rtol"] = 0.5  # the largest shape's entry is the top-level one
    path.write_bytes(canonical_json(manifest))
    try:
        with pytest.raises(BundleError, match=r"manifest.json: content sha256 [0-9a-f]{64} differs from the recorded manifest_sha256"):
            Bundle.open(bundle_copy)
        # Schema-only opening (inspect) still reads it.
        assert Bundle.open(bundle_copy, verify=False).manifest["selftest"]["rtol"] == 0.5
    finally:
        path.write_bytes(original)


def test_manifest_reformatted_is_refused(bundle_copy):
    path = bundle_copy / "manifest.json"
    original = path.read_bytes()
    path.write_bytes(json.dumps(json.loads(original), indent=4, sort_keys=True).encode() + b"\n")
    try:
        with pytest.raises(BundleError, match=r"manifest.json: not in canonical form"):
            Bundle.open(bundle_copy)
    finally:
        path.write_bytes(original)


def test_weights_swapped_with_recomputed_manifest_entry_but_stale_digest(bundle_copy):
    """Editing a file and its manifest entry consistently still breaks the manifest digest."""
    from colibri_sdk.bundle import file_sha256

    mpath, wpath = bundle_copy / "manifest.json", bundle_copy / "selftest" / "output.npy"
    m_orig, w_orig = mpath.read_bytes(), wpath.read_bytes()
    try:
        expected = np.load(wpath)
        np.save(wpath, np.zeros_like(expected))
        manifest = json.loads(m_orig)
        entry = next(e for e in manifest["files"] if e["path"] == "selftest/output.npy")
        entry["sha256"], entry["size"] = file_sha256(wpath), wpath.stat().st_size
        mpath.write_bytes(canonical_json(manifest))
        with pytest.raises(BundleError, match="manifest.json: content sha256"):
            Bundle.open(bundle_copy)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        assert Bundle.open(bundle_copy).selftest()[1].max() == 0  # consistent edits are not a signature check
    finally:
        mpath.write_bytes(m_orig)
        wpath.write_bytes(w_orig)


@pytest.mark.parametrize("section, key, value, message", [
    ("small_batch", None, "", r"kernels\.small_batch is str ''; allowed: a mapping of \["),
    ("routing", "block_m", 0, r"kernels\.routing\.block_m = 0: must be in 1\.\.128"),
    ("small_batch", "max_pairs_quantized", -1, r"kernels\.small_batch\.max_pairs_quantized = -1: must be in 0\.\.4096"),
    ("small_batch", "max_pairs_quantized", 1.5, r"kernels\.small_batch\.max_pairs_quantized = 1\.5: must be an integer, got float"),
    ("small_batch", "max_pairs_quantized", True, r"kernels\.small_batch\.max_pairs_quantized = True: must be an integer, got bool"),
    ("small_batch", "max_pairs", None, r"kernels\.small_batch\.max_pairs = None: must be an integer, got NoneType"),
    ("small_batch", "max_pairs", [16], r"kernels\.small_batch\.max_pairs = \[16\]: must be an integer, got list"),
], ids=["small_batch-str", "block_m-0", "max_pairs_quantized--1", "max_pairs_quantized-1.5",
        "max_pairs_quantized-true", "max_pairs-null", "max_pairs-list"])
def test_an_invalid_profile_in_a_consistent_manifest_is_a_bundle_error(bundle_copy, section, key, value, message):
    """A manifest edited consistently (digest recomputed: an integrity check, not a signature) whose recorded
    profile holds a value the profile schema refuses: a BundleError naming the key, the value and what is allowed,
    whether or not the catalogue could still plan it (a string for a mapping and block_m 0 had been a TypeError and
    a ZeroDivisionError; max_pairs_quantized -1, 1.5 or true had been accepted)."""
    mpath = bundle_copy / "manifest.json"
    original = mpath.read_bytes()
    try:
        manifest = json.loads(original)
        if key is None:
            manifest["profile"]["kernels"][section] = value
        else:
            manifest["profile"]["kernels"][section][key] = value
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        with pytest.raises(BundleError, match=r"manifest\.json: profile: " + message):
            Bundle.open(bundle_copy)
        with pytest.raises(BundleError, match=message):
            Bundle.open(bundle_copy, verify=False)
    finally:
        mpath.write_bytes(original)


@pytest.mark.parametrize("capacity, message", [
    ({"mode": "hard"}, r"capacity.*factor"),
    ({"factor": "1"}, r"capacity.*factor"),
])
def test_an_invalid_recorded_capacity_is_a_bundle_error(bundle_copy, capsys, capacity, message):
    """A re-digested manifest whose recorded capacity the capacity rule refuses: a BundleError from open (and a
    one-line `inspect` error), not inspect's KeyError / ValueError while describing it."""
    mpath = bundle_copy / "manifest.json"
    original = mpath.read_bytes()
    try:
        manifest = json.loads(original)
        manifest["profile"]["capacity"] = capacity
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        with pytest.raises(BundleError, match=r"manifest\.json: profile: " + message):
            Bundle.open(bundle_copy, verify=False)
        assert cli.main(["inspect", str(bundle_copy)]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    finally:
        mpath.write_bytes(original)


def test_a_partial_recorded_profile_is_read(bundle_copy):
    """A recorded profile without keys added after its bundle was built (here the optional max_pairs_quantized and
    description) opens: missing keys take the catalogue's defaults; only values present are checked."""
    mpath = bundle_copy / "manifest.json"
    original = mpath.read_bytes()
    try:
        manifest = json.loads(original)
        manifest["profile"]["kernels"]["small_batch"].pop("max_pairs_quantized", None)
        manifest["profile"].pop("description", None)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        assert Bundle.open(bundle_copy, verify=False).manifest["profile"]["kernels"]["small_batch"]
    finally:
        mpath.write_bytes(original)


def test_the_cuda_plan_check_of_an_unplannable_profile_is_a_bundle_error(bundle_copy):
    """The CUDA backend's first check (cuda_image.checked_launch_plan) on a shape's manifest whose profile has a
    null max_pairs: a BundleError, not int()'s TypeError (it runs without a GPU)."""
    from colibri_sdk.runtime.cuda_image import checked_launch_plan

    bundle = Bundle.open(bundle_copy, verify=False)
    view = bundle.for_shape(1, 16)
    manifest = json.loads(json.dumps(view.manifest))
    manifest["profile"]["kernels"]["small_batch"]["max_pairs"] = None
    with bundle.open_weights() as opened:
        with pytest.raises(BundleError, match=r"manifest.json: kernels\[\].defines: the catalogue cannot plan the "
                                              r"manifest's profile at batch 1 x tokens 16 \(TypeError"):
            checked_launch_plan(manifest, opened.header)


def test_inspect_shows_a_profile_name_with_an_escape_sequence_escaped(bundle_copy, capsys):
    """A consistent manifest whose profile name holds a terminal escape: `inspect` prints its ascii() form."""
    mpath = bundle_copy / "manifest.json"
    original = mpath.read_bytes()
    try:
        manifest = json.loads(original)
        manifest["profile"]["name"] = "a\x1b[2Jb"
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        assert cli.main(["inspect", str(bundle_copy)]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "'a\\x1b[2Jb'" in out
    finally:
        mpath.write_bytes(original)


def test_missing_truncated_and_extra_files(bundle_copy):
    cubin = bundle_copy / "kernels" / "gate_up.sm_87.cubin"
    original = cubin.read_bytes()
    cubin.unlink()
    try:
        with pytest.raises(BundleError, match=r"kernels/gate_up.sm_87.cubin: listed in the manifest but missing"):
            Bundle.open(bundle_copy)
        cubin.write_bytes(original[:-1])
        with pytest.raises(BundleError, match=rf"kernels/gate_up.sm_87.cubin: {len(original) - 1} bytes; the manifest records {len(original)}"):
            Bundle.open(bundle_copy)
    finally:
        cubin.write_bytes(original)
    extra = bundle_copy / "kernels" / "extra.sm_87.cubin"
    extra.write_bytes(original)
    try:
        with pytest.raises(BundleError, match=r"kernels/extra.sm_87.cubin: not listed in the manifest"):
            Bundle.open(bundle_copy)
    finally:
        extra.unlink()
    Bundle.open(bundle_copy)


def test_schema_faults(bundle_copy, tmp_path):
    with pytest.raises(BundleError, match=r"none is not a bundle folder \(no such directory\)$"):
        Bundle.open(tmp_path / "none")
    (tmp_path / "model.colibri").write_bytes(b"COLI")  # a file given where a bundle folder goes
    with pytest.raises(BundleError, match=r"model.colibri is not a bundle folder \(a file; `colibri-sdk build` makes"):
        Bundle.open(tmp_path / "model.colibri")
    (tmp_path / "model.colibri").unlink()
    os.mkfifo(tmp_path / "fifo")  # neither a file nor a folder
    with pytest.raises(BundleError, match=r"fifo is not a bundle folder \(not a directory\)$"):
        Bundle.open(tmp_path / "fifo")
    (tmp_path / "fifo").unlink()
    with pytest.raises(BundleError, match="manifest.json: cannot read the manifest"):
        Bundle.open(tmp_path)
    path = bundle_copy / "manifest.json"
    original = path.read_bytes()
    try:
        for change, match in [
            ({"schema_version": 2}, r"schema_version = 2; this SDK reads schema_version 1"),
            ({"dtype": "bf16"}, r"dtype = 'bf16'; allowed: \('fp16', 'fp32'\)"),
            ({"extra": 1}, r"unknown keys \['extra'\]"),
            ({"min_driver": "12020"}, r"min_driver = '12020'; allowed: int"),
        ]:
            manifest = json.loads(original)
            manifest.update(change)
            path.write_bytes(canonical_json(manifest))
            with pytest.raises(BundleError, match=match):
                Bundle.open(bundle_copy, verify=False)
        manifest = json.loads(original)
        del manifest["kernels"]
        path.write_bytes(canonical_json(manifest))
        with pytest.raises(BundleError, match=r"missing key 'kernels'"):
            Bundle.open(bundle_copy, verify=False)
        manifest = json.loads(original)
        manifest["files"][0]["path"] = "../outside"
        path.write_bytes(canonical_json(manifest))
        with pytest.raises(BundleError, match=r"files\[0\].path: path '../outside'; allowed: a normalised relative path"):
            Bundle.open(bundle_copy, verify=False)
        path.write_bytes(original[:100])
        with pytest.raises(BundleError, match="manifest.json: not valid JSON"):
            Bundle.open(bundle_copy, verify=False)
    finally:
        path.write_bytes(original)


def test_accessors(bundle_copy):
    bundle = Bundle.open(bundle_copy)
    assert bundle.kernel_image("routing", "cubin")[:4] == b"\x7fELF"
    allowed = re.escape(repr([spec.name for spec in catalog.kernels_for({})]))
    with pytest.raises(BundleError, match=rf"no kernel 'softmax' in .*; allowed: {allowed}"):
        bundle.kernel_image("softmax", "cubin")
    with pytest.raises(BundleError, match=r"kernel image kind 'sass'; allowed: \('cubin', 'ptx'\)"):
        bundle.kernel_image("routing", "sass")
    with bundle.open_weights() as weights:
        assert weights.header.hidden_size == 256
    assert bundle.weights_path == bundle_copy / "model.colibri"
    assert repr(bundle).endswith("arch=sm_87, dtype=fp16, shape=(4, 16))")
    assert bundle.shapes == [(1, 16), (4, 16)]
    small = bundle.for_shape(1, 16)
    assert small.shape == (1, 16) and small.manifest["profile"]["shape"] == {"batch": 1, "tokens": 16}
    assert small.kernel("routing")["cubin"] == "kernels/routing.b1t16.sm_87.cubin"
    assert small.selftest()[0].shape == (1, 16, 256) and bundle.selftest()[0].shape == (4, 16, 256)
    with pytest.raises(BundleError, match=r"no compiled shape batch 2 x tokens 16; allowed: \[\(1, 16\), \(4, 16\)\]"):
        bundle.for_shape(2, 16)


def test_verify_cli(bundle_copy, capsys):
    assert cli.main(["verify", str(bundle_copy), "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    files = 2 * (2 * len(catalog.kernels_for({})) + 2) + 1
    assert f"schema 1, {files} files + manifest, checksums ok" in out and "self-test passed on cpu" in out
    target = bundle_copy / "selftest" / "input.npy"
    original = target.read_bytes()
    target.write_bytes(original[:-4] + b"\x00\x00\x80\x7f")
    try:
        assert cli.main(["verify", str(bundle_copy), "--backend", "cpu"]) == 1
        err = capsys.readouterr().err
        assert "colibri-sdk verify: error: selftest/input.npy: sha256" in err
    finally:
        target.write_bytes(original)


def test_verify_cli_fails_on_a_wrong_expected_output(bundle_copy, capsys):
    """A self-test whose stored output does not match what the backend computes fails verify (exit 1)."""
    mpath, opath = bundle_copy / "manifest.json", bundle_copy / "selftest" / "output.npy"
    m_orig, o_orig = mpath.read_bytes(), opath.read_bytes()
    try:
        from colibri_sdk.bundle import file_sha256

        np.save(opath, np.load(opath) + 1.0)
        manifest = json.loads(m_orig)
        entry = next(e for e in manifest["files"] if e["path"] == "selftest/output.npy")
        entry["sha256"] = file_sha256(opath)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        mpath.write_bytes(canonical_json(manifest))
        assert cli.main(["verify", str(bundle_copy), "--backend", "cpu"]) == 1
        assert "self-test failed" in capsys.readouterr().err
    finally:
        mpath.write_bytes(m_orig)
        opath.write_bytes(o_orig)
