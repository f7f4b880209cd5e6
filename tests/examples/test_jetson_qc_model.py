"""The trained classifier through the built bundle: accuracy, and equality with the torch model it came from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qc.dataset import CLASSES, make_dataset
from qc.model import MOE_WEIGHTS, STEM_HEAD_WEIGHTS, WEIGHTS_DIR, StemHead
from qc.preprocess import preprocess_batch

# Documented in examples/jetson_qc/README.md: the shipped weights must classify at least this fraction of a fresh
# held-out set (a seed used neither for training nor for the training script's held-out set) correctly.
ACCURACY_THRESHOLD = 0.85
PASS_FAIL_THRESHOLD = 0.93
CHECK_SEED = 3
CHECK_FRAMES = 400


@pytest.fixture(scope="module")
def check_set():
    frames, labels = make_dataset(CHECK_FRAMES, CHECK_SEED)
    return frames, labels, preprocess_batch(frames)


@pytest.fixture(scope="module")
def bundle_probs(qc_classifier, check_set):
    _, _, images = check_set
    return np.stack([qc_classifier.probs(image) for image in images])


@pytest.fixture(scope="module")
def torch_net(qc_bundle):
    pytest.importorskip("torch", reason="torch is the training framework the bundle is compared with")
    from colibri_sdk.format import ColibriFile
    from qc.torch_model import QCNet

    with np.load(STEM_HEAD_WEIGHTS) as arrays, ColibriFile(qc_bundle / "model.colibri") as moe:
        return QCNet.from_arrays(dict(arrays), moe)


def test_shipped_weights_match_the_profile_shape():
    from colibri_sdk.format import ColibriFile

    with ColibriFile(MOE_WEIGHTS) as f:
        h = f.header.to_dict()
    assert (h["num_layers"], h["num_experts"], h["top_k"], h["hidden_size"], h["intermediate_size"]) == (2, 8, 2, 64, 64)
    assert (h["dtype"], h["routing"], h["composition"]) == ("float16", "topk_softmax", "residual")
    assert MOE_WEIGHTS.stat().st_size < 500_000
    report = json.loads((WEIGHTS_DIR / "qc_train.json").read_text())
    assert report["held_out_accuracy"] >= ACCURACY_THRESHOLD
    assert report["classes"] == list(CLASSES)


def test_accuracy_through_the_bundle_is_above_the_documented_threshold(check_set, bundle_probs):
    _, labels, _ = check_set
    predicted = bundle_probs.argmax(axis=1)
    accuracy = float((predicted == labels).mean())
    pass_fail = float(((predicted == 0) == (labels == 0)).mean())
    assert accuracy >= ACCURACY_THRESHOLD, f"4-class accuracy {accuracy:.3f}"
    assert pass_fail >= PASS_FAIL_THRESHOLD, f"pass/fail accuracy {pass_fail:.3f}"
    # Every class is predicted: the model is not collapsed onto the majority.
    assert set(predicted.tolist()) == set(range(len(CLASSES)))


def test_bundle_predictions_equal_torch_predictions(check_set, bundle_probs, torch_net):
    import torch

    _, _, images = check_set
    with torch.no_grad():
        torch_probs = torch.softmax(torch_net(torch.from_numpy(images)), dim=1).numpy()
    np.testing.assert_array_equal(bundle_probs.argmax(axis=1), torch_probs.argmax(axis=1))
    np.testing.assert_allclose(bundle_probs, torch_probs, atol=1e-4, rtol=0)


def test_numpy_stem_equals_torch_stem(check_set, torch_net):
    import torch

    _, _, images = check_set
    stem = StemHead()
    numpy_tokens = np.stack([stem.tokens(image) for image in images[:32]])
    with torch.no_grad():
        torch_tokens = torch_net.tokens(torch.from_numpy(images[:32])).numpy()
    assert numpy_tokens.shape == (32, 16, 64) and numpy_tokens.dtype == np.float32
    np.testing.assert_allclose(numpy_tokens, torch_tokens, atol=1e-5, rtol=1e-5)


def test_classify_applies_the_threshold(qc_classifier, check_set):
    from qc.model import Classifier

    frames, labels, _ = check_set
    ok_frame = frames[int(np.flatnonzero(labels == 0)[0])]
    p_defect = qc_classifier.classify(ok_frame).p_defect
    assert 0.0 < p_defect < 0.5
    below = Classifier(qc_classifier.moe, qc_classifier.stem_head, threshold=p_defect * 0.99)
    above = Classifier(qc_classifier.moe, qc_classifier.stem_head, threshold=p_defect * 1.01)
    assert not below.classify(ok_frame).passed  # fails when p_defect >= threshold
    assert above.classify(ok_frame).passed
    with pytest.raises(ValueError, match=r"threshold 0.0; allowed: 0 < threshold <= 1"):
        Classifier(qc_classifier.moe, qc_classifier.stem_head, threshold=0.0)
