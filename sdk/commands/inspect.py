"""`colibri-sdk inspect FILE|BUNDLE [--json]`: header fields, sizes and per-block offsets of a .colibri file,
or the manifest summary of a bundle."""

from __future__ import annotations

import json
from pathlib import Path

from ..bundle.manifest import HEADER_V2_KEYS, control_character
from ..bundle.reader import HEADER_FIELDS, Bundle, bundle_summary
from ..driver_version import format_driver_version
from ..errors import BundleError, FormatError
from ..format import Header, HeaderV2
from ..format.constants import VERSION_2


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a .colibri file's header and layout, or a bundle's manifest")
    p.add_argument("path", help="a .colibri file or a bundle folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def routing_facts(header: dict) -> dict:
    """What a file's routing computes, in words and flags, the same for every routing scheme (docs/format.md,
    "Semantics v2"; `colibri_sdk.reference.route_v2`). A header's `norm_topk` field is only read for routing 1 and
    2 (it must be 0 for routing 0): `topk_softmax` (Mixtral, gpt-oss, Qwen3-MoE / OLMoE with `norm_topk_prob`) takes
    the softmax of the k selected logits, so its weights are renormalised by construction (transformers'
    `MixtralTopKRouter`: softmax, top-k, divide by the sum; `GptOssTopKRouter`: top-k, softmax over the k).

    Args:
        header: a header's raw fields (`Header` / `HeaderV2` attributes or a manifest's `weights.header`): v1 files
            have no v2 fields, which then take their v1 meaning (no groups, no biases, no scaling).

    Returns:
        {"scores": "softmax of the k selected logits" | "softmax over all experts" | "sigmoid",
         "selection": e.g. "top-2 logits", "top-8 sigmoid scores + correction bias, within the best 4 of 8 groups
         (group score top2_sum)", "renormalized": bool (the k weights are divided by their sum, or sum to 1),
         "scaling": float (routed_scaling_factor), "router_bias": bool,
         "text": the one-line summary `inspect` prints}.
    """
    from ..format.constants import GROUP_SCORE_NAMES, ROUTING_SIGMOID_TOPK, ROUTING_TOPK_SOFTMAX

    routing, k = header.get("routing", 0), header.get("top_k")
    if routing == ROUTING_TOPK_SOFTMAX:
        scores, chosen, renormalized = "softmax of the k selected logits", "logits", True
    else:
        scores = "sigmoid" if routing == ROUTING_SIGMOID_TOPK else "softmax over all experts"
        chosen = "sigmoid scores" if routing == ROUTING_SIGMOID_TOPK else "softmax scores"
        renormalized = bool(header.get("norm_topk"))
    if header.get("correction_bias"):
        chosen += " + correction bias"
    selection = f"top-{k} {chosen}"
    n_group = header.get("n_group", 1)
    if n_group > 1:
        selection += (f", within the best {header.get('topk_group')} of {n_group} groups "
                      f"(group score {GROUP_SCORE_NAMES.get(header.get('group_score'), header.get('group_score'))})")
    scaling = float(header.get("routed_scaling_factor", 1.0))
    text = (f"select the {selection}" + (" (router bias on the logits)" if header.get("router_bias") else "")
            + f"; weights: {scores}, "
            + ("renormalised (sum 1)" if renormalized else "not renormalised")
            + (f", x {scaling:g}" if scaling != 1.0 else ""))
    return {"scores": scores, "selection": selection, "renormalized": renormalized, "scaling": scaling,
            "router_bias": bool(header.get("router_bias")), "text": text}


def _shown_value(key: str, value, header: dict):
    """A header field as the text table shows it: `norm_topk` of routing 0 says what the routing does."""
    from ..format.constants import ROUTING_TOPK_SOFTMAX

    if key == "norm_topk" and header.get("routing", 0) == ROUTING_TOPK_SOFTMAX:
        return "implied (routing topk_softmax: the softmax of the k selected logits sums to 1; the field is 0)"
    return value


def _raw_fields(header) -> dict:
    """A Header / HeaderV2's raw field values (codes, not names) by attribute name."""
    import dataclasses

    return {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}


def run(args) -> int:
    path = Path(args.path)
    if path.is_dir():
        return inspect_bundle(path, as_json=args.json)
    from ..format import ColibriFile

    with ColibriFile(path) as f:
        raw = _raw_fields(f.header)
        info = {"path": str(path), "header": f.header.to_dict(), "routing": routing_facts(raw),
                "file_bytes": f.header.file_size, "blocks": f.layout()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{path}  ({info['file_bytes']:,} bytes)")
    kw = max([18] + [len(key) for key in info["header"]])  # v2 names (shared_intermediate_size, ...) are longer
    quantized = info["header"].get("quant", "float") != "float"  # v1 headers have no quant
    for key, value in info["header"].items():
        if key == "dtype" and quantized:  # v2 int8/int4: dtype is the scales' type (docs/format.md, v2 header)
            value = f"{value} (the scales; experts: quant below)"
        print(f"  {key:<{kw}} {_shown_value(key, value, raw)}")
    print(f"  {'routing_rule':<{kw}} {info['routing']['text']}")
    if quantized:  # the experts' storage in the words of build / run / convert ("int8 per row", "int4 g128")
        print(f"  {'experts':<{kw}} {expert_storage(raw)}")
    bw = max([10] + [len(row["block"]) for row in info["blocks"]])
    print(f"  {'block':<{bw}} {'offset':>14} {'bytes':>14}  shape")
    for row in info["blocks"]:
        shape = "" if row["shape"] is None else "x".join(map(str, row["shape"]))
        print(f"  {row['block']:<{bw}} {row['offset']:>14,} {row['bytes']:>14,}  {shape}")
    return 0


FLOAT_STORAGE = {0: "fp32", 1: "fp16"}  # a header's dtype code -> the name a manifest's dtype uses


def expert_storage(header: dict, dtype: str | None = None) -> str | None:
    """"int4 g128", "int8 per row", ... for int8/int4 experts (a v2 header as a dict); for float experts the header's
    own float type ("fp32") where it differs from the manifest's `dtype` (a v2 file is copied into a bundle as it is,
    so an fp32 v2 file in an fp16 profile's bundle keeps fp32 experts), else None."""
    from ..format.constants import QUANT_NAMES

    quant = header.get("quant", 0)
    if not quant or quant not in QUANT_NAMES:
        own = FLOAT_STORAGE.get(header.get("dtype"))
        return own if dtype is not None and own is not None and own != dtype else None
    from ..quantize import group_text

    text = f"{QUANT_NAMES[quant]} {group_text(header.get('group_size', 0))}"
    return text + (" with zero points" if header.get("zero_points") else "")


def storage_record(header: dict, dtype: str) -> dict:
    """The experts' weight storage for `run --json` / `inspect --json` ("storage"): the manifest's `dtype` is the
    float type of the activations, scales and float blocks, never the storage of int8/int4 experts.

    Args:
        header: the manifest's `weights.header` (v1 or v2 fields). dtype: the manifest's dtype ("fp16" | "fp32").

    Returns:
        {"experts": "int4" | "int8" | "fp16" | "fp32", "group_size": int (0 = one group per row; 0 for float),
         "zero_points": bool, "text": "int4 g128", "int8 per row", "fp16", ... (the text output's words)}.
    """
    text = expert_storage(header, dtype)
    if not header.get("quant"):
        text = text or dtype
        return {"experts": text, "group_size": 0, "zero_points": False, "text": text}
    from ..format.constants import QUANT_NAMES

    return {"experts": QUANT_NAMES[header["quant"]], "group_size": int(header.get("group_size", 0)),
            "zero_points": bool(header.get("zero_points")), "text": text}


def stored_form(header: dict, dtype: str) -> str:
    """The one-line summary's words for a bundle's weights (`build`, `run`): "fp16"; "int4 g128 with zero points,
    fp16 scales" / "int8 per row, fp32 scales" for int8/int4 experts (the scales' type is the header's `dtype`: a
    v2 file is copied into a bundle as it is, so an import with fp32 scales keeps them in an fp16 profile's bundle);
    "fp32 experts, fp16 activations" for a v2 float file whose experts keep their own type.

    Args:
        header: the manifest's `weights.header`. dtype: the manifest's dtype ("fp16" | "fp32").
    """
    record = storage_record(header, dtype)
    if header.get("quant"):
        return f"{record['text']}, {FLOAT_STORAGE.get(header.get('dtype'), dtype)} scales"
    return dtype if record["text"] == dtype else f"{record['text']} experts, {dtype} activations"


def _shown(value, limit: int = 200) -> str:
    """A manifest string for the terminal: with a control character (an escape sequence, say) as its ascii() form,
    and cut at `limit` characters (the length said)."""
    text = str(value)
    if control_character(text) is not None:
        text = ascii(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def inspect_bundle(path: Path, as_json: bool = False) -> int:
    """Print a bundle's manifest summary (schema checked; checksums are `colibri-sdk verify`'s job). Returns 0.

    Raises:
        BundleError: not a bundle, or the manifest does not follow the schema.
    """
    bundle = Bundle.open(path, verify=False)
    info = bundle_summary(bundle)
    m = bundle.manifest
    info["top_k"] = {"bundle": m["weights"]["header"].get("top_k"),
                     "model": m["weights"].get("model_top_k", m["weights"]["header"].get("top_k"))}
    info["capacity"] = m["profile"].get("capacity")  # None: dropless
    info["storage"] = storage_record(m["weights"]["header"], m["dtype"])
    info["routing"] = routing_facts(m["weights"]["header"])
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    m = bundle.manifest
    print(f"{bundle.path}  (bundle schema {m['schema_version']}, colibri-sdk {m['sdk_version']})")
    rows = [
        ("profile", _shown(info["profile"])),
        ("arch", f"{m['arch']} (compute capability {m['compute_capability'][0]}.{m['compute_capability'][1]})"),
        ("dtype", m["dtype"]),
        ("shape", f"batch {m['shape']['batch']} x tokens {m['shape']['tokens']}"
                  + (" (the largest compiled shape)" if len(info["shapes"]) > 1 else "")),
        ("shapes", ", ".join(f"{s['batch']}x{s['tokens']} ({s['launches']} launches)" for s in info["shapes"])
                   + ("" if "shapes" in m else " (a bundle from before `shapes`: its one shape)")),
        ("aggregation", m["aggregation"]),
        ("nvrtc", m["nvrtc_version"]),
        ("min driver", f"CUDA {format_driver_version(m['min_driver'])} ({m['min_driver']})"),
        ("launches", info["launches"]),
    ]
    model_k, k = m["weights"].get("model_top_k"), m["weights"]["header"].get("top_k")
    if model_k is not None and model_k != k:
        rows.append(("top-k", f"{k} (override; the model's own k is {model_k})"))
    storage = expert_storage(m["weights"]["header"], m["dtype"])
    if storage:
        rows.append(("experts", f"{storage} (the weights' own storage)"))
    cap = m["profile"].get("capacity")
    from ..capacity import describe as describe_capacity
    rows.append(("capacity", "dropless" if not cap else describe_capacity(cap)))
    for key, value in rows:
        print(f"  {key:<14} {value}")
    recorded = m["weights"]["header"]
    v2 = recorded.get("version") == VERSION_2 or any(k in recorded for k in HEADER_V2_KEYS)
    try:
        if v2:  # shared experts, biases, sigmoid / grouped routing, quantized experts: every v2 field
            header = HeaderV2(**{k: v for k, v in recorded.items() if k in HEADER_FIELDS + HEADER_V2_KEYS}).to_dict()
        else:
            header = Header(**{k: v for k, v in recorded.items() if k in HEADER_FIELDS}).to_dict()
    except FormatError as exc:
        raise BundleError(f"{bundle.path}/manifest.json: weights.header: {exc}") from exc
    described = ", ".join(f"{k} {'implied by the routing' if k == 'norm_topk' and not recorded.get('routing') else v}"
                          for k, v in header.items() if k not in ("magic", "version"))
    print(f"  weights        {m['weights']['file']}: {described}")
    print(f"  routing        {routing_facts(recorded)['text']}")
    print(format_resources(m["kernels"]))
    print(f"  {'file':<36} {'bytes':>14}  sha256")
    for entry in m["files"]:
        print(f"  {entry['path']:<36} {entry['size']:>14,}  {entry['sha256'][:16]}")
    return 0


def format_resources(kernels: list[dict]) -> str:
    """The ptxas resource table: one row per entry point (registers, static shared memory, stack, spills)."""
    head = f"  {'kernel':<12} {'symbol':<24} {'regs':>5} {'smem B':>8} {'stack B':>8} {'spill st':>9} {'spill ld':>9}"
    lines = [head]
    for k in kernels:
        for symbol in sorted(k["resources"]):
            r = k["resources"][symbol]
            lines.append(
                f"  {k['name']:<12} {symbol:<24} {r['registers']:>5} {r['shared_bytes']:>8} {r['stack_bytes']:>8} "
                f"{r['spill_store_bytes']:>9} {r['spill_load_bytes']:>9}"
            )
    return "\n".join(lines)
