"""A transformers Mixtral whose MoE blocks run on colibri: attention, norms and embeddings stay in PyTorch, each
decoder layer's `mlp` (transformers' MixtralSparseMoeBlock) is replaced by a module that calls `Runtime.layer(l, x)`.

The pipeline:

    1. `tiny_mixtral()`                   a random-init MixtralForCausalLM (CPU, float32) and `save_pretrained`
    2. `colibri-sdk convert CKPT -o W.colibri --dtype fp32 --composition sequential`
                                          sequential composition: layer l's output is the block's output alone; the
                                          decoder layer adds its own residual, as in transformers
    3. `build(...)`                       a bundle for the Orin profile at fp32 (NVRTC compiles its kernels; the
                                          CPU backend runs it here)
    4. `replace_moe_blocks(model, rt)`    every `model.model.layers[l].mlp` becomes `ColibriMoE(rt, l)`

Run `python examples/transformers_embed/embed.py` to see the logits of both models side by side.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]


def tiny_mixtral(seed: int = 0, layers: int = 2):
    """A random-init MixtralForCausalLM: hidden 32, intermediate 48, 8 experts, top-2, vocabulary 64, eval mode."""
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).eval()


def convert_and_build(model, folder: Path) -> Path:
    """save_pretrained → `colibri-sdk convert` (fp32, sequential) → a bundle for the Orin profile at fp32.

    Returns:
        the bundle folder (batch 1 x tokens 16: sequences of up to 16 tokens).
    """
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.profile import Profile, load_profile

    checkpoint, weights = folder / "checkpoint", folder / "mixtral.colibri"
    model.save_pretrained(checkpoint)
    cmd = [sys.executable, "-m", "colibri_sdk", "convert", str(checkpoint), "-o", str(weights), "--dtype", "fp32",
           "--composition", "sequential", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    data = copy.deepcopy(load_profile("orin").to_dict())
    data["dtype"] = "fp32"
    return build_bundle(Profile.from_dict(data, "orin-fp32"), folder / "bundle", weights).path


class ColibriMoE(torch.nn.Module):
    """Drop-in for transformers' MixtralSparseMoeBlock: (batch, seq, hidden) float32 → the same shape.

    Calls `rt.layer(index, x)` on the CPU backend through NumPy (no copy on the way in: `Tensor.numpy()` shares
    memory). The bundle must be converted with sequential composition, so the layer's output is the block's.
    """

    def __init__(self, rt, index: int):
        super().__init__()
        self.rt, self.index = rt, index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.detach().to(torch.float32).contiguous().numpy()
        y = self.rt.layer(self.index, x)
        return torch.from_numpy(y).to(hidden_states.dtype)


def replace_moe_blocks(model, rt):
    """Swap every decoder layer's MoE block for a ColibriMoE calling layer l of `rt`; returns the model."""
    if len(model.model.layers) != rt.num_layers:
        raise ValueError(f"the model has {len(model.model.layers)} decoder layers; the bundle has {rt.num_layers}")
    for index, layer in enumerate(model.model.layers):
        layer.mlp = ColibriMoE(rt, index)
    return model


def main() -> int:
    from colibri_sdk.runtime import Runtime

    model = tiny_mixtral()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = convert_and_build(model, Path(tmp))
        with Runtime.load(bundle, backend="cpu") as rt:
            embedded = replace_moe_blocks(copy.deepcopy(model), rt)
            with torch.no_grad():
                logits = embedded(ids).logits.numpy()
            stats = rt.stats()
    err = float(np.abs(logits - expected).max())
    print(f"logits {logits.shape}: max |colibri - transformers| = {err:.3g} (scale {np.abs(expected).max():.3g})")
    print(f"colibri calls {stats.calls}, p50 {stats.p50_ms:.3f} ms, p99 {stats.p99_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
