"""Bad input to examples/jetson_qc/qc_loop.py: argument errors exit 2 naming the value and the allowed range, other
refusals exit 1 in one line, a corrupt image is one error event (not the end of the folder), and a failing camera
ends the loop with a non-zero status so that a service manager restarts it."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from qc.loop import EventLog, run_loop
from qc.model import Prediction
from qc.sources import FolderSource, Frame, SourceError, open_source
from timeout_support import guard

ROOT = Path(__file__).resolve().parents[2]
QC_LOOP = ROOT / "examples" / "jetson_qc" / "qc_loop.py"


def load_qc_loop():
    spec = importlib.util.spec_from_file_location("qc_loop_bad_input", QC_LOOP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OkClassifier:
    """Says every frame is OK; remembers the mean pixel of each frame it saw."""

    def __init__(self):
        self.seen = []
        self.moe = type("Moe", (), {"backend_name": "cpu", "dtype": "fp16", "load_seconds": 0.0})()

    def classify(self, image):
        self.seen.append(float(np.mean(image)))
        return Prediction(0, np.array([1.0, 0.0, 0.0, 0.0], np.float32), 0.0, True, 0.1)

    def close(self):
        pass


@pytest.mark.parametrize("flag, value, message", [
    ("--fps", "nan", "argument --fps: nan; allowed: a finite number >= 0 and <= 1e+06"),
    ("--fps", "-1", "argument --fps: -1; allowed: a finite number >= 0 and <= 1e+06"),
    ("--fps", "inf", "argument --fps: inf; allowed: a finite number >= 0 and <= 1e+06"),
    ("--threshold", "2", "argument --threshold: 2; allowed: a finite number > 0 and <= 1"),
    ("--threshold", "nan", "argument --threshold: nan; allowed: a finite number > 0 and <= 1"),
    ("--threshold", "0", "argument --threshold: 0; allowed: a finite number > 0 and <= 1"),
    ("--stats-every", "-1", "argument --stats-every: -1; allowed: >= 0"),
    ("--seed", "-5", "argument --seed: -5; allowed: >= 0"),
])
def test_bad_numbers_are_usage_errors(capsys, flag, value, message):
    with pytest.raises(SystemExit) as stop:
        load_qc_loop().parse_args([flag, value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f": error: {message}")  # prog: sys.argv[0]


def test_bad_numbers_on_the_command_line_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(QC_LOOP), "--threshold", "nan", "--bundle", str(tmp_path)],
                          capture_output=True, text=True, timeout=guard(600))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == ("qc_loop.py: error: argument --threshold: nan; allowed: a finite "
                                            "number > 0 and <= 1")
    assert not (tmp_path / "manifest.json").exists()  # refused before any build


def test_negative_synthetic_seed_is_a_source_error():
    with pytest.raises(SourceError, match=r"^synthetic seed -3; expected an integer >= 0, e\.g\. synthetic:7$"):
        open_source("synthetic:-3")


def test_save_frames_pointing_at_a_file_exits_1_and_keeps_the_file(tmp_path):
    afile = tmp_path / "frames"
    afile.write_text("keep me")
    done = subprocess.run([sys.executable, str(QC_LOOP), "--save-frames", str(afile), "--bundle", str(tmp_path / "b"),
                           "--no-build", "--max-frames", "1"], capture_output=True, text=True, timeout=guard(600))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().endswith(f"ERROR --save-frames {afile}: cannot use it as a folder for the PNG frames: "
                                        f"File exists"), done.stderr
    assert "Traceback" not in done.stderr and afile.read_text() == "keep me"


def test_a_corrupt_file_in_a_folder_is_one_error_event_and_the_rest_are_classified(tmp_path):
    np.save(tmp_path / "a.npy", np.full((64, 64), 10, np.uint8))
    (tmp_path / "b.npy").write_bytes(b"not a numpy file")
    (tmp_path / "c.pgm").write_bytes(b"P5\n99999 99999\n255\n")  # header promises far more than it holds
    np.save(tmp_path / "d.npy", np.full((64, 64), 200, np.uint8))
    out, model = io.StringIO(), OkClassifier()
    final = run_loop(FolderSource(tmp_path), model, EventLog(out), fps=0, queue_size=8, stats_every=0)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["type"], e["source"]) for e in events[:-1]] == [
        ("frame", "a.npy"), ("error", "b.npy"), ("error", "c.pgm"), ("frame", "d.npy")]
    assert events[1]["error"].startswith(f"FrameReadError: cannot read {tmp_path / 'b.npy'}: ValueError: ")
    assert model.seen == [10.0, 200.0]
    assert (final["captured"], final["frames"], final["errors"], final["stopped_by"]) == (4, 2, 2, "end of source")


def test_a_failing_camera_exits_1(monkeypatch, capsys, caplog):
    class FailingCamera:
        def __iter__(self):
            yield Frame(0, np.zeros((64, 64), np.uint8), "usb:0#0")
            raise OSError("camera unplugged")

        def close(self):
            pass

    module = load_qc_loop()
    monkeypatch.setattr(module, "open_source", lambda *a, **k: FailingCamera())
    monkeypatch.setattr(module, "open_classifier", lambda args: OkClassifier())
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)  # and its logging set-up
    assert module.main(["--source", "usb:0", "--fps", "0"]) == 1
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert final["stopped_by"] == "source error" and final["frames"] == 1
    assert caplog.messages[-1] == "stopped: the frame source usb:0 failed (see the error event)"
