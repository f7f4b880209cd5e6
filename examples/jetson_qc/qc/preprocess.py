"""Fixed-shape preprocessing: any camera frame → one (64, 64) float32 image, standardised per frame.

    frame (h, w) grey or (h, w, 3|4) BGR(A), uint8 / uint16 / float in [0, 1]
      → grey float32 in [0, 1]          ITU-R BT.601 luma: 0.299 R + 0.587 G + 0.114 B
      → centre crop to a square
      → resize to (64, 64)              area average when the side is a multiple of 64, else bilinear
      → (x - mean) / max(std, 0.02)     removes the global gain and offset of the lighting

The training script and the camera loop call the same function, so the model sees the same numbers in both.
"""

from __future__ import annotations

import numpy as np

IMAGE_SIZE = 64
MIN_STD = 0.02


def to_grey(frame: np.ndarray) -> np.ndarray:
    """(h, w) or (h, w, 3|4) BGR(A) frame → (h, w) float32 grey in [0, 1]."""
    frame = np.asarray(frame)
    if frame.dtype == np.uint8:
        scaled = frame.astype(np.float32) / 255.0
    elif frame.dtype == np.uint16:
        scaled = frame.astype(np.float32) / 65535.0
    elif frame.dtype.kind == "f":
        scaled = frame.astype(np.float32, copy=False)
    else:
        raise ValueError(f"frame dtype {frame.dtype}; allowed: uint8, uint16, float (0..1)")
    if scaled.ndim == 2:
        return scaled
    if scaled.ndim == 3 and scaled.shape[2] in (3, 4):
        b, g, r = scaled[:, :, 0], scaled[:, :, 1], scaled[:, :, 2]
        return (0.114 * b + 0.587 * g + 0.299 * r).astype(np.float32)
    if scaled.ndim == 3 and scaled.shape[2] == 1:
        return scaled[:, :, 0]
    raise ValueError(f"frame shape {frame.shape}; allowed: (h, w), (h, w, 1), (h, w, 3) BGR, (h, w, 4) BGRA")


def centre_crop(image: np.ndarray) -> np.ndarray:
    """The largest centred square of an (h, w) image."""
    h, w = image.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return image[top : top + side, left : left + side]


def resize(image: np.ndarray, size: int) -> np.ndarray:
    """Square (n, n) float32 → (size, size): area average if n is a multiple of size, else bilinear
    (pixel centres aligned, as OpenCV's INTER_LINEAR)."""
    n = image.shape[0]
    if n % size == 0:
        f = n // size
        return image.reshape(size, f, size, f).mean(axis=(1, 3), dtype=np.float32)
    coords = (np.arange(size, dtype=np.float32) + 0.5) * (n / size) - 0.5
    coords = np.clip(coords, 0, n - 1)
    lo = np.floor(coords).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    t = (coords - lo).astype(np.float32)
    rows = image[lo] * (1 - t)[:, None] + image[hi] * t[:, None]
    return (rows[:, lo] * (1 - t)[None, :] + rows[:, hi] * t[None, :]).astype(np.float32)


def preprocess(frame: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """One camera frame → (size, size) float32, zero mean and unit standard deviation (std floored at 0.02).

    Raises:
        ValueError: an unsupported dtype or shape, or a frame smaller than `size` on either side.
    """
    grey = centre_crop(to_grey(frame))
    if grey.shape[0] < size:
        raise ValueError(f"frame {np.shape(frame)} is smaller than the model input {size} x {size}")
    image = resize(grey, size)
    std = max(float(image.std()), MIN_STD)
    return ((image - image.mean()) / std).astype(np.float32)


def preprocess_batch(frames: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """(n, h, w[, c]) frames → (n, size, size) float32."""
    return np.stack([preprocess(f, size) for f in frames]) if len(frames) else np.zeros((0, size, size), np.float32)
