"""Where each .colibri tensor comes from in a Hugging Face checkpoint: tensor names per family, expert layouts,
the layer map, refusals.

Names under the block prefix `<root>layers.<L>.<block>.` (what `save_pretrained` writes in transformers 5.x, and
the in-memory names of its fused `*Experts` modules):

| family | block | router | routed experts | shared expert |
|---|---|---|---|---|
| mixtral | `block_sparse_moe` / `mlp` | `gate.weight` | `experts.E.w1/w3/w2.weight` | — |
| qwen*_moe, olmoe, deepseek_*, glm4_moe | `mlp` | `gate.weight` (+ `gate.e_score_correction_bias`: DeepSeek-V3, GLM) | `experts.E.gate_proj/up_proj/down_proj.weight` | `shared_expert.*` + `shared_expert_gate.weight` (Qwen2-MoE), `shared_experts.*` (DeepSeek, GLM) |
| granitemoe | `block_sparse_moe` | `router.layer.weight` / `router.weight` | `input_linear.weight` (E, 2I, H) gate rows first, `output_linear.weight` (E, H, I) | — |
| gpt_oss | `mlp` | `router.weight`, `router.bias` | `experts.gate_up_proj` (E, H, 2I) gate/up **interleaved** along the last axis, `experts.gate_up_proj_bias` (E, 2I), `experts.down_proj` (E, I, H), `experts.down_proj_bias` (E, H); or MXFP4 `*_blocks` / `*_scales` | — |

The fused layout of every other family (`experts.gate_up_proj` (E, 2I, H) gate rows first, `experts.down_proj`
(E, H, I)) is read as well. Expert matrices are stored as `nn.Linear` weights (out, in); the router as (hidden,
experts). Expert indices are parsed as integers (expert 10 follows expert 9). compressed-tensors checkpoints name a
quantized Linear `<name>.weight_packed` / `.weight_scale` / `.weight_zero_point` / `.weight_shape` instead of
`<name>.weight` (compressed.py reads them).
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConvertError
from .families import ModelSpec

LAYER_RE = re.compile(r"^(?P<root>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
EXPERT_RE = re.compile(r"^experts\.(?P<expert>\d+)\.(?P<proj>\w+?)\.(?P<param>weight|weight_packed)$")
PER_EXPERT_NAMES = {
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
}
# Companion tensors of a compressed-tensors quantized Linear (consumed with its `weight_packed`).
PACKED_COMPANIONS = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
MOE_BLOCKS = ("block_sparse_moe", "mlp")
ROUTER_NAMES = ("gate.weight", "router.weight", "router.layer.weight")


@dataclasses.dataclass(frozen=True)
class Source:
    """One .colibri tensor's origin.

    Attributes:
        name: the checkpoint tensor (for a quantized source: its main tensor, `*_blocks` or `*.weight_packed`).
        index: leading indices into it (one expert of a fused tensor), or None.
        transform: applied after reading: None, "T" (transpose), "even_cols_T" / "odd_cols_T" (gpt-oss interleaved
            gate / up columns, then transposed), "even_rows" / "odd_rows" (the same for a (2I, H) matrix), "even" /
            "odd" (interleaved bias), "even_cols" / "odd_cols" (interleaved (E, 2I) biases), "flat" ((1, H) → (H,)),
            "first_rows" / "last_rows" (gate-first fused (2I, H)).
        quant: None (a float tensor), "mxfp4" (gpt-oss blocks + scales) or "pack_quantized" (compressed-tensors).
        aux: the companion tensor names of a quantized source (mxfp4: (scales,); pack_quantized: (scale,
            zero_point or "", shape or "")).
    """

    name: str
    index: tuple | None = None
    transform: str | None = None
    quant: str | None = None
    aux: tuple = ()

    @property
    def label(self) -> str:
        """The tensor name with its index, for messages: `...experts.gate_up_proj[3]`."""
        if self.index is None:
            return self.name
        return f"{self.name}[{', '.join(str(i) for i in self.index)}]"


@dataclasses.dataclass(frozen=True)
class Layout:
    """sources[(kind, file_layer, index)] → Source for every tensor of the .colibri file (index: expert, shared
    expert, or None for per-layer vectors); `style`: per-expert | fused | gpt-oss | granite; `left_out`: model
    layer → why it is not in the file."""

    sources: dict
    style: str
    left_out: dict


def _shape_error(spec: ModelSpec, name: str, shape, expected, what: str) -> ConvertError:
    k = spec.keys
    return ConvertError(
        f"{spec.family}: tensor {name!r} has shape {tuple(shape)}; expected {tuple(expected)} {what} from config.json "
        f"({k['hidden_size']}={spec.hidden_size}, {k['intermediate_size']}={spec.intermediate_size}, "
        f"{k['num_experts']}={spec.num_experts})"
    )


def _refuse_leftover(spec: ModelSpec, names: list[str]) -> None:
    """Explain why tensors in a MoE block were not used, naming the family first."""
    f = spec.family
    for name in names:
        if "shared_expert" in name:
            raise ConvertError(
                f"{f}: tensor {name!r} is a shared expert, which {f} does not have (config.json declares none); "
                f"models with shared experts convert as qwen2_moe, deepseek_v2, deepseek_v3 or glm4_moe"
            )
        if name.endswith("e_score_correction_bias"):
            raise ConvertError(
                f"{f}: tensor {name!r} is a DeepSeek-V3 score-correction bias, which {f} routing does not use; "
                f"sigmoid routing with a correction bias converts as deepseek_v3 or glm4_moe"
            )
        if name.endswith(".bias") or name.endswith("_bias"):
            raise ConvertError(
                f"{f}: tensor {name!r} is a bias, which {f} experts and router do not have; only gpt_oss carries "
                f"router and expert biases"
            )
    raise ConvertError(
        f"{f}: unexpected tensor {names[0]!r} in a MoE block ({len(names)} unused); a {f} MoE block holds only "
        f"{_expected_names(spec)}"
    )


def _expected_names(spec: ModelSpec) -> str:
    if spec.family == "gpt_oss":
        return "router.weight/bias and experts.gate_up_proj(_bias), experts.down_proj(_bias)"
    if spec.family == "granitemoe":
        return "router.layer.weight, input_linear.weight and output_linear.weight"
    extra = ""
    if spec.shared is not None:
        extra = " and the shared expert" + (" with its gate" if spec.shared.gated else "")
    return f"the router and the SwiGLU expert weights{extra}"


def _find_layers(tensors: dict) -> tuple[str, dict[int, dict[str, str]]]:
    """(root, {model layer: {name inside the layer: full name}})."""
    roots: set[str] = set()
    layers: dict[int, dict[str, str]] = {}
    for name in tensors:
        m = LAYER_RE.match(name)
        if m:
            roots.add(m["root"])
            layers.setdefault(module_index(m["layer"], name, "layer"), {})[m["rest"]] = name
    return (roots.pop() if len(roots) == 1 else ""), layers


def module_index(text: str, name: str, what: str) -> int:
    """The layer or expert number of a tensor name, spelled as `nn.ModuleList` writes it (`str(i)`: `layers.1.`).

    A leading zero (`layers.01.`), or digits other than ASCII ones (`layers.１.`), is refused rather than read as 1: no PyTorch state dict spells an index that way
    (`load_state_dict` would not load such a name into the model), and `layers.1.` next to `layers.01.` would make
    two tensors claim one module.

    Raises:
        ConvertError: naming the tensor and the index.
    """
    if not text.isascii():  # `\d` matches every Unicode digit: 'layers.１.' (fullwidth) or 'layers.١.' (Arabic-Indic)
        raise ConvertError(
            f"tensor {name!r}: {what} index {text!r} is not in ASCII digits; allowed: the index as nn.ModuleList "
            f"writes it ('{what}s.{int(text)}.')"
        )
    if text != "0" and text.startswith("0"):
        raise ConvertError(
            f"tensor {name!r}: {what} index {text!r} has a leading zero; allowed: the index as nn.ModuleList writes it "
            f"('{what}s.{int(text)}.')"
        )
    return int(text)


def _router_of(layer_tensors: dict[str, str]) -> tuple[str, str] | None:
    """(block prefix inside the layer, router name inside the layer) of a MoE layer, or None (a dense layer)."""
    for block in MOE_BLOCKS:
        for router in ROUTER_NAMES:
            key = f"{block}.{router}"
            if key in layer_tensors:
                return block + ".", key
    return None


def plan(tensors: dict, spec: ModelSpec) -> Layout:
    """Map every (kind, file layer, index) of the .colibri file to its checkpoint tensor.

    File layer l is model layer spec.moe_layers[l]; the dense layers of spec.dense_layers and the extra layers
    (DeepSeek multi-token prediction) are left out and listed in Layout.left_out.

    Raises:
        ConvertError: starting with the model type: a layer the config calls MoE without a router, a router in a
            layer the config calls dense, a missing or extra expert tensor, a shape that does not match
            config.json, or a tensor inside a MoE block that the family does not have.
    """
    root, layers = _find_layers(tensors)
    f = spec.family
    roots = sorted({m["root"] for m in map(LAYER_RE.match, tensors) if m})
    if len(roots) > 1:
        shown = ", ".join(repr(r + "layers.N") for r in roots[:3]) + (", ..." if len(roots) > 3 else "")
        raise ConvertError(
            f"{f}: the checkpoint has decoder layers under {len(roots)} roots ({shown}); expected one, as "
            f"save_pretrained writes (e.g. 'model.layers.N')"
        )
    if not any(_router_of(t) for t in layers.values()):
        raise ConvertError(f"{f}: no MoE router found (no tensor named like 'model.layers.0.mlp.gate.weight')")
    left_out: dict[int, str] = {}
    for layer in sorted(layers):
        found = _router_of(layers[layer])
        if layer >= spec.num_layers:
            if layer < spec.num_layers + spec.extra_layers:
                left_out[layer] = "multi-token-prediction layer (num_nextn_predict_layers)"
                continue
            raise ConvertError(
                f"{f}: tensors of layer {layer} are in the checkpoint, but config.json "
                f"{spec.keys['num_layers']} = {spec.num_layers}"
            )
        if layer in spec.dense_layers:
            if found:
                raise ConvertError(
                    f"{f}: layer {layer} has a MoE router ({root}layers.{layer}.{found[1]}), but config.json makes it "
                    f"a dense layer ({_dense_keys(spec)})"
                )
            left_out[layer] = "dense MLP layer"
    for layer in spec.dense_layers:
        left_out.setdefault(layer, "dense MLP layer")
    sources: dict = {}
    styles = set()
    for file_layer, layer in enumerate(spec.moe_layers):
        found = _router_of(layers.get(layer, {}))
        if found is None:
            raise ConvertError(
                f"{f}: layer {layer} has no MoE router (expected a tensor like {root}layers.{layer}.mlp.gate.weight), "
                f"but config.json makes it a MoE layer ({_dense_keys(spec)})"
            )
        prefix = f"{root}layers.{layer}.{found[0]}"
        block = {name[len(prefix):]: name for name in tensors if name.startswith(prefix)}
        styles.add(_plan_layer(tensors, spec, file_layer, layer, prefix, block, found[1][len(found[0]):], sources))
    if len(styles) > 1:
        raise ConvertError(f"{f}: layers mix expert layouts {sorted(styles)}; expected one layout for the whole checkpoint")
    return Layout(sources, styles.pop(), dict(sorted(left_out.items())))


def _dense_keys(spec: ModelSpec) -> str:
    if spec.family in ("qwen2_moe", "qwen3_moe"):
        return "mlp_only_layers / decoder_sparse_step"
    if spec.family in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        return "first_k_dense_replace"
    return f"every {spec.family} layer is a MoE layer"


def _check(spec: ModelSpec, tensors: dict, name: str, expected: tuple, what: str) -> None:
    info = tensors[name]
    shape = info.shape
    if name.endswith(".weight_packed"):
        return  # shape checked against weight_shape when read (compressed.py)
    if shape != expected:
        raise _shape_error(spec, name, shape, expected, what)


def _plan_layer(tensors, spec: ModelSpec, fl: int, layer: int, prefix: str, block: dict, router: str, sources) -> str:
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    used = {router}
    _check(spec, tensors, block[router], (E, H), "(experts, hidden)")
    sources[("router", fl, None)] = _float_or_packed(block, router, transform="T")
    if spec.router.bias:
        used.add(_need(spec, block, prefix, "router.bias", tensors, (E,)))
        sources[("router_bias", fl, None)] = Source(block["router.bias"])
    if spec.router.correction_bias:
        used.add(_need(spec, block, prefix, "gate.e_score_correction_bias", tensors, (E,)))
        sources[("correction_bias", fl, None)] = Source(block["gate.e_score_correction_bias"])
    if spec.family == "gpt_oss":
        style = _plan_gpt_oss(tensors, spec, fl, prefix, block, used, sources)
    elif "input_linear.weight" in block or "output_linear.weight" in block:
        style = "granite"
        for key, shape in (("input_linear.weight", (E, 2 * I, H)), ("output_linear.weight", (E, H, I))):
            used.add(_need(spec, block, prefix, key, tensors, shape))
        for e in range(E):
            sources[("gate_proj", fl, e)] = Source(block["input_linear.weight"], (e,), "first_rows")
            sources[("up_proj", fl, e)] = Source(block["input_linear.weight"], (e,), "last_rows")
            sources[("down_proj", fl, e)] = Source(block["output_linear.weight"], (e,))
    elif "experts.gate_up_proj" in block or "experts.down_proj" in block:
        style = "fused"
        for key, shape in (("experts.gate_up_proj", (E, 2 * I, H)), ("experts.down_proj", (E, H, I))):
            used.add(_need(spec, block, prefix, key, tensors, shape))
        for e in range(E):
            sources[("gate_proj", fl, e)] = Source(block["experts.gate_up_proj"], (e,), "first_rows")
            sources[("up_proj", fl, e)] = Source(block["experts.gate_up_proj"], (e,), "last_rows")
            sources[("down_proj", fl, e)] = Source(block["experts.down_proj"], (e,))
    else:
        style = "per-expert"
        _plan_per_expert(tensors, spec, fl, layer, prefix, block, used, sources)
    if spec.shared is not None:
        _plan_shared(tensors, spec, fl, prefix, block, used, sources)
    leftover = sorted(set(block) - used)
    if leftover:
        _refuse_leftover(spec, [prefix + sub for sub in leftover])
    return style


def _need(spec: ModelSpec, block: dict, prefix: str, key: str, tensors, shape) -> str:
    if key not in block:
        raise ConvertError(f"{spec.family}: tensor {prefix + key!r} is missing")
    _check(spec, tensors, block[key], shape, f"({key})")
    return key


def _float_or_packed(block: dict, key: str, transform: str | None = None, index=None) -> Source:
    """A float Linear weight, or (compressed-tensors) its packed form `<name>.weight_packed` + companions."""
    if key in block:
        return Source(block[key], index, transform)
    base = key[: -len(".weight")]
    packed = block[base + ".weight_packed"]
    aux = tuple(block.get(f"{base}.{c}", "") for c in ("weight_scale", "weight_zero_point", "weight_shape"))
    return Source(packed, index, transform, "pack_quantized", aux)


def _mark_linear(block: dict, key: str, used: set) -> bool:
    """Mark a Linear weight (float or packed with companions) as used; False if absent."""
    if key in block:
        used.add(key)
        return True
    base = key[: -len(".weight")]
    if base + ".weight_packed" not in block:
        return False
    used.add(base + ".weight_packed")
    used.update(f"{base}.{c}" for c in PACKED_COMPANIONS if f"{base}.{c}" in block)
    return True


def _plan_per_expert(tensors, spec, fl, layer, prefix, block, used, sources) -> None:
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    found: dict[tuple[str, int], str] = {}
    for sub in block:
        m = EXPERT_RE.match(sub)
        if not m or m["proj"] not in PER_EXPERT_NAMES:
            continue
        expert, kind = module_index(m["expert"], prefix + sub, "expert"), PER_EXPERT_NAMES[m["proj"]]
        if expert >= E:
            raise ConvertError(
                f"{spec.family}: extra expert tensor {prefix + sub!r}: expert {expert} >= config.json "
                f"{spec.keys['num_experts']} = {E}"
            )
        if (kind, expert) in found:
            raise ConvertError(
                f"{spec.family}: expert {expert} of layer {layer} has two {kind} tensors: "
                f"{prefix + found[(kind, expert)]!r} and {prefix + sub!r}"
            )
        _check(spec, tensors, block[sub], shapes[kind], f"({kind})")
        found[(kind, expert)] = sub
    names = ("w1", "w3", "w2") if prefix.endswith("block_sparse_moe.") else ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        for kind, short in zip(("gate_proj", "up_proj", "down_proj"), names):
            if (kind, e) not in found:
                raise ConvertError(
                    f"{spec.family}: missing expert tensor {prefix}experts.{e}.{short}.weight ({kind} of expert {e}, "
                    f"layer {layer})"
                )
            sub = found[(kind, e)]
            key = sub.removesuffix("_packed")
            _mark_linear(block, key, used)
            sources[(kind, fl, e)] = _float_or_packed(block, key)


def _plan_shared(tensors, spec, fl, prefix, block, used, sources) -> None:
    H, Is = spec.hidden_size, spec.shared.intermediate_size
    base = "shared_expert." if spec.shared.gated else "shared_experts."
    for proj, shape in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
        key = f"{base}{proj}.weight"
        if not _mark_linear(block, key, used):
            raise ConvertError(
                f"{spec.family}: tensor {prefix + key!r} is missing (config.json declares a shared expert of size "
                f"{Is})"
            )
        if key in block:
            _check(spec, tensors, block[key], shape, f"(shared {proj}, {spec.keys['shared_intermediate_size']})")
        sources[(f"shared_{proj}", fl, 0)] = _float_or_packed(block, key)
    if spec.shared.gated:
        key = "shared_expert_gate.weight"
        if not _mark_linear(block, key, used):
            raise ConvertError(f"{spec.family}: tensor {prefix + key!r} is missing (Qwen2-MoE gates its shared expert)")
        if key in block:
            _check(spec, tensors, block[key], (1, H), "(shared expert gate)")
        sources[("shared_expert_gate", fl, None)] = _float_or_packed(block, key, transform="flat")


def _plan_gpt_oss(tensors, spec, fl, prefix, block, used, sources) -> str:
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    for key, shape in (("experts.gate_up_proj_bias", (E, 2 * I)), ("experts.down_proj_bias", (E, H))):
        used.add(_need(spec, block, prefix, key, tensors, shape))
    if "experts.gate_up_proj_blocks" in block:
        style = "mxfp4"
        if H % 32 or I % 32:
            raise ConvertError(f"{spec.family}: MXFP4 experts need hidden and intermediate sizes divisible by 32; "
                               f"got {H} and {I}")
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            used.add(_need(spec, block, prefix, f"experts.{proj}_blocks", tensors, (E, rows, cols // 32, 16)))
            used.add(_need(spec, block, prefix, f"experts.{proj}_scales", tensors, (E, rows, cols // 32)))
        for e in range(E):
            for kind, transform in (("gate_proj", "even_rows"), ("up_proj", "odd_rows")):
                sources[(kind, fl, e)] = Source(
                    block["experts.gate_up_proj_blocks"], (e,), transform, "mxfp4", (block["experts.gate_up_proj_scales"],)
                )
            sources[("down_proj", fl, e)] = Source(
                block["experts.down_proj_blocks"], (e,), None, "mxfp4", (block["experts.down_proj_scales"],)
            )
    else:
        style = "gpt-oss"
        for key, shape in (("experts.gate_up_proj", (E, H, 2 * I)), ("experts.down_proj", (E, I, H))):
            used.add(_need(spec, block, prefix, key, tensors, shape))
        for e in range(E):
            sources[("gate_proj", fl, e)] = Source(block["experts.gate_up_proj"], (e,), "even_cols_T")
            sources[("up_proj", fl, e)] = Source(block["experts.gate_up_proj"], (e,), "odd_cols_T")
            sources[("down_proj", fl, e)] = Source(block["experts.down_proj"], (e,), "T")
    sources[("gate_bias", fl, None)] = Source(block["experts.gate_up_proj_bias"], None, "even_cols")
    sources[("up_bias", fl, None)] = Source(block["experts.gate_up_proj_bias"], None, "odd_cols")
    sources[("down_bias", fl, None)] = Source(block["experts.down_proj_bias"])
    return style
