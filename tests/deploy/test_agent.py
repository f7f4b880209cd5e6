"""The device side (sdk/deploy/agent/): one module per noun, standard library only, Python 3.8 syntax, and sent as
one `python3 -c` program that answers every operation with one JSON object."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from colibri_sdk.deploy.agent.main import MODULES, OPS
from colibri_sdk.deploy.remote import agent_source

AGENT = Path(__file__).resolve().parents[2] / "sdk" / "deploy" / "agent"


def test_every_module_is_sent_and_none_is_large():
    on_disk = {p.stem for p in AGENT.glob("*.py")} - {"__init__"}
    assert set(MODULES) == on_disk and MODULES[-1] == "main"
    assert all(len((AGENT / f"{m}.py").read_text().splitlines()) < 300 for m in MODULES)


def test_modules_use_python_3_8_syntax_and_the_standard_library_only():
    for name in MODULES:
        tree = ast.parse((AGENT / f"{name}.py").read_text(), feature_version=(3, 8))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [node.module.split(".")[0]]
            else:
                continue
            assert all(t in sys.stdlib_module_names for t in tops), (name, tops)


def run_agent(*argv, cwd=None) -> tuple:
    proc = subprocess.run([sys.executable, "-c", agent_source(), *argv], capture_output=True, text=True, cwd=cwd)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_sent_program_answers_with_one_json_object(tmp_path):
    code, answer = run_agent("fly", str(tmp_path))
    assert code == 2 and answer == {"error": {"errno": "EINVAL", "path": "", "message": "usage: OP ROOT ARG... "
                                                                                       f"with OP in {sorted(OPS)}"}}
    code, answer = run_agent("status", str(tmp_path / "none"))
    assert code == 0 and answer == {"root": str(tmp_path / "none"), "exists": False, "bundles": []}
    code, answer = run_agent("switch", str(tmp_path), "not-hex", "3")
    assert code == 3 and answer["error"]["message"] == "not a bundle id (hex digits): 'not-hex'"
