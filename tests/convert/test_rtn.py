"""`convert --dtype int8|int4 [--group-size N]` on a float checkpoint: round-to-nearest per group, the error
reported per tensor kind, and the file computing the transformers block with the file's own (dequantized)
weights."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_sdk.format import ColibriFile
from colibri_sdk.reference import ReferenceEngine
from hf_models import HIDDEN, LAYERS, block_output, convert_cli, make_model, rel_err, torch


# Error bound per group, amax = the group's largest |w|: int8 scale amax/127, |error| <= scale/2; int4 uses
# llama.cpp Q4_0's scale m/-8 (m the largest-magnitude value), so values of the other sign near amax clip at code 7:
# |error| <= amax/8.
@pytest.mark.parametrize("dtype,group,bound", [("int4", 32, 8), ("int8", 0, 254), ("int8", 128, 254)])
def test_round_to_nearest(tmp_path, capsys, dtype, group, bound):
    model = make_model("mixtral", 2, seed=6)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    out = tmp_path / "m.colibri"
    assert convert_cli(folder, out, "--dtype", dtype, "--group-size", str(group)) == 0
    printed = capsys.readouterr().out
    assert f"quantized {3 * 16 * LAYERS} matrices to {dtype} {'per row' if group == 0 else f'g{group}'} (round-to-nearest); max error / max |w|: down_proj " in printed
    f = ColibriFile(out)
    assert (f.header.quant, f.header.group_size) == ({"int8": 1, "int4": 2}[dtype], group)
    # The round-to-nearest bound (+ the fp16 rounding of the scale).
    experts = model.model.layers[1].mlp.experts
    w = experts.down_proj[3].detach().numpy()
    size = w.shape[1] if group == 0 else group
    for g in range(0, w.shape[1], size):
        amax = np.abs(w[:, g:g + size]).max(axis=1, keepdims=True)
        err = np.abs(f.weight("down_proj", 1, 3)[:, g:g + size] - w[:, g:g + size])
        assert (err <= amax / bound * (1 + 2e-3) + 1e-12).all()
    # The engine computes the block holding exactly the file's weights.
    with torch.no_grad():
        for layer in range(LAYERS):
            ex = model.model.layers[layer].mlp.experts
            inter = ex.down_proj.shape[-1]
            for e in range(16):
                ex.gate_up_proj[e, :inter] = torch.from_numpy(f.weight("gate_proj", layer, e))
                ex.gate_up_proj[e, inter:] = torch.from_numpy(f.weight("up_proj", layer, e))
                ex.down_proj[e] = torch.from_numpy(f.weight("down_proj", layer, e))
            model.model.layers[layer].mlp.gate.weight.copy_(torch.from_numpy(f.router(layer).T.copy()))
    x = np.random.default_rng(0).standard_normal((2, 8, HIDDEN)).astype(np.float32)
    engine = ReferenceEngine(out)
    for layer in range(LAYERS):
        assert rel_err(engine.layer(layer, x.reshape(-1, HIDDEN)).reshape(x.shape), block_output(model, layer, x)) <= 1e-5


def test_group_size_needs_an_integer_dtype(saved_mixtral, tmp_path, capsys):
    assert convert_cli(saved_mixtral[0], tmp_path / "m.colibri", "--dtype", "fp16", "--group-size", "32") == 1
    assert "--group-size 32 with --dtype fp16; allowed only with int8 or int4" in capsys.readouterr().err
    assert convert_cli(saved_mixtral[0], tmp_path / "m.colibri", "--dtype", "int4", "--group-size", "0") == 1
    assert "--group-size 0 with --dtype int4; allowed: 32, 64, 128" in capsys.readouterr().err


def test_the_default_group_is_int8_per_row_and_int4_g128_and_every_summary_says_it(saved_mixtral, tmp_path, capsys):
    # --dtype int8 meant int8 g128 while the README's fit table and bench/quant_bench.py quote "int8 per row"
    from colibri_sdk import cli

    for dtype, group, words in (("int8", 0, "int8 per row"), ("int4", 128, "int4 g128")):
        out = tmp_path / f"{dtype}.colibri"
        assert convert_cli(saved_mixtral[0], out, "--dtype", dtype) == 0
        assert f"matrices to {words} (round-to-nearest)" in capsys.readouterr().out  # convert
        with ColibriFile(out) as f:
            assert f.header.group_size == group
        assert cli.main(["inspect", str(out)]) == 0
        assert any(line.split() == ["experts", *words.split()] for line in capsys.readouterr().out.splitlines())
    bundle = tmp_path / "bundle"
    assert cli.main(["build", "--profile", "orin", "--weights", str(tmp_path / "int8.colibri"), "-o", str(bundle),
                     "--batch", "1", "--tokens", "2"]) == 0
    assert ", int8 per row, fp16 scales, batch 1 x tokens 2" in capsys.readouterr().out  # build
    assert cli.main(["inspect", str(bundle)]) == 0
    assert "int8 per row (the weights' own storage)" in capsys.readouterr().out  # inspect of a bundle
    assert cli.main(["run", str(bundle), "--backend", "cpu", "--iters", "1"]) == 0
    printed = capsys.readouterr().out
    assert "(int8 per row, fp16 scales, batch 1 x tokens 2" in printed and "experts  int8 per row" in printed  # run
