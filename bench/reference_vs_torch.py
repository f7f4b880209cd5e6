"""Reference engine (NumPy) vs the transformers MoE block (torch CPU), same weights, same inputs.

Builds a transformers `MixtralSparseMoeBlock` at random initialisation, writes its weights as an fp32 .colibri
file, and times one layer of both on (tokens, hidden) inputs for tokens = 1, 4, 16, 64. Prints the median time of
each, the ratio reference / torch, and the max relative difference of their outputs.

    python bench/reference_vs_torch.py [--hidden 1024 --intermediate 2048 --experts 8 --top-k 2 --repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--experts-impl", default="grouped_mm", help="transformers experts implementation (eager, grouped_mm, ...)")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from colibri_sdk.format import Header, write_model
    from colibri_sdk.reference import ReferenceEngine

    H, I, E, K = args.hidden, args.intermediate, args.experts, args.top_k
    config = transformers.MixtralConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8,
    )
    # The experts implementation a model built with from_pretrained / from_config gets by default on CPU.
    config._experts_implementation = args.experts_impl
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
    gate_up = block.experts.gate_up_proj.detach().numpy()  # (E, 2I, H), gate rows first
    down = block.experts.down_proj.detach().numpy()  # (E, H, I)
    router = block.gate.weight.detach().numpy().T  # (H, E)

    folder = Path(tempfile.mkdtemp(prefix="colibri-ref-bench-"))
    header = Header(num_layers=1, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=0)
    path = write_model(folder / "m.colibri", header, gate_up[None, :, :I], gate_up[None, :, I:], down[None], router[None])
    engine = ReferenceEngine(path)

    impl = getattr(block.experts.config, "_experts_implementation", None) or "eager"
    print(
        f"MixtralSparseMoeBlock hidden {H}, intermediate {I}, {E} experts, top-{K}, fp32; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, experts implementation: {impl}), numpy {np.__version__}; "
        f"median of {args.repeats}"
    )
    print(f"{'tokens':>6} {'reference ms':>13} {'torch ms':>9} {'ref/torch':>10} {'max rel diff':>13}")
    rng = np.random.default_rng(1)
    for tokens in args.tokens:
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        xt = torch.from_numpy(x)[None]
        with torch.no_grad():
            expected = block(xt)[0].numpy()
            t_torch = median_ms(lambda: block(xt), args.repeats)
        actual = engine.layer(0, x)
        t_ref = median_ms(lambda: engine.layer(0, x), args.repeats)
        diff = float(np.abs(actual - expected).max() / np.abs(expected).max())
        print(f"{tokens:>6} {t_ref:>13.3f} {t_torch:>9.3f} {t_ref / t_torch:>10.2f} {diff:>13.2e}")
    engine.close()
    path.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
