"""What .colibri v1 cannot hold is refused with an error naming the config key or the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri_sdk.convert import convert
from colibri_sdk.errors import ConvertError
from hf_models import convert_cli, edit_config, make_model, transformers

PREFIX = "model.layers.0.block_sparse_moe."


def rewrite(folder, change) -> None:
    """Load the single-file checkpoint as NumPy arrays, apply change(dict), save it back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def refused(folder, tmp_path, match: str, **kwargs) -> None:
    out = tmp_path / "out.colibri"
    with pytest.raises(ConvertError, match=match):
        convert(folder, out, progress=False, **kwargs)
    assert not out.exists()
    assert not (tmp_path / "out.colibri.partial").exists()


# ---- config keys ---------------------------------------------------------------------------------------------
FOREIGN = r"which transformers' mixtral model ignores: the checkpoint is not a plain mixtral; allowed: "
CONFIG_CASES = [
    ({"scoring_func": "sigmoid"}, r"^mixtral: config\.json scoring_func = 'sigmoid' means non-softmax routing \(sigmoid routing converts as deepseek_v3\), " + FOREIGN + "'softmax' or absent"),
    ({"topk_method": "noaux_tc"}, r"^mixtral: config\.json topk_method = 'noaux_tc' means grouped top-k routing \(converts as deepseek_v2 / deepseek_v3\)"),
    ({"n_group": 8}, r"^mixtral: config\.json n_group = 8 means grouped routing"),
    ({"topk_group": 4}, r"^mixtral: config\.json topk_group = 4 means grouped routing"),
    ({"routed_scaling_factor": 2.5}, r"^mixtral: config\.json routed_scaling_factor = 2\.5 means scaled routing weights"),
    ({"n_shared_experts": 2}, r"^mixtral: config\.json n_shared_experts = 2 means shared experts \(converts as deepseek_v2 / deepseek_v3\)"),
    ({"decoder_sparse_step": 2}, r"^mixtral: config\.json decoder_sparse_step = 2 means dense MLP layers between MoE layers \(converts as qwen2_moe / qwen3_moe\)"),
    ({"mlp_only_layers": [1]}, r"^mixtral: config\.json mlp_only_layers = \[1\] means dense MLP layers"),
    ({"first_k_dense_replace": 1}, r"^mixtral: config\.json first_k_dense_replace = 1 means leading dense layers \(converts as deepseek_v2 / deepseek_v3\)"),
    ({"hidden_act": "gelu"}, r"^mixtral: config\.json hidden_act = 'gelu': experts must be SwiGLU with SiLU; allowed: silu, swish$"),
    ({"mlp_bias": True}, r"^mixtral: config\.json mlp_bias = True means MLP biases \(only gpt_oss experts carry biases\)"),
    ({"model_type": "llama"}, r"^config\.json model_type = 'llama' is not supported; allowed: mixtral, qwen3_moe, olmoe, qwen2_moe, granitemoe, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss$"),
    ({"model_type": "phimoe"}, r"^phimoe: routes with SparseMixer .*; not supported$"),
    ({"num_experts_per_tok": 17}, r"^mixtral: config\.json num_experts_per_tok = 17 exceeds num_local_experts = 16; allowed: 1\.\.16$"),
    ({"num_local_experts": 70000}, r"^mixtral: config\.json num_local_experts = 70000; allowed: an integer in 1\.\.65535$"),
    ({"hidden_size": 0}, r"^mixtral: config\.json hidden_size = 0; allowed: an integer in 1\.\.65535$"),
    ({"num_experts_per_tok": None}, r"^mixtral: config\.json has no top-k \(looked for num_experts_per_tok\)$"),
    ({"norm_topk_prob": "yes", "model_type": "olmoe", "num_experts": 16}, r"^olmoe: config\.json norm_topk_prob = 'yes'; allowed: true, false$"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"^mixtral: config\.json quantization_config quant_method = 'gptq' is not imported; allowed: 'compressed-tensors' \(format 'pack-quantized'\), 'mxfp4' \(gpt_oss\); or convert a bf16/fp16 copy$"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}}, r"^mixtral: config\.json quantization_config format = 'float-quantized' is not imported; allowed: 'pack-quantized'"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "input_activations": {"num_bits": 8}}}}}, r"^mixtral: config\.json quantization_config config_groups\.g quantizes activations; allowed: weight-only schemes"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}}}}}, r"^mixtral: config\.json quantization_config config_groups\.g\.weights type 'int' num_bits 3; allowed: type 'int' with num_bits 4 or 8$"),
    # a 5,000-character value is quoted shortened (reprlib), keeping the message one short line
    ({"hidden_act": "g" * 5000}, r"^mixtral: config\.json hidden_act = 'g{20,30}\.\.\.g{20,30}': experts must be SwiGLU"),
    ({"model_type": "x" * 5000}, r"^config\.json model_type = 'x{20,30}\.\.\.x{20,30}' is not supported"),
]


@pytest.mark.parametrize("changes,match", CONFIG_CASES, ids=[f"{next(iter(c))}-{i}" for i, (c, _) in enumerate(CONFIG_CASES)])
def test_config_refusals(mixtral_copy, tmp_path, changes, match):
    edit_config(mixtral_copy, **changes)
    refused(mixtral_copy, tmp_path, match)


def test_qwen2_moe_without_shared_expert_size(tmp_path):
    """Every Qwen2-MoE block has a shared expert: a config without its size is refused by name."""
    model = make_model("qwen2", 2)
    model.save_pretrained(tmp_path / "qwen2")
    edit_config(tmp_path / "qwen2", shared_expert_intermediate_size=None)
    refused(tmp_path / "qwen2", tmp_path, r"^qwen2_moe: config\.json has no shared expert size \(looked for shared_expert_intermediate_size\)$")


def test_shared_expert_tensor_in_a_family_without_one(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "shared_expert.gate_proj.weight": np.zeros((48, 32), np.float32)}))
    refused(mixtral_copy, tmp_path, r"^mixtral: tensor 'model\.layers\.0\.block_sparse_moe\.shared_expert\.gate_proj\.weight' is a shared expert, which mixtral does not have .*; models with shared experts convert as qwen2_moe, deepseek_v2, deepseek_v3 or glm4_moe$")


def deepseek_folder(tmp_path, **changes):
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=48, n_routed_experts=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=32, first_k_dense_replace=0,
    )
    folder = tmp_path / "deepseek"
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    edit_config(folder, **changes)
    save_file({"model.layers.0.mlp.gate.weight": np.zeros((16, 32), np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("changes,match", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, r"^deepseek_v3: config\.json quantization_config\.quant_method = 'fp8': block-scaled FP8 weights are not imported; convert a bf16 copy"),
    ({"scoring_func": "softmax"}, r"^deepseek_v3: config\.json scoring_func = 'softmax', but transformers' deepseek_v3 router uses sigmoid; allowed: 'sigmoid' or absent$"),
    ({"topk_method": "greedy"}, r"^deepseek_v3: config\.json topk_method = 'greedy'; allowed: 'noaux_tc'$"),
    ({"n_group": 3}, r"^deepseek_v3: config\.json n_group = 3, topk_group = 4 with 16 experts; allowed: n_group dividing 16, topk_group <= n_group$"),
    ({"n_group": 16, "topk_group": 4}, r"^deepseek_v3: config\.json n_group = 16 leaves 1 expert per group; .*allowed: n_group <= 8$"),
    ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 3}, r"^deepseek_v3: config\.json num_experts_per_tok = 3 exceeds the 2 experts of the topk_group = 1 selected groups; allowed: 1\.\.2$"),
    ({"model_type": "deepseek_v2", "norm_topk_prob": True, "topk_method": "greedy"}, r"^deepseek_v2: config\.json norm_topk_prob = true: transformers' DeepseekV2TopkRouter ignores it .*; allowed: false$"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, r"^deepseek_v2: config\.json topk_method = 'noaux_tc'; allowed: 'greedy', 'group_limited_greedy'$"),
], ids=["fp8", "softmax", "greedy", "n_group", "one-per-group", "top_k", "v2-norm", "v2-method"])
def test_deepseek_config_refusals(tmp_path, changes, match):
    """Real DeepSeek config keys: each inconsistency is named after the model type."""
    refused(deepseek_folder(tmp_path, **changes), tmp_path, match)


# ---- tensors -------------------------------------------------------------------------------------------------
def test_expert_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.3.w1.bias": np.zeros(48, np.float32)}))
    refused(mixtral_copy, tmp_path, r"^mixtral: tensor 'model\.layers\.0\.block_sparse_moe\.experts\.3\.w1\.bias' is a bias, which mixtral experts and router do not have; only gpt_oss carries router and expert biases$")


def test_router_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "gate.bias": np.zeros(16, np.float32)}))
    refused(mixtral_copy, tmp_path, r"^mixtral: tensor 'model\.layers\.0\.block_sparse_moe\.gate\.bias' is a bias")


def test_deepseek_score_correction_bias_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "gate.e_score_correction_bias": np.zeros(16, np.float32)}))
    refused(mixtral_copy, tmp_path, r"^mixtral: tensor '.*gate\.e_score_correction_bias' is a DeepSeek-V3 score-correction bias, which mixtral routing does not use; sigmoid routing with a correction bias converts as deepseek_v3 or glm4_moe$")


def test_missing_expert_tensor(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.pop(PREFIX + "experts.12.w2.weight"))
    refused(mixtral_copy, tmp_path, r"missing expert tensor model\.layers\.0\.block_sparse_moe\.experts\.12\.w2\.weight")


def test_extra_expert_tensor(mixtral_copy, tmp_path):
    extra = np.zeros((48, 32), np.float32)
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.16.w1.weight": extra}))
    refused(mixtral_copy, tmp_path, r"extra expert tensor '.*experts\.16\.w1\.weight': expert 16 >= config\.json num_local_experts = 16")


def test_unknown_tensor_in_moe_block(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.3.w4.weight": np.zeros((48, 32), np.float32)}))
    refused(mixtral_copy, tmp_path, r"unexpected tensor '.*experts\.3\.w4\.weight' in a MoE block")


def test_wrong_shape_names_tensor_and_config(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.5.w3.weight": np.zeros((40, 32), np.float32)}))
    refused(mixtral_copy, tmp_path, r"'.*experts\.5\.w3\.weight' has shape \(40, 32\); expected \(48, 32\) .*intermediate_size=48")


def test_dense_layer_without_router(mixtral_copy, tmp_path):
    def drop_layer1(t):
        for name in [n for n in t if n.startswith("model.layers.1.block_sparse_moe.")]:
            del t[name]
        t["model.layers.1.mlp.gate_proj.weight"] = np.zeros((48, 32), np.float32)

    rewrite(mixtral_copy, drop_layer1)
    refused(mixtral_copy, tmp_path, r"^mixtral: layer 1 has no MoE router \(expected a tensor like model\.layers\.1\.mlp\.gate\.weight\), but config\.json makes it a MoE layer \(every mixtral layer is a MoE layer\)$")


def test_integer_dtype_is_refused(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t.update({PREFIX + "experts.0.w1.weight": np.zeros((48, 32), np.int8)}))
    refused(mixtral_copy, tmp_path, r"'.*experts\.0\.w1\.weight' has dtype I8; allowed: BF16, F16, F32")


def test_fp16_overflow_names_tensor_and_count(mixtral_copy, tmp_path):
    def big(t):
        t[PREFIX + "experts.7.w2.weight"][:3, 0] = [7e4, -1e5, 65504.0]

    rewrite(mixtral_copy, big)
    refused(mixtral_copy, tmp_path, r"experts\.7\.w2\.weight: 2 values overflow float16 .*--clamp-fp16")
    # fp32 holds them; clamping is explicit.
    assert convert_cli(mixtral_copy, tmp_path / "f32.colibri", "--dtype", "fp32") == 0
    assert convert_cli(mixtral_copy, tmp_path / "c.colibri", "--clamp-fp16") == 0
    from colibri_sdk.format import ColibriFile

    w = ColibriFile(tmp_path / "c.colibri").tensor("down_proj", 0, 7)
    assert w[:3, 0].tolist() == [65504.0, -65504.0, 65504.0]


def test_non_finite_weight(mixtral_copy, tmp_path):
    rewrite(mixtral_copy, lambda t: t[PREFIX + "gate.weight"].__setitem__((0, 0), np.nan))
    refused(mixtral_copy, tmp_path, r"block_sparse_moe\.gate\.weight: 1 non-finite values")


# ---- folders -------------------------------------------------------------------------------------------------
def test_missing_config(mixtral_copy, tmp_path):
    (mixtral_copy / "config.json").unlink()
    refused(mixtral_copy, tmp_path, r"no config\.json")


def test_malformed_config(mixtral_copy, tmp_path):
    (mixtral_copy / "config.json").write_text("{not json")
    refused(mixtral_copy, tmp_path, r"config\.json: not valid JSON")


def test_pytorch_bin_only(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / "pytorch_model.bin")
    refused(mixtral_copy, tmp_path, r"only PyTorch \.bin/\.pt weights found")


def test_index_names_missing_shard(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / "model-00001-of-00002.safetensors")
    index = {"weight_map": {PREFIX + "gate.weight": "model-00002-of-00002.safetensors"}}
    (mixtral_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(mixtral_copy, tmp_path, r"names shard 'model-00002-of-00002\.safetensors', which is not in")


def test_index_places_tensor_in_wrong_shard(mixtral_copy, tmp_path):
    shard = "model-00001-of-00001.safetensors"
    (mixtral_copy / "model.safetensors").rename(mixtral_copy / shard)
    index = {"weight_map": {PREFIX + "gate.weight": shard, "lm_head.bias": shard}}
    (mixtral_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(mixtral_copy, tmp_path, r"places 'lm_head\.bias' in model-00001-of-00001\.safetensors, which does not")


def test_corrupt_safetensors(mixtral_copy, tmp_path):
    (mixtral_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(mixtral_copy, tmp_path, r"model\.safetensors: not a readable safetensors file")


def test_missing_output_folder(saved_mixtral, tmp_path):
    with pytest.raises(ConvertError, match=r"output folder .*nowhere does not exist"):
        convert(saved_mixtral[0], tmp_path / "nowhere" / "m.colibri", progress=False)


def test_cli_error_exit_code(mixtral_copy, tmp_path, capsys):
    edit_config(mixtral_copy, hidden_act="relu")
    assert convert_cli(mixtral_copy, tmp_path / "m.colibri") == 1
    err = capsys.readouterr().err
    assert err.startswith("colibri-sdk convert: error: mixtral: config.json hidden_act = 'relu'")


# ---- the v2 families ---------------------------------------------------------------------------------------------
def test_missing_shared_expert_tensor(tmp_path):
    from hf_models import make_family

    make_family("qwen2_moe").save_pretrained(tmp_path / "q")
    rewrite(tmp_path / "q", lambda t: t.pop("model.layers.2.mlp.shared_expert.up_proj.weight"))
    refused(tmp_path / "q", tmp_path, r"^qwen2_moe: tensor 'model\.layers\.2\.mlp\.shared_expert\.up_proj\.weight' is missing \(config\.json declares a shared expert of size 40\)$")


def test_router_in_a_layer_the_config_calls_dense(tmp_path):
    from hf_models import make_family

    make_family("qwen2_moe").save_pretrained(tmp_path / "q")
    edit_config(tmp_path / "q", mlp_only_layers=[0, 1])
    refused(tmp_path / "q", tmp_path, r"^qwen2_moe: layer 0 has a MoE router \(model\.layers\.0\.mlp\.gate\.weight\), but config\.json makes it a dense layer \(mlp_only_layers / decoder_sparse_step\)$")


def test_deepseek_multi_token_prediction_layer_is_left_out(tmp_path):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers extra layers after the decoder: left out, by name."""
    from hf_models import make_family

    model = make_family("deepseek_v3")
    model.save_pretrained(tmp_path / "d")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items() if k.startswith("model.layers.2.")}
    rewrite(tmp_path / "d", lambda t: t.update(extra))
    edit_config(tmp_path / "d", num_nextn_predict_layers=0)
    refused(tmp_path / "d", tmp_path, r"^deepseek_v3: tensors of layer 3 are in the checkpoint, but config\.json num_hidden_layers = 3$")
    edit_config(tmp_path / "d", num_nextn_predict_layers=1)
    report = convert(tmp_path / "d", tmp_path / "d.colibri", progress=False)
    assert report.left_out == {0: "dense MLP layer", 3: "multi-token-prediction layer (num_nextn_predict_layers)"}
    assert report.header.layer_map == (1, 2)


def test_gpt_oss_missing_expert_bias(tmp_path):
    from hf_models import make_family

    make_family("gpt_oss").save_pretrained(tmp_path / "g")
    rewrite(tmp_path / "g", lambda t: t.pop("model.layers.1.mlp.experts.down_proj_bias"))
    refused(tmp_path / "g", tmp_path, r"^gpt_oss: tensor 'model\.layers\.1\.mlp\.experts\.down_proj_bias' is missing$")


def test_phimoe_checkpoint_is_refused(tmp_path):
    """A PhiMoE checkpoint saved by transformers: SparseMixer routing is named as the reason."""
    config = transformers.PhimoeConfig(
        hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=32, max_position_embeddings=64,
    )
    transformers.PhimoeForCausalLM(config).save_pretrained(tmp_path / "phimoe")
    refused(tmp_path / "phimoe", tmp_path, r"^phimoe: routes with SparseMixer \(each selected expert's weight is a softmax over only the logits within a jitter threshold of it, the second choice taken after masking the first\), which no \.colibri router computes; not supported$")


@pytest.mark.parametrize("old,new,what,problem", [
    # read as int() it was layer 1 while the block was looked up as 'layers.1.': KeyError: 'gate.weight'
    ("model.layers.1.", "model.layers.01.", "layer", r"index '0\d' has a leading zero"),
    (PREFIX + "experts.3.", PREFIX + "experts.03.", "expert", r"index '0\d' has a leading zero"),
    # fullwidth digit one and Arabic-Indic digit three: int() reads 1 and 3
    ("model.layers.1.", "model.layers.\uff11.", "layer", r"index '[^']+' is not in ASCII digits"),
    (PREFIX + "experts.3.", PREFIX + "experts.\u0663.", "expert", r"index '[^']+' is not in ASCII digits"),
], ids=["layer-leading-zero", "expert-leading-zero", "layer-non-ascii", "expert-non-ascii"])
def test_an_index_not_written_as_nn_modulelist_writes_it_is_refused_naming_the_tensor(mixtral_copy, tmp_path, old,
                                                                                        new, what, problem):
    def rename(tensors):
        for name in [n for n in tensors if n.startswith(old)]:
            tensors[new + name[len(old):]] = tensors.pop(name)

    rewrite(mixtral_copy, rename)
    shown = new.replace(".", r"\.")
    refused(mixtral_copy, tmp_path, rf"^tensor '{shown}[^']+': {what} {problem}; allowed: the index as "
            rf"nn\.ModuleList writes it \('{what}s\.\d\.'\)$")


def test_a_missing_source_and_a_file_are_named_apart(tmp_path):
    """No such path, and a file that is not a .gguf: each said as it is, with what convert takes."""
    refused(tmp_path / "nowhere", tmp_path, r"nowhere: no such folder; expected a Hugging Face checkpoint folder "
                                            r"\(or a \.gguf file\)")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    refused(tmp_path / "weights.bin", tmp_path, r"weights.bin: not a folder; expected a Hugging Face checkpoint folder")
