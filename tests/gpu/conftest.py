"""GPU tests: marked `gpu`, skipped with the driver probe's reason when no CUDA driver or device is usable."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _needs_gpu(request):
    if request.node.get_closest_marker("gpu") is None:
        return
    from colibri_sdk.runtime.driver import probe_driver

    ok, reason = probe_driver()
    if not ok:
        pytest.skip(f"no usable CUDA GPU: {reason}")
