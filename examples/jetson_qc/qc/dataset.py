"""A procedural surface-defect data set: camera frames of a metal plate, OK or with one defect.

Every frame is drawn from its own generator seeded with (seed, index), so frame i of a set is the same whatever
the set's size, on every platform (NumPy's PCG64). Nothing is downloaded.

A frame is (size, size) uint8 grey levels, by default 128 x 128:
    background   dark, 0.08-0.2
    plate        a rounded square over most of the frame, shifted by up to +-6 px, base level 0.4-0.7,
                 with a brushed texture (streaks along one axis)
    lighting     a linear gradient in a random direction (+-0.18), a global gain 0.75-1.25
    defect       one of
                   scratch  a straight thin line, 25-70 px long, mostly brighter than the plate (70 %)
                   spot     a soft elliptic blob, radius 2.5-7 px, mostly darker (75 %)
                   crack    a jagged dark polyline (a random walk of 10-18 segments of 3-6 px), often branched
    noise        Gaussian, sigma 0.01-0.035 (in units of full scale)

Classes (the label order is the model's output order): 0 ok, 1 scratch, 2 spot, 3 crack.
"""

from __future__ import annotations

import numpy as np

CLASSES = ("ok", "scratch", "spot", "crack")
FRAME_SIZE = 128


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    return y, x


def _segment_distance(y, x, p0, p1) -> np.ndarray:
    """Distance in px from every pixel to the segment p0-p1 ((y, x) points). y, x: (size, size)."""
    (y0, x0), (y1, x1) = p0, p1
    dy, dx = y1 - y0, x1 - x0
    length2 = dy * dy + dx * dx
    t = np.zeros_like(y) if length2 == 0 else np.clip(((y - y0) * dy + (x - x0) * dx) / length2, 0.0, 1.0)
    return np.hypot(y - (y0 + t * dy), x - (x0 + t * dx))


def _line_alpha(distance: np.ndarray, half_width: float) -> np.ndarray:
    """Anti-aliased coverage of a line of `half_width` px: 1 inside, a 1-px linear edge, 0 outside."""
    return np.clip(half_width + 0.5 - distance, 0.0, 1.0)


def _plate(rng, y, x, size):
    """Background + plate + brushed texture; returns (image, centre (cy, cx), plate half-size)."""
    image = np.full((size, size), rng.uniform(0.08, 0.2), np.float32)
    cy, cx = size / 2 + rng.uniform(-6, 6, size=2)
    half = size * rng.uniform(0.40, 0.44)
    corner = size * 0.08
    # Rounded square: distance outside the inner square, minus the corner radius.
    qy = np.maximum(np.abs(y - cy) - (half - corner), 0.0)
    qx = np.maximum(np.abs(x - cx) - (half - corner), 0.0)
    inside = np.clip(corner + 0.5 - np.hypot(qy, qx), 0.0, 1.0)
    base = rng.uniform(0.4, 0.7)
    streaks = rng.normal(0.0, 0.02, size=size).astype(np.float32)
    streaks = np.convolve(streaks, np.ones(3) / 3, mode="same")
    texture = streaks[None, :] if rng.random() < 0.5 else streaks[:, None]
    image = image * (1 - inside) + (base + texture) * inside
    return image, (cy, cx), half


def _scratch(rng, y, x, centre, reach):
    cy, cx = centre
    length = rng.uniform(25, 70)
    angle = rng.uniform(0, np.pi)
    my, mx = cy + rng.uniform(-reach, reach), cx + rng.uniform(-reach, reach)
    dy, dx = np.sin(angle) * length / 2, np.cos(angle) * length / 2
    d = _segment_distance(y, x, (my - dy, mx - dx), (my + dy, mx + dx))
    contrast = rng.uniform(0.15, 0.35) * (1.0 if rng.random() < 0.7 else -1.0)  # mostly bright (reflective)
    return contrast * _line_alpha(d, rng.uniform(0.6, 1.4))


def _spot(rng, y, x, centre, reach):
    cy, cx = centre
    my, mx = cy + rng.uniform(-reach, reach), cx + rng.uniform(-reach, reach)
    ry, rx = rng.uniform(2.5, 7.0), rng.uniform(2.5, 7.0)
    r2 = ((y - my) / ry) ** 2 + ((x - mx) / rx) ** 2
    contrast = rng.uniform(0.2, 0.4) * (-1.0 if rng.random() < 0.75 else 1.0)
    return contrast * np.exp(-(r2**2))


def _crack(rng, y, x, centre, reach):
    cy, cx = centre
    point = np.array([cy + rng.uniform(-reach, reach), cx + rng.uniform(-reach, reach)])
    heading = rng.uniform(0, 2 * np.pi)
    half_width = rng.uniform(0.5, 1.1)
    distance = np.full(y.shape, np.inf, np.float32)
    branch_at = int(rng.integers(3, 8)) if rng.random() < 0.6 else -1
    branch_from = None
    for step in range(int(rng.integers(10, 19))):
        heading += rng.uniform(-1.2, 1.2)
        nxt = point + rng.uniform(3, 6) * np.array([np.sin(heading), np.cos(heading)])
        distance = np.minimum(distance, _segment_distance(y, x, point, nxt))
        if step == branch_at:
            branch_from = (nxt.copy(), heading + rng.choice((-1.0, 1.0)) * rng.uniform(0.6, 1.2))
        point = nxt
    if branch_from is not None:
        point, heading = branch_from
        for _ in range(int(rng.integers(3, 7))):
            heading += rng.uniform(-1.0, 1.0)
            nxt = point + rng.uniform(3, 6) * np.array([np.sin(heading), np.cos(heading)])
            distance = np.minimum(distance, _segment_distance(y, x, point, nxt))
            point = nxt
    return -rng.uniform(0.25, 0.45) * _line_alpha(distance, half_width)


_DEFECTS = {1: _scratch, 2: _spot, 3: _crack}


def render(seed: int, index: int, label: int, size: int = FRAME_SIZE) -> np.ndarray:
    """One frame of class `label` (0..3, see CLASSES), drawn from the generator seeded with (seed, index).

    Returns:
        (size, size) uint8 grey levels.
    """
    if label not in range(len(CLASSES)):
        raise ValueError(f"label {label!r}; allowed: 0..{len(CLASSES) - 1} ({', '.join(CLASSES)})")
    rng = np.random.default_rng([seed, index, label])
    y, x = _grid(size)
    image, centre, half = _plate(rng, y, x, size)
    if label:
        image = image + _DEFECTS[label](rng, y, x, centre, 0.6 * half)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(angle) * (x - size / 2) + np.sin(angle) * (y - size / 2)) / size
    image = (image + rng.uniform(-0.18, 0.18) * 2 * ramp) * rng.uniform(0.75, 1.25)
    image = image + rng.normal(0.0, rng.uniform(0.01, 0.035), size=image.shape)
    return np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8)


def make_dataset(count: int, seed: int, size: int = FRAME_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """A balanced set: labels cycle through the classes, frame i drawn from (seed, i).

    Returns:
        frames (count, size, size) uint8, labels (count,) int64.
    """
    labels = np.arange(count, dtype=np.int64) % len(CLASSES)
    frames = np.stack([render(seed, i, int(labels[i]), size) for i in range(count)]) if count else (
        np.zeros((0, size, size), np.uint8)
    )
    return frames, labels
