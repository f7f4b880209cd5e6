"""Model families the converter knows: config.json → a description of the model's MoE layers (ModelSpec).

Each family is read the way its transformers 5.x modeling code reads the config:

| model_type | MoE layers | router (transformers class) | shared expert |
|---|---|---|---|
| mixtral | every layer | softmax → top-k → renormalise (`MixtralTopKRouter`) | — |
| granitemoe | every layer | top-k of logits → softmax (`GraniteMoeTopKRouter`) | — |
| olmoe | every layer | softmax → top-k → renormalise if `norm_topk_prob` (`OlmoeTopKRouter`) | — |
| qwen3_moe | not in `mlp_only_layers` and `(l+1) % decoder_sparse_step == 0` | as OLMoE (`Qwen3MoeTopKRouter`) | — |
| qwen2_moe | as Qwen3-MoE | as OLMoE (`Qwen2MoeTopKRouter`) | one, `shared_expert_intermediate_size`, × sigmoid(shared_expert_gate·x) |
| deepseek_v2 | `l >= first_k_dense_replace` | softmax → greedy or group-limited top-k (group score = max) → × `routed_scaling_factor` (`DeepseekV2TopkRouter`) | `n_shared_experts × moe_intermediate_size`, added |
| deepseek_v3, glm4_moe | as DeepSeek-V2 | sigmoid; selection on sigmoid + `e_score_correction_bias`, group-limited (group score = sum of the top two); weights = the uncorrected sigmoids, renormalised (+1e-20) if `norm_topk_prob`, × `routed_scaling_factor` (`DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`) | as DeepSeek-V2 |
| gpt_oss | every layer | logits + router bias → top-k → softmax (`GptOssTopKRouter`) | — ; expert biases, clamped SwiGLU |

Anything else is refused by `model_type` first, with what would work.
"""

from __future__ import annotations

import dataclasses
import reprlib

from ..errors import ConvertError

U16_MAX = 0xFFFF
SILU_NAMES = ("silu", "swish")

# model_type → the families' parser (filled at the end of this module); the order is the one `allowed:` lists.
SUPPORTED_MODEL_TYPES = (
    "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "granitemoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
)

# Known MoE model types that do not convert, and why / what would work. Quoted after the model type.
REFUSED_MODEL_TYPES = {
    "phimoe": (
        "routes with SparseMixer (each selected expert's weight is a softmax over only the logits within a "
        "jitter threshold of it, the second choice taken after masking the first), which no .colibri router "
        "computes; not supported"
    ),
    "deepseek_v32": "uses DeepSeek sparse attention and an indexer the converter has not been checked against; "
    "not supported (a DeepSeek-V3 checkpoint converts as deepseek_v3)",
    "qwen3_next": "mixes linear-attention layers and a gated shared expert under names the converter has not been "
    "checked against; not supported (Qwen2-MoE with its shared expert converts as qwen2_moe)",
    "granitemoeshared": "has a shared expert under names the converter has not been checked against; not supported "
    "(GraniteMoE without a shared expert converts as granitemoe)",
    "granitemoehybrid": "mixes Mamba layers with MoE layers; not supported (GraniteMoE converts as granitemoe)",
    "jamba": "mixes Mamba layers with MoE layers; not supported",
    "dbrx": "stores its experts under a fused layout with its own names; not supported",
    "llama4": "routes with a sigmoid of the top-1 logit applied to the expert input; not supported",
    "jetmoe": "also routes its attention through experts (mixture of attention heads); not supported",
}


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 8


def _value(value) -> str:
    """A config.json value as quoted in an error: its repr, shortened (reprlib) so a message stays one short line."""
    return _REPR.repr(value)


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """How a token's top-k experts and their weights are formed from the router logits z = W_r x (+ bias), fp32.

    Attributes:
        scoring: "softmax" or "sigmoid" (scores s from z).
        order: "softmax_topk" — scores over all experts, then the k largest scores; "topk_softmax" — the k largest
            logits, then a softmax over those k (GraniteMoE, gpt-oss; for softmax this equals softmax_topk with
            renormalize, up to rounding).
        renormalize: divide the k selected weights by their sum (+ renorm_epsilon).
        renorm_epsilon: added to that sum (DeepSeek-V3: 1e-20; others 0).
        n_group, topk_group: group-limited selection: experts split into n_group equal groups, only the topk_group
            best groups compete (1, 1: plain top-k).
        group_score: "max" (DeepSeek-V2: a group's largest score) or "top2_sum" (DeepSeek-V3: the sum of its two
            largest selection scores).
        scaling: routed_scaling_factor, multiplies the final weights.
        bias: a router bias (experts,) added to the logits (gpt-oss).
        correction_bias: a score-correction bias (experts,) added to the scores for the selection only; the
            weights use the uncorrected scores (DeepSeek-V3 `e_score_correction_bias`).
    Ties go to the lower expert index.
    """

    scoring: str = "softmax"
    order: str = "softmax_topk"
    renormalize: bool = False
    renorm_epsilon: float = 0.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    scaling: float = 1.0
    bias: bool = False
    correction_bias: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """The routed experts. activation: "silu" (down(silu(gate x) ⊙ up x)) or "swiglu_clamped" (gpt-oss:
    gate ← min(gate, limit), up ← clip(up, -limit, limit), down(gate·sigmoid(alpha·gate)·(up + 1)));
    bias: gate/up/down biases (gpt-oss)."""

    intermediate_size: int
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False


@dataclasses.dataclass(frozen=True)
class SharedSpec:
    """An always-on SwiGLU expert added to the routed output. gated: scaled by sigmoid(g · x) with g (hidden,)
    (Qwen2-MoE `shared_expert_gate`); otherwise added as it is (DeepSeek `shared_experts`)."""

    intermediate_size: int
    gated: bool


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What config.json says about the MoE part of a model.

    Attributes:
        family: the config's `model_type`.
        num_layers: the model's decoder layer count (`num_hidden_layers`).
        moe_layers: the model layer index of every MoE layer, ascending (the file's layers, in order).
        dense_layers: the model layers with a dense MLP instead (left out of the file).
        num_experts, top_k, hidden_size: routed expert count, experts per token, model width.
        expert, router, shared: see ExpertSpec, RouterSpec, SharedSpec (None: no shared expert).
        keys: size name → the config key it was read from (quoted in errors).
        extra_layers: checkpoint layers past num_layers that the config declares and the converter leaves out
            (DeepSeek-V3 `num_nextn_predict_layers`, the multi-token-prediction layers).
        notes: facts about the model the file does not hold (e.g. GraniteMoE's residual_multiplier).
    """

    family: str
    num_layers: int
    moe_layers: tuple
    dense_layers: tuple
    num_experts: int
    top_k: int
    hidden_size: int
    expert: ExpertSpec
    router: RouterSpec
    shared: SharedSpec | None
    keys: dict
    extra_layers: int = 0
    notes: tuple = ()

    @property
    def intermediate_size(self) -> int:
        return self.expert.intermediate_size


# ---- reading keys ------------------------------------------------------------------------------------------------
def _first_key(config: dict, keys: tuple[str, ...], what: str, family: str) -> tuple[str, object]:
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    raise ConvertError(f"{family}: config.json has no {what} (looked for {', '.join(keys)})")


def _size(config: dict, keys: tuple[str, ...], what: str, family: str, low: int = 1) -> tuple[str, int]:
    key, value = _first_key(config, keys, what, family)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= U16_MAX:
        raise ConvertError(f"{family}: config.json {key} = {_value(value)}; allowed: an integer in {low}..{U16_MAX}")
    return key, value


def _flag(config: dict, key: str, default: bool, family: str) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConvertError(f"{family}: config.json {key} = {_value(value)}; allowed: true, false")
    return value


def _number(config: dict, key: str, default: float, family: str) -> float:
    value = config.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise ConvertError(f"{family}: config.json {key} = {_value(value)}; allowed: a positive number")
    return float(value)


def _silu(config: dict, family: str) -> None:
    act = config.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ConvertError(
            f"{family}: config.json hidden_act = {_value(act)}: experts must be SwiGLU with SiLU; allowed: "
            f"{', '.join(SILU_NAMES)}"
        )


# Keys that some families read and others ignore: a non-neutral value in a family that ignores them means the
# checkpoint is not what that family's transformers class computes. key → (neutral values, what it means).
FOREIGN_KEYS = {
    "n_shared_experts": ((None, 0), "shared experts (converts as deepseek_v2 / deepseek_v3)"),
    "shared_expert_intermediate_size": ((None, 0), "a shared expert (converts as qwen2_moe)"),
    "scoring_func": ((None, "softmax"), "non-softmax routing (sigmoid routing converts as deepseek_v3)"),
    "topk_method": ((None, "greedy"), "grouped top-k routing (converts as deepseek_v2 / deepseek_v3)"),
    "n_group": ((None, 1), "grouped routing (converts as deepseek_v2 / deepseek_v3)"),
    "topk_group": ((None, 1), "grouped routing (converts as deepseek_v2 / deepseek_v3)"),
    "routed_scaling_factor": ((None, 1, 1.0), "scaled routing weights (converts as deepseek_v2 / deepseek_v3)"),
    "decoder_sparse_step": ((None, 1), "dense MLP layers between MoE layers (converts as qwen2_moe / qwen3_moe)"),
    "mlp_only_layers": ((None, []), "dense MLP layers (converts as qwen2_moe / qwen3_moe)"),
    "first_k_dense_replace": ((None, 0), "leading dense layers (converts as deepseek_v2 / deepseek_v3)"),
    "moe_layer_freq": ((None, 1), "dense MLP layers between MoE layers; not supported"),
    "mlp_bias": ((None, False), "MLP biases (only gpt_oss experts carry biases)"),
    "router_bias": ((None, False), "a router bias (only gpt_oss carries one)"),
    "moe_bias": ((None, False), "expert biases (only gpt_oss experts carry biases)"),
}


def _refuse_foreign(config: dict, family: str, read: tuple[str, ...]) -> None:
    for key, (neutral, meaning) in FOREIGN_KEYS.items():
        value = config.get(key)
        if key in read or value is None or any(value == n for n in neutral if n is not None):
            continue
        allowed = " or ".join(repr(n) for n in neutral if n is not None)
        raise ConvertError(
            f"{family}: config.json {key} = {_value(value)} means {meaning}, which transformers' {family} model "
            f"ignores: the checkpoint is not a plain {family}; allowed: {allowed} or absent"
        )


def _moe_sizes(config: dict, family: str, experts_keys, inter_keys) -> dict:
    keys = {}
    keys["num_layers"], num_layers = _size(config, ("num_hidden_layers",), "layer count", family)
    keys["num_experts"], num_experts = _size(config, experts_keys, "expert count", family)
    keys["top_k"], top_k = _size(config, ("num_experts_per_tok",), "top-k", family)
    keys["hidden_size"], hidden = _size(config, ("hidden_size",), "hidden size", family)
    keys["intermediate_size"], inter = _size(config, inter_keys, "expert intermediate size", family)
    if top_k > num_experts:
        raise ConvertError(
            f"{family}: config.json {keys['top_k']} = {top_k} exceeds {keys['num_experts']} = {num_experts}; "
            f"allowed: 1..{num_experts}"
        )
    return dict(keys=keys, num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=hidden, inter=inter)


def _spec(family, sizes, moe_layers, router, *, shared=None, expert=None, extra_layers=0, notes=()) -> ModelSpec:
    L = sizes["num_layers"]
    if not moe_layers:
        raise ConvertError(f"{family}: config.json leaves no MoE layer among its {L} layers; nothing to convert")
    expert = expert or ExpertSpec(sizes["inter"])
    moe = set(moe_layers)  # built once: up to 65535 layers
    return ModelSpec(
        family=family, num_layers=L, moe_layers=tuple(moe_layers),
        dense_layers=tuple(l for l in range(L) if l not in moe), num_experts=sizes["num_experts"],
        top_k=sizes["top_k"], hidden_size=sizes["hidden_size"], expert=expert, router=router, shared=shared,
        keys=sizes["keys"], extra_layers=extra_layers, notes=tuple(notes),
    )


# ---- families ----------------------------------------------------------------------------------------------------
def _mixtral(config: dict, family: str) -> ModelSpec:
    _refuse_foreign(config, family, ())
    _silu(config, family)
    sizes = _moe_sizes(config, family, ("num_local_experts",), ("intermediate_size",))
    router = RouterSpec(order="softmax_topk", renormalize=True)
    return _spec(family, sizes, range(sizes["num_layers"]), router)


def _granitemoe(config: dict, family: str) -> ModelSpec:
    _refuse_foreign(config, family, ())
    _silu(config, family)
    sizes = _moe_sizes(config, family, ("num_local_experts",), ("intermediate_size",))
    notes = []
    mult = config.get("residual_multiplier", 1.0)
    if mult not in (None, 1, 1.0):
        notes.append(
            f"residual_multiplier = {_value(mult)}: the decoder adds residual_multiplier × the MoE output; the file holds "
            f"the MoE block itself"
        )
    return _spec(family, sizes, range(sizes["num_layers"]), RouterSpec(order="topk_softmax"), notes=notes)


def _olmoe_qwen(config: dict, family: str) -> ModelSpec:
    read = ("decoder_sparse_step", "mlp_only_layers") if family != "olmoe" else ()
    if family == "qwen2_moe":
        read += ("shared_expert_intermediate_size",)
    _refuse_foreign(config, family, read)
    _silu(config, family)
    inter_keys = ("intermediate_size",) if family == "olmoe" else ("moe_intermediate_size",)
    sizes = _moe_sizes(config, family, ("num_experts", "num_local_experts"), inter_keys)
    norm = _flag(config, "norm_topk_prob", False, family)
    L = sizes["num_layers"]
    layers = list(range(L))
    if family != "olmoe":
        step = config.get("decoder_sparse_step", 1)
        if step is None:
            step = 1
        if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= U16_MAX:
            raise ConvertError(f"{family}: config.json decoder_sparse_step = {_value(step)}; allowed: an integer >= 1")
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in only):
            raise ConvertError(f"{family}: config.json mlp_only_layers = {_value(only)}; allowed: a list of layer indices")
        dense = set(only)
        layers = [l for l in layers if l not in dense and (l + 1) % step == 0]
    shared = None
    if family == "qwen2_moe":
        key, size = _size(config, ("shared_expert_intermediate_size",), "shared expert size", family)
        sizes["keys"]["shared_intermediate_size"] = key
        shared = SharedSpec(size, gated=True)
    return _spec(family, sizes, layers, RouterSpec(order="softmax_topk", renormalize=norm), shared=shared)


def _deepseek(config: dict, family: str) -> ModelSpec:
    v2 = family == "deepseek_v2"
    read = ("n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
            "scoring_func", "topk_method")
    if config.get("mlp_bias"):
        raise ConvertError(
            f"{family}: config.json mlp_bias = {_value(config['mlp_bias'])}: biases on the shared and dense MLPs are not "
            f"held by .colibri (only gpt_oss-style routed-expert biases are); allowed: false"
        )
    _refuse_foreign(config, family, read)
    _silu(config, family)
    sizes = _moe_sizes(config, family, ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",))
    L = sizes["num_layers"]
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        raise ConvertError(
            f"{family}: config.json quantization_config.quant_method = 'fp8': block-scaled FP8 weights are not "
            f"imported; convert a bf16 copy (dequantize with transformers or DeepSeek's fp8_cast_bf16.py first)"
        )
    scoring = config.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    expected = "softmax" if v2 else "sigmoid"
    if scoring != expected:
        raise ConvertError(
            f"{family}: config.json scoring_func = {_value(scoring)}, but transformers' {family} router uses {expected}; "
            f"allowed: {expected!r} or absent"
        )
    method = config.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    if method not in methods:
        raise ConvertError(
            f"{family}: config.json topk_method = {_value(method)}; allowed: {', '.join(repr(m) for m in methods)}"
        )
    n_group, topk_group = _groups(config, family, sizes) if not v2 or method == "group_limited_greedy" else (1, 1)
    norm = _flag(config, "norm_topk_prob", False if v2 else True, family)
    if v2 and norm:
        raise ConvertError(
            f"{family}: config.json norm_topk_prob = true: transformers' DeepseekV2TopkRouter ignores it while "
            f"DeepSeek's own code renormalises instead of scaling, so the checkpoint's meaning is ambiguous; "
            f"allowed: false"
        )
    scaling = _number(config, "routed_scaling_factor", 1.0, family)
    router = RouterSpec(
        scoring=scoring, order="softmax_topk", renormalize=norm, renorm_epsilon=0.0 if v2 else 1e-20,
        n_group=n_group, topk_group=topk_group, group_score="max" if v2 else "top2_sum", scaling=scaling,
        correction_bias=not v2,
    )
    first = 0
    if config.get("first_k_dense_replace") is not None:
        _, first = _size(config, ("first_k_dense_replace",), "leading dense layer count", family, low=0)
    shared = None
    n_shared = config.get("n_shared_experts")
    if n_shared:
        _, n_shared = _size(config, ("n_shared_experts",), "shared expert count", family)
        shared = SharedSpec(n_shared * sizes["inter"], gated=False)
        sizes["keys"]["shared_intermediate_size"] = "n_shared_experts × moe_intermediate_size"
    extra = config.get("num_nextn_predict_layers") or 0
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
        raise ConvertError(f"{family}: config.json num_nextn_predict_layers = {_value(extra)}; allowed: an integer >= 0")
    return _spec(family, sizes, range(min(first, L), L), router, shared=shared, extra_layers=extra)


def _groups(config: dict, family: str, sizes: dict) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited DeepSeek router, checked against the expert count and top-k."""
    E, v2 = sizes["num_experts"], family == "deepseek_v2"
    _, n_group = _size(config, ("n_group",), "group count (n_group)", family)
    _, topk_group = _size(config, ("topk_group",), "selected group count (topk_group)", family)
    if E % n_group or topk_group > n_group:
        raise ConvertError(
            f"{family}: config.json n_group = {n_group}, topk_group = {topk_group} with {E} experts; allowed: "
            f"n_group dividing {E}, topk_group <= n_group"
        )
    per_group = E // n_group
    if not v2 and per_group < 2:
        raise ConvertError(
            f"{family}: config.json n_group = {n_group} leaves {per_group} expert per group; the group score is "
            f"the sum of a group's two best experts; allowed: n_group <= {E // 2}"
        )
    if sizes["top_k"] > topk_group * per_group:
        raise ConvertError(
            f"{family}: config.json num_experts_per_tok = {sizes['top_k']} exceeds the {topk_group * per_group} "
            f"experts of the topk_group = {topk_group} selected groups; allowed: 1..{topk_group * per_group}"
        )
    return n_group, topk_group


def _gpt_oss(config: dict, family: str) -> ModelSpec:
    _refuse_foreign(config, family, ())
    sizes = _moe_sizes(config, family, ("num_local_experts",), ("intermediate_size",))
    alpha = _number(config, "swiglu_alpha", 1.702, family)
    limit = _number(config, "swiglu_limit", 7.0, family)
    expert = ExpertSpec(sizes["inter"], activation="swiglu_clamped", alpha=alpha, limit=limit, bias=True)
    router = RouterSpec(order="topk_softmax", bias=True)
    return _spec(family, sizes, range(sizes["num_layers"]), router, expert=expert)


_PARSERS = {
    "mixtral": _mixtral, "granitemoe": _granitemoe, "olmoe": _olmoe_qwen, "qwen3_moe": _olmoe_qwen,
    "qwen2_moe": _olmoe_qwen, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "glm4_moe": _deepseek,
    "gpt_oss": _gpt_oss,
}


def model_spec(config: dict) -> ModelSpec:
    """Read the MoE layers, sizes, router and shared expert from a parsed config.json.

    Raises:
        ConvertError: starting with the model type: an unsupported or refused `model_type` (with the reason and
            what would work), a key the family's transformers class would ignore but which changes the model, a
            missing or out-of-range size key, inconsistent routing keys, or top_k > num_experts.
    """
    family = config.get("model_type")
    if not isinstance(family, str):  # a list or an object would not even be a dict key
        raise ConvertError(
            f"config.json model_type = {family!r:.80}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if family in REFUSED_MODEL_TYPES:
        raise ConvertError(f"{family}: {REFUSED_MODEL_TYPES[family]}")
    if family not in _PARSERS:
        raise ConvertError(
            f"config.json model_type = {_value(family)} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _PARSERS[family](config, family)
