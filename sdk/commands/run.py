"""`colibri-sdk run BUNDLE [--input IN.npy] [--output OUT.npy] [--backend auto|cuda|cpu] [--iters N] [--eager]
[--lengths N ...] [--json]`: run a bundle on one input, write the output, print the backend and the latency per call
(as text, or with --json as one JSON object holding `Runtime.stats()` too)."""

from __future__ import annotations

from pathlib import Path

MAX_ITERS = 1_000_000  # timed calls; enough for any latency percentile, and a typo cannot run for ever


def register(sub) -> None:
    p = sub.add_parser("run", help="run a bundle on an input (random when none) and time it")
    p.add_argument("bundle", help="a bundle folder (colibri-sdk build)")
    p.add_argument(
        "--input",
        metavar="IN.npy",
        help="float32 or float16 (batch, tokens, hidden) or (tokens, hidden), at most the bundle's largest shape; "
        "default: N(0, 1) at the largest shape (or --batch/--tokens)",
    )
    p.add_argument("--output", metavar="OUT.npy", help="write the output here (float32, the input's shape); an "
                   "existing file is replaced only with --force")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto", help="default: auto")
    p.add_argument("--iters", type=int, default=100, help="timed calls after the first, 1..1000000 (default: 100)")
    p.add_argument("--eager", action="store_true", help="CUDA: launch kernels one by one instead of graph replay")
    p.add_argument("--lengths", type=int, nargs="+", metavar="N", help="per-sequence lengths, one per batch row")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input (default: 0)")
    p.add_argument("--batch", type=int, help="batch of the random input (default: the largest shape's)")
    p.add_argument("--tokens", type=int, help="tokens of the random input (default: the largest shape's)")
    p.add_argument("--no-verify", action="store_true", help="skip the size and sha256 check of every file at load")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (bundle, backend, shape, load, first call, latency, Runtime.stats())")
    p.set_defaults(func=run)


def latency_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max of per-call wall times, in milliseconds (percentiles by linear interpolation)."""
    import numpy as np

    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p99 = np.percentile(ms, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(ms.max())}


def load_input(path: str):
    """An input array from a .npy file (no pickles). The file is opened without blocking (a FIFO is refused, not
    waited on) and must start with the .npy magic (numpy.lib.format.MAGIC_PREFIX) before np.load reads it.

    Raises:
        InputError: not a regular file, unreadable, not a .npy file (empty, text, a pickle, a .npz archive), or a
            .npy file numpy cannot load (a cut header, an object array, a shape too large to allocate).
    """
    import os
    import stat

    import numpy as np

    from ..bundle.paths import kind_of
    from ..errors import InputError

    allowed = "allowed: a .npy file holding one array"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputError(f"--input {path}: cannot open ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"--input {path}: {kind_of(mode)}; {allowed}")
    with os.fdopen(fd, "rb") as fh:
        head = fh.read(len(np.lib.format.MAGIC_PREFIX))
        if head.startswith(b"PK"):
            raise InputError(f"--input {path}: a .npz archive; {allowed}")
        if head != np.lib.format.MAGIC_PREFIX:
            what = "an empty file" if not head else f"not a .npy file (it starts with {head!r})"
            raise InputError(f"--input {path}: {what}; {allowed}")
        fh.seek(0)
        try:
            return np.load(fh, allow_pickle=False)
        except (OSError, ValueError, MemoryError, EOFError) as exc:  # MemoryError: a header claiming a huge shape
            raise InputError(f"--input {path}: cannot load a .npy array ({exc or type(exc).__name__})") from exc


def save_output(path: str, y) -> None:
    """Write `y` as .npy to exactly `path` (np.save on a name would append .npy to a name without it): into a new
    file beside it, then renamed over it, so an interrupted write leaves no half file and a file linked to `path`
    (a hard link into a bundle, say) is not written through."""
    import os
    import tempfile

    import numpy as np

    from ..errors import InputError

    target = Path(path)
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    except OSError as exc:
        raise InputError(f"--output {path}: cannot write ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, y, allow_pickle=False)
        os.replace(partial, target)
    except OSError as exc:
        raise InputError(f"--output {path}: cannot write ({exc.strerror or exc})") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def check_output(path: str, force: bool) -> None:
    """--output names a new file in an existing folder, or (with --force) an existing regular file: never a folder,
    FIFO, device or socket (opening a FIFO would block). Raises InputError naming it and what is allowed."""
    import stat

    from ..errors import InputError

    out = Path(path)
    allowed = "allowed: a new file path in an existing folder, or an existing file with --force"
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        if not out.parent.is_dir():
            raise InputError(f"--output {path}: folder {out.parent} does not exist; allowed: a file path in an "
                             "existing folder") from None
        return
    except OSError as exc:
        raise InputError(f"--output {path}: cannot write there: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"--output {path}: is a folder; allowed: a file path in an existing folder")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise InputError(f"--output {path}: {kind}; {allowed}")
    if not force:
        raise InputError(f"--output {path}: the file exists; {allowed}")


def run(args) -> int:
    import time

    import numpy as np

    from ..errors import InputError
    from ..runtime import Runtime

    if not 1 <= args.iters <= MAX_ITERS:
        raise InputError(f"--iters {args.iters}; allowed: 1..{MAX_ITERS}")
    if args.seed < 0:
        raise InputError(f"--seed {args.seed}; allowed: 0 or more")
    if args.input and (args.batch is not None or args.tokens is not None):
        raise InputError("--batch / --tokens size the random input; --input gives its own shape")
    from ..bundle import Bundle

    start = time.perf_counter()
    bundle = Bundle.open(args.bundle, verify=False)  # the manifest only: the arguments are checked before any work
    batch, tokens = check_random_shape(args, bundle.shape)
    if args.output and Path(bundle.path).resolve() in Path(args.output).resolve().parents:
        raise InputError(f"--output {args.output}: inside the bundle {bundle.path} (writing it would replace a file "
                         "of the bundle); allowed: a file path outside the bundle folder")
    if args.output:  # before any work: a FIFO would block the write after the timings
        check_output(args.output, args.force)
    if not args.no_verify:  # the checksums first, with a progress bar (they read every byte of the weights)
        from .progress import StepBars

        with StepBars(quiet=args.quiet, desc_prefix="run: ") as bars:
            bundle.verify(progress=bars)
    rt = Runtime.load(args.bundle, backend=args.backend, eager=args.eager, verify=False)
    load_seconds = time.perf_counter() - start
    with rt:
        if args.input:
            x = load_input(args.input)
            source = args.input
        else:
            x = np.random.default_rng(args.seed).standard_normal((batch, tokens, rt.hidden_size)).astype(np.float32)
            source = f"random N(0, 1), seed {args.seed}"
        start = time.perf_counter()
        y = rt.infer(x, input_lengths=args.lengths)
        first = time.perf_counter() - start
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            rt.infer(x, input_lengths=args.lengths)
            times.append(time.perf_counter() - start)
        if args.json:
            return print_json(run_report(rt, args, source, x, first, times, load_seconds), args.output, y)
        mode = {"cpu": "NumPy"}.get(rt.backend_name, "eager launches" if args.eager else "CUDA Graph replay")
        from .inspect import expert_storage, stored_form

        fixed_b, fixed_t = rt.shape
        form = stored_form(rt.bundle.manifest["weights"]["header"], rt.dtype)
        print(f"bundle   {rt.bundle.path}  ({form}, batch {fixed_b} x tokens {fixed_t}, hidden {rt.hidden_size})")
        if len(rt.shapes) > 1:
            print(f"shapes   {', '.join(f'{b}x{t}' for b, t in rt.shapes)} (batch x tokens)")
        print(f"backend  {rt.backend_name} ({mode})")
        if storage := expert_storage(rt.bundle.manifest["weights"]["header"], rt.bundle.manifest["dtype"]):
            print(f"experts  {storage} (the weights' own storage)")
        if rt.top_k != rt.model_top_k:
            print(f"top-k    {rt.top_k} (build override; the model's own k is {rt.model_top_k})")
        if rt.capacity:
            c, dropped = rt.capacity, rt.stats().last_dropped_pairs
            from ..capacity import describe as describe_capacity
            print(f"capacity {describe_capacity(c)}; {dropped} pairs dropped in the last call")
        print(f"load     {load_seconds * 1e3:.1f} ms" + ("" if args.no_verify else " (with checksums)"))
        print(f"input    {source}  {x.dtype} {tuple(x.shape)}" + (f"  lengths {args.lengths}" if args.lengths else ""))
        chosen = rt.stats().last_shape
        print(f"shape    batch {chosen[0]} x tokens {chosen[1]} (the smallest compiled shape that holds the input)")
        stats = latency_ms(times)
        print(f"first    {first * 1e3:.3f} ms")
        print(
            f"latency  p50 {stats['p50']:.3f} ms  p99 {stats['p99']:.3f} ms  max {stats['max']:.3f} ms"
            f"  ({args.iters} calls)"
        )
    if args.output:
        save_output(args.output, y)
        print(f"output   {args.output}  {y.dtype} {tuple(y.shape)}")
    return 0


def check_random_shape(args, largest: tuple[int, int]) -> tuple[int, int]:
    """The (batch, tokens) of the random input: --batch / --tokens, else the largest compiled shape's.

    Checked before the bundle is verified or loaded, so that a bad value is the one line printed (no backend notice
    before it) and a huge value makes no input that would not fit in memory.

    Raises:
        InputError: --batch or --tokens outside 1..the largest compiled shape's, naming the flag and the value.
    """
    from ..errors import InputError
    from ..runtime.checks import counts_up_to

    batch = largest[0] if args.batch is None else args.batch
    tokens = largest[1] if args.tokens is None else args.tokens
    for flag, value, top in (("--batch", batch, largest[0]), ("--tokens", tokens, largest[1])):
        if not 1 <= value <= top:
            raise InputError(f"{flag} {value}; allowed: {counts_up_to(top)} (the largest compiled shape's)")
    return batch, tokens


def print_json(report: dict, output: str | None, y) -> int:
    """Write the output (if asked), add it to the report, print the report as one JSON line; exit code 0."""
    import json

    if output:
        save_output(output, y)
        report["output"] = {"path": output, "dtype": str(y.dtype), "shape": list(y.shape)}
    print(json.dumps(report, sort_keys=True))
    return 0


def run_report(rt, args, source: str, x, first: float, times: list[float], load_seconds: float) -> dict:
    """The `run --json` object: what the text output prints, plus `Runtime.stats().as_dict()` under "stats"."""
    from .inspect import storage_record

    batch, tokens = rt.shape
    return {
        "bundle": str(rt.bundle.path),
        "dtype": rt.dtype,  # the activations' / scales' float type; int8/int4 experts: see "storage"
        "storage": storage_record(rt.bundle.manifest["weights"]["header"], rt.dtype),
        "shape": {"batch": batch, "tokens": tokens},
        "shapes": [{"batch": b, "tokens": t} for b, t in rt.shapes],
        "shape_chosen": dict(zip(("batch", "tokens"), rt.stats().last_shape)),
        "hidden_size": rt.hidden_size,
        "top_k": rt.top_k,
        "model_top_k": rt.model_top_k,
        "capacity": rt.capacity,  # None: dropless
        "backend": rt.backend_name,
        "eager": bool(args.eager),
        "load_ms": load_seconds * 1e3,
        "verified": not args.no_verify,
        "input": {"source": source, "dtype": str(x.dtype), "shape": list(x.shape), "lengths": args.lengths},
        "first_ms": first * 1e3,
        "iters": args.iters,
        "latency_ms": latency_ms(times),
        "stats": rt.stats().as_dict(),
    }
