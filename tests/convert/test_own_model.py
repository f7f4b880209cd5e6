"""docs/convert.md, "Your own model": a custom PyTorch MoE (defined here, no transformers class) written with the
format's public writer, built, and its MoE blocks swapped for the runtime's layers. The code run is the guide's own
(its first two Python blocks, read from the page), so the guide stays true."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the custom module is a PyTorch nn.Module (the convert extra's tests)")
from torch import nn  # noqa: E402

from colibri_sdk.errors import FormatError  # noqa: E402
from colibri_sdk.runtime import Runtime  # noqa: E402

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "convert.md"
HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 24, 40, 6, 2, 3


class Expert(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, INTER, bias=False)
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class SparseMoE(nn.Module):
    """softmax over all experts -> top-k -> (optionally) renormalise; a dense loop over the chosen experts."""

    def __init__(self, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = TOP_K, renormalize
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (chosen == e)
            if hit.any():
                w = (weights * hit).sum(dim=-1, keepdim=True)  # 0 where e is not chosen
                out = out + w * expert(x)
        return out


class Layer(nn.Module):
    def __init__(self, renormalize: bool):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = SparseMoE(renormalize)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class TinyModel(nn.Module):
    """Three layers, each a LayerNorm and an MoE block inside a residual, then a final norm."""

    def __init__(self, renormalize: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Layer(renormalize) for _ in range(LAYERS))
        for layer in self.layers:  # a wide router: top-k choices far apart, so float rounding never flips one
            nn.init.normal_(layer.moe.router.weight, std=1.0)
            nn.init.normal_(layer.norm.weight, mean=1.0, std=0.1)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def guide_blocks() -> list[str]:
    """The Python blocks of the guide's "Your own model" section, in order."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "not-renormalised"])
def test_a_custom_module_written_built_and_swapped_gives_its_own_outputs(tmp_path, monkeypatch, renormalize):
    model = TinyModel(renormalize, seed=3).eval()
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(x).numpy()
    mapping, build = guide_blocks()[:2]
    assert build.count("renormalize=True") == 1
    build = build.replace("renormalize=True", f"renormalize={renormalize}")  # the routing of this model
    namespace = {"model": model}
    exec(compile(mapping, f"{GUIDE}:mapping", "exec"), namespace)
    monkeypatch.chdir(tmp_path)  # the guide's relative paths: my_moe.colibri, bundles/my_moe
    exec(compile(build, f"{GUIDE}:build", "exec"), namespace)
    bundle = namespace["bundle"]
    assert (tmp_path / "bundles" / "my_moe" / "manifest.json").is_file()
    with Runtime.load(bundle, backend="cpu") as rt:
        namespace["swap_moe_blocks"](model.layers, rt)
        assert all(type(layer.moe).__name__ == "ColibriMoE" for layer in model.layers)
        with torch.no_grad():
            got = model(x).numpy()
        assert rt.stats().calls == LAYERS
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_the_mapping_refuses_a_block_that_does_not_fit(tmp_path):
    model = TinyModel(True, seed=5)
    model.layers[1].moe.experts[2].down = nn.Linear(INTER - 1, HIDDEN, bias=False)  # one expert of another size
    namespace = {}
    exec(compile(guide_blocks()[0], f"{GUIDE}:mapping", "exec"), namespace)
    with pytest.raises(FormatError, match=r"down_proj"):
        namespace["write_colibri"]([layer.moe for layer in model.layers], tmp_path / "bad.colibri", True)
    assert not (tmp_path / "bad.colibri").exists()
