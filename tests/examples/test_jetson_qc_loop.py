"""The camera loop: a bounded CPU run as CI runs it, drops under a slow model, SIGTERM, a failing frame."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

from qc.dataset import CLASSES
from qc.loop import DropOldestQueue, EventLog, StopFlag, run_loop
from qc.model import Prediction
from qc.sources import Frame, SourceError, SyntheticSource, open_source

ROOT = Path(__file__).resolve().parents[2]
QC_LOOP = ROOT / "examples" / "jetson_qc" / "qc_loop.py"


def parse_events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_cli(*args, timeout=None) -> subprocess.CompletedProcess:
    timeout = guard(600) if timeout is None else timeout
    return subprocess.run([sys.executable, str(QC_LOOP), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


# ---- the bounded run CI does ---------------------------------------------------------------------------------------
def test_bounded_synthetic_run_on_cpu(qc_bundle, tmp_path):
    frames_dir = tmp_path / "frames"
    done = run_cli("--bundle", str(qc_bundle), "--no-build", "--backend", "cpu", "--max-frames", "40", "--fps", "100",
                   "--queue-size", "64", "--stats-every", "10", "--save-frames", str(frames_dir),
                   "--save-failures-only")
    assert done.returncode == 0, done.stderr
    assert "self-test passed on cpu" in done.stderr
    events = parse_events(done.stdout)
    start, frames = events[0], [e for e in events if e["type"] == "frame"]
    stats = [e for e in events if e["type"] == "stats"]
    assert start["type"] == "start" and start["backend"] == "cpu" and start["dtype"] == "fp16"
    assert [e["frame"] for e in frames] == list(range(40))  # queue of 64: nothing dropped
    assert [s["frames"] for s in stats] == [10, 20, 30, 40, 40]
    final = stats[-1]
    assert final["final"] and final["stopped_by"] == "max-frames"
    assert (final["captured"], final["dropped"], final["errors"]) == (40, 0, 0)
    assert 0 < final["latency_ms"]["p50"] <= final["latency_ms"]["p99"] <= final["latency_ms"]["max"]
    for e in frames:
        assert e["verdict"] == ("fail" if e["p_defect"] >= 0.5 else "pass")
        assert e["class"] == max(e["probs"], key=e["probs"].get)
        assert e["truth"] in CLASSES
    correct = sum(e["class"] == e["truth"] for e in frames)
    assert correct >= 32, f"{correct}/40 synthetic frames classified correctly"
    failed = sorted(f"{e['frame']:06d}_fail_{e['class']}.png" for e in frames if e["verdict"] == "fail")
    assert failed and sorted(p.name for p in frames_dir.iterdir()) == failed
    png = (frames_dir / failed[0]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"


def test_sigterm_stops_the_loop_cleanly(qc_bundle):
    proc = subprocess.Popen([sys.executable, str(QC_LOOP), "--bundle", str(qc_bundle), "--no-build", "--backend",
                             "cpu", "--fps", "20", "--no-verify"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        seen = []
        deadline = time.monotonic() + guard(600)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(json.loads(line))
            if seen[-1]["type"] == "frame" and seen[-1]["frame"] >= 2:
                break
        assert seen and seen[-1]["type"] == "frame", seen
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=guard(600))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    final = parse_events(out)[-1]
    assert final["type"] == "stats" and final["final"] and final["stopped_by"] == "SIGTERM"
    assert final["frames"] >= 3


def test_missing_bundle_with_no_build_is_refused(tmp_path):
    done = run_cli("--bundle", str(tmp_path / "nothing"), "--no-build", "--max-frames", "1")
    assert done.returncode == 1
    assert f"bundle {tmp_path / 'nothing'} has no manifest.json and --no-build was given" in done.stderr
    assert done.stdout == ""


# ---- in-process loop behaviour -------------------------------------------------------------------------------------
class SlowClassifier:
    """A stand-in model that takes `delay` seconds per frame and says every frame is OK."""

    def __init__(self, delay: float):
        self.delay = delay
        self.seen: list[int] = []

    def classify(self, image):
        time.sleep(self.delay)
        return Prediction(0, np.array([1.0, 0.0, 0.0, 0.0], np.float32), 0.0, True, self.delay * 1e3)


class IndexedSource:
    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        for i in range(self.count):
            yield Frame(i, np.full((64, 64), i, np.uint8), f"test#{i}")


def test_slow_inference_drops_the_oldest_frames_and_counts_them():
    out = io.StringIO()
    final = run_loop(IndexedSource(30), SlowClassifier(0.03), EventLog(out), fps=500, queue_size=2, stats_every=0)
    events = parse_events(out.getvalue())
    processed = [e["frame"] for e in events if e["type"] == "frame"]
    assert final["captured"] == 30
    assert final["dropped"] > 0
    assert len(processed) + final["dropped"] == 30
    assert processed == sorted(processed)
    assert processed[-1] == 29  # the newest frame survives; the oldest ones were dropped
    assert final["stopped_by"] == "end of source"


def test_a_failing_frame_is_logged_and_the_loop_goes_on(qc_classifier, caplog):
    class SourceWithBadFrame:
        def __iter__(self):
            synthetic = iter(SyntheticSource(seed=5))
            for i in range(6):
                frame = next(synthetic)
                if i == 2:
                    frame.image = np.full((128, 128), np.nan, np.float32)  # the runtime refuses NaN input
                yield frame

    out = io.StringIO()
    with caplog.at_level("ERROR", logger="jetson_qc"):
        final = run_loop(SourceWithBadFrame(), qc_classifier, EventLog(out), fps=0, queue_size=16, stats_every=0)
    events = parse_events(out.getvalue())
    errors = [e for e in events if e["type"] == "error"]
    assert [e["frame"] for e in errors] == [2]
    assert errors[0]["error"].startswith("InputError: input has non-finite values")
    assert [e["frame"] for e in events if e["type"] == "frame"] == [0, 1, 3, 4, 5]
    assert (final["frames"], final["errors"], final["captured"]) == (5, 1, 6)
    assert "frame 2 (synthetic#2) failed: InputError" in caplog.text


def test_stop_flag_ends_a_paced_run_with_its_reason():
    stop = StopFlag()
    threading.Timer(0.3, stop.request, args=("SIGINT",)).start()
    out = io.StringIO()
    started = time.monotonic()
    final = run_loop(IndexedSource(10_000), SlowClassifier(0.0), EventLog(out), fps=20, stop=stop, stats_every=0)
    assert time.monotonic() - started < 3.0
    assert final["stopped_by"] == "SIGINT"
    assert 1 <= final["frames"] <= 12


def test_drop_oldest_queue():
    q = DropOldestQueue(2)
    for item in "abc":
        q.put(item)
    assert q.dropped == 1
    assert [q.get(0.01), q.get(0.01), q.get(0.01)] == ["b", "c", None]
    q.close()
    assert q.finished
    with pytest.raises(ValueError, match=r"queue capacity 0; allowed: >= 1"):
        DropOldestQueue(0)


# ---- sources and images --------------------------------------------------------------------------------------------
def test_folder_source_reads_numpy_and_pnm_files(tmp_path):
    grey = np.arange(64 * 64, dtype=np.uint32).reshape(64, 64).astype(np.uint8)
    np.save(tmp_path / "a.npy", grey)
    rgb = np.stack([grey, grey // 2, grey // 3], axis=2)
    (tmp_path / "b.ppm").write_bytes(b"P6\n# comment\n64 64\n255\n" + rgb.tobytes())
    (tmp_path / "notes.txt").write_text("ignored")
    frames = list(open_source(f"folder:{tmp_path}"))
    assert [f.name for f in frames] == ["a.npy", "b.ppm"]
    np.testing.assert_array_equal(frames[0].image, grey)
    np.testing.assert_array_equal(frames[1].image, rgb[:, :, ::-1])  # frames are BGR


def test_synthetic_source_is_deterministic_by_seed():
    a = [f.image for f, _ in zip(SyntheticSource(seed=9), range(3))]
    b = [f.image for f, _ in zip(SyntheticSource(seed=9), range(3))]
    c = next(iter(SyntheticSource(seed=10))).image
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("webcam:0", "unknown source 'webcam:0'; allowed: synthetic[:SEED] | folder:PATH"),
        ("usb:front", "USB camera index 'front'; expected a non-negative integer"),
        ("folder:/no/such/dir", "folder '/no/such/dir' does not exist"),
        ("video:", "source 'video:' needs a value after 'video:'"),
    ],
)
def test_bad_source_specs_are_refused(spec, message):
    with pytest.raises(SourceError, match=message.replace("[", r"\[").replace("|", r"\|")):
        open_source(spec)


def test_opencv_sources_explain_a_missing_opencv(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)  # makes `import cv2` raise ImportError
    with pytest.raises(SourceError, match=r"the usb source needs OpenCV \(cv2\), which is not installed"):
        open_source("usb:0")


def test_png_encoder_round_trips_pixels():
    from qc.images import encode_png

    image = (np.arange(5 * 7 * 3) % 251).astype(np.uint8).reshape(5, 7, 3)
    png = encode_png(image)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    idat_len = int.from_bytes(png[33:37], "big")
    assert png[37:41] == b"IDAT"
    raw = np.frombuffer(zlib.decompress(png[41 : 41 + idat_len]), np.uint8).reshape(5, 1 + 7 * 3)
    assert (raw[:, 0] == 0).all()
    np.testing.assert_array_equal(raw[:, 1:].reshape(5, 7, 3), image)


def test_achieved_rate_counts_intervals_between_frames(monkeypatch):
    """10 frames completed 0.2 s apart are 5 frames per second (9 intervals in 1.8 s), not 10 / 1.8."""
    from qc import loop

    clock = iter([100.0] + [100.0 + 0.2 * i for i in range(10)] + [200.0] * 4)
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    stats = loop.Stats()
    for _ in range(4):
        stats.add(1.0, 1.0)
    first = stats.window(captured=4, dropped=0)  # frames 0..3: 3 intervals in 0.6 s
    for _ in range(6):
        stats.add(1.0, 1.0)
    second = stats.window(captured=10, dropped=0)  # frames 4..9 after frame 3: 6 intervals in 1.2 s
    final = stats.final(captured=10, dropped=0, stopped_by="max-frames")
    assert (first["fps"], second["fps"], final["fps"]) == (5.0, 5.0, 5.0)


def test_events_file_in_a_new_folder_is_created(qc_bundle, tmp_path):
    events = tmp_path / "new" / "folder" / "events.jsonl"
    done = run_cli("--bundle", str(qc_bundle), "--no-build", "--backend", "cpu", "--max-frames", "3", "--fps", "100",
                   "--no-verify", "--events", str(events))
    assert done.returncode == 0, done.stderr
    kinds = [e["type"] for e in parse_events(events.read_text())]
    assert kinds[0] == "start" and kinds[-1] == "stats" and kinds.count("frame") == 3
