"""The classifier in torch: used to train it and as the reference the bundle's predictions are checked against.

    image (batch, 64, 64)
      → conv 5 x 5, 16 filters, stride 2, zero padding 2, ReLU                  (batch, 16, 32, 32)
      → per token (a 4 x 4 grid of 8 x 8 cells, row-major): max and mean       (batch, 16, 32)
      → stem: features @ stem_w.T + stem_b + pos                              (batch, 16, 64)
      → MoE layers, residual: h = h + moe_l(h)                                 (batch, 16, 64)
            moe(x) = sum_{j<k} w_j * down_{S_j}( silu(gate_{S_j} x) * up_{S_j} x )
            z = x @ router (router (hidden, experts)); S = top-k of z; w = softmax(z[S])
            — the .colibri semantics with routing 0 (top-k softmax) and residual composition
              (docs/format.md "Semantics", colibri_sdk.reference)
      → mean over the 16 tokens                                                (batch, 64)
      → head: h @ head_w.T + head_b                                            (batch, 4) logits

The MoE parameters are stored in the .colibri layout (gate/up (experts, intermediate, hidden), down
(experts, hidden, intermediate), router (hidden, experts)), so export is a copy. Training evaluates every expert on
every token and weights them with the sparse top-k weights (zero for the unselected experts): the same function as
the sparse evaluation, simpler to differentiate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .model import CELL, CHANNELS, FEATURES, GRID, HIDDEN, KERNEL, NUM_CLASSES, STRIDE, TOKENS

EXPERTS = 8
TOP_K = 2
INTERMEDIATE = 64
LAYERS = 2


class MoELayer(nn.Module):
    """One MoE layer with the .colibri routing-0 semantics. Input and output (tokens, hidden) float32."""

    def __init__(self, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, experts: int = EXPERTS,
                 top_k: int = TOP_K):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Parameter(torch.randn(hidden, experts) / hidden**0.5)
        self.gate = nn.Parameter(torch.randn(experts, intermediate, hidden) / hidden**0.5)
        self.up = nn.Parameter(torch.randn(experts, intermediate, hidden) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, intermediate) * 0.5 / intermediate**0.5)
        self.last_router_probs: torch.Tensor | None = None
        self.last_top1: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.router                                              # (n, experts)
        top_logits, top_index = torch.topk(logits, self.top_k, dim=-1)        # largest first
        weights = torch.softmax(top_logits, dim=-1)                           # softmax over the k selected
        dense = torch.zeros_like(logits).scatter(1, top_index, weights)       # (n, experts), zero if unselected
        gate = torch.einsum("nh,eih->nei", x, self.gate)
        up = torch.einsum("nh,eih->nei", x, self.up)
        expert_out = torch.einsum("nei,ehi->neh", nn.functional.silu(gate) * up, self.down)
        self.last_router_probs = torch.softmax(logits, dim=-1)
        self.last_top1 = top_index[:, 0]
        return torch.einsum("ne,neh->nh", dense, expert_out)


class QCNet(nn.Module):
    """Stem → residual MoE layers → mean pool → linear head. forward: (batch, 64, 64) float32 → (batch, 4) logits."""

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.conv = nn.Conv2d(1, CHANNELS, KERNEL, stride=STRIDE, padding=KERNEL // 2)
        self.stem = nn.Linear(FEATURES, HIDDEN)
        self.pos = nn.Parameter(torch.randn(TOKENS, HIDDEN) * 0.02)
        self.moe = nn.ModuleList(MoELayer() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, NUM_CLASSES)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(batch, 64, 64) → (batch, 16, 64) stem output."""
        b = images.shape[0]
        fmap = torch.relu(self.conv(images[:, None])).reshape(b, CHANNELS, GRID, CELL, GRID, CELL)
        features = torch.cat([fmap.amax(dim=(3, 5)), fmap.mean(dim=(3, 5))], dim=1)   # (b, 32, 4, 4)
        return self.stem(features.permute(0, 2, 3, 1).reshape(b, TOKENS, FEATURES)) + self.pos

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.tokens(images)
        b = h.shape[0]
        flat = h.reshape(b * TOKENS, HIDDEN)
        for layer in self.moe:
            flat = flat + layer(flat)
        return self.head(flat.reshape(b, TOKENS, HIDDEN).mean(dim=1))

    def balance_loss(self) -> torch.Tensor:
        """Switch-Transformer load-balancing term (Fedus et al. 2021, eq. 4), summed over layers:
        experts * sum_e (fraction of tokens whose first choice is e) * (mean router probability of e)."""
        total = torch.zeros(())
        for layer in self.moe:
            probs, top1 = layer.last_router_probs, layer.last_top1
            experts = probs.shape[1]
            fraction = torch.bincount(top1, minlength=experts).float() / top1.numel()
            total = total + experts * (fraction * probs.mean(dim=0)).sum()
        return total

    # ---- export ------------------------------------------------------------------------------------------------
    def round_moe_to_fp16(self) -> None:
        """Round the MoE weights to float16 values in place, so the fp16 .colibri holds exactly this model."""
        with torch.no_grad():
            for layer in self.moe:
                for p in (layer.router, layer.gate, layer.up, layer.down):
                    p.copy_(p.half().float())

    def moe_arrays(self) -> dict[str, np.ndarray]:
        """float32 arrays for colibri_sdk.format.write_model: gate/up (L, E, I, H), down (L, E, H, I),
        router (L, H, E)."""
        def stack(name):
            return np.stack([getattr(layer, name).detach().cpu().numpy() for layer in self.moe]).astype(np.float32)

        return {"gate": stack("gate"), "up": stack("up"), "down": stack("down"), "router": stack("router")}

    def stem_head_arrays(self) -> dict[str, np.ndarray]:
        """float32 arrays for the NumPy stem and head (qc.model.StemHead)."""
        f = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
        return {"conv_w": f(self.conv.weight).reshape(CHANNELS, KERNEL * KERNEL), "conv_b": f(self.conv.bias),
                "stem_w": f(self.stem.weight), "stem_b": f(self.stem.bias), "pos": f(self.pos),
                "head_w": f(self.head.weight), "head_b": f(self.head.bias)}

    @classmethod
    def from_arrays(cls, stem_head: dict, moe_file) -> "QCNet":
        """Rebuild the network from the shipped stem/head arrays and a ColibriFile (its blocks read as float32)."""
        layers = moe_file.header.num_layers
        net = cls(layers=layers)
        with torch.no_grad():
            net.conv.weight.copy_(torch.from_numpy(np.asarray(stem_head["conv_w"]).reshape(CHANNELS, 1, KERNEL, KERNEL)))
            net.conv.bias.copy_(torch.from_numpy(np.asarray(stem_head["conv_b"])))
            net.stem.weight.copy_(torch.from_numpy(np.asarray(stem_head["stem_w"])))
            net.stem.bias.copy_(torch.from_numpy(np.asarray(stem_head["stem_b"])))
            net.pos.copy_(torch.from_numpy(np.asarray(stem_head["pos"])))
            net.head.weight.copy_(torch.from_numpy(np.asarray(stem_head["head_w"])))
            net.head.bias.copy_(torch.from_numpy(np.asarray(stem_head["head_b"])))
            blocks = {name: moe_file.block(kind).astype(np.float32) for name, kind in
                      (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"), ("router", "router"))}
            for i, layer in enumerate(net.moe):
                for name, block in blocks.items():
                    getattr(layer, name).copy_(torch.from_numpy(block[i]))
        return net.eval()

