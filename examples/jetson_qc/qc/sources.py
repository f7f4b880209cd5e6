"""Frame sources: where the camera loop gets its frames.

A source is an iterator of `Frame`s plus `close()`. `open_source(spec)` picks one from a short string:

    synthetic[:SEED]       procedural plates (qc.dataset), 30 % with a defect; the ground truth rides along (default)
    folder:PATH            image files in name order: .npy, .pgm/.ppm (NumPy only), .png/.jpg/.bmp (OpenCV)
    video:PATH             a video file (OpenCV)
    usb:INDEX              a V4L2/USB camera, e.g. usb:0 (OpenCV)
    gst:PIPELINE           a GStreamer pipeline ending in appsink (OpenCV built with GStreamer), e.g. a CSI camera
                           on a Jetson:
                             gst:nvarguscamerasrc sensor-id=0 ! video/x-raw(memory:NVMM),width=1280,height=720,
                             framerate=30/1 ! nvvidconv ! video/x-raw,format=BGRx ! videoconvert !
                             video/x-raw,format=BGR ! appsink drop=true max-buffers=1

OpenCV is imported only by the sources that need it; without it they raise SourceError saying how to install it.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Iterator

import numpy as np

from .dataset import CLASSES, render

SPEC_HELP = "synthetic[:SEED] | folder:PATH | video:PATH | usb:INDEX | gst:PIPELINE"
NUMPY_IMAGE_SUFFIXES = (".npy", ".pgm", ".ppm")
OPENCV_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")


class SourceError(RuntimeError):
    """A frame source cannot be opened or read (bad spec, missing file, OpenCV missing, camera not found)."""


@dataclasses.dataclass
class Frame:
    """One captured frame.

    Attributes:
        index: 0, 1, 2, ... in capture order.
        image: (h, w) grey or (h, w, 3) BGR, uint8.
        name: where it came from (file name, "usb:0#17", "synthetic#17").
        truth: the true class name when the source knows it (synthetic frames), else None.
        captured: time.perf_counter() at capture, seconds (set by the loop).
        error: why the image could not be read (a corrupt file of a folder source; `image` is then None); the
            loop reports it as an error event and goes on with the next frame.
    """

    index: int
    image: np.ndarray | None
    name: str
    truth: str | None = None
    captured: float = 0.0
    error: str | None = None


def import_cv2(purpose: str):
    """Import OpenCV or raise SourceError explaining how to get it."""
    try:
        import cv2
    except ImportError as exc:
        raise SourceError(
            f"{purpose} needs OpenCV (cv2), which is not installed: pip install 'colibri-sdk[camera]' "
            "(opencv-python-headless); on a Jetson use JetPack's python3-opencv, which has GStreamer"
        ) from exc
    return cv2


class SyntheticSource:
    """Procedural plate frames (qc.dataset.render), frame i drawn from (seed, i); a fraction has a defect.

    Args:
        seed: generator seed.
        defect_rate: probability that a frame has a defect (its class then uniform over the defect classes).
        size: frame side in px (default 128).
    """

    def __init__(self, seed: int = 0, defect_rate: float = 0.3, size: int = 128):
        self.seed, self.defect_rate, self.size = seed, defect_rate, size
        self._count = itertools.count()

    def label(self, index: int) -> int:
        rng = np.random.default_rng([self.seed, index, 99])
        return int(rng.integers(1, len(CLASSES))) if rng.random() < self.defect_rate else 0

    def __iter__(self) -> Iterator[Frame]:
        for i in self._count:
            label = self.label(i)
            yield Frame(i, render(self.seed, i, label, self.size), f"synthetic#{i}", CLASSES[label])

    def close(self) -> None:
        pass


class FolderSource:
    """Image files of a folder in name order; with `repeat`, start again at the end."""

    def __init__(self, folder: str | Path, repeat: bool = False):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SourceError(f"folder {str(self.folder)!r} does not exist or is not a folder")
        suffixes = NUMPY_IMAGE_SUFFIXES + OPENCV_IMAGE_SUFFIXES
        self.files = sorted(p for p in self.folder.iterdir() if p.suffix.lower() in suffixes)
        if not self.files:
            raise SourceError(f"folder {str(self.folder)!r} has no images; allowed suffixes: {', '.join(suffixes)}")
        self.repeat = repeat
        self._cv2 = None
        if any(p.suffix.lower() in OPENCV_IMAGE_SUFFIXES for p in self.files):
            self._cv2 = import_cv2(f"reading {self.folder} (PNG/JPEG files)")

    def read(self, path: Path) -> np.ndarray:
        suffix = path.suffix.lower()
        if suffix == ".npy":
            return np.load(path)
        if suffix in (".pgm", ".ppm"):
            from .images import read_pnm

            image = read_pnm(path)
            return image[:, :, ::-1] if image.ndim == 3 else image  # PPM is RGB; frames are BGR
        image = self._cv2.imread(str(path), self._cv2.IMREAD_UNCHANGED)
        if image is None:
            raise SourceError(f"OpenCV cannot read {path}")
        return image

    def __iter__(self) -> Iterator[Frame]:
        index = itertools.count()
        while True:
            for path in self.files:
                try:
                    image = self.read(path)
                except (OSError, ValueError, SourceError) as exc:  # one corrupt file must not end the folder
                    yield Frame(next(index), None, path.name, error=f"cannot read {path}: {type(exc).__name__}: "
                                                                    f"{exc}")
                    continue
                yield Frame(next(index), image, path.name)
            if not self.repeat:
                return

    def close(self) -> None:
        pass


class CaptureSource:
    """OpenCV VideoCapture: a video file, a USB camera index, or a GStreamer pipeline string."""

    def __init__(self, target: str | int, kind: str):
        cv2 = import_cv2(f"the {kind} source")
        if kind == "gst":
            self.capture = cv2.VideoCapture(target, cv2.CAP_GSTREAMER)
        else:
            self.capture = cv2.VideoCapture(target)
        if not self.capture.isOpened():
            hint = {
                "usb": "check the index (ls /dev/video*) and permissions (group video)",
                "gst": "check the pipeline with gst-launch-1.0 and that cv2.getBuildInformation() lists GStreamer",
                "video": "check the path and that OpenCV's video backend reads this codec",
            }[kind]
            raise SourceError(f"cannot open {kind} source {target!r}: {hint}")
        if kind in ("usb", "gst"):
            self.capture.set(cv2.CAP_PROP_BUFFERSIZE, 1)  # a live camera: keep the newest frame, not a backlog
        self.kind, self.target = kind, target

    def __iter__(self) -> Iterator[Frame]:
        for i in itertools.count():
            ok, image = self.capture.read()
            if not ok:
                return
            yield Frame(i, image, f"{self.kind}:{self.target}#{i}")

    def close(self) -> None:
        self.capture.release()


def open_source(spec: str, seed: int = 0, repeat: bool = False):
    """Open the source named by `spec` (see the module docstring).

    Raises:
        SourceError: unknown kind, bad USB index, missing file or folder, OpenCV missing or cannot open it.
    """
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        try:
            value = int(rest) if rest else seed
        except ValueError:
            raise SourceError(f"synthetic seed {rest!r}; expected an integer >= 0, e.g. synthetic:7") from None
        if value < 0:
            raise SourceError(f"synthetic seed {value}; expected an integer >= 0, e.g. synthetic:7")
        return SyntheticSource(seed=value)
    if not rest:
        raise SourceError(f"source {spec!r} needs a value after '{kind}:'; allowed: {SPEC_HELP}")
    if kind == "folder":
        return FolderSource(rest, repeat=repeat)
    if kind == "video":
        if not Path(rest).is_file():
            raise SourceError(f"video file {rest!r} does not exist")
        return CaptureSource(rest, "video")
    if kind == "usb":
        if not rest.isdigit():
            raise SourceError(f"USB camera index {rest!r}; expected a non-negative integer, e.g. usb:0")
        return CaptureSource(int(rest), "usb")
    if kind == "gst":
        return CaptureSource(rest, "gst")
    raise SourceError(f"unknown source {spec!r}; allowed: {SPEC_HELP}")
