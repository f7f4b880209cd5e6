"""int8 / int4 expert weights: file size, accuracy against the fp32 transformers block, routing agreement, and the
CPU backend's time, measured side by side in one run (docs/format.md, "v2").

1. Size: file bytes ÷ the fp16 file's bytes, from the format's byte counts (HeaderV2.file_size) for the dimensions
   of Qwen3-30B-A3B and Mixtral-8x7B, and as written on disk for the accuracy model below.
2. Accuracy: a 4-layer Qwen3-MoE (hidden 512, moe_intermediate 352, 16 experts, top-4, renormalised), initialised by
   transformers (`Qwen3MoeForCausalLM(config)`, N(0, 0.02)), and the same with heavy-tailed expert weights
   (Student-t, 3 degrees of freedom, scaled to std 0.02). Per layer, the relative error ‖y − y_ref‖ / ‖y_ref‖ of
   the reference engine on the stored file against transformers' `Qwen3MoeSparseMoeBlock` in fp32 on the same
   input (the fp32 stack's state), averaged over the 4 layers; 256 tokens, x ~ N(0, 1).
3. Routing: the 4 layers composed residually (x + moe(x)); for every token and layer, whether the quantized
   file's top-k set equals the fp32 file's, and the mean overlap |S ∩ S'| / k.
4. Speed: the runtime's CPU backend (colibri_sdk.runtime.cpu_backend) at tokens 1 on one layer of
   Qwen3-30B-A3B's expert size (hidden 2048, intermediate 768, 16 experts, top-8), fp16 vs int8 vs int4, calls
   interleaved (median of 20 each), one BLAS thread.

    python bench/quant_bench.py        # writes bench/results/quant_bench.txt (about a minute)
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from colibri_sdk.format import ColibriFile, HeaderV2, write_arrays  # noqa: E402
from colibri_sdk.quantize import Quantizer  # noqa: E402
from colibri_sdk.reference import ReferenceEngine  # noqa: E402
from colibri_sdk.runtime.cpu_backend import CpuBackend  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "quant_bench.txt"
STORAGES = [  # (label, quant, group_size, dtype)
    ("fp16", 0, 0, 1),
    ("int8 per row", 1, 0, 1),
    ("int8 g128", 1, 128, 1),
    ("int4 g32", 2, 32, 1),
    ("int4 g64", 2, 64, 1),
    ("int4 g128", 2, 128, 1),
]


def header(dims: dict, quant: int, group: int, dtype: int) -> HeaderV2:
    return HeaderV2(**dims, dtype=dtype, routing=1, norm_topk=1, composition=1, quant=quant, group_size=group)


def sizes(out: list[str]) -> None:
    models = {
        "Qwen3-30B-A3B": dict(num_layers=48, num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
        "Mixtral-8x7B": dict(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    }
    out.append("1. File size ÷ fp16 (the format's byte counts: experts, scales, fp32 router)")
    out.append(f"  {'storage':<14}" + "".join(f"{m:>22}" for m in models))
    for label, quant, group, dtype in STORAGES:
        row = f"  {label:<14}"
        for dims in models.values():
            fp16 = header(dims, 0, 0, 1).file_size
            h = header(dims, quant, group, dtype)
            row += f"{h.file_size / fp16:>12.4f} ({h.file_size / 1e9:5.2f} GB)"
        out.append(row)
    out.append("  targets: int4 g128 <= 0.27, int8 <= 0.52")


def transformers_stack(heavy: bool, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        hidden_size=512, moe_intermediate_size=352, intermediate_size=1024, num_experts=16, num_experts_per_tok=4,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, norm_topk_prob=True,
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    blocks = [model.model.layers[i].mlp for i in range(4)]
    if heavy:
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            for b in blocks:
                for p in (b.experts.gate_up_proj, b.experts.down_proj):
                    t = rng.standard_t(3, size=tuple(p.shape))
                    p.copy_(torch.from_numpy(t / t.std() * 0.02))
    return blocks


def stack_arrays(blocks) -> dict:
    gate_up = np.stack([b.experts.gate_up_proj.detach().float().numpy() for b in blocks])
    inter = gate_up.shape[2] // 2
    return {
        "gate_proj": gate_up[:, :, :inter], "up_proj": gate_up[:, :, inter:],
        "down_proj": np.stack([b.experts.down_proj.detach().float().numpy() for b in blocks]),
        "router": np.stack([b.gate.weight.detach().float().numpy().T for b in blocks]),
    }


def accuracy(out: list[str], folder: Path) -> None:
    import torch

    dims = dict(num_layers=4, num_experts=16, top_k=4, hidden_size=512, intermediate_size=352)
    x = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)
    out.append("")
    out.append("2-3. Accuracy vs the fp32 transformers Qwen3MoeSparseMoeBlock (4 layers, hidden 512, intermediate 352,")
    out.append("     16 experts, top-4; per-layer relative error, mean over layers) and routing agreement (residual stack)")
    out.append(f"  {'weights':<12} {'storage':<14} {'rel err':>9} {'max layer':>10} {'weights err':>12} "
               f"{'top-k same':>11} {'overlap':>8} {'size ÷ fp16':>12}")
    for name, heavy in (("HF init", False), ("heavy-tail", True)):
        blocks = transformers_stack(heavy)
        arrays = stack_arrays(blocks)
        ref_file = write_arrays(folder / f"{name}-fp32.colibri", header(dims, 0, 0, 0), arrays)
        ref = ReferenceEngine(ref_file)
        states, ref_routes = [x], []
        for layer in range(4):
            ref_routes.append(np.sort(ref.route(layer, states[-1])[0], -1))
            states.append(states[-1] + ref.layer(layer, states[-1]))
        with torch.no_grad():
            hf = [blocks[layer](torch.from_numpy(states[layer])[None])[0].numpy() for layer in range(4)]
        fp16_size = None
        for label, quant, group, dtype in STORAGES:
            h = header(dims, quant, group, dtype)
            q = Quantizer(h) if quant else None
            conv = {k: v for k, v in arrays.items()}
            path = folder / f"{name}-{label.replace(' ', '')}.colibri"
            if q is None:
                write_arrays(path, h, conv)
                werr = float("nan")
            else:
                from colibri_sdk.format import ColibriWriter

                with ColibriWriter(path, h) as w:
                    for kind, layer, e in w.pending():
                        a = conv[kind][layer] if e is None else conv[kind][layer, e]
                        w.write(kind, layer, e, q(kind, a) if e is not None else a)
                werr = max(k.relative for k in q.report.kinds.values())
            size = path.stat().st_size
            fp16_size = fp16_size or size
            eng = ReferenceEngine(ColibriFile(path))
            errs = [np.linalg.norm(eng.layer(l, states[l]) - hf[l]) / np.linalg.norm(hf[l]) for l in range(4)]
            same, overlap, state = [], [], x
            for layer in range(4):
                idx = np.sort(eng.route(layer, state)[0], -1)
                same.append((idx == ref_routes[layer]).all(-1))
                overlap.append([len(set(a) & set(b)) / 4 for a, b in zip(idx, ref_routes[layer])])
                state = state + eng.layer(layer, state)
            out.append(
                f"  {name:<12} {label:<14} {np.mean(errs):>9.2e} {np.max(errs):>10.2e} {werr:>12.2e} "
                f"{np.mean(same):>11.4f} {np.mean(overlap):>8.4f} {size / fp16_size:>12.4f}"
            )
    out.append("  rel err: ‖y − y_ref‖/‖y_ref‖ per layer on the same input; weights err: the worst kind's")
    out.append("  ‖W − Ŵ‖_F/‖W‖_F (colibri_sdk.quantize); top-k same: tokens×layers with the fp32 file's exact set")


class _Bundle:
    """The part of colibri_sdk.bundle.Bundle the CPU backend uses (the build refuses int8/int4 weights today)."""

    shape = (1, 1)

    def __init__(self, path: Path):
        self.path = path

    def open_weights(self):
        return ColibriFile(self.path)


def speed(out: list[str], folder: Path) -> None:
    dims = dict(num_layers=1, num_experts=16, top_k=8, hidden_size=2048, intermediate_size=768)
    rng = np.random.default_rng(2)
    arrays = {
        "gate_proj": (rng.standard_normal((1, 16, 768, 2048)) * 0.02).astype(np.float32),
        "up_proj": (rng.standard_normal((1, 16, 768, 2048)) * 0.02).astype(np.float32),
        "down_proj": (rng.standard_normal((1, 16, 2048, 768)) * 0.02).astype(np.float32),
        "router": rng.standard_normal((1, 2048, 16)).astype(np.float32),
    }
    labels = ["fp16", "int8 per row", "int4 g32", "int4 g128"]
    backends = {}
    for label, quant, group, dtype in STORAGES:
        if label in labels:
            path = write_arrays(folder / f"speed-{label.replace(' ', '')}.colibri", header(dims, quant, group, dtype), arrays)
            backends[label] = CpuBackend(_Bundle(path))
    del arrays
    x = rng.standard_normal((1, 1, 2048)).astype(np.float32)
    times = {label: [] for label in labels}
    for b in backends.values():
        b.infer_padded(x)
        b.infer_padded(x)
    for _ in range(20):
        for label, b in backends.items():
            start = time.perf_counter()
            b.infer_padded(x)
            times[label].append(time.perf_counter() - start)
    base = np.median(times["fp16"])
    out.append("")
    out.append("4. CPU backend, tokens 1, one layer of hidden 2048, intermediate 768, 16 experts, top-8, median of 20")
    out.append(f"  {'storage':<14} {'ms':>8} {'÷ fp16':>8}")
    for label in labels:
        m = np.median(times[label])
        out.append(f"  {label:<14} {m * 1e3:>8.2f} {m / base:>8.2f}")
    out.append("  target: int4 <= 2x fp16 (the selected experts' matrices are dequantized per call, one table gather)")
    for b in backends.values():
        b.close()


def main() -> int:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = [
        f"# bench/quant_bench.py  ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, NumPy {np.__version__}, load average {load:.1f} at start, "
        f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']})",
        "",
    ]
    start = time.perf_counter()
    sizes(out)
    with tempfile.TemporaryDirectory() as tmp:
        accuracy(out, Path(tmp))
        speed(out, Path(tmp))
    out.append("")
    out.append(f"total {time.perf_counter() - start:.0f} s")
    text = "\n".join(out) + "\n"
    print(text, end="")
    if "--no-write" not in sys.argv:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
