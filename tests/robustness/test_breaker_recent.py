"""Hostile input to the most recent changes: each refusal is one typed line naming the bad value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from robustness_helpers import cli_error

from colibri_sdk.format import Header, write_model


def _weights(path: Path, experts: int, top_k: int, hidden: int = 8, inter: int = 8) -> Path:
    """A one-layer fp16 model with the given experts and top-k (N(0, 0.2) experts, N(0, 1) router)."""
    header = Header(num_layers=1, num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                    dtype=1, composition=1)
    rng = np.random.default_rng(3)
    return write_model(path, header, rng.standard_normal((1, experts, inter, hidden)) * 0.2,
                       rng.standard_normal((1, experts, inter, hidden)) * 0.2,
                       rng.standard_normal((1, experts, hidden, inter)) * 0.2,
                       rng.standard_normal((1, hidden, experts)))


def test_build_refuses_more_experts_than_the_kernels_take(tmp_path, capsys):
    # 257 experts: kernels/common.cuh static_asserts COLI_EXPERTS <= 256; the build must say so before NVRTC runs
    weights = _weights(tmp_path / "e257.colibri", 257, 2)
    line = cli_error(capsys, "build", "--profile", "orin", "--weights", str(weights), "-o", str(tmp_path / "b"))
    assert line == (f"colibri-sdk build: error: {weights}: num_experts = 257; allowed: 1..256 (MAX_EXPERTS, the most "
                    "experts per layer the kernels are compiled for)")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.partial-*"))


def test_storage_of_fp32_v2_experts_in_an_fp16_bundle_is_fp32(tmp_path, capsys):
    # a v2 file is copied as it is: fp32 float experts stay fp32 in an fp16 profile's bundle; `storage` must say so
    import json

    from colibri_sdk import cli
    from colibri_sdk.format import HeaderV2, write_arrays

    h = HeaderV2(num_layers=1, num_experts=4, top_k=2, hidden_size=16, intermediate_size=16, dtype=0, composition=1)
    rng = np.random.default_rng(6)
    arrays = {k: 0.2 * rng.standard_normal(((1, h.count(k)) if h.is_matrix(k) else (1,)) + h.shape(k))
              for k in h.kinds}
    weights = write_arrays(tmp_path / "f32.colibri", h, arrays)
    out = tmp_path / "b"
    assert cli.main(["build", "--profile", "orin", "--weights", str(weights), "-o", str(out), "--tokens", "2",
                     "--batch", "1", "-q"]) == 0
    fp32 = {"experts": "fp32", "group_size": 0, "zero_points": False, "text": "fp32"}
    for argv in (["inspect", str(out), "--json"], ["run", str(out), "--backend", "cpu", "--iters", "1", "--json"]):
        capsys.readouterr()
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["storage"] == fp32, (argv[0], report["storage"])
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    assert "\n  experts        fp32 (the weights' own storage)\n" in capsys.readouterr().out


def test_profile_shape_of_huge_lists_is_refused_without_forming_their_product(bundle):
    # profile.shape lists of 1000 values each (1,000,000 pairs) in a re-digested manifest: refused in one short line
    # (the product was listed in full in the message, and a 64 MiB manifest could make it hang)
    from robustness_helpers import load_manifest, save_manifest

    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    m = load_manifest(bundle)
    m["profile"]["shape"] = {"batch": list(range(1, 1001)), "tokens": list(range(1, 1001))}
    save_manifest(bundle, m)
    with pytest.raises(BundleError) as exc:
        Bundle.open(bundle, verify=False)
    message = str(exc.value)
    assert "\n" not in message and len(message) < 600, len(message)
    assert "gives the shapes 1000 x 1000 pairs; allowed: the compiled shapes [(1, 16)" in message


@pytest.mark.parametrize("batch, tokens", [([1.5, 4], 16), ([True, 4], 16), (["1", "4"], "16"), ([1, 4], 16.0)])
def test_profile_shape_values_must_be_integers(bundle, batch, tokens):
    # int() read 1.5 as 1, True as 1 and "16" as 16, so these manifests opened as if they named the compiled shapes
    from robustness_helpers import load_manifest, save_manifest

    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    m = load_manifest(bundle)
    assert [(e["batch"], e["tokens"]) for e in m["shapes"]] == [(1, 16), (4, 16)]
    m["profile"]["shape"] = {"batch": batch, "tokens": tokens}
    save_manifest(bundle, m)
    with pytest.raises(BundleError, match=r"profile\.shape = .* gives the shapes None; allowed: the compiled shapes "
                                          r"\[\(1, 16\), \(4, 16\)\] \(shapes / shape\)$"):
        Bundle.open(bundle, verify=False)


def test_shapes_beyond_the_gemv_tiles_are_refused_before_nvrtc(tmp_path, capsys):
    # 5 x 64 = 320 tokens at 256 small_batch threads: small_batch.cu (compiled for every bundle) static_asserts
    # tokens * 16 rows * 4 <= 16 KiB; the build printed NVRTC's log, and its hint "lower max_pairs" did not help
    weights = _weights(tmp_path / "m.colibri", 4, 2)
    line = cli_error(capsys, "build", "--profile", "orin", "--weights", str(weights), "-o", str(tmp_path / "b"),
                     "--batch", "5", "--tokens", "64")
    assert line.endswith("with --batch 5, --tokens 64: shape batch*tokens = 320 (batch 5 x tokens 64); allowed: at "
                         "most 256 at kernels.small_batch.threads = 256 (the GEMV kernels' 16 KiB shared-memory "
                         "tiles, kernels/small_batch.cu); lower kernels.small_batch.threads or the shape"), line


def test_a_hostile_buffers_record_is_quoted_in_a_short_line(bundle):
    # 20,000 extra buffer names in shapes[0].buffers (re-digested): refused, quoting the record cut short
    from robustness_helpers import load_manifest, save_manifest

    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    m = load_manifest(bundle)
    m["shapes"][0]["buffers"].update({f"b{i:05d}": 4 for i in range(20000)})
    save_manifest(bundle, m)
    with pytest.raises(BundleError, match=r"shapes\[0\]\.buffers = \{.*\.\.\. differs from the catalogue's") as exc:
        Bundle.open(bundle)
    assert len(str(exc.value)) < 1000, len(str(exc.value))


def test_run_refuses_an_iteration_count_that_would_not_end(small_bundle_dir, capsys):
    line = cli_error(capsys, "run", str(small_bundle_dir), "--backend", "cpu", "--iters", "100000000000000000000")
    assert line == "colibri-sdk run: error: --iters 100000000000000000000; allowed: 1..1000000"


def test_profile_top_k_above_the_kernels_limit_is_a_profile_error(tmp_path):
    import yaml

    from colibri_sdk.errors import ProfileError
    from colibri_sdk.profile import load_profile, resolve

    data = yaml.safe_load(resolve("orin").read_text())
    data["top_k"] = 17  # kernels/common.cuh COLI_MAX_TOP_K is 16: the profile must refuse it, not the build later
    path = tmp_path / "k17.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"top_k .*17.*allowed: an integer in 1\.\.16"):
        load_profile(str(path))


def test_runtime_load_of_a_non_path_is_a_bundle_error():
    from colibri_sdk.errors import BundleError
    from colibri_sdk.runtime import Runtime

    with pytest.raises(BundleError, match=r"bundle_dir is int 5; allowed: a path"):
        Runtime.load(5)


def test_convert_output_with_a_trailing_separator_is_refused(tmp_path, capsys):
    # pathlib drops the trailing "/": without the check `-o out.colibri/` wrote a file named out.colibri
    from robustness_helpers import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt")
    line = cli_error(capsys, "convert", str(ckpt), "-o", str(tmp_path / "out.colibri") + "/")
    assert line == (f"colibri-sdk convert: error: output '{tmp_path}/out.colibri/' is not a file path; allowed: a path "
                    "ending in a file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
