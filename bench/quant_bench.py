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
5. Importers: a 4-layer Qwen3-MoE initialised by transformers (hidden 512, moe_intermediate 384, 16 experts,
   top-4, renormalised) saved as the pre-quantized checkpoints users download, made with each format's own
   library, then imported by `colibri_sdk.convert.convert` (no re-quantization): compressed-tensors
   "pack-quantized" W4A16 (symmetric, group 128, bf16 scales: llm-compressor's W4A16 preset, the checkpoints vLLM
   serves; `PackedQuantizationCompressor` of the `compressed-tensors` package) and GGUF Q8_0 / Q4_0
   (`gguf.quants.quantize`, llama.cpp's 3-D expert tensors). Per importer: file size ÷ the fp16 .colibri of the
   same model, relative error of each MoE layer vs the fp32 transformers block holding the ORIGINAL weights (as in
   2), top-k agreement with the fp32 file (as in 3), and how many expert matrices dequantize bit for bit as the
   library's own dequantization (compressed-tensors `decompress`: its bf16 result, and its float32 result with the
   scales widened; `gguf.quants.dequantize`). The checkpoints are built with the helpers of tests/convert
   (quantized_models.py, gguf_models.py); needs torch, transformers, compressed-tensors and gguf (the `test` and
   `convert` extras).

    python bench/quant_bench.py        # writes bench/results/quant_bench.txt (about two minutes)
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
    ("int8 per row", 1, 0, 1),  # convert --dtype int8's default (colibri_sdk.quantize.DEFAULT_GROUP_SIZE)
    ("int8 g128", 1, 128, 1),
    ("int4 g32", 2, 32, 1),
    ("int4 g64", 2, 64, 1),
    ("int4 g128", 2, 128, 1),  # convert --dtype int4's default
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
    """The part of colibri_sdk.bundle.Bundle the CPU backend uses (no bundle needs to be built to time it)."""

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


def importer_model():
    import torch
    import transformers

    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(
        hidden_size=512, moe_intermediate_size=384, intermediate_size=1024, num_experts=16, num_experts_per_tok=4,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, norm_topk_prob=True,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _bit_exact(path: Path, equal) -> tuple[int, int]:
    """(expert matrices for which `equal(kind, layer, expert, ours)` holds, expert matrices); `ours` is the file's
    exact float32 dequantization (ColibriFile.weight)."""
    hits = total = 0
    with ColibriFile(path) as f:
        h = f.header
        for layer in range(h.num_layers):
            for e in range(h.num_experts):
                for kind in ("gate_proj", "up_proj", "down_proj"):
                    total += 1
                    hits += bool(equal(kind, layer, e, f.weight(kind, layer, e)))
    return hits, total


def importers(out: list[str], folder: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "convert"))
    import torch

    from colibri_sdk.convert import convert

    from gguf_models import gguf, write_gguf  # the test helpers: checkpoints written by the libraries themselves
    from quantized_models import decompress, save_pack_quantized

    model = importer_model()
    layers = model.config.num_hidden_layers
    x = np.random.default_rng(4).standard_normal((256, 512)).astype(np.float32)
    blocks = [model.model.layers[i].mlp for i in range(layers)]
    ckpt = folder / "imp-fp32"
    model.save_pretrained(ckpt)
    fp32 = folder / "imp-fp32.colibri"
    fp16 = folder / "imp-fp16.colibri"
    convert(ckpt, fp32, dtype="fp32", progress=False)
    convert(ckpt, fp16, dtype="fp16", progress=False)
    ref = ReferenceEngine(fp32)
    states, ref_routes = [x], []
    for layer in range(layers):
        ref_routes.append(np.sort(ref.route(layer, states[-1])[0], -1))
        states.append(states[-1] + ref.layer(layer, states[-1]))
    with torch.no_grad():
        hf = [blocks[layer](torch.from_numpy(states[layer])[None])[0].numpy() for layer in range(layers)]
    rows = []

    tensors, scheme = save_pack_quantized(model, folder / "imp-w4a16", bits=4, group_size=128, symmetric=True,
                                          scale_dtype=torch.bfloat16)
    ct_file = folder / "imp-w4a16.colibri"
    convert(folder / "imp-w4a16", ct_file, progress=False)

    widened = {k: (v.float() if k.endswith("weight_scale") else v) for k, v in tensors.items()}

    def ct_equal(kind, layer, e, ours):
        """The library's bf16 result bit for bit, and its float32 result with the scales widened."""
        name = f"model.layers.{layer}.mlp.experts.{e}.{kind}"
        native = decompress(tensors, name, scheme)
        return (torch.from_numpy(ours).to(native.dtype).equal(native)
                and np.array_equal(ours, decompress(widened, name, scheme).numpy()))

    rows.append(("compressed-tensors W4A16 g128 (bf16 scales)", ct_file, ct_equal))
    for qtype in ("Q8_0", "Q4_0"):
        written = write_gguf(model, "qwen3", folder / f"imp-{qtype}.gguf", qtype)
        path = folder / f"imp-{qtype}.colibri"
        convert(folder / f"imp-{qtype}.gguf", path, progress=False)
        names = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}

        def gguf_equal(kind, layer, e, ours, written=written, names=names):
            data, kind_ = written[f"blk.{layer}.{names[kind]}.weight"]
            return np.array_equal(ours, gguf.quants.dequantize(data, kind_)[e])

        rows.append((f"GGUF {qtype} (gguf-py)", path, gguf_equal))
    out.append("")
    out.append("5. Importers: a 4-layer Qwen3-MoE (hidden 512, moe_intermediate 384, 16 experts, top-4), transformers")
    out.append("   init; the pre-quantized checkpoint made by the format's library, imported without re-quantizing")
    out.append(f"  {'source':<44} {'storage':<16} {'size ÷ fp16':>12} {'rel err':>9} {'max layer':>10} "
               f"{'top-k same':>11} {'overlap':>8} {'bit-exact':>10}")
    for label, path, equal in rows:
        with ColibriFile(path) as f:
            h = f.header
        storage = f"{('int8', 'int4')[h.quant - 1]} g{h.group_size} {('fp32', 'fp16')[h.dtype]} sc"
        eng = ReferenceEngine(ColibriFile(path))
        errs = [np.linalg.norm(eng.layer(l, states[l]) - hf[l]) / np.linalg.norm(hf[l]) for l in range(layers)]
        same, overlap, state = [], [], x
        for layer in range(layers):
            idx = np.sort(eng.route(layer, state)[0], -1)
            same.append((idx == ref_routes[layer]).all(-1))
            overlap.append([len(set(a) & set(b)) / 4 for a, b in zip(idx, ref_routes[layer])])
            state = state + eng.layer(layer, state)
        hits, total = _bit_exact(path, equal)
        out.append(
            f"  {label:<44} {storage:<16} {path.stat().st_size / fp16.stat().st_size:>12.4f} {np.mean(errs):>9.2e} "
            f"{np.max(errs):>10.2e} {np.mean(same):>11.4f} {np.mean(overlap):>8.4f} {f'{hits}/{total}':>10}"
        )
    out.append("  rel err vs the fp32 block with the original (unquantized) weights; bit-exact: expert matrices whose")
    out.append("  file dequantization equals the library's (compressed-tensors: its bf16 result after rounding ours to")
    out.append("  bf16, and its float32 result with the scales widened; gguf-py: its float32 result)")


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
        importers(out, Path(tmp))
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
