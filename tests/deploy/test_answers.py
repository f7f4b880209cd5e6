"""The agent's answers checked against their operation's schema before use (sdk/deploy/answers.py), fed to
RemoteAgent.answer directly (no sshd): a malformed answer is a one-line RemoteAnswerError naming the host, the
operation and the field; text from the device reaches the terminal with its control characters escaped."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from colibri_sdk.deploy import RemoteAnswerError, RemoteCommandError, RemoteDiskFullError, Target
from colibri_sdk.deploy.answers import printable
from colibri_sdk.deploy.connection import CommandResult
from colibri_sdk.deploy.remote import RemoteAgent
from colibri_sdk.deploy.store import DeviceStore

SHA = "ab" * 32
TARGET = Target("127.0.0.1", user="colibri", port=2222)


def agent(result: CommandResult | None = None) -> RemoteAgent:
    return RemoteAgent(SimpleNamespace(target=TARGET, run=lambda *a, **k: result), "/opt/colibri")


def answer(op: str, payload, status: int = 0):
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return agent().answer(op, CommandResult(status, text.encode() + b"\n", b""))


@pytest.mark.parametrize("op, payload, message", [
    ("plan", {"error": True}, "error = True; expected a JSON object"),
    ("plan", {"root": "/opt/colibri", "free": 10, "objects": {SHA: {"state": "stored", "offset": "10"}}},
     f"objects['{SHA}'].offset = '10'; expected a whole number >= 0"),
    ("plan", {"root": "/opt/colibri", "free": -1, "objects": {}}, "free = -1; expected a whole number >= 0"),
    ("plan", {"root": "relative", "free": 1, "objects": {}}, "root = 'relative'; expected an absolute path"),
    ("plan", {"free": 1, "objects": {}}, "root is missing"),
    ("stage", {"path": "/opt/colibri/bundles/ab", "reused": "no", "corrupt": []},
     "reused = 'no'; expected true or false"),
    ("receive", {"objects": {SHA: {"status": "sorted"}}},
     f"objects['{SHA}'].status = 'sorted'; expected one of stored, mismatch, short"),
    ("status", {"root": "/opt/colibri", "exists": True, "bundles": [{"id": "../x", "activated": 1, "files": 1,
                                                                      "bytes": 1}]},
     "bundles[0].id = '../x'; expected a bundle id"),
    ("status", {"root": "/opt/colibri", "exists": True, "bundles": []}, "store_objects is missing"),
    ("rollback", [1, 2], "the answer = [1, 2]; expected a JSON object"),
    ("probe", {"machine": "aarch64", "python": [3], "implementation": "cpython"},
     "python = [3]; expected a list of 2 to 2 entries"),
])
def test_a_malformed_answer_is_a_one_line_error_naming_host_operation_and_field(op, payload, message):
    with pytest.raises(RemoteAnswerError) as caught:
        answer(op, payload)
    text = str(caught.value)
    assert text.startswith(f"colibri@127.0.0.1:2222: remote {op} in '/opt/colibri': malformed answer: "), text
    assert message in text and "\n" not in text


def test_an_answer_that_is_no_json_or_cut_short_is_refused():
    for payload in ('{"root": "/opt/col', "", "not json"):
        with pytest.raises(RemoteAnswerError, match="the answer is not one JSON object"):
            answer("plan", payload)


def test_a_plan_that_leaves_out_an_object_or_overshoots_its_size_is_refused():
    root = {"root": "/opt/colibri", "free": 10}
    for objects, message in (({}, f"objects has no entry for {SHA}"),
                             ({SHA: {"state": "partial", "offset": 99}}, "partial at offset 99, for an object of 5")):
        store = DeviceStore(agent(CommandResult(0, json.dumps({**root, "objects": objects}).encode(), b"")))
        with pytest.raises(RemoteAnswerError, match=message):
            store.plan({SHA: 5})


def test_device_text_is_shown_with_control_characters_escaped():
    evil = {"error": {"errno": "ENOSPC", "path": "/x\x1b]0;owned\x07", "message": "disk\x1b[2J full\nrm -rf /"}}
    with pytest.raises(RemoteDiskFullError) as caught:
        answer("plan", evil)
    text = str(caught.value)
    assert "\x1b" not in text and "\n" not in text and "\x07" not in text, text
    assert "disk\\x1b[2J full\\nrm -rf /" in text, text
    assert printable("a\tb\x9b") == "a\\tb\\x9b"


def test_an_error_answer_still_raises_its_typed_error():
    with pytest.raises(RemoteCommandError, match="no bundle 12 under"):
        answer("switch", {"error": {"errno": "EINVAL", "path": "", "message": "no bundle 12 under /x"}}, 3)


def test_a_plan_with_a_partial_upload_of_every_byte_is_accepted():
    """A deploy killed after the last byte but before the rename leaves such a .partial; the next one resumes it."""
    plan = {"root": "/opt/colibri", "free": 10, "objects": {SHA: {"state": "partial", "offset": 5}}}
    store = DeviceStore(agent(CommandResult(0, json.dumps(plan).encode(), b"")))
    assert store.plan({SHA: 5}).objects[SHA].offset == 5
