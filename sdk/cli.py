"""`colibri-sdk` command line: a thin layer. Each subcommand lives in `colibri_sdk.commands.<name>`, which
parses its arguments, calls the library, prints, and returns an exit code.

Exit codes: 0 success, 1 a ColibriError or an OSError the library let through (one line on stderr), 2 bad usage
(argparse).

Every subcommand takes `-q/--quiet` and `-v/--verbose` (added here, so they are spelled the same everywhere and
reach each command as `args.quiet` / `args.verbose`). The library never prints: its notices go through `logging`
(loggers under "colibri_sdk") and this module shows them on stderr as `colibri-sdk: MESSAGE`:

    default    notices (INFO) and warnings; progress bars on stderr when stderr is a terminal
    -q         warnings and errors only; no progress bars
    -v         also debug lines (DEBUG), e.g. the time of each build step
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from . import __version__
from .errors import ColibriError

COMMANDS = ("inspect", "convert", "build", "verify", "run", "deploy")

# Optional dependencies → the extra that installs them (pyproject.toml [project.optional-dependencies]).
EXTRAS = {
    "yaml": "build",
    "cuda": "build",
    "nvidia": "build",
    "safetensors": "convert",
    "tqdm": "convert",
    "paramiko": "deploy",
    "cv2": "camera",
}


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """-q/--quiet and -v/--verbose (mutually exclusive). An option a subcommand already defines is left as it is."""
    group = parser.add_mutually_exclusive_group()
    for flags, help_text in (
        (("-q", "--quiet"), "no progress bars and no notices (warnings and errors are still shown)"),
        (("-v", "--verbose"), "also show debug lines"),
    ):
        try:
            group.add_argument(*flags, action="store_true", help=help_text)
        except argparse.ArgumentError:
            pass


class _NoticeFormatter(logging.Formatter):
    """`colibri-sdk: MESSAGE` for notices, `colibri-sdk: warning: MESSAGE` (error, debug) for the other levels."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno != logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        return f"colibri-sdk: {text}"


def configure_logging(quiet: bool = False, verbose: bool = False) -> logging.Handler:
    """Show the library's log records on stderr (level: WARNING with quiet, DEBUG with verbose, else INFO).

    Returns:
        The handler added to the "colibri_sdk" logger (replacing one an earlier call added); the caller removes it.
    """
    logger = logging.getLogger("colibri_sdk")
    for old in [h for h in logger.handlers if getattr(h, "_colibri_cli", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler._colibri_cli = True
    handler.setFormatter(_NoticeFormatter())
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    handler.setLevel(level)
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-sdk",
        description="Hugging Face MoE checkpoint → .colibri → AOT bundle → on-device runtime.",
    )
    parser.add_argument("--version", action="version", version=f"colibri-sdk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"colibri_sdk.commands.{name}").register(sub)
    for subparser in sub.choices.values():
        add_common_options(subparser)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, systemd, a CI job's end), raised like Ctrl-C so that the library's cleanup runs
    (a build's hidden `.NAME.partial-*` folder, a convert's `.partial` file) instead of the process just ending."""


def printable(text: str) -> str:
    """`text` with every Unicode category-C character (controls such as ESC, NUL and newline, format characters)
    written as its Python escape (\\x1b, \\n, \\u200b): an error message quotes paths and values the user gave,
    and it is one line that never drives the terminal."""
    import unicodedata

    return "".join(c if unicodedata.category(c)[0] != "C" else repr(c)[1:-1] for c in text)


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logger = logging.getLogger("colibri_sdk")
    level = logger.level
    handler = configure_logging(quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False))
    on_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        return _run(args)
    finally:
        if on_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except ColibriError as exc:
        print(f"colibri-sdk {args.command}: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        extra = EXTRAS[top]
        print(
            f"colibri-sdk {args.command}: error: this command needs the Python package {top!r} "
            f'(extra "{extra}"): in the colibri-sdk checkout, pip install ".[{extra}]" (colibri-sdk is on no package '
            f'index)',
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `colibri-sdk inspect --json | head`): not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as exc:
        if isinstance(exc, Terminated):
            print(f"colibri-sdk {args.command}: terminated (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"colibri-sdk {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        # What the library did not turn into a ColibriError (e.g. EACCES from Path.is_dir on a path below a folder
        # the user may not enter): still one line naming the path and the reason, never a traceback.
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"colibri-sdk {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
