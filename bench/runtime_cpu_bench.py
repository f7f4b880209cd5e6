"""CPU backend benchmark, measured side by side in one run: one MoE layer against transformers' block, a NumPy
copy and (where llama-cpp-python is installed) llama.cpp's CPU backend, `Runtime.infer` against the backend's own
call, the BLAS thread rule, and load time and memory.

MoE layer ("moe"): shape A (hidden 1024, intermediate 2816, 8 experts, top-2; Mixtral's block) and shape B (hidden
2048, intermediate 768, 128 experts, top-8; Qwen3-MoE's block with norm_topk_prob), one layer each. fp32: the
transformers block at random initialisation and the .colibri file written from its weights (outputs compared);
fp16 / int8 per row / int4 g128 / int4 g32: files of random codes and scales of the same shape. Per point (shape,
storage, tokens 1/4/16/64, threads 1 and 2) the fastest call of interleaved rounds (the machine is shared: each
round runs every point once, in alternating order): `CpuBackend.run_layers` (threads: BLAS threads through
threadpoolctl; the compiled kernels split the layer's experts between as many threads), torch
(torch.set_num_threads), and at T=1 a NumPy copy of as many bytes as the selected experts store, from a pool of the
layer's size (the same cache footprint). Before each timed call of these three, 1 GiB of other memory is read
(untimed): every call starts with its weights out of the cache (a layer of shape A fits the 480 MiB L3 here, and
torch, timed right after colibri on the same inputs, found the experts cached). Page size: the colibri files are
dropped from the page cache before the children start (posix_fadvise DONTNEED, as a reboot does) and each child
reads each file once through its backend's mapping, which asks for 2 MiB pages, as `Runtime.load`'s check does
(docs/runtime.md, "2 MiB pages"); at 1 thread shape A's fp32 / fp16 / int8 / int4 g128 run again at T = 1 and 4
on copies of the files made with shutil.copyfile just before the child starts, which the page cache holds in 4 KiB
pages (rows "4KiB", torch's ratio beside the fp32 ones), and the report says how
much of the weights the calls touched the kernel mapped in 2 MiB pages. Ratios: torch time ÷ colibri time
(> 1: colibri faster); effective bandwidth = the selected experts' stored bytes ÷ time, ÷ the copy's, and ÷ a
read-only pass over as many bytes (BLAS sdot of two halves, "read GB/s"): the rate of one plain sequential read, so
at T=1 the read pass's rate ÷ torch's fp32 rate is the torch ratio of a product that reads its weights as fast as
that pass (printed after each table; prefetch hints over several streams can read faster: docs/runtime.md).
Goals (issue 24): >= 1.5x torch at T=1, >= 1.2x at 4/16/64 (fp32); bandwidth >= 0.8x the copy's for every storage.
llama.cpp peer (bench/runtime_cpu_llama.py; docs/runtime.md, "The llama.cpp peer"): llama.cpp's CPU backend on the
same shapes, the experts in Q4_0 and Q8_0, beside colibri's int4 g32 / int4 g128 and int8 of the same run (llama.cpp
time ÷ colibri time, > 1: colibri faster; "llama_cpp_peer" in --json). llama.cpp times only whole models, so the
bench writes one-layer GGUF files with gguf-py (A as llama.cpp's "llama" with experts, B as "qwen3moe"; random
codes; attention of one head of 32, a 64-token "none" vocabulary) and times each twice: "whole", and the same model
with the experts' intermediate size 32; whole - that = the MoE layer estimate (the router drops out with the rest).
Fed through llama-cpp-python's low-level API (one llama_batch of T tokens, n_threads = the thread count, the KV
cache cleared and 1 GiB read before each call), in its own child process right after colibri's of the same thread
count. It needs llama-cpp-python, which builds llama.cpp from source (cmake and a C++ compiler; about 20 min on 2
shared cores; `pip freeze > c.txt && pip install -c c.txt llama-cpp-python` keeps the installed packages'
versions), and gguf (the convert extra); where either is not importable, or llama.cpp cannot load a file, the line
says "skipped (reason)" and the bench goes on. Not in CI.

Overhead ("overhead"): `Runtime.infer` vs `CpuBackend.run_layers` at T=1 on shape A fp32 (goal <= 1.1x).

Latency: one bundle per fixed shape (batch 1 x tokens T, built with `colibri-sdk build` from profiles/orin.yaml with
`shape.tokens` replaced), each timed at its own shape; next to it (T <= 64), the tokens-64 bundle fed T tokens
(padded to 64 internally), in every setting's child, so that each does the same work. Each in a child process:
once with no thread variable set ("default": the backend chooses its threads itself, colibri_sdk.blas), and once
per explicit BLAS thread count
(OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = 1 .. the CPU count, which the backend respects), in rounds of alternating
order; each point keeps its fastest round. "best" is the fastest of the explicit counts; the goal is default within
1.2x of best at every T. Also printed: the CPU time per call, which other load on the machine inflates less.

Load: the demo bundle (25 MB of weights) and a large one (one Mixtral-like layer of ~1 GB, hidden 4096, 8 experts,
top-2), each loaded in a fresh child process: load time without and with checksums (`verify`), resident set after
loading and after the first call, and the peak. The weights are mmap'ed and read only when a call touches them, so
load time and RSS after load should not depend on the weights' size.

    python bench/runtime_cpu_bench.py --json           # writes bench/results/runtime_cpu_bench.txt and .json
    python bench/runtime_cpu_bench.py --sections moe,overhead --moe-rounds 5
    python bench/runtime_cpu_bench.py --iters 50 --large-gb 2

The sections live in bench/runtime_cpu_moe.py (MoE layer, overhead) and bench/runtime_cpu_system.py (threads,
load, the child processes); this file parses the options, runs them and writes the report.
"""


from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runtime_cpu_moe import moe_section, overhead_section
from runtime_cpu_system import RESULTS, thread_and_load_sections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--iters", type=int, default=20, help="timed calls per point (default: 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the thread settings (default: 3)")
    parser.add_argument("--large-gb", type=float, default=1.0, help="size of the large model (default: 1 GB)")
    parser.add_argument("--repeats", type=int, default=3, help="load measurements per bundle (median; default: 3)")
    parser.add_argument("--output", type=Path, default=RESULTS,
                        help=f"the report (text; --json beside it); default: {RESULTS.relative_to(RESULTS.parents[2])}, "
                             f"the committed results, which a run replaces")
    parser.add_argument("--sections", default="moe,overhead,threads,load",
                        help="comma-separated: moe, overhead, threads, load (default: all)")
    parser.add_argument("--moe-rounds", type=int, default=3, help="interleaved rounds of the MoE layer (default: 3)")
    parser.add_argument("--moe-calls", type=int, default=3, help="calls per point and round (default: 3)")
    parser.add_argument("--moe-shapes", default="A,B", help="MoE layer shapes to run (default: A,B)")
    parser.add_argument("--moe-threads", default="1,2", help="thread counts (default: 1,2; 2 runs shape A only)")
    parser.add_argument("--moe-b-tokens", default="1,4,16,64", help="token counts of shape B (default: 1,4,16,64)")
    parser.add_argument("--moe-files", default=None, help="folder of the MoE layer files, reused when present")
    parser.add_argument("--json", action="store_true", help="also write the results as JSON next to --output")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"moe", "overhead", "threads", "load"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; allowed: moe, overhead, threads, load")
    if sections & {"moe", "overhead"} and importlib.util.find_spec("torch") is None:
        parser.error("the moe and overhead sections compare with transformers' MoE block and need torch and "
                     "transformers (the test extra: scripts/setup_env.sh all); --sections threads,load runs without")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "load_average_at_start": os.getloadavg()[0]}

    lines = [
        f"# bench/runtime_cpu_bench.py  ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, NumPy {np.__version__}, load average "
        f"{os.getloadavg()[0]:.1f} at start)",
    ]

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="colibri-rt-bench-") as tmp:
        tmp = Path(tmp)
        if "moe" in sections:
            report.update(moe_section(tmp, args, say))
        if "overhead" in sections:
            report.update(overhead_section(tmp, args, say))
        for leftover in tmp.glob("*.colibri"):  # (files in --moe-files are kept)
            leftover.unlink()
        if sections & {"threads", "load"}:
            thread_and_load_sections(tmp, args, say, sections, report)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.output}")
    if args.json:
        path = args.output.with_suffix(".json")
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
