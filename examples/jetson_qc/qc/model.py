"""The classifier around the colibri runtime: NumPy stem and head, the MoE part from a bundle.

    frame → preprocess (64, 64) → conv stem (16, 64) → runtime.infer: MoE layers (16, 64) → mean → head (4,) → softmax

The stem and head are the torch model's (qc.torch_model.QCNet) in NumPy, same operations in the same order, float32.
The MoE part runs from a bundle built with `colibri-sdk build --profile profiles/orin.yaml --weights
weights/qc_moe.colibri` — a frame is batch 1 x tokens 16 — on CUDA when present, else on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .dataset import CLASSES
from .preprocess import IMAGE_SIZE, preprocess

PATCH = 16                          # pixels of the (64, 64) image per token side
GRID = IMAGE_SIZE // PATCH          # 4 x 4 patches
TOKENS = GRID * GRID                # 16, the profile's fixed tokens
HIDDEN = 64
NUM_CLASSES = len(CLASSES)
CHANNELS = 16                       # conv filters of the stem
KERNEL = 5                          # conv kernel side, zero padding KERNEL // 2
STRIDE = 2                          # conv stride: the feature map is (32, 32)
CELL = PATCH // STRIDE              # feature-map cells per token side: 8
FEATURES = 2 * CHANNELS             # per token: max and mean of each channel over its cell

EXAMPLE_DIR = Path(__file__).resolve().parent.parent
WEIGHTS_DIR = EXAMPLE_DIR / "weights"
MOE_WEIGHTS = WEIGHTS_DIR / "qc_moe.colibri"
STEM_HEAD_WEIGHTS = WEIGHTS_DIR / "qc_stem_head.npz"
DEFAULT_PROFILE = EXAMPLE_DIR.parent.parent / "profiles" / "orin.yaml"
DEFAULT_THRESHOLD = 0.5

STEM_HEAD_SHAPES = {
    "conv_w": (CHANNELS, KERNEL * KERNEL),  # torch Conv2d weight (16, 1, 5, 5) flattened row-major
    "conv_b": (CHANNELS,),
    "stem_w": (HIDDEN, FEATURES),
    "stem_b": (HIDDEN,),
    "pos": (TOKENS, HIDDEN),
    "head_w": (NUM_CLASSES, HIDDEN),
    "head_b": (NUM_CLASSES,),
}


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class StemHead:
    """The NumPy stem and head, from the shipped .npz (float32 arrays named and shaped as STEM_HEAD_SHAPES).

    Stem, for a (64, 64) image — torch: qc.torch_model.QCNet.tokens:
        f = relu(conv2d(image, conv_w, conv_b, stride 2, zero padding 2))      (32, 32, 16)
            (cross-correlation, as torch.nn.Conv2d: f[y, x] = sum_ij w[i, j] * image[2y + i - 2, 2x + j - 2])
        per token t = 4 * row + col, its 8 x 8 cell of f:
            features = [max over the cell (16), mean over the cell (16)]        (16, 32)
        tokens = features @ stem_w.T + stem_b + pos                            (16, 64)
    Head: logits = mean over tokens of the MoE output @ head_w.T + head_b      (4,)
    """

    def __init__(self, path: str | os.PathLike = STEM_HEAD_WEIGHTS):
        with np.load(path) as data:
            self.arrays = {k: np.ascontiguousarray(data[k], dtype=np.float32) for k in data.files}
        for name, shape in STEM_HEAD_SHAPES.items():
            if name not in self.arrays or self.arrays[name].shape != shape:
                got = self.arrays[name].shape if name in self.arrays else "missing"
                raise ValueError(f"{path}: array {name!r} is {got}; expected {shape}")

    def features(self, image: np.ndarray) -> np.ndarray:
        """(64, 64) float32 preprocessed image → (16, 32) float32 per-token features."""
        a = self.arrays
        pad = KERNEL // 2
        padded = np.pad(image, pad)
        windows = np.lib.stride_tricks.sliding_window_view(padded, (KERNEL, KERNEL))[::STRIDE, ::STRIDE]
        side = windows.shape[0]                                              # 32
        fmap = windows.reshape(side * side, KERNEL * KERNEL) @ a["conv_w"].T + a["conv_b"]
        fmap = np.maximum(fmap, 0.0).reshape(GRID, CELL, GRID, CELL, CHANNELS)
        peak = fmap.max(axis=(1, 3)).reshape(TOKENS, CHANNELS)
        mean = fmap.mean(axis=(1, 3), dtype=np.float32).reshape(TOKENS, CHANNELS)
        return np.concatenate([peak, mean], axis=1)

    def tokens(self, image: np.ndarray) -> np.ndarray:
        """(64, 64) float32 preprocessed image → (16, 64) float32 tokens."""
        a = self.arrays
        return (self.features(image) @ a["stem_w"].T + a["stem_b"]) + a["pos"]

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """(16, 64) MoE output → (4,) class logits."""
        a = self.arrays
        return hidden.mean(axis=0) @ a["head_w"].T + a["head_b"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One classified frame.

    Attributes:
        label: index into CLASSES of the most probable class.
        probs: (4,) float32 class probabilities.
        p_defect: 1 - P(ok).
        passed: p_defect < the threshold.
        infer_ms: wall time of preprocess + stem + runtime + head, in ms.
    """

    label: int
    probs: np.ndarray
    p_defect: float
    passed: bool
    infer_ms: float

    @property
    def name(self) -> str:
        return CLASSES[self.label]


class Classifier:
    """preprocess → stem → MoE (`moe.infer`, (1, 16, 64) float32 → same) → head → pass/fail.

    Args:
        moe: anything with `infer(x)` for x (1, 16, 64) float32 — a colibri_sdk.runtime.Runtime.
        stem_head: the NumPy stem and head.
        threshold: a frame fails when p_defect = 1 - P(ok) >= threshold (0 < threshold <= 1).
    """

    def __init__(self, moe, stem_head: StemHead, threshold: float = DEFAULT_THRESHOLD):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold {threshold!r}; allowed: 0 < threshold <= 1")
        self.moe = moe
        self.stem_head = stem_head
        self.threshold = threshold

    def probs(self, image: np.ndarray) -> np.ndarray:
        """(64, 64) preprocessed image → (4,) float32 class probabilities."""
        x = np.ascontiguousarray(self.stem_head.tokens(image)[None], dtype=np.float32)
        y = self.moe.infer(x)
        return softmax(self.stem_head.head(np.asarray(y, dtype=np.float32)[0]))

    def classify(self, frame: np.ndarray) -> Prediction:
        """One camera frame (any shape preprocess accepts) → Prediction."""
        start = time.perf_counter()
        probs = self.probs(preprocess(frame))
        elapsed = (time.perf_counter() - start) * 1e3
        p_defect = float(1.0 - probs[0])
        return Prediction(int(np.argmax(probs)), probs, p_defect, p_defect < self.threshold, elapsed)

    def close(self) -> None:
        close = getattr(self.moe, "close", None)
        if close is not None:
            close()


# ---- bundle ---------------------------------------------------------------------------------------------------
def build_command(bundle_dir: str | os.PathLike, weights: str | os.PathLike = MOE_WEIGHTS,
                  profile: str | os.PathLike = DEFAULT_PROFILE) -> list[str]:
    """The `colibri-sdk build` command line that makes the example's bundle."""
    return [sys.executable, "-m", "colibri_sdk", "build", "--profile", str(profile), "--weights", str(weights),
            "-o", str(bundle_dir)]


def ensure_bundle(bundle_dir: str | os.PathLike, weights: str | os.PathLike = MOE_WEIGHTS,
                  profile: str | os.PathLike = DEFAULT_PROFILE, log=None) -> Path:
    """Build the bundle into `bundle_dir` with `colibri-sdk build` unless it already has a manifest.json.

    Building needs the build extras (NVRTC through pip, no GPU); on a device without them, build on the host and
    copy the bundle (`colibri-sdk deploy`).

    Raises:
        RuntimeError: the build command failed (its output is quoted).
    """
    bundle_dir = Path(bundle_dir)
    if (bundle_dir / "manifest.json").is_file():
        return bundle_dir
    command = build_command(bundle_dir, weights, profile)
    if log is not None:
        log(f"bundle {bundle_dir} is missing; building: {' '.join(command)}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return bundle_dir


def load_classifier(bundle_dir: str | os.PathLike, backend: str = "auto", threshold: float = DEFAULT_THRESHOLD,
                    stem_head: str | os.PathLike = STEM_HEAD_WEIGHTS, verify: bool = True) -> Classifier:
    """Open the bundle with the colibri runtime and wrap it with the stem and head.

    Raises:
        colibri_sdk.errors.ColibriError: the bundle is missing, tampered with, or the backend cannot run.
    """
    from colibri_sdk.runtime import Runtime

    stem_head = StemHead(stem_head)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold {threshold!r}; allowed: 0 < threshold <= 1")
    runtime = Runtime.load(bundle_dir, backend=backend, verify=verify)
    # A frame is (1, TOKENS, HIDDEN): the bundle needs that hidden size and a compiled shape holding one frame
    # (orin compiles batch 1 and 4 x tokens 16; each call runs at the smallest shape that holds it).
    if runtime.hidden_size != HIDDEN or runtime.shape[1] < TOKENS:
        shapes = ", ".join(f"{b}x{t}" for b, t in runtime.shapes)
        runtime.close()
        raise ValueError(f"bundle {bundle_dir} has the shapes {shapes} (batch x tokens) at hidden "
                         f"{runtime.hidden_size}; this model needs tokens {TOKENS} at hidden {HIDDEN}")
    return Classifier(runtime, stem_head, threshold)
