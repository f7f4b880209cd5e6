"""bench/fuzz.py at CI-sized counts with fixed seeds: every mutated .colibri file, bundle, profile, checkpoint, GGUF file and device-agent answer
ends as a one-line typed error or as an accepted input an independent check agrees with; never a crash, a hang, a
silent wrong answer or a read outside the bundle folder. (The large counts: `python bench/fuzz.py`,
bench/results/fuzz.txt.)"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from timeout_support import guard

ROOT = Path(__file__).resolve().parents[2]
# A case running past this counts as a hang: far above a busy 2-core run's time for one case (a bundle case, which
# opens and verifies a bundle, took over 10 s at load average 8), scaled by COLIBRI_TEST_TIMEOUT_SCALE.
CASE_TIMEOUT = guard(60)


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("colibri_fuzz", ROOT / "bench" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _check(tally) -> None:
    counts = tally.counts
    assert {c: counts[c] for c in ("crash", "hang", "silent-wrong", "read-outside-folder")} == dict.fromkeys(
        ("crash", "hang", "silent-wrong", "read-outside-folder"), 0), tally.examples
    assert counts["typed"] > 0 and counts["accepted-correct"] > 0, counts  # both outcomes were exercised
    assert counts["typed"] + counts["accepted-correct"] == counts["tried"]


@pytest.mark.parametrize(("name", "count", "seed"), [("colibri", 300, 1), ("v2", 120, 5), ("profile", 150, 2), ("agent", 300, 4),
                                                    ("checkpoint", 50, 3), ("gguf", 120, 6)])
def test_fuzz_files(fuzz, tmp_path, name, count, seed):
    _check(fuzz.TARGETS[name](count, seed, tmp_path, CASE_TIMEOUT))


def test_fuzz_bundles(fuzz, tmp_path, small_bundle_dir):
    _check(fuzz.fuzz_bundles(80, 4, tmp_path, CASE_TIMEOUT, base=small_bundle_dir))


def test_the_fuzzer_sees_a_read_outside_the_folder(fuzz, tmp_path):
    """The detector itself: opening a file under the watched folder is counted, with its path."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("x")
    tally = fuzz.Tally("probe")
    fuzz.run_case(tally, "probe", lambda: open(os.path.join(outside, "secret")).close(), outside, 5.0)
    fuzz.run_case(tally, "fine", lambda: None, outside, 5.0)
    assert tally.counts["read-outside-folder"] == 1 and tally.counts["accepted-correct"] == 1
    assert tally.examples["read-outside-folder"][0][1].endswith("outside/secret")


def test_the_fuzzer_sees_a_hang_and_a_crash(fuzz):
    import time

    tally = fuzz.Tally("probe")
    fuzz.run_case(tally, "hang", lambda: time.sleep(5), None, 0.2)
    fuzz.run_case(tally, "crash", lambda: {}["missing"], None, 5.0)
    assert tally.counts["hang"] == 1 and tally.counts["crash"] == 1
