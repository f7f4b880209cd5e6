"""`colibri-sdk convert HF_DIR -o model.colibri [--force] [--dtype fp16|fp32] [--clamp-fp16]`: a Hugging Face MoE
checkpoint folder → a .colibri file (docs/convert.md)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint folder to a .colibri file")
    p.add_argument("checkpoint", metavar="HF_DIR", help="folder with config.json and *.safetensors (single or sharded)")
    p.add_argument("-o", "--output", required=True, help="the .colibri file to write")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="storage dtype (default: fp16)")
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
        clamp_fp16=args.clamp_fp16,
        composition=args.composition,
        progress=False if args.quiet else None,  # None: a bar when stderr is a terminal
    )
    h = report.header
    print(
        f"{report.path}: {report.family} ({report.layout} experts, {'/'.join(report.source_dtypes)} → {h.dtype_name}), "
        f"{h.num_layers} layers × {h.num_experts} experts, top-{h.top_k}, hidden {h.hidden_size}, "
        f"intermediate {h.intermediate_size}, routing {h.to_dict()['routing']}, composition {h.to_dict()['composition']}"
    )
    print(f"  {report.tensors} tensors, {report.bytes_written:,} bytes in {report.seconds:.2f} s ({report.mb_per_s:.0f} MB/s)")
    if report.clamped:
        print(f"  clamped {report.clamped} values to ±65504")
    return 0
