"""Device profiles: the shipped ones load, every schema violation is a ProfileError naming key, value and rule."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from colibri_sdk.errors import ProfileError
from colibri_sdk.profile import Profile, load_profile, packaged_dir, packaged_names

SHIPPED = ("a100", "h200", "orin", "rtx4090")

# Facts from the vendors' data sheets and the CUDA programming guide (compute capability tables).
EXPECTED = {
    "orin": ("sm_87", (8, 7), 16, 166912, 167936, True),
    "a100": ("sm_80", (8, 0), 108, 166912, 167936, False),
    "rtx4090": ("sm_89", (8, 9), 128, 101376, 102400, False),
    "h200": ("sm_90", (9, 0), 132, 232448, 233472, False),
}


def orin_dict() -> dict:
    with open(packaged_dir() / "orin.yaml") as f:
        return yaml.safe_load(f)


def refused(data: dict, match: str, **kwargs) -> str:
    with pytest.raises(ProfileError, match=match) as info:
        Profile.from_dict(data, "test.yaml", **kwargs)
    return str(info.value)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_with_hardware_facts(name):
    profile = load_profile(name)
    arch, cc, sms, optin, per_sm, unified = EXPECTED[name]
    assert profile.arch == arch
    assert profile.compute_capability == cc
    assert profile.toolkit == 12
    assert profile.hardware["sm_count"] == sms
    assert profile.hardware["shared_memory_per_block"] == 49152
    assert profile.hardware["shared_memory_per_block_optin"] == optin
    assert profile.hardware["shared_memory_per_sm"] == per_sm
    assert profile.data["target"]["unified_memory"] is unified
    with open(packaged_dir() / f"{name}.yaml") as f:
        assert profile.to_dict() == yaml.safe_load(f)


def test_shipped_names_and_lookup_by_path(tmp_path):
    assert packaged_names() == sorted(SHIPPED)
    copy_path = tmp_path / "board.yaml"
    copy_path.write_text((packaged_dir() / "orin.yaml").read_text())
    profile = load_profile(str(copy_path))
    assert profile.source == str(copy_path)
    assert profile.stem == "board"
    assert profile.to_dict() == load_profile("orin").to_dict()


def test_to_dict_is_a_copy():
    profile = load_profile("orin")
    d = profile.to_dict()
    d["kernels"]["routing"]["threads"] = 1
    assert profile.data["kernels"]["routing"]["threads"] == 128


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match=r"no shipped profile named 'xavier'; allowed: \['a100', 'h200', 'orin', 'rtx4090'\]"):
        load_profile("xavier")
    with pytest.raises(ProfileError, match="profile file 'nope/board.yaml' not found"):
        load_profile("nope/board.yaml")


def _set(data, path, value):
    *head, last = path.split(".")
    node = data
    for key in head:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value


DELETE = object()

CASES = [
    # (key path, value, expected message)
    ("colour", "red", r"unknown key 'colour'; allowed keys: \['aggregation', 'allow_spills', 'capacity', 'description', "),
    ("target.cores", 8, r"unknown key 'target.cores'; allowed keys in target: \['arch', 'min_driver', 'toolkit', "),
    ("kernels.routing.block_n", 64, r"unknown key 'kernels.routing.block_n'; allowed keys in kernels.routing: \['block_m', 'threads'\]"),
    ("kernels.softmax", {"threads": 32}, r"unknown key 'kernels.softmax'; allowed keys in kernels: \["),
    ("dtype", DELETE, r"missing key 'dtype'"),
    ("kernels.down.block_k", DELETE, r"missing key 'kernels.down.block_k'"),
    ("hardware", DELETE, r"missing key 'hardware'"),
    ("shape.tokens", "16", r"shape.tokens = '16' \(str\); allowed: int or list, an integer in 1\.\.65536, or a list"),
    ("shape.batch", True, r"shape.batch = True \(bool\); allowed: int"),
    ("target.unified_memory", "yes", r"target.unified_memory = 'yes' \(str\); allowed: bool, true or false"),
    ("allow_spills", 0, r"allow_spills = 0 \(int\); allowed: bool"),
    ("hardware.memory_bandwidth_gbs", "fast", r"hardware.memory_bandwidth_gbs = 'fast' \(str\); allowed: int or float"),
    ("hardware.memory_bandwidth_gbs", 0, r"hardware.memory_bandwidth_gbs = 0; allowed: a number of GB/s"),
    ("shape", [1, 16], r"shape is list \[1, 16\]; allowed: a mapping of \['batch', 'tokens'\]"),
    ("kernels.gate_up.threads", 100, r"kernels.gate_up.threads = 100: must be a multiple of 32; allowed: 32\.\.1024, multiple of 32 \(threads per block\)"),
    ("kernels.down.threads", 2048, r"kernels.down.threads = 2048: must be in 32\.\.1024; allowed: 32\.\.1024, multiple of 32"),
    ("kernels.routing.threads", 128.0, r"kernels.routing.threads = 128.0: must be an integer, got float"),
    ("kernels.gate_up.block_n", 48, r"kernels.gate_up.block_n = 48: must be a power of two; allowed: 16\.\.256, power of two"),
    ("kernels.routing.block_m", 256, r"kernels.routing.block_m = 256: must be in 1\.\.128"),
    ("kernels.small_batch.max_pairs", 0, r"kernels.small_batch.max_pairs = 0: must be in 1\.\.4096"),
    ("kernels.small_batch.max_pairs_quantized", 5000,
     r"kernels.small_batch.max_pairs_quantized = 5000: must be in 0\.\.4096; allowed: 0\.\.4096 \(max_pairs for int8/int4"),
    ("dtype", "bf16", r"dtype = 'bf16'; allowed: one of \['fp16', 'fp32'\]"),
    ("aggregation", "sum", r"aggregation = 'sum'; allowed: one of \['ordered', 'atomic'\]"),
    ("target.arch", "ampere", r"target.arch = 'ampere'; allowed: sm_XY, e.g. 'sm_87'"),
    ("target.arch", "sm_90a", r"target.arch = 'sm_90a'; allowed: sm_XY"),
    ("target.min_driver", 12025, r"target.min_driver = 12025; allowed: an integer in 11000\.\.99990, cuDriverGetVersion"),
    ("target.min_driver", 11080, r"target.min_driver = 11080 is a CUDA 11.x driver; allowed: at least 12000 \(CUDA 12.0\)"),
    ("shape.tokens", 70000, r"shape.tokens = 70000; allowed: an integer in 1\.\.65536"),
    ("shape.tokens", [16, 1], r"shape.tokens = \[16, 1\]; allowed: .*a list of 1\.\.8 such integers in increasing order"),
    ("shape.tokens", [], r"shape.tokens = \[\]; allowed: .*a list of 1\.\.8 such integers"),
    ("shape.batch", [1, 1], r"shape.batch = \[1, 1\]; allowed: .*in increasing order"),
    ("shape.batch", [1, True], r"shape.batch = \[1, True\]; allowed: "),
    ("shape.tokens", list(range(1, 10)), r"shape.tokens = \[1, 2, 3, .*\]; allowed: .*a list of 1\.\.8"),
    ("hardware.shared_memory_per_block", 65536, r"hardware.shared_memory_per_block = 65536; allowed: an integer in 1024\.\.49152"),
    ("hardware.shared_memory_per_block_optin", 232448, r"hardware.shared_memory_per_block_optin = 232448; allowed: shared_memory_per_block \(49152\) \.\. 166912 \(sm_87 opt-in limit\)"),
    ("hardware.shared_memory_per_sm", 233472, r"hardware.shared_memory_per_sm = 233472; allowed: shared_memory_per_block_optin \(166912\) \.\. 167936 \(sm_87 per-SM limit\)"),
    ("name", "orin board", r"name = 'orin board'; allowed: letters, digits"),
]


@pytest.mark.parametrize("path, value, match", CASES, ids=[f"{c[0]}={'<deleted>' if c[1] is DELETE else repr(c[1])}"[:40] for c in CASES])
def test_schema_violation_names_key_value_and_rule(path, value, match):
    data = orin_dict()
    _set(data, path, value if value is DELETE else copy.deepcopy(value))
    message = refused(data, match)
    assert message.startswith("test.yaml: ")


def test_batch_times_tokens_is_capped():
    data = orin_dict()
    data["shape"] = {"batch": 512, "tokens": 512}
    refused(data, r"shape batch\*tokens = 262144; allowed: at most 65536")


def test_arch_the_installed_nvrtc_does_not_support():
    data = orin_dict()
    data["target"]["arch"] = "sm_95"
    refused(data, r"target.arch = 'sm_95' is not supported by the installed NVRTC 12\.\d+; allowed: .*sm_87, sm_89, sm_90")


def test_arch_without_known_shared_memory_limits():
    data = orin_dict()
    data["target"]["arch"] = "sm_61"
    refused(data, r"target.arch = 'sm_61': shared memory limits unknown; allowed: sm_70, sm_72, sm_75, sm_80", toolchain=False)


def test_toolkit_other_than_the_installed_nvrtc_names_the_pip_package():
    data = orin_dict()
    data["target"]["toolkit"] = 13
    data["target"]["min_driver"] = 13000
    message = refused(data, r"target.toolkit = 13, but the installed NVRTC is 12\.\d+; allowed: 12, or install NVRTC 13")
    assert "nvidia-cuda-nvrtc" in message
    # Without the toolchain check (reading a profile for anything but a build) it is valid.
    assert Profile.from_dict(data, toolchain=False).toolkit == 13


def test_yaml_duplicate_key_and_syntax_errors(tmp_path):
    text = (packaged_dir() / "orin.yaml").read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(text.replace("aggregation: ordered", "aggregation: ordered\naggregation: atomic"))
    with pytest.raises(ProfileError, match=r"dup.yaml:(\d+):1: duplicate key 'aggregation' at line \1 \(first at line \d+\)"):
        load_profile(dup)
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [sm_87\n")
    with pytest.raises(ProfileError) as info:
        load_profile(bad)
    assert str(info.value).endswith(
        "bad.yaml:2:1: not valid YAML: while parsing a flow sequence; expected ',' or ']', but got '<stream end>'"
    )
    top = tmp_path / "list.yaml"
    top.write_text("- sm_87\n")
    with pytest.raises(ProfileError, match=r"list.yaml: the profile is list \['sm_87'\]; allowed: a mapping of"):
        load_profile(top)


def test_safe_loader_refuses_python_objects(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ProfileError, match=re.escape("not valid YAML")):
        load_profile(evil)
