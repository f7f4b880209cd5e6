"""`colibri-sdk convert HF_DIR|MODEL.gguf -o model.colibri [--force] [--dtype auto|fp16|fp32|int8|int4] [--group-size N] [--clamp-fp16]`: a MoE
checkpoint folder → a .colibri file (docs/convert.md)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint folder to a .colibri file")
    p.add_argument("checkpoint", metavar="HF_DIR|MODEL.gguf",
                   help="folder with config.json and model.safetensors (or model.safetensors.index.json and its "
                        "shards), or a .gguf file")
    p.add_argument("-o", "--output", required=True, help="the .colibri file to write")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument(
        "--dtype",
        choices=("auto", "fp16", "fp32", "int8", "int4"),
        default="auto",
        help="expert storage: auto (default: fp16, or a pre-quantized checkpoint's own int8/int4 layout, copied "
        "without re-quantizing), fp16/fp32 (quantized sources dequantized), int8/int4 (round-to-nearest)",
    )
    p.add_argument(
        "--group-size", type=int, choices=(0, 32, 64, 128), default=None,
        help="int8/int4 scale group along the reduction dimension (default: int8 per row, int4 128; 0 = per row, "
        "int8 only)",
    )
    p.add_argument("--clamp-fp16", action="store_true", help="clamp weights beyond ±65504 instead of refusing them")
    p.add_argument(
        "--composition",
        choices=("residual", "sequential"),
        default="residual",
        help="how layers compose: x + moe(x) (default) or moe(x)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from ..convert import convert
    from ..errors import ConvertError

    # An existing file is replaced only with --force (a folder or a special file never is: convert() refuses it).
    out = Path(args.output)
    if (out.is_symlink() or out.is_file()) and not args.force:
        raise ConvertError(f"-o {args.output}: exists; refusing to replace it without --force (or choose another -o)")
    report = convert(
        args.checkpoint,
        args.output,
        dtype=args.dtype,
        group_size=args.group_size,
        clamp_fp16=args.clamp_fp16,
        composition=args.composition,
        progress=False if args.quiet else None,  # None: a bar when stderr is a terminal
    )
    for line in summary(report):
        print(line)
    return 0


def summary(report) -> list[str]:
    """The lines `convert` prints for a ConvertReport."""
    h = report.header
    d = h.to_dict()
    lines = [
        f"{report.path}: {report.family} ({report.layout} experts, {'/'.join(report.source_dtypes)} → {report.storage if report.storage not in ('fp16', 'fp32') else h.dtype_name}), "
        f"{h.num_layers} layers × {h.num_experts} experts, top-{h.top_k}, hidden {h.hidden_size}, "
        f"intermediate {h.intermediate_size}, routing {d['routing']}, composition {d['composition']}",
        f"  {report.tensors} tensors, {report.bytes_written:,} bytes in {report.seconds:.2f} s ({report.mb_per_s:.0f} MB/s)",
    ]
    if getattr(h, "layer_map", None) is not None and hasattr(h, "num_model_layers"):
        extra = []
        if h.num_shared_experts:
            extra.append(f"shared expert {h.shared_intermediate_size}{' (gated)' if h.shared_gate else ''}")
        if h.n_group > 1:
            extra.append(f"groups {h.topk_group} of {h.n_group}")
        if h.routed_scaling_factor != 1.0:
            extra.append(f"scaling {h.routed_scaling_factor:g}")
        if h.activation:
            extra.append(f"clamped SwiGLU (limit {h.swiglu_limit:g}, alpha {h.swiglu_alpha:g})")
        if h.router_bias or h.correction_bias or h.expert_bias:
            extra.append("biases: " + ", ".join(n for n, f in (("router", h.router_bias), ("correction", h.correction_bias), ("experts", h.expert_bias)) if f))
        lines.append(f"  v2: file layers ← model layers {list(h.layer_map)} of {h.num_model_layers}" + (f"; {'; '.join(extra)}" if extra else ""))
    if report.left_out:
        groups: dict[str, list[int]] = {}
        for layer, why in report.left_out.items():
            groups.setdefault(why, []).append(layer)
        for why, layers in groups.items():
            lines.append(f"  left out: model layers {layers} ({why})")
    if report.imported:
        lines.append(f"  imported {report.imported} quantized matrices as {report.storage} without re-quantizing")
    if report.quantized:
        errors = ", ".join(f"{k} {v:.2e}" for k, v in sorted(report.quant_error.items()))
        lines.append(f"  quantized {report.quantized} matrices to {report.storage} (round-to-nearest); max error / max |w|: {errors}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    if report.clamped:
        lines.append(f"  clamped {report.clamped} values to ±65504")
    return lines
