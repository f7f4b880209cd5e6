"""Programmatic dependent launch (profile `programmatic_dependent_launch`): where the profile allows it, the compile
constant and the launch plan it gives, and the griddepcontrol instructions NVRTC compiles for sm_90 (real NVRTC)."""

from __future__ import annotations

import copy

import pytest

from colibri_sdk import catalog
from colibri_sdk.errors import ProfileError
from colibri_sdk.format import Header
from colibri_sdk.profile import Profile, load_profile

HEADER = Header(2, 8, 2, 64, 32, dtype=1)


def profile(name: str, **changes) -> dict:
    data = copy.deepcopy(load_profile(name, toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": 16}
    for key, value in changes.items():
        if key == "min_driver":
            data["target"]["min_driver"] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("name, min_driver, match", [
    ("orin", 12030, r"programmatic_dependent_launch = true with target.arch = 'sm_87', target.min_driver = 12030; "
                    r"allowed: sm_90 or newer \(griddepcontrol\) and min_driver >= 12030"),
    ("a100", 12030, r"target.arch = 'sm_80'"),
    ("h200", 12000, r"target.arch = 'sm_90', target.min_driver = 12000; allowed: sm_90 or newer"),
])
def test_refused_below_sm_90_or_a_cuda_12_3_driver(name, min_driver, match):
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(profile(name, programmatic_dependent_launch=True, min_driver=min_driver), toolchain=False)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_value_is_a_boolean(value):
    with pytest.raises(ProfileError, match=r"programmatic_dependent_launch = .*allowed: bool, true or false"):
        Profile.from_dict(profile("h200", programmatic_dependent_launch=value, min_driver=12030), toolchain=False)


def test_defines_and_plan_only_where_the_profile_sets_it():
    """Off (absent or false): no COLI_PDL and no "pdl" key, so bundles without it are as before. On: COLI_PDL 1 and
    every launch after the first marked, on both paths."""
    for changes in ({}, {"programmatic_dependent_launch": False}):
        data = Profile.from_dict(profile("h200", **changes), toolchain=False).data
        assert "COLI_PDL" not in catalog.compile_defines(data, HEADER)
        assert not any("pdl" in launch for launch in catalog.launch_plan(data, HEADER))
    for max_pairs in (64, 1):  # the GEMV path, then the tiles
        data = profile("h200", programmatic_dependent_launch=True, min_driver=12030)
        data["kernels"]["small_batch"]["max_pairs"] = max_pairs
        data = Profile.from_dict(data, toolchain=False).data
        assert catalog.compile_defines(data, HEADER)["COLI_PDL"] == 1
        plan = catalog.launch_plan(data, HEADER)
        assert len(plan) == 6 and "pdl" not in plan[0] and all(launch["pdl"] is True for launch in plan[1:])


def test_sm_90_kernels_wait_for_the_launch_before_them():
    """Every kernel of the h200 profile with it compiles (NVRTC, sm_90) to PTX whose entries each wait
    (griddepcontrol.wait) and then let the next launch be scheduled (griddepcontrol.launch_dependents); without it
    (one kernel compiled: the rest share the same common.cuh entry) the PTX has neither."""
    from colibri_sdk.aot.kernels import compile_catalog, compile_kernel

    on = Profile.from_dict(profile("h200", programmatic_dependent_launch=True, min_driver=12030))
    compiled = compile_catalog(on, HEADER, workers=2)
    assert {kernel.spec.name for kernel in compiled} >= {"routing", "small_batch"}
    for kernel in compiled:
        ptx = kernel.output.ptx.decode()
        entries = ptx.count(".entry ")
        assert entries >= 1, kernel.spec.name
        assert ptx.count("griddepcontrol.wait") >= entries, kernel.spec.name
        assert ptx.count("griddepcontrol.launch_dependents") >= entries, kernel.spec.name
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    off = Profile.from_dict(profile("h200"))
    spec = next(spec for spec in catalog.kernels_for(off.to_dict()) if spec.name == "routing")
    ptx = compile_kernel(spec, off, HEADER, catalog.kernel_dir(), None).output.ptx.decode()
    assert ".entry " in ptx and "griddepcontrol" not in ptx
