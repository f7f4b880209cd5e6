"""The correctness cases of tests/gpu, each test in its own pytest process with its own time limit.

Collects the node ids (`pytest --collect-only -q tests/gpu`), runs them `workers` at a time, and writes one
results line per case as it ends: status "ok" (passed), "skip" (with pytest's reason) or "fail" (failed, error,
or timed out, with the first line of the failure). Every case's pytest output is appended to OUT/correctness.log.
A case that skips because no GPU is usable is a failure on a GPU machine: the check is then not a GPU pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from device import ROOT, seconds_left


def collect(pytest_args: list[str], timeout: float) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu"), "--collect-only", "-q",
                           "-p", "no:cacheprovider", *pytest_args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise RuntimeError(f"pytest collected no tests/gpu case (rc {done.returncode}): "
                           f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    return ids


def outcome(xml_path: Path) -> tuple[str, str]:
    """(status, reason) from a one-test JUnit XML file."""
    case = next(ET.parse(xml_path).iter("testcase"))
    for tag, status in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
        node = case.find(tag)
        if node is not None:
            text = node.get("message") or (node.text or "").strip()
            return status, text.splitlines()[0][:400] if text else tag
    return "ok", ""


def run_cases(results, ids: list[str], pytest_args: list[str], per_case_s: float, workers: int, log: Path,
              require_gpu: bool) -> dict:
    lock = threading.Lock()
    counts = {"ok": 0, "skip": 0, "fail": 0}
    tmp = Path(tempfile.mkdtemp(prefix="colibri-gpu-check-"))

    def one(index: int, node: str) -> None:
        xml = tmp / f"{index}.xml"
        limit = int(min(per_case_s, seconds_left() - 8))
        if limit < 5:
            with lock:
                counts["skip"] += 1
                results.write("case", "skip", case=node, reason="not run: the phase's time is spent")
            return
        cmd = ["timeout", "--kill-after=5", str(limit), sys.executable, "-m", "pytest", node, "-q", "-rs",
               "-p", "no:cacheprovider", f"--junitxml={xml}", f"--basetemp={tmp / f'b{index}'}", *pytest_args]
        t = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
        seconds = round(time.monotonic() - t, 2)
        if done.returncode in (124, 137):
            status, reason = "fail", f"timed out after {limit} s"
        elif xml.exists():
            status, reason = outcome(xml)
        else:
            status, reason = "fail", f"pytest exited {done.returncode} without a report: " \
                                     f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}"
        if require_gpu and status == "skip" and "no usable CUDA GPU" in reason:
            status = "fail"
        with lock:
            counts[status] += 1
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"===== {node} ({status}, {seconds} s)\n{done.stdout}{done.stderr}\n")
            values = {"case": node, "seconds": seconds}
            if reason:
                values["reason"] = reason
            results.write("case", status, **values)

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(one, i, node) for i, node in enumerate(ids)]:
                future.result()
    finally:  # the cases' bundles and reports (their output is in the log and the results already)
        shutil.rmtree(tmp, ignore_errors=True)
    return counts
