"""`colibri-sdk verify --rebuild` (colibri_sdk.aot.rebuild, docs/build.md "Checking a bundle against its sources"):
a cubin planted in the NVRTC cache, with its digest recomputed, passes `build` and plain `verify`; the rebuild names
it. An honest bundle passes; a bundle that records no NVRTC inputs, another NVRTC version and edited kernel sources
are refused, each in one line."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from colibri_sdk import catalog, cli
from colibri_sdk.aot.cache import NvrtcCache, decode_entry, encode_entry
from colibri_sdk.aot.nvrtc import CompiledSource
from colibri_sdk.bundle.manifest import DIGEST_KEY, canonical_json, manifest_digest
from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.profile import Profile, load_profile


def small_profile() -> Profile:
    data = copy.deepcopy(load_profile("orin").data)
    data["shape"] = {"batch": 1, "tokens": [1, 2]}  # two shapes: images of both are rebuilt
    return Profile.from_dict(data, "orin 1x1,1x2")


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """(root, the bundle built through an empty cache folder root/cache)."""
    root = tmp_path_factory.mktemp("rebuild")
    built = build_bundle(small_profile(), root / "honest", nvrtc_cache=NvrtcCache(root / "cache"), workers=2)
    return root, built.path


def verify(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["verify", *map(str, args), "--no-selftest", "--rebuild"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rewrite_manifest(bundle: Path, change) -> None:
    """Edit manifest.json and recompute its digest (what anyone who can write the bundle can do)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    change(manifest)
    manifest[DIGEST_KEY] = manifest_digest(manifest)
    (bundle / "manifest.json").write_bytes(canonical_json(manifest))


def test_an_honest_bundle_is_identical_to_its_rebuild(honest, capsys):
    _, bundle = honest
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert len(manifest["shapes"]) == 2
    inputs = manifest["kernels"][0]["inputs"]
    assert "-I<kernels>" in inputs["options"] and not any(str(Path.home()) in o for o in inputs["options"])
    assert sorted(inputs["headers"]) == ["common.cuh"]
    code, out, err = verify(capsys, bundle)
    images = 2 * sum(len(s["kernels"]) for s in manifest["shapes"])
    assert (code, err) == (0, "")
    assert f"  rebuild: {images} images ({images // 2} compilations, NVRTC {manifest['nvrtc_version']}, no cache) " \
           "identical to the bundle's\n" in out


def test_a_forged_cache_entry_passes_build_and_verify_but_not_the_rebuild(honest, tmp_path, capsys, monkeypatch):
    root, _ = honest
    folder = tmp_path / "cache"
    shutil.copytree(root / "cache", folder)
    forged = 0
    for path in sorted(folder.glob("*.nvrtc")):
        key = path.name.removesuffix(".nvrtc")
        entry = decode_entry(path.read_bytes(), key)
        if b"colibri_routing" not in entry.cubin:
            continue
        cubin = bytearray(entry.cubin)
        cubin[-1] ^= 0xFF  # past the ELF header: the arch check and the resource report are unchanged
        path.write_bytes(encode_entry(key, CompiledSource(bytes(cubin), entry.ptx, entry.log, entry.resources,
                                                          entry.options)))
        forged += 1
    assert forged == 2  # routing.cu at both shapes
    out = tmp_path / "forged"
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(folder))
    assert cli.main(["build", "--profile", "orin", "--demo", "--batch", "1", "--tokens", "1,2", "-o", str(out)]) == 0
    count = len(list(folder.glob("*.nvrtc")))
    assert f"  nvrtc cache: {count} of {count} compilations from the cache" in capsys.readouterr().out  # forged too
    assert cli.main(["verify", str(out), "--no-selftest"]) == 0  # the checksums are those of what was written
    capsys.readouterr()
    code, stdout, err = verify(capsys, out)
    assert code == 3
    lines = [line for line in stdout.splitlines() if line.startswith("  rebuild: ")]
    arch = small_profile().arch
    assert len(lines) == 2, stdout
    assert lines[0].startswith(f"  rebuild: kernels/routing.b1t1.{arch}.cubin: differs from NVRTC's output for "
                               "routing.cu (routing, batch 1 x tokens 1): ")
    assert lines[1].startswith(f"  rebuild: kernels/routing.{arch}.cubin: differs from NVRTC's output for "
                               "routing.cu (routing, batch 1 x tokens 2): ")
    assert lines[1].endswith(", first difference at byte " + f"{(out / f'kernels/routing.{arch}.cubin').stat().st_size - 1:,}")
    assert err.startswith(f"colibri-sdk verify: error: {out}: 2 of ") and "build it again with --no-cache" in err
    assert err.count("\n") == 1


def test_a_bundle_without_recorded_inputs_is_refused(honest, tmp_path, capsys):
    _, bundle = honest
    old = tmp_path / "old"
    shutil.copytree(bundle, old)

    def drop(manifest):
        for entry in [*manifest["kernels"], *(k for s in manifest["shapes"] for k in s["kernels"])]:
            entry.pop("inputs", None)

    rewrite_manifest(old, drop)
    code, _, err = verify(capsys, old)
    assert code == 1
    assert err.startswith(f"colibri-sdk verify: error: {old}: kernel routing (batch 1 x tokens 1) records no NVRTC "
                          "inputs (kernels[].inputs): the bundle was written by colibri-sdk ")
    assert err.endswith(", before --rebuild existed; build it again with this colibri-sdk (--no-cache) to check it\n")
    assert cli.main(["verify", str(old), "--no-selftest"]) == 0  # everything else still reads it


def test_another_nvrtc_version_is_refused(honest, tmp_path, capsys):
    _, bundle = honest
    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    rewrite_manifest(other, lambda m: m.update(nvrtc_version="12.0"))
    code, _, err = verify(capsys, other)
    assert code == 1
    assert f"{other} was built with NVRTC 12.0; the installed NVRTC is " in err
    assert "a rebuild here proves nothing" in err and err.count("\n") == 1


@pytest.mark.parametrize("edited", ["routing.cu", "common.cuh"])
def test_kernel_sources_that_differ_from_the_recorded_ones_are_refused(honest, tmp_path, capsys, edited):
    _, bundle = honest
    kernels = tmp_path / "kernels"
    shutil.copytree(catalog.kernel_dir(), kernels, ignore=shutil.ignore_patterns("__pycache__"))
    with open(kernels / edited, "a", encoding="utf-8") as fh:
        fh.write("\n// an edit\n")
    code, _, err = verify(capsys, bundle, "--kernels", kernels)
    assert code == 1
    if edited == "routing.cu":
        assert f"{kernels / edited}: sha256 " in err and "differs from the source the bundle was built from" in err
    else:
        assert f"{kernels}: header(s) ['common.cuh'] differ from the ones the bundle was built from" in err
    assert "--kernels DIR" in err and err.count("\n") == 1
    if edited == "routing.cu":  # once: with the edit undone both cases hold the same folder (a full NVRTC rebuild)
        shutil.copy(catalog.kernel_dir() / edited, kernels / edited)
        assert verify(capsys, bundle, "--kernels", kernels)[0] == 0  # the same sources from another folder


@pytest.mark.parametrize("name", ["missing", "a_file"])
def test_kernels_that_is_not_a_folder_is_named_in_one_line(honest, tmp_path, capsys, name):
    _, bundle = honest
    kernels = tmp_path / name
    if name == "a_file":
        kernels.write_text("")
    code, _, err = verify(capsys, bundle, "--kernels", kernels)
    what = "no such folder" if name == "missing" else "not a folder"
    assert code == 1
    assert err == f"colibri-sdk verify: error: --kernels {kernels}: {what}; allowed: a folder with the kernel " \
                  "sources (*.cu, common.cuh) the bundle was built from\n"


def test_recorded_options_that_differ_are_named_by_the_first_difference(honest, tmp_path, capsys):
    _, bundle = honest
    copy_ = tmp_path / "b"
    shutil.copytree(bundle, copy_)

    def change(manifest):
        for kernels in [manifest["kernels"]] + [s["kernels"] for s in manifest["shapes"]]:
            for entry in kernels:
                entry["inputs"]["options"] = entry["inputs"]["options"] + ["--extra-device-vectorization"]

    rewrite_manifest(copy_, change)
    code, _, err = verify(capsys, copy_)
    assert code == 1 and err.count("\n") == 1
    assert re.search(r"NVRTC option (\d+) here is \(none\), recorded '--extra-device-vectorization' \((\d+) options "
                     r"here, (\d+) recorded\)", err), err
    assert len(err) < 400


def test_kernels_without_rebuild_is_a_usage_error(honest, capsys):
    _, bundle = honest
    assert cli.main(["verify", str(bundle), "--no-selftest", "--kernels", "somewhere"]) == 1
    assert "--kernels DIR is for --rebuild" in capsys.readouterr().err


@pytest.mark.parametrize("change,match", [
    (lambda k: k["inputs"].update(source_sha256="zz"), r"inputs\.source_sha256 = 'zz'; allowed: 64 lowercase hex digits"),
    (lambda k: k["inputs"].update(options="-arch=sm_87"), r"inputs\.options = '-arch=sm_87'; allowed: list"),
    (lambda k: k["inputs"].update(extra=1), r"unknown keys \['extra'\] in kernel routing"),
    (lambda k: k.update(source="../../../etc/passwd"), r"source = '\.\./\.\./\.\./etc/passwd'; allowed: one of the catalogue's sources"),
    (lambda k: k["defines"].update(COLIBRI_THREADS="128"), r"defines\.COLIBRI_THREADS = '128'; allowed: an integer"),
], ids=["digest", "options", "unknown-key", "source-path", "define"])
def test_malformed_inputs_are_refused_in_one_line(honest, tmp_path, capsys, change, match):
    _, bundle = honest
    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)

    def edit(manifest):
        for entry in [manifest["kernels"][0], manifest["shapes"][-1]["kernels"][0]]:  # the top level = the last shape
            change(entry)

    rewrite_manifest(bad, edit)
    code, _, err = verify(capsys, bad)
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(match, err), err
