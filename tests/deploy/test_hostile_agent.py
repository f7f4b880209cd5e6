"""A device whose agent answers badly (fake_agent.py, over the real loopback sshd): each operation in turn is
garbled, truncated, delayed, flooded and dropped. Every case ends in a typed, one-line DeployError naming the host
and the operation, and the device's `current` bundle is left as it was, byte for byte.

Each case starts from a copy of a store the real agent made (bundle a deployed; for `rollback`, a then b), deployed
once per session with the case's options (conftest.start_from)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from timeout_support import guard
from deploy_bundles import remote_tree

from colibri_sdk.deploy import DeployError, RemoteAnswerError, RemoteTimeoutError, deploy, rollback, status

pytestmark = pytest.mark.ssh

FAKE = Path(__file__).with_name("fake_agent.py")
FAULTS = ("garble", "truncate", "delay", "flood", "drop")
OPERATIONS = ("plan", "receive", "stage", "switch", "rollback", "status")
# The command timeout with a delaying agent (scaled by guard). Where real agent operations run before the delayed
# one under the same timeout (receive, stage, switch: plan, receive, stage first), it leaves a busy machine's agent
# starts time; where the delayed operation is the first command of its call (plan, status, rollback), nothing but
# the delayed agent runs under it.
FAULT_TIMEOUT_S = 3.0
FIRST_FAULT_TIMEOUT_S = 0.5
FIRST = ("plan", "status", "rollback")
SELFTEST = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --selftest"


def current_of(device_dir: Path) -> tuple:
    """(the bundle id `current` names, {path: sha256} of its folder)."""
    link = device_dir / "current"
    return os.readlink(link), remote_tree(link)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", OPERATIONS)
def test_a_misbehaving_agent_is_a_typed_error_and_current_is_untouched(target, options, device_dir, shared_bundle,
                                                                       start_from, op, fault):
    a, b = shared_bundle(), shared_bundle(model_seed=1, kernel_seed=1)
    options = replace(options, verify=op == "switch", remote_colibri=SELFTEST)
    start_from([a, b] if op == "rollback" else [a], verify=options.verify, remote_colibri=SELFTEST)
    before = current_of(device_dir)
    # Only the delaying agent needs a short command timeout; the other faults keep the ordinary one, so that a busy
    # machine's slow agent start is never mistaken for the fault. The agent stays silent 4 x FAULT_TIMEOUT_S, far
    # past the client's timeout; rollback's client waits longer (hashing time is allowed) than any delay a test can
    # afford, so its agent ends its silence, without an answer, at 4 x its own (short) timeout.
    wait = guard(FIRST_FAULT_TIMEOUT_S if op in FIRST else FAULT_TIMEOUT_S)
    agent_fault = f"delay={4 * (wait if op == 'rollback' else guard(FAULT_TIMEOUT_S))}" if fault == "delay" else fault
    hostile = replace(options, remote_python=shlex.join([sys.executable, str(FAKE), op, agent_fault]))
    slow = target.with_(command_timeout=wait) if fault == "delay" else target
    with pytest.raises(DeployError) as caught:
        if op == "rollback":
            rollback(slow, hostile)
        elif op == "status":
            status(slow, hostile)
        else:
            deploy(b, slow, hostile)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(target.label + ":"), message
    assert f"remote {op} in " in message, message
    if fault in ("garble", "truncate", "flood"):
        assert isinstance(caught.value, RemoteAnswerError), message
    if fault == "flood":
        assert "wrote more than 16,777,216 bytes" in message, message
    if fault == "drop":
        assert "connection was lost" in message, message
    if fault == "delay" and op not in ("rollback", "stage"):  # those two wait longer: hashing time is allowed
        assert isinstance(caught.value, RemoteTimeoutError), message
    assert current_of(device_dir) == before
