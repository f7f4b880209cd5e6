"""`colibri-sdk inspect FILE [--json]`."""

from __future__ import annotations

import json

import pytest

from colibri_sdk import cli


def test_inspect_json(small_file, capsys):
    path, _, _ = small_file
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"] == {
        "magic": "COLI", "version": "0x0100", "num_layers": 2, "num_experts": 3, "top_k": 2, "hidden_size": 4,
        "intermediate_size": 5, "dtype": "float16", "routing": "topk_softmax", "composition": "sequential",
    }
    # fp16: gate/up/down blocks 2*3*5*4*2 = 240 bytes each, router 2*4*3*2 = 48 bytes.
    blocks = [(b["block"], b["offset"], b["bytes"], b["shape"]) for b in info["blocks"]]
    assert blocks == [
        ("header", 0, 64, None),
        ("gate_proj", 64, 240, [2, 3, 5, 4]),
        ("up_proj", 304, 240, [2, 3, 5, 4]),
        ("down_proj", 544, 240, [2, 3, 4, 5]),
        ("router", 784, 48, [2, 4, 3]),
    ]
    assert info["file_bytes"] == 832 == path.stat().st_size


def test_inspect_table(small_file, capsys):
    path, _, _ = small_file
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{path}  (832 bytes)"
    assert "  dtype              float16" in out
    assert "  down_proj             544            240  2x3x4x5" in out


def test_inspect_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"GGUF" + bytes(60))
    assert cli.main(["inspect", str(bad)]) == 1
    assert capsys.readouterr().err.strip() == f"colibri-sdk inspect: error: {bad}: bad magic b'GGUF'; expected b'COLI'"


def test_inspect_v2_shows_the_layer_map_and_every_block(tmp_path, capsys):
    import numpy as np

    from colibri_sdk.format import HeaderV2, write_arrays

    h = HeaderV2(num_layers=2, num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, dtype=1, routing=1,
                 quant=2, group_size=32, num_shared_experts=1, shared_intermediate_size=4, shared_gate=1,
                 layer_map=(1, 3), num_model_layers=4)
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(((2, h.count(k)) if h.is_matrix(k) else (2,)) + h.shape(k)).astype(np.float32)
              for k in h.kinds}
    path = write_arrays(tmp_path / "v2.colibri", h, arrays)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"]["layer_map"] == [1, 3] and info["header"]["num_model_layers"] == 4
    assert info["header"]["quant"] == "int4" and info["header"]["shared_gate"] is True
    blocks = [(b["block"], b["offset"], b["bytes"]) for b in info["blocks"]]
    # int4 gate: 2 layers * 4 experts * 6 rows * ceil(8/2) bytes = 192; fp16 scales 2*4*6*1*2 = 96; 64-aligned
    assert blocks[:4] == [("header", 0, 64), ("layer_map", 64, 4), ("gate_proj", 128, 192), ("gate_proj.scales", 320, 96)]
    assert blocks[-1] == ("shared_expert_gate", 1728, 64) and info["file_bytes"] == 1792 == path.stat().st_size


def test_inspect_table_columns_line_up_with_v2_names(tmp_path, capsys):
    import numpy as np

    from colibri_sdk.format import HeaderV2, write_arrays

    h = HeaderV2(num_layers=1, num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, dtype=1, routing=1,
                 quant=2, group_size=32, num_shared_experts=1, shared_intermediate_size=4, shared_gate=1)
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(((1, h.count(k)) if h.is_matrix(k) else (1,)) + h.shape(k)).astype(np.float32)
              for k in h.kinds}
    path = write_arrays(tmp_path / "v2.colibri", h, arrays)
    assert cli.main(["inspect", str(path)]) == 0
    import re

    lines = capsys.readouterr().out.splitlines()
    assert "  dtype                    float16 (the scales; experts: quant below)" in lines
    assert "  quant                    int4" in lines
    start = next(i for i, line in enumerate(lines) if line.startswith("  block "))
    value_columns = {re.match(r"  \S+ +", line).end() for line in lines[1:start]}
    bytes_ends = {re.match(r"  \S+ +\S+ +\S+", line).end() for line in lines[start:]}
    assert len(value_columns) == 1 and len(bytes_ends) == 1, lines


def test_inspect_a_bundle_of_v2_weights_shows_every_v2_field(tmp_path, capsys):
    """A bundle built from sigmoid-routed, grouped, int4 weights with a shared expert: its table names every v2
    field of the manifest's weights.header instead of refusing routing code 2 as a v1 header would."""
    from v2_bundle_support import random_v2_bundle

    from colibri_sdk.format import HeaderV2

    h = HeaderV2(num_layers=1, num_experts=4, top_k=2, hidden_size=32, intermediate_size=16, dtype=1, routing=2,
                 quant=2, group_size=32, norm_topk=1, n_group=2, topk_group=1, group_score=2, correction_bias=1,
                 num_shared_experts=1, shared_intermediate_size=8, shared_gate=1, routed_scaling_factor=2.5)
    bundle = random_v2_bundle(tmp_path, h, 0)
    capsys.readouterr()
    assert cli.main(["inspect", str(bundle)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("weights"))
    for shown in ("routing sigmoid_topk", "quant int4", "n_group 2", "group_score top2_sum", "correction_bias True",
                  "num_shared_experts 1", "routed_scaling_factor 2.5"):
        assert shown in line, line


def _v2_file(tmp_path, name, **fields):
    import numpy as np

    from colibri_sdk.format import HeaderV2, write_arrays

    h = HeaderV2(num_layers=1, num_experts=8, top_k=2, hidden_size=8, intermediate_size=6, dtype=1, **fields)
    rng = np.random.default_rng(1)
    arrays = {k: rng.standard_normal(((1, h.count(k)) if h.is_matrix(k) else (1,)) + h.shape(k)).astype(np.float32)
              for k in h.kinds}
    return h, write_arrays(tmp_path / f"{name}.colibri", h, arrays)


# Each scheme as its transformers router computes it (docs/format.md "Semantics v2"): Mixtral softmax → top-k →
# divide by the sum (MixtralTopKRouter); Qwen3-MoE / OLMoE without norm_topk_prob: softmax → top-k, not divided;
# with it: divided; DeepSeek-V2: softmax, group-limited (max), not renormalised, scaled; DeepSeek-V3: sigmoid,
# selection on sigmoid + correction bias within the best groups (top-2 sum), renormalised, scaled; gpt-oss: top-k of
# the biased logits, softmax over the k.
ROUTING_CASES = {
    "mixtral": (dict(routing=0), True, "select the top-2 logits; weights: softmax of the k selected logits, "
                "renormalised (sum 1)"),
    "qwen3_no_norm": (dict(routing=1), False, "select the top-2 softmax scores; weights: softmax over all experts, "
                      "not renormalised"),
    "qwen3_norm": (dict(routing=1, norm_topk=1), True, "select the top-2 softmax scores; weights: softmax over all "
                   "experts, renormalised (sum 1)"),
    "deepseek_v2": (dict(routing=1, n_group=4, topk_group=2, group_score=1, routed_scaling_factor=16.0), False,
                    "select the top-2 softmax scores, within the best 2 of 4 groups (group score max); weights: "
                    "softmax over all experts, not renormalised, x 16"),
    "deepseek_v3": (dict(routing=2, norm_topk=1, correction_bias=1, n_group=4, topk_group=2, group_score=2,
                         routed_scaling_factor=2.5), True,
                    "select the top-2 sigmoid scores + correction bias, within the best 2 of 4 groups (group score "
                    "top2_sum); weights: sigmoid, renormalised (sum 1), x 2.5"),
    "gpt_oss": (dict(routing=0, router_bias=1), True, "select the top-2 logits (router bias on the logits); weights: "
                "softmax of the k selected logits, renormalised (sum 1)"),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_inspect_routing_facts_are_true_for_every_scheme(tmp_path, capsys, case):
    """The shown routing facts say what the routing computes: a Mixtral file (routing topk_softmax, whose
    norm_topk field must be 0) is shown renormalised; and the reference engine's weights agree (sum 1 or not)."""
    import numpy as np

    from colibri_sdk.reference import route_v2

    fields, renormalized, text = ROUTING_CASES[case]
    h, path = _v2_file(tmp_path, case, **fields)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["routing"]
    assert facts["renormalized"] is renormalized and facts["text"] == text
    logits = np.random.default_rng(2).standard_normal((16, 8))
    bias = np.linspace(-0.1, 0.1, 8) if h.correction_bias else None
    _, weights = route_v2(logits, h, bias)
    sums = weights.sum(axis=-1) / h.routed_scaling_factor
    assert np.allclose(sums, 1.0, atol=1e-9) is renormalized
    assert cli.main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  routing_rule             {text}" in lines
    norm_line = next(line for line in lines if line.startswith("  norm_topk "))
    assert ("implied (routing topk_softmax" in norm_line) is (fields["routing"] == 0)
    if fields["routing"] != 0:
        assert norm_line.split()[1] == str(bool(fields.get("norm_topk")))


def test_inspect_v1_routing_facts(small_file, capsys):
    path, _, _ = small_file  # v1, routing 0 (Mixtral)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routing"]["renormalized"] is True
