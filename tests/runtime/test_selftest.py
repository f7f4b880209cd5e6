"""Runtime.self_test: the bundle's stored vectors pass; a tampered reference output fails."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_sdk.errors import BundleError
from colibri_sdk.runtime import Runtime, SelfTestResult
from colibri_sdk.runtime.runtime import compare

from runtime_bundles import write_manifest


def _tamper_output(bundle, delta=0.5):
    path = bundle / "selftest" / "output.npy"
    y = np.load(path)
    y[1, 3, 17] += delta
    np.save(path, y)


def test_self_test_passes(demo_bundle):
    with Runtime.load(demo_bundle, backend="cpu") as rt:
        result = rt.self_test()
    assert isinstance(result, SelfTestResult)
    assert result.passed and result.backend == "cpu"
    recorded = json.loads((demo_bundle / "manifest.json").read_text())["selftest"]
    assert (result.rtol, result.atol) == (recorded["rtol"], recorded["atol"])
    assert 0 < result.max_abs_err < 1e-4  # fp32 arithmetic against the float64 reference
    assert str(result).startswith("self-test passed on cpu: max abs err ")
    result.raise_if_failed()


def test_tampered_output_is_refused_by_verify(fresh_bundle):
    _tamper_output(fresh_bundle)
    with pytest.raises(BundleError, match=r"^selftest/output\.npy: sha256 [0-9a-f]{64} differs from the manifest's"):
        Runtime.load(fresh_bundle, backend="cpu")


def test_tampered_output_fails_the_self_test(fresh_bundle):
    _tamper_output(fresh_bundle, delta=0.5)
    with Runtime.load(fresh_bundle, backend="cpu", verify=False) as rt:
        result = rt.self_test()
    assert not result.passed
    assert result.max_abs_err == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(BundleError, match=r"^self-test FAILED on cpu: max abs err 0\.5"):
        result.raise_if_failed()


def test_consistent_manifest_with_wrong_reference_fails(fresh_bundle):
    """A bundle whose checksums are regenerated after the change passes verify but not the self-test."""
    _tamper_output(fresh_bundle, delta=0.1)
    write_manifest(fresh_bundle, json.loads((fresh_bundle / "manifest.json").read_text()))
    with Runtime.load(fresh_bundle, backend="cpu", verify=True) as rt:
        result = rt.self_test()
    assert not result.passed
    assert result.max_abs_err == pytest.approx(0.1, rel=0.01)


def test_self_test_input_of_the_wrong_shape(fresh_bundle):
    np.save(fresh_bundle / "selftest" / "input.npy", np.zeros((1, 8, 64), np.float32))
    write_manifest(fresh_bundle, json.loads((fresh_bundle / "manifest.json").read_text()))
    with Runtime.load(fresh_bundle, backend="cpu") as rt:
        with pytest.raises(BundleError, match=r"self-test input shape \(1, 8, 64\); the bundle's fixed shape is \(2, 8, 64\)"):
            rt.self_test()


def test_compare_rule():
    expected = np.array([1.0, -2.0, 0.0], np.float32)
    # atol + rtol * |expected| = 0.1 + 0.1 * (1, 2, 0) = (0.2, 0.3, 0.1)
    assert compare(expected + np.float32([0.19, -0.29, 0.09]), expected, 0.1, 0.1).passed
    passed = compare(expected + np.float32([0.0, 0.0, 0.09]), expected, 0.1, 0.1)
    assert passed.passed and passed.max_rel_err == pytest.approx(0.9, rel=1e-5)  # above rtol, within atol
    assert passed.worst == pytest.approx(0.9, rel=1e-5)
    assert str(passed).endswith("max rel err 0.9 (rtol 0.1, atol 0.1); the worst value at 0.9 of its bound "
                                "atol + rtol*|expected| (at most 1 passes)")
    failed = compare(expected + np.float32([0.0, 0.31, 0.0]), expected, 0.1, 0.1)
    assert not failed.passed and failed.worst == pytest.approx(0.31 / 0.3, rel=1e-5)
    assert failed.max_abs_err == pytest.approx(0.31, rel=1e-5)
    assert failed.max_rel_err == pytest.approx(0.31 / 2, rel=1e-5)
    nan = compare(np.float32([1.0, np.nan, 0.0]), expected, 0.1, 0.1)
    assert not nan.passed and nan.max_abs_err == float("inf")
    with pytest.raises(BundleError, match=r"self-test output shape \(2,\); the stored reference output is \(3,\)"):
        compare(expected[:2], expected, 0.1, 0.1)
