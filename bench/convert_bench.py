"""Converter benchmark: peak RSS and throughput on synthetic sharded checkpoints of growing size.

Writes a Mixtral-style bf16 checkpoint (hidden 1024, intermediate 2048, 8 experts, ~100 MB per layer, 256 MB
shards) of each requested size, converts it to fp16 in a child process, and prints the child's peak RSS, MB/s and
peak RSS ÷ checkpoint size, next to a child that only imports the converter (the baseline). Constant memory shows
as the same peak RSS at every size.

    python bench/convert_bench.py                 # 0.5 and 2 GB
    python bench/convert_bench.py --gb 0.25 1     # sizes in GB (10^9 bytes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 2048, 8, 2
SHARD_BYTES = 256 << 20

# Peak RSS is the child's VmHWM (Linux), which starts afresh at exec. (getrusage's ru_maxrss does not: a child
# forked from this process inherits the generator's peak.)
CHILD = """
import json, sys, time
from colibri_sdk.convert import convert
start = time.perf_counter()
if sys.argv[1] != "-":
    report = convert(sys.argv[1], sys.argv[2], dtype="fp16", progress=False)
seconds = time.perf_counter() - start
status = open("/proc/self/status").read()
hwm_kb = int(status.split("VmHWM:")[1].split()[0])
print(json.dumps({"maxrss_mb": hwm_kb / 1024, "seconds": seconds}))
"""


def write_checkpoint(folder: Path, gb: float, seed: int = 0) -> int:
    """Write a sharded bf16 Mixtral-style checkpoint of about `gb` × 10^9 bytes; return its tensor bytes."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    per_layer = EXPERTS * 3 * HIDDEN * INTER * 2 + EXPERTS * HIDDEN * 2
    layers = max(1, round(gb * 1e9 / per_layer))
    folder.mkdir(parents=True)
    config = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "num_hidden_layers": layers, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    noise = (rng.standard_normal(HIDDEN * INTER + 7, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def tensor(shape, k):  # cheap distinct contents: a rolled window of one random buffer
        n = shape[0] * shape[1]
        return np.roll(noise, k)[:n].reshape(shape)

    weight_map, shard, shard_bytes, shard_files, total, k = {}, {}, 0, [], 0, 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(shard_files) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in shard})
        shard_files.append(name)
        shard, shard_bytes = {}, 0

    for layer in range(layers):
        prefix = f"model.layers.{layer}.block_sparse_moe."
        items = [(prefix + "gate.weight", (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            items += [(f"{prefix}experts.{e}.w1.weight", (INTER, HIDDEN)), (f"{prefix}experts.{e}.w3.weight", (INTER, HIDDEN)),
                      (f"{prefix}experts.{e}.w2.weight", (HIDDEN, INTER))]
        for name, shape in items:
            k += 1
            shard[name] = tensor(shape, k)
            shard_bytes += shard[name].nbytes
            total += shard[name].nbytes
            if shard_bytes >= SHARD_BYTES:
                flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def run_child(folder: str, out: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, folder, out], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, nargs="+", default=[0.5, 2.0], help="checkpoint sizes in GB")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary folder)")
    args = parser.parse_args()

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="colibri-convert-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs; "
          f"Mixtral-style bf16 → fp16, hidden {HIDDEN}, intermediate {INTER}, {EXPERTS} experts")
    base = run_child("-", "-")
    print(f"baseline (import only): peak RSS {base['maxrss_mb']:.0f} MB")
    print(f"{'checkpoint':>12} {'shards':>6} {'output':>10} {'seconds':>8} {'MB/s in':>8} {'peak RSS':>9} "
          f"{'RSS-base':>9} {'RSS/ckpt':>9}")
    try:
        for gb in args.gb:
            folder = scratch / f"ckpt_{gb:g}GB"
            shutil.rmtree(folder, ignore_errors=True)
            total = write_checkpoint(folder, gb)
            shards = len(list(folder.glob("*.safetensors")))
            out = scratch / f"model_{gb:g}GB.colibri"
            r = run_child(str(folder), str(out))
            out_bytes = out.stat().st_size
            print(f"{total / 1e9:>10.2f}GB {shards:>6} {out_bytes / 1e9:>8.2f}GB {r['seconds']:>8.2f} "
                  f"{total / 1e6 / r['seconds']:>8.0f} {r['maxrss_mb']:>7.0f}MB {r['maxrss_mb'] - base['maxrss_mb']:>7.0f}MB "
                  f"{r['maxrss_mb'] * 2**20 / total:>9.3f}")
            shutil.rmtree(folder)
            out.unlink()
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
