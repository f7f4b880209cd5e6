"""`status ROOT`: the bundles, pointers, history, store and free space; a ROOT with bundles/ but no store/, or
holding an entry the store did not make (layout.check_layout), is refused.

A bundle's "files" counts the files its manifest lists (manifest.json besides), its "bytes" all of them; its
"manifest" the keys `--status` shows: profile name, model sizes (the weights header), dtype, shape, arch.
"""

import json
import os

from .bundles import list_bundles
from .common import AgentError, emit, free_bytes
from .layout import check_layout
from .pointers import read_history, read_pointer
from .runtime import read_record

MODEL_KEYS = ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size")


def summary(manifest):
    """The manifest keys `--status` shows (missing ones as None)."""
    header = (manifest.get("weights") or {}).get("header") or {}
    profile = manifest.get("profile")
    out = {k: manifest.get(k) for k in ("sdk_version", "arch", "dtype", "shape")}
    out["profile"] = profile.get("name") if isinstance(profile, dict) else None
    out["model"] = {k: header.get(k) for k in MODEL_KEYS} if isinstance(header, dict) else {}
    return out


def op_status(root):
    if not os.path.isdir(os.path.join(root, "bundles")):
        emit({"root": root, "exists": False, "bundles": []})
        return
    if not os.path.isdir(os.path.join(root, "store")):
        raise AgentError("%r is not a colibri store (no store/); allowed: a --remote-dir a deploy made" % root)
    check_layout(root)
    rows = []
    for name, mtime in list_bundles(root):
        folder = os.path.join(root, "bundles", name)
        row = {"id": name, "activated": mtime, "files": 0, "bytes": 0, "manifest": {}}
        try:
            with open(os.path.join(folder, "manifest.json"), "rb") as f:
                raw = f.read()
            manifest = json.loads(raw.decode("utf-8"))
            row["files"] = len(manifest.get("files", []))  # the files the manifest lists, besides itself
            row["bytes"] = len(raw) + sum(int(e.get("size", 0)) for e in manifest.get("files", []))
            row["manifest"] = summary(manifest)
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            row["error"] = str(exc)
        rows.append(row)
    store = os.path.join(root, "store")
    partial = [n for n in os.listdir(store) if n.endswith(".partial")]
    emit({
        "root": root,
        "exists": True,
        "current": read_pointer(root, "current"),
        "previous": read_pointer(root, "previous"),
        "history": read_history(root),
        "bundles": rows,
        "store_objects": len(os.listdir(store)) - len(partial),
        "store_bytes": sum(os.path.getsize(os.path.join(store, n)) for n in os.listdir(store)),
        "partial": len(partial),
        "free": free_bytes(root),
        "runtime": read_record(root),
    })
