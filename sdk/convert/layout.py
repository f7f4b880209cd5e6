"""Where each .colibri tensor comes from in a checkpoint: tensor names, expert layout, refusals.

Two expert layouts are recognised per layer, under the block prefix `<root>layers.<L>.<block>.` with
<block> = `block_sparse_moe` (Mixtral) or `mlp` (Qwen-MoE, OLMoE, and Mixtral in transformers >= 5 memory):

  per-expert  experts.<E>.w1/w3/w2.weight  or  experts.<E>.gate_proj/up_proj/down_proj.weight
              (gate, up: (intermediate, hidden); down: (hidden, intermediate))      — what save_pretrained writes
  fused       experts.gate_up_proj (experts, 2*intermediate, hidden), gate rows first;
              experts.down_proj (experts, hidden, intermediate)       — transformers' in-memory `*Experts` modules

The router is `gate.weight` (experts, hidden); .colibri stores it transposed, (hidden, experts).
Expert indices are parsed as integers, so expert 10 follows expert 9, never expert 1.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConvertError
from .families import ModelSpec

ROUTER_RE = re.compile(r"^(?P<root>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp)\.gate\.weight$")
EXPERT_RE = re.compile(r"^experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
PER_EXPERT_NAMES = {
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
}
FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"


@dataclasses.dataclass(frozen=True)
class Source:
    """One .colibri tensor's origin: checkpoint tensor `name`, an optional index into it, and whether the
    result must be transposed (the router)."""

    name: str
    index: tuple | None = None
    transpose: bool = False

    @property
    def label(self) -> str:
        """The tensor name with its slice, for messages: `...experts.gate_up_proj[3, :48]`."""
        if self.index is None:
            return self.name
        parts = []
        for item in self.index:
            if isinstance(item, slice):
                parts.append(f"{'' if item.start is None else item.start}:{'' if item.stop is None else item.stop}")
            else:
                parts.append(str(item))
        return f"{self.name}[{', '.join(parts)}]"


@dataclasses.dataclass(frozen=True)
class Layout:
    """sources[(kind, layer, expert)] → Source, for every tensor of the .colibri file; `style`: per-expert | fused."""

    sources: dict
    style: str


def _shape_error(name: str, shape, expected, spec: ModelSpec, what: str) -> ConvertError:
    k = spec.keys
    return ConvertError(
        f"tensor {name!r} has shape {tuple(shape)}; expected {tuple(expected)} {what} from config.json "
        f"({k['hidden_size']}={spec.hidden_size}, {k['intermediate_size']}={spec.intermediate_size}, "
        f"{k['num_experts']}={spec.num_experts})"
    )


def _refuse_leftover(names: list[str]) -> None:
    """Explain why tensors in a MoE block were not used."""
    for name in names:
        if "shared_expert" in name:
            raise ConvertError(f"tensor {name!r}: shared experts are not representable in .colibri v1")
        if name.endswith("e_score_correction_bias"):
            raise ConvertError(
                f"tensor {name!r}: biased / grouped routing (DeepSeek) is not representable in .colibri v1"
            )
        if name.endswith(".bias") or name.endswith("_bias"):
            raise ConvertError(f"tensor {name!r}: biases are not representable in .colibri v1 (experts and router are bias-free)")
    raise ConvertError(
        f"unexpected tensor {names[0]!r} in a MoE block ({len(names)} unused); the format holds only the router "
        f"and SwiGLU expert weights"
    )


def plan(tensors: dict, spec: ModelSpec) -> Layout:
    """Map every (kind, layer, expert) of the .colibri file to its checkpoint tensor.

    Args:
        tensors: name → TensorInfo (shape, dtype) for the whole checkpoint.
        spec: sizes and routing from config.json.

    Raises:
        ConvertError: a layer without a MoE router (a dense layer), a missing or extra expert tensor, a shape that
            does not match config.json, a bias, a shared expert, or any other tensor inside a MoE block.
    """
    routers: dict[int, tuple[str, str]] = {}
    for name in tensors:
        m = ROUTER_RE.match(name)
        if m:
            layer = int(m["layer"])
            prefix = f"{m['root']}layers.{layer}.{m['block']}."
            if layer in routers:
                raise ConvertError(f"layer {layer} has two routers: {routers[layer][1]!r} and {name!r}")
            routers[layer] = (prefix, name)
    if not routers:
        raise ConvertError("no MoE router found (no tensor named like 'model.layers.0.mlp.gate.weight')")
    extra_layers = sorted(set(routers) - set(range(spec.num_layers)))
    if extra_layers:
        raise ConvertError(
            f"router {routers[extra_layers[0]][1]!r} belongs to layer {extra_layers[0]}, but config.json "
            f"{spec.keys['num_layers']} = {spec.num_layers}"
        )
    sources: dict = {}
    styles = set()
    for layer in range(spec.num_layers):
        if layer not in routers:
            some = next(iter(routers.values()))[1]
            raise ConvertError(
                f"layer {layer} has no MoE router (expected a tensor like {some!r} for layer {layer}): "
                f"dense layers between MoE layers are not representable"
            )
        prefix, router = routers[layer]
        styles.add(_plan_layer(tensors, spec, layer, prefix, router, sources))
    if len(styles) > 1:
        raise ConvertError(f"layers mix expert layouts {sorted(styles)}; expected one layout for the whole checkpoint")
    return Layout(sources, styles.pop())


def _plan_layer(tensors: dict, spec: ModelSpec, layer: int, prefix: str, router: str, sources: dict) -> str:
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    block = {name[len(prefix):]: info for name, info in tensors.items() if name.startswith(prefix)}
    used = {"gate.weight"}
    if tensors[router].shape != (E, H):
        raise _shape_error(router, tensors[router].shape, (E, H), spec, "(experts, hidden)")
    sources[("router", layer, None)] = Source(router, transpose=True)

    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    if FUSED_GATE_UP in block or FUSED_DOWN in block:
        style = "fused"
        for key, shape in ((FUSED_GATE_UP, (E, 2 * I, H)), (FUSED_DOWN, (E, H, I))):
            if key not in block:
                raise ConvertError(f"tensor {prefix + key!r} is missing (the fused expert layout needs both "
                                   f"{FUSED_GATE_UP} and {FUSED_DOWN})")
            if block[key].shape != shape:
                raise _shape_error(prefix + key, block[key].shape, shape, spec, "(fused experts)")
            used.add(key)
        for e in range(E):
            sources[("gate_proj", layer, e)] = Source(prefix + FUSED_GATE_UP, (e, slice(0, I)))
            sources[("up_proj", layer, e)] = Source(prefix + FUSED_GATE_UP, (e, slice(I, 2 * I)))
            sources[("down_proj", layer, e)] = Source(prefix + FUSED_DOWN, (e,))
    else:
        style = "per-expert"
        found: dict[tuple[str, int], str] = {}
        for sub in block:
            m = EXPERT_RE.match(sub)
            if not m or m["proj"] not in PER_EXPERT_NAMES:
                continue
            expert, kind = int(m["expert"]), PER_EXPERT_NAMES[m["proj"]]
            name = prefix + sub
            if expert >= E:
                raise ConvertError(
                    f"extra expert tensor {name!r}: expert {expert} >= config.json {spec.keys['num_experts']} = {E}"
                )
            if (kind, expert) in found:
                raise ConvertError(f"expert {expert} of layer {layer} has two {kind} tensors: {found[(kind, expert)]!r} and {name!r}")
            if tensors[name].shape != shapes[kind]:
                raise _shape_error(name, tensors[name].shape, shapes[kind], spec, f"({kind})")
            found[(kind, expert)] = name
            used.add(sub)
        names = ("w1", "w3", "w2") if "block_sparse_moe" in prefix else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            for kind, short in zip(("gate_proj", "up_proj", "down_proj"), names):
                if (kind, e) not in found:
                    raise ConvertError(f"missing expert tensor {prefix}experts.{e}.{short}.weight ({kind} of expert {e}, layer {layer})")
                sources[(kind, layer, e)] = Source(found[(kind, e)])
    leftover = sorted(set(block) - used)
    if leftover:
        _refuse_leftover([prefix + sub for sub in leftover])
    return style
