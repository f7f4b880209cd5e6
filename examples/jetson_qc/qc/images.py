"""PNG writing and frame annotation with NumPy and the standard library (OpenCV is optional on the device).

PNG encoding follows the PNG specification (ISO/IEC 15948): signature, IHDR, one zlib-compressed IDAT of
filter-0 scanlines, IEND; each chunk with its CRC-32.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

PASS_COLOUR = (0, 200, 0)  # RGB
FAIL_COLOUR = (230, 0, 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an 8-bit image: (height, width) grey or (height, width, 3) RGB, uint8."""
    image = np.ascontiguousarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ValueError(f"image {image.dtype} {image.shape}; expected uint8 (h, w) or (h, w, 3)")
    height, width = image.shape[:2]
    colour_type = 0 if image.ndim == 2 else 2
    rows = image.reshape(height, -1)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def to_rgb(frame: np.ndarray) -> np.ndarray:
    """(h, w) grey or (h, w, 3) BGR uint8 camera frame → (h, w, 3) RGB uint8."""
    if frame.ndim == 2:
        return np.repeat(frame[:, :, None], 3, axis=2)
    return np.ascontiguousarray(frame[:, :, ::-1])


def annotate(frame: np.ndarray, passed: bool, p_defect: float, label: str) -> np.ndarray:
    """The frame as RGB with a border (green pass, red fail) and a bar along the bottom whose length is p_defect.

    With OpenCV present the verdict and class are also written as text.

    Returns:
        (h, w, 3) uint8 RGB.
    """
    rgb = to_rgb(np.asarray(frame, dtype=np.uint8)).copy()
    height, width = rgb.shape[:2]
    colour = np.array(PASS_COLOUR if passed else FAIL_COLOUR, np.uint8)
    border = max(2, min(height, width) // 40)
    rgb[:border], rgb[-border:], rgb[:, :border], rgb[:, -border:] = colour, colour, colour, colour
    bar = int(round(np.clip(p_defect, 0.0, 1.0) * (width - 2 * border)))
    rgb[height - 3 * border : height - border, border : border + bar] = colour
    try:
        import cv2
    except ImportError:
        return rgb
    text = f"{'PASS' if passed else 'FAIL'} {label} {p_defect:.2f}"
    scale = max(0.3, width / 640)
    cv2.putText(rgb, text, (2 * border, 2 * border + int(12 * scale)), cv2.FONT_HERSHEY_SIMPLEX, scale,
                tuple(int(c) for c in colour), 1, cv2.LINE_AA)
    return rgb


def write_png(path: str | Path, image: np.ndarray) -> Path:
    """Write an (h, w) grey or (h, w, 3) RGB uint8 image as PNG; returns the path."""
    path = Path(path)
    path.write_bytes(encode_png(image))
    return path


def read_pnm(path: str | Path) -> np.ndarray:
    """Read a binary 8-bit PGM (P5) or PPM (P6) file: (h, w) grey or (h, w, 3) RGB uint8."""
    data = Path(path).read_bytes()
    tokens, pos = [], 0
    while len(tokens) < 4:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            pos = data.index(b"\n", pos)
            continue
        start = pos
        while pos < len(data) and not data[pos : pos + 1].isspace():
            pos += 1
        tokens.append(data[start:pos])
    magic, width, height, maxval = tokens[0], int(tokens[1]), int(tokens[2]), int(tokens[3])
    if magic not in (b"P5", b"P6") or maxval != 255:
        raise ValueError(f"{path}: {magic!r} maxval {maxval}; supported: P5/P6 with maxval 255")
    channels = 3 if magic == b"P6" else 1
    pixels = np.frombuffer(data, np.uint8, count=width * height * channels, offset=pos + 1)
    return pixels.reshape((height, width, 3) if channels == 3 else (height, width))
