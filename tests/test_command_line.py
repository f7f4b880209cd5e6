"""The command line as a whole: missing optional dependencies and closed pipes give one line, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from timeout_support import guard

# Run the CLI in a fresh interpreter in which importing `module` fails as if the package were not installed.
RUN_WITHOUT = """
import sys
sys.modules[{module!r}] = None  # `import {module}` now raises ModuleNotFoundError(name={module!r})
from colibri_sdk.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "module, extra, argv",
    [
        ("paramiko", "deploy", ["deploy", "--status", "--host", "user@127.0.0.1"]),
        ("yaml", "build", ["build", "--profile", "orin", "--demo", "-o", "unused-bundle"]),
    ],
)
def test_missing_optional_dependency_names_the_extra(tmp_path, module, extra, argv):
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT.format(module=module, argv=argv)],
        capture_output=True, text=True, cwd=tmp_path, timeout=guard(600),
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().endswith(
        f"needs the Python package {module!r} (extra \"{extra}\"): in the colibri-sdk checkout, pip install "
        f"\".[{extra}]\" (colibri-sdk is on no package index)"
    ), result.stderr


def test_closed_stdout_is_not_an_error(demo_model_path):
    cmd = f"{sys.executable} -m colibri_sdk inspect --json {demo_model_path} | head -c 10"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=guard(600))
    assert result.stdout == '{\n  "path"'
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


# ---- one spelling of -q / -v on every subcommand -------------------------------------------------------------------
MINIMAL_ARGS = {
    "inspect": ["x.colibri"],
    "convert": ["ckpt", "-o", "m.colibri"],
    "build": ["--profile", "orin", "--demo"],
    "verify": ["bundle"],
    "run": ["bundle"],
    "deploy": ["bundle", "--host", "h"],
}


def test_every_subcommand_has_quiet_and_verbose():
    from colibri_sdk.cli import COMMANDS, make_parser

    assert sorted(MINIMAL_ARGS) == sorted(COMMANDS)
    parser = make_parser()
    for name in COMMANDS:
        base = [name, *MINIMAL_ARGS[name]]
        assert (parser.parse_args(base).quiet, parser.parse_args(base).verbose) == (False, False), name
        for flags in (["-q"], ["--quiet"]):
            args = parser.parse_args(base + flags)
            assert (args.quiet, args.verbose) == (True, False), (name, flags)
        for flags in (["-v"], ["--verbose"]):
            args = parser.parse_args(base + flags)
            assert (args.quiet, args.verbose) == (False, True), (name, flags)


@pytest.mark.parametrize("argv, message", [
    (["convert", "ckpt", "-o", "m.colibri", "-q", "-v"], "argument -v/--verbose: not allowed with argument -q/--quiet"),
    (["convert", "ckpt", "-o", "m.colibri", "--no-progress"], "unrecognized arguments: --no-progress"),
    (["build", "--profile", "orin", "--demo", "--verbose", "--quiet"],
     "argument -q/--quiet: not allowed with argument -v/--verbose"),
])
def test_usage_errors(capsys, argv, message):
    from colibri_sdk.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_convert_never_replaces_an_existing_output_without_force(tmp_path, capsys):
    from colibri_sdk.cli import main

    out = tmp_path / "m.colibri"
    out.write_bytes(b"an earlier model")
    assert main(["convert", str(tmp_path / "no-checkpoint"), "-o", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"colibri-sdk convert: error: -o {out}: exists; refusing to replace it without --force (or choose another -o)\n"
    )
    assert out.read_bytes() == b"an earlier model"
    # With --force the conversion itself runs (and here refuses the missing checkpoint, leaving the file alone).
    assert main(["convert", str(tmp_path / "no-checkpoint"), "-o", str(out), "--force"]) == 1
    assert "refusing to replace" not in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier model"


# ---- the library never prints ------------------------------------------------------------------------------------
def test_no_print_outside_the_command_line():
    """print() is for sdk/cli.py and sdk/commands/ only; the library logs (logging) instead."""
    import ast
    from pathlib import Path

    import colibri_sdk

    root = Path(colibri_sdk.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "cli.py" or rel.startswith("commands/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
    assert len(list(root.rglob("*.py"))) > 20  # the scan saw the package
    assert found == []


def test_library_notices_reach_stderr_through_the_cli(capsys):
    """The CLI's handler shows INFO notices as `colibri-sdk: ...`, warnings with their level; -q keeps warnings only;
    -v adds debug lines; the handler is gone after main() returns."""
    import logging

    from colibri_sdk.cli import configure_logging

    log = logging.getLogger("colibri_sdk.test")
    for quiet, verbose, expected in (
        (False, False, "colibri-sdk: a notice\ncolibri-sdk: warning: a warning\n"),
        (True, False, "colibri-sdk: warning: a warning\n"),
        (False, True, "colibri-sdk: debug: a detail\ncolibri-sdk: a notice\ncolibri-sdk: warning: a warning\n"),
    ):
        handler = configure_logging(quiet=quiet, verbose=verbose)
        try:
            log.debug("a detail")
            log.info("a notice")
            log.warning("a warning")
        finally:
            logging.getLogger("colibri_sdk").removeHandler(handler)
        assert capsys.readouterr().err == expected, (quiet, verbose)
    logging.getLogger("colibri_sdk").setLevel(logging.NOTSET)
    log.warning("nobody listens")  # the package's NullHandler: Python's last-resort handler stays silent
    assert capsys.readouterr().err == ""
