"""`colibri-sdk inspect FILE|BUNDLE [--json]`: header fields, sizes and per-block offsets of a .colibri file,
or the manifest summary of a bundle."""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a .colibri file's header and layout, or a bundle's manifest")
    p.add_argument("path", help="a .colibri file or a bundle folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    path = Path(args.path)
    if path.is_dir():
        from ..bundle import inspect_bundle

        return inspect_bundle(path, as_json=args.json)
    from ..format import ColibriFile

    with ColibriFile(path) as f:
        info = {"path": str(path), "header": f.header.to_dict(), "file_bytes": f.header.file_size, "blocks": f.layout()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{path}  ({info['file_bytes']:,} bytes)")
    for key, value in info["header"].items():
        print(f"  {key:<18} {value}")
    print(f"  {'block':<10} {'offset':>14} {'bytes':>14}  shape")
    for row in info["blocks"]:
        shape = "" if row["shape"] is None else "x".join(map(str, row["shape"]))
        print(f"  {row['block']:<10} {row['offset']:>14,} {row['bytes']:>14,}  {shape}")
    return 0
