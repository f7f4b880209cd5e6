"""The CUDA backend against the float64 reference engine on fresh random inputs, with poisoned buffers.

Each case builds a bundle for this GPU (cubin) from a random float32 model and runs 3 fresh random inputs; before
each run every scratch buffer and the output are filled with NaN words, so a value not written during the call shows.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from colibri_sdk.bundle import Bundle
from colibri_sdk.errors import BackendError, InputError

from gpu_support import build, profile_for_this_gpu, random_model, reference

pytestmark = pytest.mark.gpu

# name: (model kwargs, profile overrides). GEMV path when batch*tokens*top_k <= small_batch.max_pairs.
TILED = {"small_batch": {"max_pairs": 1}}
CASES = {
    "t1-e8-k2-fp16-gemv": (dict(experts=8, top_k=2), dict(shape={"batch": 1, "tokens": 1})),
    "t4-e16-k1-fp32-gemv-odd": (dict(experts=16, top_k=1, hidden=100, inter=75),
                                dict(dtype="fp32", shape={"batch": 1, "tokens": 4})),
    "t16-e64-k4-fp16-tiled-odd": (dict(experts=64, top_k=4, hidden=130, inter=97, routing=1),
                                  dict(shape={"batch": 1, "tokens": 16}, kernels=TILED)),
    "t64-e8-k2-fp32-tiled-seq": (dict(layers=2, experts=8, top_k=2, hidden=96, inter=160, composition=0),
                                 dict(dtype="fp32", shape={"batch": 1, "tokens": 64}, kernels=TILED)),
    "t64-e64-k4-fp16-tiled-atomic": (dict(experts=64, top_k=4, hidden=128, inter=64),
                                     dict(aggregation="atomic", shape={"batch": 1, "tokens": 64})),
    "t8-e16-k4-fp16-gemv-atomic": (dict(experts=16, top_k=4, hidden=72, inter=200),
                                   dict(aggregation="atomic", shape={"batch": 1, "tokens": 8})),
    "t3-e64-k1-fp32-gemv-bm1": (dict(experts=64, top_k=1, hidden=64, inter=33, routing=1),
                                dict(dtype="fp32", shape={"batch": 1, "tokens": 3}, kernels={"routing": {"block_m": 1}})),
    "t33-e16-k2-fp16-tiled-bm32": (dict(layers=2, experts=16, top_k=2, hidden=72, inter=200),
                                   dict(shape={"batch": 1, "tokens": 33},
                                        kernels={"routing": {"block_m": 32}, **TILED})),
    "t64-e8-k4-fp16-gemv-many": (dict(experts=8, top_k=4, hidden=136, inter=80),
                                 dict(shape={"batch": 1, "tokens": 64}, kernels={"small_batch": {"max_pairs": 4096}})),
    "b2t5-e8-k2-fp32-tiled": (dict(experts=8, top_k=2, hidden=48, inter=40),
                              dict(dtype="fp32", shape={"batch": 2, "tokens": 5},
                                   kernels={"small_batch": {"max_pairs": 1}})),
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Bundles built on first use: name → (bundle folder, the bundle's weights)."""
    cache = {}

    def get(name):
        if name not in cache:
            model_kwargs, overrides = CASES[name]
            root = tmp_path_factory.mktemp(name)
            weights = random_model(root / "model.colibri", seed=len(cache) + 1, **model_kwargs)
            path = build(profile_for_this_gpu(**overrides), weights, root / "bundle")
            cache[name] = (path, Bundle.open(path).weights_path)
        return cache[name]

    return get


def check_close(y: np.ndarray, expected: np.ndarray, stable: np.ndarray, what: str) -> None:
    assert stable.sum() >= max(1, stable.size // 2), f"{what}: too few tokens with a clear routing margin"
    assert np.isfinite(y).all(), f"{what}: non-finite output (a value not written during the call?)"
    scale = float(np.abs(expected).max())
    err = np.abs(y - expected)[stable]
    limit = 1e-3 * scale + 1e-3 * np.abs(expected)[stable]
    worst = float((err - limit).max())
    assert worst <= 0, f"{what}: max abs error {err.max():.3g} exceeds the tolerance (scale {scale:.3g})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(bundles, name):
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    path, weights = bundles(name)
    bundle = Bundle.open(path)
    rng = np.random.default_rng(hash(name) & 0xFFFF)
    with CudaBackend(bundle) as backend, CudaBackend(bundle, eager=True) as eager:
        assert backend.image_kind == "cubin"
        batch, tokens = bundle.shape
        for trial in range(3):
            x = rng.standard_normal((batch, tokens, backend.hidden)).astype(np.float32)
            backend.poison()
            y = backend.infer_padded(x)
            expected, stable = reference(weights, x)
            check_close(y, expected, stable, f"{name} trial {trial}")
            eager.poison()
            y_eager = eager.infer_padded(x)
            if bundle.aggregation == "ordered":
                assert np.array_equal(y.view(np.uint32), y_eager.view(np.uint32)), f"{name}: graph != eager bitwise"
            else:
                np.testing.assert_allclose(y_eager, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))


@pytest.mark.parametrize("name", ["t1-e8-k2-fp16-gemv", "t33-e16-k2-fp16-tiled-bm32"])
def test_1000_replays_are_bitwise_identical(bundles, name):
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    path, _ = bundles(name)
    bundle = Bundle.open(path)
    with CudaBackend(bundle) as backend:
        batch, tokens = bundle.shape
        x = np.random.default_rng(5).standard_normal((batch, tokens, backend.hidden)).astype(np.float32)
        first = backend.infer_padded(x).view(np.uint32)
        for i in range(999):
            y = backend.infer_padded(x).view(np.uint32)
            assert np.array_equal(y, first), f"replay {i + 1} differs from the first"


def test_concurrent_calls_are_serialised(bundles):
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    path, _ = bundles("t16-e64-k4-fp16-tiled-odd")
    bundle = Bundle.open(path)
    rng = np.random.default_rng(9)
    with CudaBackend(bundle) as backend:
        batch, tokens = bundle.shape
        inputs = [rng.standard_normal((batch, tokens, backend.hidden)).astype(np.float32) for _ in range(4)]
        alone = [backend.infer_padded(x) for x in inputs]
        results: dict[int, list] = {i: [] for i in range(4)}

        def worker(i):
            for _ in range(25):
                results[i].append(backend.infer_padded(inputs[i]))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(4):
            assert len(results[i]) == 25
            assert all(np.array_equal(r, alone[i]) for r in results[i]), f"thread {i} got another input's output"


def test_bad_input_and_close(bundles):
    from colibri_sdk.runtime.cuda_backend import CudaBackend

    path, _ = bundles("t1-e8-k2-fp16-gemv")
    backend = CudaBackend(Bundle.open(path))
    batch, tokens = backend.shape
    good = np.zeros((batch, tokens, backend.hidden), np.float32)
    with pytest.raises(InputError, match=r"C-contiguous float32 array of shape \(1, 1, 256\); got ndarray float64"):
        backend.infer_padded(good.astype(np.float64))
    with pytest.raises(InputError, match=r"got ndarray float32 \(1, 1, 255\)"):
        backend.infer_padded(good[..., :255])
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        backend.infer_padded(good)


def test_runtime_self_test_and_input_errors(bundles):
    """Through the public Runtime API: the bundle's own self-test vectors pass on CUDA; bad input is refused."""
    from colibri_sdk.runtime import Runtime

    path, _ = bundles("t16-e64-k4-fp16-tiled-odd")
    with Runtime.load(path, backend="cuda") as rt:
        assert rt.backend_name == "cuda"
        result = rt.self_test()
        assert result.passed, result
        with pytest.raises(InputError, match="hidden|130"):
            rt.infer(np.zeros((4, 129), np.float32))
        bad = np.zeros((4, 130), np.float32)
        bad[1, 2] = np.nan
        with pytest.raises(InputError, match="NaN|non-finite"):
            rt.infer(bad)
        with pytest.raises(InputError, match="tokens"):
            rt.infer(np.zeros((17, 130), np.float32))
