"""Mutation fuzzing of every file the SDK reads: .colibri weights (v1 and v2), bundles, device profiles, HF checkpoints,
GGUF files.

Each case mutates a valid input with a seeded generator (byte flips, header fields, structure-aware JSON / YAML
edits, links, FIFOs, forged digests), runs the SDK's own reader on it (`ColibriFile`; `Bundle.open` +
`Runtime.load(cpu)` + self-test + inspect; `load_profile`; `convert` of a checkpoint or a GGUF file), and sorts the
outcome into one column (bench/fuzzing/cases.py):

    typed                a ColibriError with a one-line message (a multi-line one counts as a crash; one over
                         1,000 characters is listed as a note under the table)
    accepted-correct     accepted, and an independent check agrees with what was accepted (below)
    crash                any other exception escaped the SDK
    hang                 the case ran past --timeout seconds (SIGALRM)
    silent-wrong         accepted, but the independent check disagrees (e.g. a file that differs from its manifest)
    read-outside-folder  a file under the "outside" folder (a copy the links point at) was opened

One module per surface in bench/fuzzing/ (colibri_files, v2_files, bundles, profiles, checkpoints, gguf_files, and
agent_answers: the deploy client fed mutated answers of a device's agent, its own columns described there); this
script runs them. The independent checks are written there from the specs, not with the code under test: .colibri sizes and
tensor offsets from docs/format.md (v2: the header fields at their offsets, the block list and a dequantized matrix
per kind, over int8 / int4 / float bases with shared experts and each routing variant); a bundle's files re-hashed with hashlib, its canonical JSON recomputed, its weights
header and values read with struct/NumPy; a profile's values against docs/profiles.md's ranges; a converted
checkpoint's tensors against safetensors' own loader (Mixtral layout: w1 = gate, w3 = up, w2 = down, gate.T =
router); a converted GGUF file's sizes and tensors against gguf-py's reading of it. Opens are watched with an audit
hook (sys.addaudithook, the "open" event). Everything runs in this process, so a segfault would end the run (none
has happened).

    python bench/fuzz.py                        # the full counts: 10,000 / 1,200 / 3,000 / 3,000 / 1,000 / 600 / 3,000
    python bench/fuzz.py --scale 0.1            # a tenth of each
    python bench/fuzz.py --only bundle --seed 7
    python bench/fuzz.py --only v2 --scale 0.1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/fuzzing, when run as a script or loaded by path

from fuzzing.agent_answers import fuzz_agent  # noqa: E402
from fuzzing.bundles import fuzz_bundles  # noqa: E402
from fuzzing.cases import BAD, COLUMNS, Tally, run_case  # noqa: E402,F401 (run_case: used by tests/robustness)
from fuzzing.checkpoints import fuzz_checkpoints  # noqa: E402
from fuzzing.colibri_files import fuzz_colibri  # noqa: E402
from fuzzing.gguf_files import fuzz_gguf  # noqa: E402
from fuzzing.profiles import fuzz_profiles  # noqa: E402
from fuzzing.v2_files import fuzz_v2  # noqa: E402

FULL = {"colibri": 10_000, "v2": 1_200, "bundle": 3_000, "profile": 3_000, "checkpoint": 1_000, "gguf": 600,
        "agent": 3_000}
TARGETS = {"colibri": fuzz_colibri, "v2": fuzz_v2, "bundle": fuzz_bundles, "profile": fuzz_profiles,
           "checkpoint": fuzz_checkpoints, "gguf": fuzz_gguf, "agent": fuzz_agent}


def run(counts: dict[str, int], seed: int, timeout: float, work: Path | None = None) -> list[Tally]:
    """Fuzz each target `counts[name]` times; returns the tallies in TARGETS order."""
    import logging

    logging.getLogger("colibri_sdk").setLevel(logging.ERROR)  # the converter's both-files warning, once per case
    tallies = []
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-", dir=work) as tmp:
        for name, fn in TARGETS.items():
            if counts.get(name):
                folder = Path(tmp, name)
                folder.mkdir()
                tallies.append(fn(counts[name], seed, folder, timeout))
    return tallies


def table(tallies: list[Tally]) -> str:
    head = f"{'input':<11}" + "".join(f"{c:>{len(c) + 2}}" for c in COLUMNS)
    rows = [head] + [f"{t.name:<11}" + "".join(f"{t.counts[c]:>{len(c) + 2},}" for c in COLUMNS) for t in tallies]
    for t in tallies:
        for column, examples in t.examples.items():
            for case, detail in examples:
                rows.append(f"  {t.name} {column}: {case}: {detail}")
        for what, (count, examples) in t.notes.items():
            rows.append(f"  {t.name} note: {count} typed errors with a {what}, e.g.")
            rows += [f"    {case}: {detail}" for case, detail in examples]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count (default 1: the full counts)")
    parser.add_argument("--only", choices=tuple(TARGETS), nargs="+", help="fuzz only these inputs")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it counts as a hang")
    args = parser.parse_args()
    counts = {k: max(1, round(v * args.scale)) for k, v in FULL.items() if not args.only or k in args.only}
    start = time.perf_counter()
    tallies = run(counts, args.seed, args.timeout)
    print(f"colibri-sdk fuzz: seed {args.seed}, scale {args.scale:g}, timeout {args.timeout:g} s per case, "
          f"{time.perf_counter() - start:.0f} s")
    print(table(tallies))
    return 1 if any(t.counts[c] for t in tallies for c in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
