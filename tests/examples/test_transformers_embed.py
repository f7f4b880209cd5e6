"""examples/transformers_embed: a transformers Mixtral whose MoE blocks call colibri per layer gives the original
model's logits (the original transformers model is the oracle)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the example needs torch (the `test` extra)")
pytest.importorskip("transformers", reason="the example needs transformers (the `test` extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "transformers_embed"))
import embed  # noqa: E402

from colibri_sdk.errors import InputError  # noqa: E402
from colibri_sdk.runtime import Runtime  # noqa: E402


@pytest.fixture(scope="module")
def mixtral_and_bundle(tmp_path_factory):
    model = embed.tiny_mixtral(seed=4)
    return model, embed.convert_and_build(model, tmp_path_factory.mktemp("embed"))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.numpy()


def test_embedded_moe_blocks_give_the_original_logits(mixtral_and_bundle):
    model, bundle = mixtral_and_bundle
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    expected = logits(model, ids)
    with Runtime.load(bundle, backend="cpu") as rt:
        embedded = embed.replace_moe_blocks(copy.deepcopy(model), rt)
        got = logits(embedded, ids)
        short = logits(embedded, ids[:, :5])
        assert rt.stats().calls == 2 * model.config.num_hidden_layers
        with pytest.raises(InputError, match=r"input tokens 17 .*allowed: 1\.\.16"):
            logits(embedded, torch.zeros((1, 17), dtype=torch.long))
        # A control that must fail: layer 0's experts in both decoder layers.
        swapped = copy.deepcopy(model)
        for layer in swapped.model.layers:
            layer.mlp = embed.ColibriMoE(rt, 0)
        wrong = logits(swapped, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(short, logits(model, ids[:, :5]), rtol=1e-4, atol=1e-4)
    assert np.abs(wrong - expected).max() > 1e-2
