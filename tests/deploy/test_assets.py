"""The on-device assets in deploy/: the systemd unit parses, and the arguments it gives the camera loop are ones
the loop accepts."""

from __future__ import annotations

import configparser
import importlib.util
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "colibri-qc@.service"
QC_LOOP = ROOT / "examples" / "jetson_qc" / "qc_loop.py"


def unit_sections() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_runs_the_active_pointer_and_restarts_on_failure():
    unit = unit_sections()
    assert unit["Service"]["Restart"] == "on-failure"
    exec_start = unit["Service"]["ExecStart"]
    assert '--bundle "$COLIBRI_DIR/current"' in exec_start and "--no-build" in exec_start


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text())
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
    assert proc.returncode == 0 and "ignoring" not in proc.stderr, proc.stderr


@pytest.mark.skipif(not QC_LOOP.exists(), reason="examples/jetson_qc/qc_loop.py is not in this checkout")
def test_camera_loop_accepts_the_units_arguments():
    spec = importlib.util.spec_from_file_location("qc_loop_for_test", QC_LOOP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    script = shlex.split(unit_sections()["Service"]["ExecStart"])[-1]  # the sh -c script
    argv = shlex.split(script.replace("$QC_ARGS", "--fps 5"))
    argv = [a.replace("$COLIBRI_DIR", "/opt/colibri").replace("$QC_SOURCE", "usb:0")
            .replace("$LOGS_DIRECTORY", "/var/log/colibri").replace("%i", "line1") for a in argv[3:]]
    args = module.parse_args(argv)
    assert str(args.bundle) == "/opt/colibri/current" and args.no_build and args.source == "usb:0"
