"""The fp16 tensor-core tiles (colibri_gate_up_tc, colibri_down_tc; common.cuh tc_tile_rows) compile with NVRTC for
every shipped profile on its own arch, at Mixtral-8x7B sizes (rows 32-byte aligned) and at odd sizes (windowed
rows), on the tiled path: no spills, no stack frame, static shared memory within 48 KiB, registers within the
launch bound (128 threads, 1 block per SM: 255). Real NVRTC, its output kept in the tests' cache; no GPU needed.
"""

from __future__ import annotations

import pytest

from colibri_sdk import catalog
from colibri_sdk.profile import load_profile

from kernel_support import make_header
from nvrtc_cache_support import compile_source

PROFILES = ("a100", "h200", "orin", "rtx4090")
SIZES = {"mixtral": dict(hidden=4096, inter=14336, experts=8, top_k=2),
         "odd": dict(hidden=2050, inter=770, experts=8, top_k=2)}


@pytest.mark.parametrize("name", PROFILES)
def test_tensor_core_tiles_compile_without_spills_for_every_shipped_profile(name):
    shipped = load_profile(name, toolchain=False)
    profile = shipped.for_shape(*max(shipped.shapes, key=lambda s: s[0] * s[1])).data  # its largest shape
    profile["kernels"]["small_batch"]["max_pairs"] = 1  # on the tiled path
    arch = profile["target"]["arch"]
    for label, kwargs in SIZES.items():
        header = make_header(dtype="fp16", **kwargs)
        assert catalog.sizes(profile, header).tensor_core, label
        defines = catalog.compile_defines(profile, header)
        for spec in catalog.KERNELS:
            if spec.name not in ("gate_up", "down"):
                continue
            out = compile_source((catalog.kernel_dir() / spec.source).read_text(), spec.source, arch, defines,
                                 [catalog.kernel_dir()])
            symbol = next(s for s in spec.symbols if s.endswith("_tc"))
            r = out.resources[symbol]
            assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["stack_bytes"] == 0, (name, label, symbol, r)
            assert r["shared_bytes"] <= 48 * 1024, (name, label, symbol, r)
            assert 0 < r["registers"] <= 255, (name, label, symbol, r)
