"""`colibri-sdk build`: every shipped profile built from scratch with the real kernels, checked file by file."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from colibri_sdk import catalog, cli
from colibri_sdk.bundle.writer import SELFTEST_SEED, build_bundle
from colibri_sdk.aot.cubin import cubin_sm
from colibri_sdk.bundle import Bundle, canonical_json, file_sha256
from colibri_sdk.demo import DEMO_SIZES
from colibri_sdk.errors import BundleError, CompileError, FormatError
from colibri_sdk.format import ColibriFile, Header, write_model
from colibri_sdk.profile import Profile, load_profile

SHIPPED = ("a100", "h200", "orin", "rtx4090")
RESOURCE_KEYS = {"registers", "shared_bytes", "stack_bytes", "spill_store_bytes", "spill_load_bytes"}


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_bundle(built, name):
    result = built[name]
    profile = load_profile(name)
    bundle = Bundle.open(result.path)  # schema, sizes and sha256 of every file
    m = bundle.manifest
    assert bundle.arch == profile.arch and m["compute_capability"] == list(profile.compute_capability)
    assert bundle.shape == profile.shape and bundle.dtype == profile.dtype == "fp16"
    assert m["profile"] == profile.to_dict()
    assert m["nvrtc_version"].startswith("12.") and m["min_driver"] == profile.min_driver
    assert m["weights"]["header"] == {**DEMO_SIZES, "dtype": 1, "routing": 0, "composition": 1, "version": 0x0100}
    sm = int(profile.arch[3:])
    specs = catalog.kernels_for(profile.to_dict())  # dropless: every catalogue kernel but the capacity kernel
    assert [k["name"] for k in m["kernels"]] == [k.name for k in specs] == [
        k.name for k in catalog.KERNELS if k.name != "capacity"]
    for spec, entry in zip(specs, m["kernels"]):
        assert entry["cubin"] == f"kernels/{spec.name}.{profile.arch}.cubin"
        cubin = bundle.kernel_image(spec.name, "cubin")
        assert cubin_sm(cubin) == sm, f"{entry['cubin']} is not sm_{sm}"
        ptx = bundle.kernel_image(spec.name, "ptx")
        assert f".target {profile.arch}".encode() in ptx and not ptx.endswith(b"\x00")
        for symbol in spec.symbols:
            assert f".entry {symbol}(".encode() in ptx
        assert set(entry["resources"]) == set(spec.symbols)
        for symbol, r in entry["resources"].items():
            assert set(r) == RESOURCE_KEYS
            assert r["registers"] > 0 and r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
            assert r["shared_bytes"] <= profile.hardware["shared_memory_per_block"]
        assert entry["defines"]["COLI_HIDDEN"] == 256 and entry["defines"]["COLI_TOPK"] == 2
    header = bundle.open_weights().header
    assert m["launch"] == catalog.launch_plan(profile.for_shape(*profile.shape).to_dict(), header)
    # Every compiled shape: its own launch plan and kernels (COLI_MAX_TOKENS = its batch*tokens), largest last.
    assert [(s["batch"], s["tokens"]) for s in m["shapes"]] == profile.shapes and len(profile.shapes) >= 2
    for entry in m["shapes"]:
        b, t = entry["batch"], entry["tokens"]
        assert entry["launch"] == catalog.launch_plan(profile.for_shape(b, t).to_dict(), header)
        assert {k["defines"]["COLI_MAX_TOKENS"] for k in entry["kernels"]} == {b * t}
        assert bundle.for_shape(b, t).selftest()[0].shape == (b, t, 256)
    assert m["shapes"][-1]["kernels"] == m["kernels"] and m["shapes"][-1]["selftest"] == m["selftest"]
    listed = [f["path"] for f in m["files"]]
    on_disk = sorted(p.relative_to(result.path).as_posix() for p in result.path.rglob("*") if p.is_file())
    assert listed == sorted(listed) and sorted(listed + ["manifest.json"]) == on_disk


@pytest.mark.parametrize("name", SHIPPED)
def test_selftest_vectors(built, name):
    bundle = Bundle.open(built[name].path, verify=False)
    x, expected, rtol, atol = bundle.selftest()
    batch, tokens = bundle.shape
    assert x.shape == expected.shape == (batch, tokens, 256)
    assert x.dtype == expected.dtype == np.float32
    seed = bundle.manifest["selftest"]["seed"]
    assert SELFTEST_SEED <= seed < SELFTEST_SEED + 32
    np.testing.assert_array_equal(x, np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32))
    # Residual composition: the output is the input plus four MoE layers, not the input itself or zero.
    assert np.abs(expected - x).max() > 0.1
    assert (rtol, atol) == (1e-2, 1e-2)


def test_manifest_is_canonical_and_resources_printed(built, capsys):
    path = built["orin"].path
    raw = (path / "manifest.json").read_bytes()
    assert raw == canonical_json(json.loads(raw)) and raw.endswith(b"}\n")
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "colibri_gate_up" in out and "spill st" in out and "sm_87 (compute capability 8.7)" in out
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["arch"] == "sm_87" and info["files"] == json.loads(raw)["files"]
    assert info["launches"] == len(json.loads(raw)["launch"]) > 0


def test_reproducible_byte_for_byte(built, kernel_dir, tmp_path):
    """The rebuild runs NVRTC itself (not the NVRTC cache), so equal bytes show that NVRTC is reproducible too."""
    first = built["orin"]
    again = build_bundle(load_profile("orin"), tmp_path / "orin", kernel_dir=kernel_dir, archive=True,
                         nvrtc_cache=False)
    assert tree_bytes(again.path) == tree_bytes(first.path)
    assert again.archive.read_bytes() == first.archive.read_bytes()


def test_archive_is_normalised(built):
    with tarfile.open(built["orin"].archive) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[0] == "orin" and "orin/manifest.json" in names and "orin/kernels/routing.sm_87.cubin" in names
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in members)
        files = {m.name: tar.extractfile(m).read() for m in members if m.isfile()}
    assert files == {f"orin/{k}": v for k, v in tree_bytes(built["orin"].path).items()}


def test_cli_build_prints_the_resource_table(kernel_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["build", "--profile", "rtx4090", "--demo"]) == 0
    out = capsys.readouterr().out
    assert "bundles/rtx4090: geforce-rtx-4090 (sm_89, fp16" in out
    for symbol in ("colibri_routing", "colibri_align", "colibri_gate_up", "colibri_down", "colibri_down_tc"):
        assert symbol in out
    assert (tmp_path / "bundles" / "rtx4090" / "kernels" / "routing.sm_89.cubin").is_file()
    # A second build replaces the earlier bundle in place only with --force.
    assert cli.main(["build", "--profile", "rtx4090", "--demo", "-o", "bundles/rtx4090"]) == 1
    assert "bundles/rtx4090 exists (a bundle); refusing to replace it without --force" in capsys.readouterr().err
    assert cli.main(["build", "--profile", "rtx4090", "--demo", "-o", "bundles/rtx4090", "--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["rtx4090"]


def tiny_weights(path: Path, dtype: int = 0, scale: float = 1.0) -> Path:
    """A 2-layer, 4-expert fp32 or fp16 .colibri file with odd sizes (tails in every tile)."""
    header = Header(num_layers=2, num_experts=4, top_k=2, hidden_size=40, intermediate_size=72, dtype=dtype)
    rng = np.random.default_rng(5)
    gate = rng.standard_normal((2, 4, 72, 40)) * 0.2 * scale
    up = rng.standard_normal((2, 4, 72, 40)) * 0.2
    down = rng.standard_normal((2, 4, 40, 72)) * 0.2
    router = rng.standard_normal((2, 40, 4))
    return write_model(path, header, gate, up, down, router)


def orin_one_shape() -> dict:
    """The orin profile at one of its shapes (batch 1 x tokens 16), as a dict: half the compilations of both."""
    data = load_profile("orin").to_dict()
    data["shape"] = {**data["shape"], "batch": 1}
    return data


def fp32_profile(**changes) -> Profile:
    data = orin_one_shape()
    data["dtype"] = "fp32"
    for key, value in changes.items():
        section, name = key.split("__")
        data[section][name] = value
    return Profile.from_dict(data, "fp32-orin.yaml")


def test_weights_converted_to_the_profile_dtype(kernel_dir, tmp_path):
    weights = tiny_weights(tmp_path / "w16.colibri", dtype=1)
    result = build_bundle(fp32_profile(), tmp_path / "b32", weights, kernel_dir=kernel_dir)
    bundle = Bundle.open(result.path)
    with ColibriFile(weights) as src, bundle.open_weights() as dst:
        assert dst.header == dataclasses.replace(src.header, dtype=0)
        np.testing.assert_array_equal(dst.block("gate_proj"), src.block("gate_proj").astype(np.float32))
    assert bundle.manifest["kernels"][0]["defines"]["COLI_FP16"] == 0
    assert bundle.manifest["selftest"]["rtol"] == 1e-4
    # Same dtype: copied byte for byte.
    same = build_bundle(Profile.from_dict(orin_one_shape(), "orin 1x16"), tmp_path / "b16", weights,
                        kernel_dir=kernel_dir)
    assert file_sha256(same.path / "model.colibri") == file_sha256(weights)


def test_fp16_overflow_when_converting_is_refused(kernel_dir, tmp_path):
    weights = tiny_weights(tmp_path / "w32.colibri", dtype=0, scale=1e6)
    with pytest.raises(FormatError, match=r"w32.colibri → fp16 for the profile: gate_proj\[layer=0, expert=0\]: \d+ values overflow float16 .*use a profile with dtype: fp32"):
        build_bundle(load_profile("orin"), tmp_path / "b", weights, kernel_dir=kernel_dir)
    assert not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["w32.colibri"]  # the partial folder is gone


def test_spill_fails_the_build_unless_allowed(stub_kernels, tmp_path):
    shutil.copy(Path(__file__).parent / "fixtures" / "spill" / "small_batch.cu", stub_kernels / "small_batch.cu")
    try:
        with pytest.raises(CompileError, match=r"small_batch.cu: colibri_gate_up_gemv spills registers \(\d+ bytes stored, \d+ bytes loaded, \d+ registers\); allowed: 0 unless the profile sets allow_spills: true"):
            build_bundle(load_profile("orin"), tmp_path / "spill", kernel_dir=stub_kernels)
        data = load_profile("orin").to_dict()
        data["allow_spills"] = True
        result = build_bundle(Profile.from_dict(data), tmp_path / "spill", kernel_dir=stub_kernels)
        assert result.manifest["kernels"][3]["resources"]["colibri_gate_up_gemv"]["spill_store_bytes"] > 0
    finally:
        shutil.copy(Path(__file__).parent / "fixtures" / "kernels" / "small_batch.cu", stub_kernels / "small_batch.cu")


def test_static_shared_memory_over_the_profile_limit_fails(kernel_dir, tmp_path):
    data = load_profile("orin").to_dict()
    data["hardware"]["shared_memory_per_block"] = 4096
    # routing.cu is compiled first; its activation tile for 16 tokens takes 16 KiB
    with pytest.raises(CompileError, match=r"routing.cu: colibri_routing uses \d+ bytes of static shared memory; allowed: at most 4096 \(hardware.shared_memory_per_block"):
        build_bundle(Profile.from_dict(data), tmp_path / "b", kernel_dir=kernel_dir)


def test_compile_error_in_a_kernel_fails_the_build_with_file_and_line(stub_kernels, tmp_path):
    source = stub_kernels / "expert_down.cu"
    original = source.read_text()
    source.write_text(original.replace("y[t] = h[t] * coli_load(d, t);", "y[t] = h[t] * coli_load(d, t)"))
    try:
        with pytest.raises(CompileError, match=r"expert_down.cu\(6\): error: expected a \";\""):
            build_bundle(load_profile("orin"), tmp_path / "b", kernel_dir=stub_kernels)
    finally:
        source.write_text(original)


def test_output_folder_that_is_not_a_bundle_is_kept(kernel_dir, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(BundleError, match="precious exists and is not a bundle; refusing to replace it"):
        build_bundle(load_profile("orin"), out, kernel_dir=kernel_dir)
    assert (out / "notes.txt").read_text() == "keep me"
