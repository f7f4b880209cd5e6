"""`colibri-sdk` command line: a thin layer. Each subcommand lives in `colibri_sdk.commands.<name>`, which
parses its arguments, calls the library, prints, and returns an exit code.

Exit codes: 0 success, 1 a ColibriError (message printed to stderr), 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-sdk",
        description="Hugging Face MoE checkpoint → .colibri → AOT bundle → on-device runtime.",
    )
    parser.add_argument("--version", action="version", version=f"colibri-sdk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"colibri_sdk.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ColibriError as exc:
        print(f"colibri-sdk {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        extra = EXTRAS[top]
        print(
            f"colibri-sdk {args.command}: error: this command needs the Python package {top!r} "
            f'(extra "{extra}"): pip install "colibri-sdk[{extra}]" (in a source checkout: pip install ".[{extra}]")',
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `colibri-sdk inspect --json | head`): not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"colibri-sdk {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
