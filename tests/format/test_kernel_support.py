"""The build takes every v2 file the CUDA kernels run (all features of the format), copied as it is, including
int8/int4 weights on a shape that takes the tiled path (the tensor-core quantized kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.bundle.writer import build_bundle
from colibri_sdk.bundle.reader import Bundle
from colibri_sdk.errors import FormatError
from colibri_sdk.format import HeaderV2, write_arrays
from colibri_sdk.profile import load_profile

SIZES = dict(num_layers=1, num_experts=4, top_k=2, hidden_size=8, intermediate_size=6)


def v2_file(tmp_path, **fields):
    h = HeaderV2(**SIZES, **fields)
    rng = np.random.default_rng(0)
    arrays = {}
    for kind in h.kinds:
        lead = (1, h.count(kind)) if h.is_matrix(kind) else (1,)
        arrays[kind] = rng.standard_normal(lead + h.shape(kind)).astype(np.float32)
    return write_arrays(tmp_path / "w.colibri", h, arrays)


@pytest.mark.parametrize(
    "fields,defines",
    [
        (dict(quant=1, num_shared_experts=1, shared_intermediate_size=4),
         dict(COLI_QUANT=1, COLI_SHARED_EXPERTS=1, COLI_SHARED_INTER=4, COLI_SHARED_GATE=0)),
        (dict(routing=2, norm_topk=1, n_group=2, topk_group=1, group_score=2, correction_bias=1,
              routed_scaling_factor=2.5),
         dict(COLI_ROUTING=2, COLI_NORM_TOPK=1, COLI_N_GROUP=2, COLI_TOPK_GROUP=1, COLI_GROUP_SCORE=2,
              COLI_CORRECTION_BIAS=1, COLI_ROUTED_SCALING_BITS=0x40200000)),
        (dict(dtype=1, routing=0, router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0, swiglu_alpha=1.702),
         dict(COLI_FP16=1, COLI_ROUTER_BIAS=1, COLI_EXPERT_BIAS=1, COLI_ACTIVATION=1,
              COLI_SWIGLU_LIMIT_BITS=0x40E00000)),
        (dict(), dict(COLI_FP16=0, COLI_ROUTER_F32=1, COLI_SHARED_EXPERTS=0)),
    ],
    ids=["int8-shared", "sigmoid-groups-correction-scaling", "gpt-oss-biases-clamp-fp16", "float-v1-features"],
)
def test_build_takes_v2_features_as_they_are(tmp_path, fields, defines):
    """Every v2 feature builds (the kernels run them: docs/kernels.md "Model features"); the file is copied byte
    for byte, whatever the profile's dtype, and the compile-time constants carry the features."""
    path = v2_file(tmp_path, **fields)
    build_bundle(load_profile("orin", toolchain=False), tmp_path / "bundle", weights=path)
    bundle = Bundle.open(tmp_path / "bundle")
    assert (tmp_path / "bundle" / bundle.manifest["weights"]["file"]).read_bytes() == path.read_bytes()
    recorded = bundle.manifest["weights"]["header"]
    for key, value in fields.items():
        assert recorded[key] == pytest.approx(value), key
    compiled = bundle.manifest["kernels"][0]["defines"]
    assert {key: compiled[key] for key in defines} == defines


@pytest.mark.parametrize("fields", [dict(dtype=1, quant=2, group_size=128), dict(dtype=0, quant=1, zero_points=1)],
                         ids=["int4-g128", "int8-per-row-zeros-fp32-scales"])
def test_build_takes_quantized_weights_and_records_the_storage(tmp_path, fields):
    path = v2_file(tmp_path, **fields)
    build_bundle(load_profile("orin", toolchain=False), tmp_path / "bundle", weights=path)
    bundle = Bundle.open(tmp_path / "bundle")  # sha256, header against the manifest, NaN/Inf scan of float blocks
    header = bundle.manifest["weights"]["header"]
    assert (header["version"], header["quant"], header["group_size"], header["zero_points"]) == (
        0x0200, fields["quant"], fields.get("group_size", 0), fields.get("zero_points", 0))
    assert (tmp_path / "bundle" / bundle.manifest["weights"]["file"]).read_bytes() == path.read_bytes()
    defines = bundle.manifest["kernels"][0]["defines"]
    assert (defines["COLI_QUANT"], defines["COLI_FP16"], defines["COLI_SCALE_FP16"]) == (fields["quant"], 0,
                                                                                         fields["dtype"])


def test_build_takes_quantized_weights_on_the_tiled_shape(tmp_path):
    path = v2_file(tmp_path, dtype=1, quant=2, group_size=32)
    profile = load_profile("orin", toolchain=False)
    data = profile.to_dict()
    data["kernels"]["small_batch"]["max_pairs"] = 16  # 16 tokens x top-2 = 32 pairs: the tiled path
    data["shape"] = {"batch": 1, "tokens": 16}
    from colibri_sdk.profile import Profile

    build_bundle(Profile.from_dict(data, toolchain=False), tmp_path / "bundle", weights=path)
    launches = Bundle.open(tmp_path / "bundle").manifest["launch"]
    assert [launch["symbol"] for launch in launches if launch["kernel"] == "expert_quant"] == [
        "colibri_gate_up_qtc", "colibri_down_qtc"]


def test_bundle_scan_reads_only_the_float_blocks_of_a_quantized_file(tmp_path):
    """int8 codes 127, -1 are the bytes 7F FF: an fp16 NaN pattern, which the scan must not look at; a NaN scale
    (a float block) is refused."""
    from colibri_sdk.errors import BundleError
    from colibri_sdk.format import ColibriFile, QuantizedTensor

    h = HeaderV2(**SIZES, dtype=1, quant=1, group_size=0)
    rng = np.random.default_rng(1)
    codes = np.tile(np.array([127, -1], dtype=np.int8), (6, 4))
    q = [[QuantizedTensor(codes if kind != "down_proj" else codes.reshape(8, 6)[:, :6].copy(),
                          np.full((rows, 1), 0.01, np.float16), None, cols, 0, 1) for _ in range(4)]
         for kind, (rows, cols) in [("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))]]
    arrays = {"gate_proj": [q[0]], "up_proj": [q[1]], "down_proj": [q[2]],
              "router": rng.standard_normal((1, 8, 4)).astype(np.float32)}
    path = write_arrays(tmp_path / "w.colibri", h, arrays)
    build_bundle(load_profile("orin", toolchain=False), tmp_path / "bundle", weights=path)
    bundle = Bundle.open(tmp_path / "bundle")
    target = tmp_path / "bundle" / bundle.manifest["weights"]["file"]
    with ColibriFile(target) as f:
        scale_at = f.header.block_offset("up_proj.scales")
    data = bytearray(target.read_bytes())
    data[scale_at : scale_at + 2] = np.array([np.nan], dtype="<f2").tobytes()
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"a NaN or Inf weight at byte offset {scale_at}"):
        Bundle.open(tmp_path / "bundle")
