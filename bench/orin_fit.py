"""Which MoE models fit which Jetson Orin at fp16 / int8 / int4, from the .colibri format's byte counts.

For each model, the .colibri file of its MoE layers (routed + shared experts, fp32 router; int8 per row, int4
group 128 with fp16 scales) is sized by `HeaderV2.file_size`; the rest of the model (attention, embeddings and
lm_head, dense MLP layers, norms), which is not in the file, is counted from the same configuration at fp16 in every
column. A model fits a board when file + rest <= memory − RESERVE_GB (JetPack, the OS and the runtime; the KV cache
and activations are not counted). The parameter total computed from the configuration is printed next to the
published one as a check of the configurations below (Hugging Face config.json values).

    python bench/orin_fit.py          # prints the table; writes bench/results/orin_fit.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

from colibri_sdk.format import HeaderV2

RESULTS = Path(__file__).resolve().parent / "results" / "orin_fit.txt"
RESERVE_GB = 1.5
BOARDS = {"Orin Nano 8GB": 8, "Orin NX 16GB": 16, "AGX Orin 32GB": 32, "AGX Orin 64GB": 64}
STORAGES = {"fp16": dict(dtype=1), "int8": dict(dtype=1, quant=1, group_size=0), "int4": dict(dtype=1, quant=2, group_size=128)}

# layers: decoder layers; moe_layers: those with experts; dense_inter: the dense MLP width of the others;
# attn: "gqa" (heads, kv_heads, head_dim) or "mla" (DeepSeek-V2: heads, q_dim, kv_lora, rope, v_dim).
MODELS = [
    dict(name="OLMoE-1B-7B", published=6.92e9, layers=16, hidden=2048, experts=64, top_k=8, inter=1024,
         vocab=50304, tied=False, attn=("gqa", 16, 16, 128)),
    dict(name="Qwen1.5-MoE-A2.7B", published=14.3e9, layers=24, hidden=2048, experts=60, top_k=4, inter=1408,
         shared=5632, vocab=151936, tied=False, attn=("gqa", 16, 16, 128)),
    dict(name="DeepSeek-V2-Lite", published=15.7e9, layers=27, moe_layers=26, dense_inter=10944, hidden=2048,
         experts=64, top_k=6, inter=1408, shared=2 * 1408, vocab=102400, tied=False,
         attn=("mla", 16, 128 + 64, 512, 64, 128)),
    dict(name="gpt-oss-20b", published=20.9e9, layers=24, hidden=2880, experts=32, top_k=4, inter=2880,
         vocab=201088, tied=False, attn=("gqa", 64, 8, 64)),
    dict(name="Qwen3-30B-A3B", published=30.5e9, layers=48, hidden=2048, experts=128, top_k=8, inter=768,
         vocab=151936, tied=False, attn=("gqa", 32, 4, 128)),
    dict(name="Mixtral-8x7B", published=46.7e9, layers=32, hidden=4096, experts=8, top_k=2, inter=14336,
         vocab=32000, tied=False, attn=("gqa", 32, 8, 128)),
    dict(name="Qwen2-57B-A14B", published=57.4e9, layers=28, hidden=3584, experts=64, top_k=8, inter=2560,
         shared=20480, vocab=151936, tied=False, attn=("gqa", 28, 4, 128)),
    dict(name="gpt-oss-120b", published=116.8e9, layers=36, hidden=2880, experts=128, top_k=4, inter=2880,
         vocab=201088, tied=False, attn=("gqa", 64, 8, 64)),
    dict(name="Mixtral-8x22B", published=141e9, layers=56, hidden=6144, experts=8, top_k=2, inter=16384,
         vocab=32768, tied=False, attn=("gqa", 48, 8, 128)),
    dict(name="Qwen3-235B-A22B", published=235e9, layers=94, hidden=4096, experts=128, top_k=8, inter=1536,
         vocab=151936, tied=False, attn=("gqa", 64, 4, 128)),
]


def header(m: dict, storage: dict) -> HeaderV2:
    shared = m.get("shared", 0)
    return HeaderV2(
        num_layers=m.get("moe_layers", m["layers"]), num_experts=m["experts"], top_k=m["top_k"],
        hidden_size=m["hidden"], intermediate_size=m["inter"], routing=1, composition=1,
        num_shared_experts=1 if shared else 0, shared_intermediate_size=shared,
        num_model_layers=m["layers"], layer_map=tuple(range(m["layers"] - m.get("moe_layers", m["layers"]), m["layers"])),
        **storage,
    )


def attention_params(m: dict) -> int:
    h = m["hidden"]
    kind, heads, *rest = m["attn"]
    if kind == "gqa":
        kv, hd = rest
        return h * heads * hd * 2 + h * kv * hd * 2
    q_dim, kv_lora, rope, v_dim = rest  # DeepSeek-V2 MLA without a q LoRA (V2-Lite)
    nope = q_dim - rope
    return h * heads * q_dim + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h


def rest_params(m: dict) -> int:
    """Parameters not in the .colibri file: attention, norms, embeddings (+ lm_head), dense MLP layers."""
    h, layers = m["hidden"], m["layers"]
    dense = layers - m.get("moe_layers", layers)
    emb = m["vocab"] * h * (1 if m["tied"] else 2)
    return layers * (attention_params(m) + 2 * h) + h + emb + dense * 3 * h * m.get("dense_inter", 0)


def moe_params(m: dict) -> int:
    h, e, i = m["hidden"], m["experts"], m["inter"]
    return m.get("moe_layers", m["layers"]) * (e * 3 * h * i + h * e + 3 * h * m.get("shared", 0))


def table() -> str:
    out = [
        "MoE models on Jetson Orin: .colibri file (MoE layers) + the rest of the model at fp16 <= memory − "
        f"{RESERVE_GB} GB",
        "(int8 = per row, int4 = group 128, fp16 scales; fp32 router; KV cache and activations not counted)",
        "",
        f"{'model':<18} {'params':>7} {'published':>9} {'rest GB':>8} "
        + "".join(f"{'file ' + s + ' GB':>14}" for s in STORAGES),
    ]
    fits = []
    for m in MODELS:
        total = moe_params(m) + rest_params(m)
        rest_gb = rest_params(m) * 2 / 1e9
        files = {s: header(m, kw).file_size / 1e9 for s, kw in STORAGES.items()}
        out.append(
            f"{m['name']:<18} {total / 1e9:>6.1f}B {m['published'] / 1e9:>8.1f}B {rest_gb:>8.2f} "
            + "".join(f"{files[s]:>14.2f}" for s in STORAGES)
        )
        fits.append((m["name"], {b: [s for s in STORAGES if files[s] + rest_gb <= gb - RESERVE_GB] for b, gb in BOARDS.items()}))
    out += ["", "| model | " + " | ".join(BOARDS) + " |", "|---|" + "---|" * len(BOARDS)]
    for name, by_board in fits:
        cells = [" / ".join(v) if v else "—" for v in by_board.values()]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    text = table()
    print(text, end="")
    if "--no-write" not in sys.argv:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("# bench/orin_fit.py (computed, not measured)\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
