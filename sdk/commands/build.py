"""`colibri-sdk build --profile orin (--weights model.colibri | --demo) [-o OUT] [--force] [--archive]
[--batch 1,4] [--tokens 1,16,64]`: compile the kernels for a device profile with NVRTC (no GPU needed), once per
compiled shape, and write a bundle (docs/build.md)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("build", help="compile the kernels for a device profile and write a bundle (no GPU needed)")
    p.add_argument(
        "--profile", required=True, help="a shipped profile name (orin, a100, rtx4090, h200) or a path to a .yaml file"
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--weights", help="a .colibri file (colibri-sdk convert)")
    model.add_argument("--demo", action="store_true", help="build the embedded demo model instead of --weights")
    p.add_argument("-o", "--output", help="the bundle folder (default: bundles/<profile>)")
    p.add_argument("--force", action="store_true", help="replace an earlier bundle (and its .tar) at the output")
    p.add_argument("--archive", action="store_true", help="also write <output>.tar (reproducible)")
    p.add_argument("--capacity-factor", type=float, metavar="F",
                   help="expert capacity C = ceil(tokens*k*F/experts) per expert and call (docs/runtime.md; the "
                   "CPU backend and the CUDA kernels, kernels/capacity.cu)")
    p.add_argument("--capacity-mode", choices=("hard", "soft"), help="with --capacity-factor; default hard")
    p.add_argument("--capacity-policy", choices=("score", "position"),
                   help="with --capacity-factor: which pairs an expert keeps first; default score")
    p.add_argument("--capacity-min", type=int, metavar="N",
                   help="with --capacity-factor: C = max(N, ceil(tokens*k*F/experts)), DeepSpeed's min_capacity; "
                   "default 1")
    p.add_argument("--capacity-order", choices=("policy", "choice"),
                   help="with --capacity-factor: choice = every first choice takes capacity before any second choice "
                   "(GShard, DeepSpeed top2gating), then the policy; default policy (the policy alone)")
    p.add_argument("--batch", metavar="B[,B...]",
                   help="compiled batch sizes in place of the profile's shape.batch, e.g. 1,4 (docs/build.md, "
                   "\"Several shapes\")")
    p.add_argument("--tokens", metavar="T[,T...]",
                   help="compiled tokens per sequence in place of the profile's shape.tokens, e.g. 1,16,64: one "
                   "kernel set, launch plan and CUDA Graph per batch x tokens pair")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="experts per token in place of the model's own k (recorded in the manifest; docs/build.md)")
    p.add_argument("--no-cache", action="store_true",
                   help="run NVRTC for every kernel, neither reading nor writing the NVRTC cache "
                   "($COLIBRI_CACHE_DIR, default ${XDG_CACHE_HOME:-~/.cache}/colibri-sdk/nvrtc; docs/build.md)")
    # --kernels DIR: compile the kernel sources of another folder (kernel development); not in --help.
    p.add_argument("--kernels", metavar="DIR", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def parse_sizes(text: str, flag: str):
    """"1,16,64" → [1, 16, 64] (sorted, no repeats); "16" → 16. The profile's schema checks the range.

    Raises:
        ProfileError: not a comma-separated list of integers, naming the flag and the text.
    """
    from ..errors import ProfileError

    from ..profile import MAX_TOKENS

    shown = repr(text) if len(str(text)) <= 60 else repr(str(text)[:57]) + "..."
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise ProfileError(f"{flag} {shown}; allowed: positive integers separated by commas, e.g. 1,16,64")
    if any(len(p.lstrip("0")) > len(str(MAX_TOKENS)) for p in parts):  # int() of thousands of digits would raise
        raise ProfileError(f"{flag} {shown}: a value above {MAX_TOKENS}; allowed: integers in 1..{MAX_TOKENS}")
    values = sorted({int(p.lstrip("0") or "0") for p in parts})
    return values[0] if len(values) == 1 else values


def override_flags(args) -> list[str]:
    """The command-line flags that replace profile values, as typed: ["--top-k 9", "--tokens 1,16"]."""
    names = (("top_k", "--top-k"), ("batch", "--batch"), ("tokens", "--tokens"),
             ("capacity_factor", "--capacity-factor"), ("capacity_mode", "--capacity-mode"),
             ("capacity_policy", "--capacity-policy"), ("capacity_min", "--capacity-min"),
             ("capacity_order", "--capacity-order"))
    return [f"{flag} {getattr(args, name)}" for name, flag in names if getattr(args, name) is not None]


def blame_flags(exc, source: str, flags: list[str]):
    """A ProfileError about `source: ...` raised once flags replaced profile values names those flags too (the file
    itself was already checked by load_profile, so the value at fault came from the command line)."""
    from ..errors import ProfileError

    prefix = f"{source}: "
    if not flags or not str(exc).startswith(prefix):
        return exc
    return ProfileError(f"{source} with {', '.join(flags)}: {str(exc)[len(prefix):]}")


def run(args) -> int:
    from ..aot.cache import NvrtcCache
    from ..bundle.writer import build_bundle
    from ..errors import ProfileError
    from ..profile import load_profile
    from .inspect import expert_storage, format_resources, stored_form
    from .progress import StepBars

    start = time.perf_counter()
    profile = load_profile(args.profile)
    overrides = {}
    if args.top_k is not None:
        overrides["top_k"] = args.top_k
    if args.batch is not None or args.tokens is not None:
        shape = dict(profile.to_dict()["shape"])
        if args.batch is not None:
            shape["batch"] = parse_sizes(args.batch, "--batch")
        if args.tokens is not None:
            shape["tokens"] = parse_sizes(args.tokens, "--tokens")
        overrides["shape"] = shape
    if args.capacity_factor is not None:
        overrides["capacity"] = {"factor": args.capacity_factor, "mode": args.capacity_mode or "hard",
                                 "policy": args.capacity_policy or "score"}
        if args.capacity_min is not None:
            overrides["capacity"]["min_capacity"] = args.capacity_min
        if args.capacity_order is not None:
            overrides["capacity"]["order"] = args.capacity_order
    elif args.capacity_mode or args.capacity_policy or args.capacity_min is not None or args.capacity_order:
        raise ProfileError("--capacity-mode / --capacity-policy / --capacity-min / --capacity-order need "
                           "--capacity-factor F")
    flags = override_flags(args)
    try:
        if overrides:
            from ..profile import Profile

            profile = Profile.from_dict({**profile.to_dict(), **overrides}, profile.source)
        out = Path(args.output) if args.output else Path("bundles") / profile.stem
        cache = None if args.no_cache else NvrtcCache()
        with StepBars(quiet=args.quiet, desc_prefix="build: ") as bars:
            result = build_bundle(profile, out, args.weights, kernel_dir=args.kernels, archive=args.archive,
                                  force=args.force, progress=bars,
                                  nvrtc_cache=cache if cache is not None else False)
    except ProfileError as exc:
        blamed = blame_flags(exc, profile.source, flags)
        if blamed is exc:
            raise
        raise blamed from exc
    if args.quiet:  # -q: errors (and warnings, on stderr) only; the bundle's contents are in `inspect`
        return 0
    m = result.manifest
    h = m["weights"]["header"]
    shapes = ", ".join(f"{e['batch']}x{e['tokens']}" for e in m.get("shapes") or [m["shape"]])
    print(
        f"{result.path}: {profile.name} ({m['arch']}, {stored_form(h, m['dtype'])}, batch {m['shape']['batch']} x tokens "
        f"{m['shape']['tokens']}, {m['aggregation']} aggregation), NVRTC {m['nvrtc_version']}, "
        f"min driver {m['min_driver']}"
    )
    if len(m.get("shapes") or []) > 1:
        print(f"  shapes: {shapes} (batch x tokens; each call runs at the smallest that holds it)")
    print(
        f"  weights: {'demo model' if args.weights is None else args.weights} → {m['weights']['file']} "
        f"({h['num_layers']} layers x {h['num_experts']} experts, top-{h['top_k']}, hidden {h['hidden_size']}, "
        f"intermediate {h['intermediate_size']}"
        + (f", {storage} experts" if (storage := expert_storage(h)) else "") + ")"
    )
    if result.converted:
        print(f"  dtype: the weights are stored as {result.source_dtype}; converted to the profile's {m['dtype']}"
              + (" (every value rounded to fp16)" if m["dtype"] == "fp16" else ""))
    if m["weights"].get("model_top_k", h["top_k"]) != h["top_k"]:
        print(f"  top-k override: {h['top_k']} experts per token (the model's own k is {m['weights']['model_top_k']})")
    if m["profile"].get("capacity"):
        c = m["profile"]["capacity"]
        from ..capacity import describe as describe_capacity
        print(f"  expert capacity: {describe_capacity(c)} (colibri_capacity after each routing launch)")
    print(format_resources(m["kernels"]))
    total = sum(f["size"] for f in m["files"])
    print(f"  {len(m['files'])} files + manifest, {total:,} bytes, {len(m.get('launch') or [])} launches per forward pass"
          + (" (the largest shape)" if len(m.get("shapes") or []) > 1 else ""))
    if cache is None:
        print("  nvrtc cache: not used (--no-cache)")
    else:
        if cache.folder is None:
            where = "no cache folder: set COLIBRI_CACHE_DIR"
        else:
            where = f"{cache.folder}; not writable: nothing stored" if cache.unwritable else str(cache.folder)
        print(f"  nvrtc cache: {cache.hits} of {cache.hits + cache.misses} compilations from the cache ({where})")
    if result.archive is not None:
        print(f"  archive: {result.archive}")
    print(f"  built in {time.perf_counter() - start:.2f} s")
    return 0
