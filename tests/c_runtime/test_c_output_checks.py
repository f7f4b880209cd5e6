"""libcolibri's checks that keep a bundle's kernels and outputs honest on the fake driver (docs/c_runtime.md):
COLIBRI_ERR_NONFINITE_OUTPUT for NaN/Inf at a valid output position (the Python runtime's NonFiniteOutputError),
and a manifest `buffers` size below what the kernels touch for the bundle's shape refused at init."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from c_runtime_support import manifest

from colibri_sdk.bundle.reader import canonical_json, manifest_digest

BUNDLE, NONFINITE_OUTPUT = 2, 9


def clean(run) -> None:
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, run
    assert "LeakSanitizer" not in run.stderr, run


def test_a_finite_input_that_overflows_gives_the_nonfinite_output_code(run_c, bundles):
    """Token 1 of sequence 0 at 1e19 (finite; the experts overflow float32): get_output returns code 9 naming that
    position, with y filled; as padding the same values, and NaN, are ignored (zeros out); a y one float short is
    refused twice, y untouched, the output kept; a finite output afterwards is COLIBRI_OK.
    The Python runtime refuses the same input at the same position."""
    from colibri_sdk.errors import NonFiniteOutputError
    from colibri_sdk.runtime import Runtime

    bundle = bundles["tiled"]  # fp32, batch 2 x tokens 8, the tiled kernels
    run = run_c(["nonfinite", bundle])
    assert run.rc == 0 and run.result["passed"] is True, run
    clean(run)
    assert run.result["message"] == (
        "colibri_get_output: the output is non-finite (NaN or Inf) at 1 valid position, first at (batch 0, token 1), "
        "from a finite input: a value overflowed the float type inside a layer (float32's largest is 3.4e38), or a "
        "kernel result is wrong; y holds the output as computed")
    x = np.load(bundle / "selftest" / "input.npy")
    x[0, 1, :] = np.float32(1e19)
    with Runtime.load(bundle, backend="cpu") as rt, pytest.raises(NonFiniteOutputError) as exc:
        rt.infer(x)
    assert exc.value.position == (0, 1) and exc.value.count == 1


def _rewrite(bundle: Path, name: str, size: int) -> None:
    """Set buffers[name] to `size` in the top-level record and in the largest `shapes` entry (they must stay equal),
    then re-digest the manifest: only the size rule can refuse it."""
    m = manifest(bundle)
    for record in [m] + m.get("shapes", [])[-1:]:
        record["buffers"][name] = size
    m["manifest_sha256"] = manifest_digest(m)
    (bundle / "manifest.json").write_bytes(canonical_json(m))


# The tiled test bundle: fp32, batch 2 x tokens 8 (T = 16), top-2 (pairs 32), hidden 64, intermediate 32, 8 experts,
# 2 layers (output in x0, so x1 is a scratch buffer). name: (the least size, the C runtime's reason)
TOO_SMALL = {
    "x1": (4096, "tokens 16 x hidden 64 float32"),
    "topk_ids": (128, "pairs 32 (tokens x top_k) x 4 bytes"),
    "topk_weights": (128, "pairs 32 (tokens x top_k) x 4 bytes"),
    "act": (4096, "pairs 32 x intermediate 32 float32"),
    "expert_offsets": (36, "experts + 1 = 9 int32"),
}


@pytest.mark.parametrize("name", sorted(TOO_SMALL))
def test_a_buffer_smaller_than_the_kernels_touch_is_refused(run_c, bundles, tmp_path, name):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    need, why = TOO_SMALL[name]
    recorded = manifest(bundles["tiled"])["buffers"]
    assert recorded[name] == need  # the catalogue's size is exactly the least the kernels touch
    bundle = Path(shutil.copytree(bundles["tiled"], tmp_path / "b"))
    _rewrite(bundle, name, need - 4)
    message = (f"manifest.json: buffers.{name} is {need - 4} bytes; allowed: at least {need} ({why} at batch 2 x "
               "tokens 8, from the manifest's shape and weights.header as sdk/catalog.py device_buffers sizes it)")
    run = run_c(["init", bundle, BUNDLE, message])
    assert run.rc == 0, run
    clean(run)
    with pytest.raises(BundleError, match=rf"buffers = .* differs from the catalogue's"):
        Bundle.open(bundle)  # the Python reader compares every buffer with the catalogue


def test_a_larger_buffer_is_accepted(run_c, bundles, tmp_path):
    """The rule is a minimum: a recorded size above it loads (the Python reader, stricter, wants the catalogue's)."""
    bundle = Path(shutil.copytree(bundles["tiled"], tmp_path / "b"))
    _rewrite(bundle, "act", manifest(bundle)["buffers"]["act"] + 64)
    run = run_c(["init", bundle, 0])
    assert run.rc == 0, run
