"""transformers' MixtralSparseMoeBlock on the same GPU and the same weights as the colibri layer.

The weights are copied from the colibri weights buffer (device to device; to the CPU on the fake driver) into the
block, whatever layout the installed transformers uses; the layouts known (FACTS: transformers >= 5 fuses the
experts) are matched by parameter names and shapes, and anything else is refused with the names and shapes seen:
  fused:     experts.gate_up_proj (E, 2I, H) gate rows first, or (E, H, 2I); experts.down_proj (E, H, I) or (E, I, H)
  per expert: experts[e].w1 / w3 (I, H) gate / up, experts[e].w2 (H, I)   (transformers 4.x MixtralBlockSparseTop2MLP)
  router:    gate.weight (E, H), the transpose of the .colibri router (H, E)
Its output is the MoE output; the colibri layer is residual (x + MoE(x)), so MoE(x) = y - x is compared.
"""

from __future__ import annotations

import numpy as np


class LayoutError(RuntimeError):
    """The installed transformers keeps the Mixtral expert weights in a layout this comparison does not know."""


def build_block(header, torch_device: str, implementation: str | None):
    """A fp16 MixtralSparseMoeBlock for the header's sizes on `torch_device`, its experts computed by
    `implementation` (transformers >= 5: "eager", "grouped_mm", ...; None: the version's default)."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=header.hidden_size, intermediate_size=header.intermediate_size,
                           num_local_experts=header.num_experts, num_experts_per_tok=header.top_k)
    if implementation is not None:
        config._experts_implementation = implementation
    with torch.device(torch_device):
        block = MixtralSparseMoeBlock(config)
    return block.to(dtype=torch.float16).eval()


def implementations(torch_device: str) -> list[str | None]:
    """The expert implementations to time: eager (the loop over experts) and, on a GPU, grouped_mm, where this
    transformers has the setting; else its only one (None)."""
    from transformers import MixtralConfig

    if not hasattr(MixtralConfig(), "_experts_implementation"):
        return [None]
    return ["eager"] if torch_device == "cpu" else ["eager", "grouped_mm"]


def describe(block) -> str:
    return ", ".join(f"{name} {tuple(p.shape)}" for name, p in block.named_parameters())


def load_weights(block, device, weights: int, header, torch_device: str) -> str:
    """Copy the layer-0 weights from the colibri weights buffer into `block`; returns the layout's name.

    Raises:
        LayoutError: unknown parameter names or shapes (the message lists what the block has).
    """
    import torch

    from colibri_sdk.format.constants import HEADER_SIZE

    e, h, i = header.num_experts, header.hidden_size, header.intermediate_size

    def fetch(kind: str, shape: tuple) -> "torch.Tensor":
        expert = None if kind == "router" else 0
        offset = header.tensor_offset(kind, 0, expert) - HEADER_SIZE
        t = torch.empty(shape, dtype=torch.float16, device=torch_device)
        device.copy_to(t.data_ptr(), weights + offset, t.numel() * 2, device_dst=torch_device != "cpu")
        return t

    gate, up, down = fetch("gate_proj", (e, i, h)), fetch("up_proj", (e, i, h)), fetch("down_proj", (e, h, i))
    router = fetch("router", (h, e))
    params = dict(block.named_parameters())
    with torch.no_grad():
        if "gate.weight" not in params or tuple(params["gate.weight"].shape) != (e, h):
            raise LayoutError(f"no router gate.weight of shape {(e, h)}; the block has: {describe(block)}")
        params["gate.weight"].copy_(router.t())
        if "experts.gate_up_proj" in params and "experts.down_proj" in params:
            gu, dn = params["experts.gate_up_proj"], params["experts.down_proj"]
            fused = torch.cat([gate, up], dim=1)  # (E, 2I, H), gate rows first
            if tuple(gu.shape) == (e, 2 * i, h):
                gu.copy_(fused)
            elif tuple(gu.shape) == (e, h, 2 * i):
                gu.copy_(fused.transpose(1, 2))
            else:
                raise LayoutError(f"experts.gate_up_proj has shape {tuple(gu.shape)}; known: {(e, 2 * i, h)}, "
                                  f"{(e, h, 2 * i)}")
            if tuple(dn.shape) == (e, h, i):
                dn.copy_(down)
            elif tuple(dn.shape) == (e, i, h):
                dn.copy_(down.transpose(1, 2))
            else:
                raise LayoutError(f"experts.down_proj has shape {tuple(dn.shape)}; known: {(e, h, i)}, {(e, i, h)}")
            return f"fused gate_up_proj {tuple(gu.shape)}, down_proj {tuple(dn.shape)}"
        if all(f"experts.{x}.w{n}.weight" in params for x in range(e) for n in (1, 2, 3)):
            for x in range(e):
                params[f"experts.{x}.w1.weight"].copy_(gate[x])
                params[f"experts.{x}.w3.weight"].copy_(up[x])
                params[f"experts.{x}.w2.weight"].copy_(down[x])
            return "per-expert w1/w3/w2"
    raise LayoutError(f"unknown Mixtral expert layout; the block has: {describe(block)}")


def forward(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def time_block(block, x, iters: int, warm: int, torch_device: str) -> dict:
    """Median time of one forward of the block (CUDA events on a GPU, perf_counter on the CPU), in µs."""
    import time

    import torch

    with torch.no_grad():
        for _ in range(warm):
            forward(block, x)
        samples = []
        for _ in range(iters):
            if torch_device == "cpu":
                t = time.perf_counter()
                forward(block, x)
                samples.append((time.perf_counter() - t) * 1e6)
            else:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward(block, x)
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop) * 1e3)
    return {"median_us": round(float(np.median(samples)), 3), "min_us": round(float(np.min(samples)), 3),
            "samples": len(samples), "timer": "perf_counter" if torch_device == "cpu" else "cuda events"}
