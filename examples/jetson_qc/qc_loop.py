"""Inspection camera loop: classify frames with the MoE model through the colibri runtime, pass/fail each one.

    python3 examples/jetson_qc/qc_loop.py                                  # synthetic frames, 5 fps, until Ctrl-C
    python3 examples/jetson_qc/qc_loop.py --max-frames 40 --fps 50         # a bounded run
    python3 examples/jetson_qc/qc_loop.py --bundle /opt/colibri/current --source usb:0 --events /var/log/qc.jsonl

The bundle folder (--bundle) is built on first use with `colibri-sdk build --profile profiles/orin.yaml --weights
weights/qc_moe.colibri` when it has no manifest.json (unless --no-build). Events go to stdout as JSON lines (or
--events FILE), logs to stderr. SIGINT and SIGTERM stop the loop cleanly (exit status 0) after the current frame;
a frame source that fails (a camera unplugged) ends it with exit status 1, bad arguments with 2.
See README.md.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qc.loop import EventLog, StopFlag, run_loop  # noqa: E402
from qc.model import DEFAULT_PROFILE, DEFAULT_THRESHOLD, EXAMPLE_DIR, MOE_WEIGHTS, STEM_HEAD_WEIGHTS  # noqa: E402
from qc.sources import SPEC_HELP, SourceError, open_source  # noqa: E402

log = logging.getLogger("jetson_qc")


def positive_or_none(text: str) -> int | None:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}; allowed: >= 1")
    return value


def number_in(low: float, high: float, low_open: bool = False):
    """An argparse type: a finite float in [low, high] ((low, high] with `low_open`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bounds = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
            raise argparse.ArgumentTypeError(f"{text}; allowed: a finite number {bounds}")
        return value

    return parse


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}; allowed: >= 0")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=EXAMPLE_DIR / "bundle",
                   help="bundle folder; built there on first use if it has no manifest.json (default: %(default)s)")
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing bundle")
    p.add_argument("--weights", type=Path, default=MOE_WEIGHTS, help="MoE weights for the build (%(default)s)")
    p.add_argument("--stem-head", type=Path, default=STEM_HEAD_WEIGHTS, help="stem/head arrays (%(default)s)")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="profile for the build (%(default)s)")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                   help="runtime backend; auto = CUDA when a driver and device exist, else CPU (default auto)")
    p.add_argument("--no-verify", action="store_true", help="skip the bundle's SHA-256 check at load")
    p.add_argument("--source", default="synthetic", help=f"frame source: {SPEC_HELP} (default synthetic)")
    p.add_argument("--seed", type=non_negative, default=0, help="seed of the synthetic source (default 0)")
    p.add_argument("--repeat", action="store_true", help="folder source: start again after the last image")
    p.add_argument("--fps", type=number_in(0.0, 1e6), default=5.0,
                   help="target frames per second; 0 = as fast as possible (5)")
    p.add_argument("--threshold", type=number_in(0.0, 1.0, low_open=True), default=DEFAULT_THRESHOLD,
                   help="fail a frame when p_defect = 1 - P(ok) >= this (default %(default)s)")
    p.add_argument("--queue-size", type=positive_or_none, default=4,
                   help="frames waiting before the oldest is dropped (default 4)")
    p.add_argument("--max-frames", type=positive_or_none, default=None, help="stop after capturing N frames")
    p.add_argument("--stats-every", type=non_negative, default=50,
                   help="a stats line every N frames (default 50; 0: off)")
    p.add_argument("--events", default="-", help="JSON-lines events file, '-' = stdout (default)")
    p.add_argument("--save-frames", type=Path, default=None, help="write annotated PNG frames to this folder")
    p.add_argument("--save-failures-only", action="store_true", help="with --save-frames: only failed frames")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p.parse_args(argv)


def open_classifier(args):
    """Build the bundle if needed, load it with the runtime, run its self-test. Errors propagate to main."""
    from qc.model import ensure_bundle, load_classifier

    if not (args.bundle / "manifest.json").is_file():
        if args.no_build:
            raise FileNotFoundError(f"bundle {args.bundle} has no manifest.json and --no-build was given")
        ensure_bundle(args.bundle, args.weights, args.profile, log=log.info)
    classifier = load_classifier(args.bundle, args.backend, args.threshold, args.stem_head, verify=not args.no_verify)
    result = classifier.moe.self_test()
    log.info("%s", result)
    if not result.passed:
        classifier.close()
        raise RuntimeError(f"bundle {args.bundle}: {result}")
    return classifier


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        import colibri_sdk  # noqa: F401
    except ImportError:
        log.error("colibri_sdk is not installed for %s: activate the environment that has it "
                  "(`source .venv/bin/activate` after scripts/demo.sh) or `pip install \"colibri-sdk[build]\"`",
                  sys.executable)
        return 1
    stop = StopFlag()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.request(signal.Signals(signum).name))
    try:
        source = open_source(args.source, seed=args.seed, repeat=args.repeat)
    except SourceError as exc:
        log.error("%s", exc)
        return 2
    if args.save_frames is not None:
        try:
            args.save_frames.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.error("--save-frames %s: cannot use it as a folder for the PNG frames: %s", args.save_frames,
                      exc.strerror or exc)
            source.close()
            return 1
    stream = sys.stdout
    if args.events != "-":
        try:
            Path(args.events).parent.mkdir(parents=True, exist_ok=True)
            stream = open(args.events, "a", encoding="utf-8")
        except OSError as exc:
            log.error("cannot open the events file %s: %s", args.events, exc.strerror or exc)
            source.close()
            return 1
    try:
        classifier = open_classifier(args)
    except Exception as exc:  # the message says what is wrong with the bundle, the build or the backend
        log.error("cannot load the model: %s: %s", type(exc).__name__, exc)
        source.close()
        if stream is not sys.stdout:
            stream.close()
        return 1
    events = EventLog(stream)
    runtime = classifier.moe
    events.write({"type": "start", "bundle": str(args.bundle), "backend": runtime.backend_name,
                  "dtype": runtime.dtype, "source": args.source, "fps": args.fps, "threshold": args.threshold,
                  "queue_size": args.queue_size, "load_s": round(runtime.load_seconds, 3)})
    try:
        final = run_loop(source, classifier, events, fps=args.fps, queue_size=args.queue_size,
                         max_frames=args.max_frames, stats_every=args.stats_every, stop=stop,
                         save_dir=args.save_frames, save_failures_only=args.save_failures_only)
    finally:
        classifier.close()
        source.close()
        if stream is not sys.stdout:
            stream.close()
    if final["stopped_by"] == "source error":  # a camera that went away: non-zero, so a service restarts
        log.error("stopped: the frame source %s failed (see the error event)", args.source)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
