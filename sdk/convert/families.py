"""Model families the converter knows, and the config checks that refuse what .colibri v1 cannot hold.

Routing per family follows the transformers router classes (transformers 5.x):
  - Mixtral (`MixtralTopKRouter`): softmax over all experts, top-k, always renormalised  → routing 0.
  - Qwen3-MoE, OLMoE, Qwen2-MoE (`*TopKRouter`): softmax, top-k, renormalised only if `norm_topk_prob`
    (default False) → routing 0 if True, else routing 1.
The format holds SwiGLU experts without biases, a softmax router without bias, and a MoE block in every layer.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConvertError
from ..format.constants import ROUTING_NAMES, ROUTING_SOFTMAX_TOPK, ROUTING_TOPK_SOFTMAX, U16_MAX

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
SILU_NAMES = ("silu", "swish")
# Families whose router scores are sigmoid(logits) (+ a score-correction bias) with no config key saying so.
SIGMOID_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the config says about the MoE part of a model.

    Attributes:
        family: the config's `model_type` ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe").
        num_layers, num_experts, top_k, hidden_size, intermediate_size: sizes (intermediate: per expert).
        routing: a ROUTING_* code (format constants).
        keys: size name → the config key it was read from (quoted in errors).
    """

    family: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    routing: int
    keys: dict

    @property
    def routing_name(self) -> str:
        return ROUTING_NAMES[self.routing]


def _first_key(config: dict, keys: tuple[str, ...], what: str) -> tuple[str, object]:
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    raise ConvertError(f"config.json has no {what} (looked for {', '.join(keys)})")


def _size(config: dict, keys: tuple[str, ...], what: str) -> tuple[str, int]:
    key, value = _first_key(config, keys, what)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= U16_MAX:
        raise ConvertError(f"config.json {key} = {value!r}; the format allows an integer in 1..{U16_MAX}")
    return key, value


def refuse_unsupported(config: dict) -> None:
    """Raise ConvertError naming the first config key whose value .colibri v1 cannot represent.

    Checked, in order: shared experts, sigmoid / grouped / scaled routing (DeepSeek), dense layers between MoE
    layers, non-SiLU activation, biases.
    """
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "moe_shared_expert_intermediate_size"):
        value = config.get(key)
        if value:
            raise ConvertError(
                f"config.json {key} = {value!r}: shared experts (Qwen2-MoE shared_expert, DeepSeek shared_experts) "
                f"are not representable in .colibri v1; allowed: 0 or absent"
            )
    if config.get("model_type") in SIGMOID_MODEL_TYPES:
        raise ConvertError(
            f"config.json model_type = {config['model_type']!r} routes with sigmoid scores and a score-correction "
            f"bias (DeepSeek-V3 style); only softmax routing is representable"
        )
    scoring = config.get("scoring_func")
    if scoring is not None and scoring != "softmax":
        raise ConvertError(
            f"config.json scoring_func = {scoring!r}: only softmax routing is representable; allowed: 'softmax'"
        )
    method = config.get("topk_method")
    if method is not None and method != "greedy":
        raise ConvertError(
            f"config.json topk_method = {method!r}: grouped top-k routing (DeepSeek) is not representable; "
            f"allowed: 'greedy' or absent"
        )
    for key in ("n_group", "topk_group"):
        value = config.get(key)
        if value is not None and value != 1:
            raise ConvertError(
                f"config.json {key} = {value!r}: grouped routing (DeepSeek) is not representable; allowed: 1 or absent"
            )
    scale = config.get("routed_scaling_factor")
    if scale is not None and scale != 1 and scale != 1.0:
        raise ConvertError(
            f"config.json routed_scaling_factor = {scale!r}: scaled routing weights are not representable; allowed: 1"
        )
    for key, allowed in (("decoder_sparse_step", 1), ("moe_layer_freq", 1), ("first_k_dense_replace", 0)):
        value = config.get(key)
        if value is not None and value != allowed:
            raise ConvertError(
                f"config.json {key} = {value!r}: dense MLP layers between MoE layers are not representable "
                f"(every layer must be a MoE layer); allowed: {allowed}"
            )
    only = config.get("mlp_only_layers")
    if only:
        raise ConvertError(
            f"config.json mlp_only_layers = {only!r}: dense MLP layers between MoE layers are not representable; "
            f"allowed: [] or absent"
        )
    act = config.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ConvertError(
            f"config.json hidden_act = {act!r}: experts must be SwiGLU with SiLU; allowed: {', '.join(SILU_NAMES)}"
        )
    for key in ("mlp_bias", "router_bias", "moe_bias"):
        if config.get(key):
            raise ConvertError(f"config.json {key} = {config[key]!r}: biases are not representable; allowed: false")


def model_spec(config: dict) -> ModelSpec:
    """Read the MoE sizes and the routing mode from a parsed config.json.

    Raises:
        ConvertError: a feature the format cannot hold (see refuse_unsupported), an unsupported `model_type`, a
            missing or out-of-range size key, or top_k > num_experts.
    """
    refuse_unsupported(config)
    family = config.get("model_type")
    if family not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"config.json model_type = {family!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    keys = {}
    keys["num_layers"], num_layers = _size(config, ("num_hidden_layers",), "layer count")
    keys["num_experts"], num_experts = _size(config, ("num_local_experts", "num_experts"), "expert count")
    keys["top_k"], top_k = _size(config, ("num_experts_per_tok",), "top-k")
    keys["hidden_size"], hidden = _size(config, ("hidden_size",), "hidden size")
    inter_keys = ("intermediate_size",) if family in ("mixtral", "olmoe") else ("moe_intermediate_size",)
    keys["intermediate_size"], inter = _size(config, inter_keys, "expert intermediate size")
    if top_k > num_experts:
        raise ConvertError(
            f"config.json {keys['top_k']} = {top_k} exceeds {keys['num_experts']} = {num_experts}; allowed: 1..{num_experts}"
        )
    if family == "mixtral":
        routing = ROUTING_TOPK_SOFTMAX
    else:
        norm = config.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ConvertError(f"config.json norm_topk_prob = {norm!r}; allowed: true, false")
        routing = ROUTING_TOPK_SOFTMAX if norm else ROUTING_SOFTMAX_TOPK
    return ModelSpec(family, num_layers, num_experts, top_k, hidden, inter, routing, keys)
