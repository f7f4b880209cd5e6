"""A device agent that answers badly, driven over the real loopback sshd (tests/deploy/test_hostile_agent.py).

Given as the deploy's `--remote-python`, it receives what the device's Python would:

    PYTHON fake_agent.py OP FAULT -c PROGRAM AGENT_OP ROOT ARG...

Every operation but OP runs the real agent (PROGRAM, as `python -c` would run it). OP is not performed (so the
device's store and its `current` pointer stay as they were); instead the agent answers with FAULT:

    garble     one JSON object whose keys are every answer's, each with a value of the wrong type
    truncate   the first bytes of an answer, cut in the middle, exit status 0
    delay      no answer for DELAY_S seconds (longer than the tests' command timeout), then exit without one;
               `delay=SECONDS` sets another time
    flood      FLOOD_BYTES of output (past the client's 16 MiB cap), then a well-formed answer line
    drop       the SSH connection dropped: the sshd process serving this session is killed

`PYTHON fake_agent.py --selftest verify ...` prints the line a passing `colibri-sdk verify` prints on CUDA (the
tests' --remote-colibri, so that `switch` is reached with --verify on a machine without a GPU).
"""

import json
import os
import signal
import sys
import time

DELAY_S = 12.0
FLOOD_BYTES = 20 << 20
GARBLED = {"root": ["/not", "a path"], "free": "plenty", "objects": [1, 2, 3], "path": 7, "reused": "no",
           "corrupt": {"a": 1}, "current": {"id": 1}, "previous": 3.5, "history": "abc", "exists": "yes",
           "bundles": 5, "removed": None, "machine": [], "python": "3.10"}
TRUNCATED = '{"root": "/tmp/colibri", "free": 12345, "objects": {"'


def session_sshd() -> int:
    """The pid of the nearest ancestor that is an sshd process (the one serving this SSH connection)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().startswith("sshd"):
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise SystemExit("no sshd above this process")


def drain_stdin() -> None:
    while os.read(0, 1 << 20):
        pass


def misbehave(op: str, fault: str) -> int:
    if fault == "drop":
        os.kill(session_sshd(), signal.SIGKILL)
        time.sleep(DELAY_S)
        return 0
    if fault.startswith("delay"):
        time.sleep(float(fault.partition("=")[2] or DELAY_S))
        return 0
    if op == "receive":
        drain_stdin()
    if fault == "garble":
        print(json.dumps(GARBLED))
    elif fault == "truncate":
        sys.stdout.write(TRUNCATED)
    elif fault == "flood":
        block = b"x" * (1 << 20)
        for _ in range(FLOOD_BYTES // len(block)):
            os.write(1, block)
        print(json.dumps({"error": {"errno": "EIO", "path": "", "message": "after the flood"}}))
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    sys.stdout.flush()
    return 0


def main(argv) -> int:
    if argv[0] == "--selftest":
        print("  self-test: self-test passed on cuda: max abs err 0, max rel err 0 (rtol 0.01, atol 0.001)")
        return 0
    op, fault, dash_c, program, agent_argv = argv[0], argv[1], argv[2], argv[3], argv[4:]
    assert dash_c == "-c", argv[:3]
    if agent_argv[0] != op:
        sys.argv = ["-c", *agent_argv]
        exec(compile(program, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    return misbehave(op, fault)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
