"""After the switch: the --on-activate command, the health check, and the rollback when either fails.

The pattern of balena, greenboot and Greengrass: a new bundle counts only once the service restarted on it and
answered. Sequence (deployment.deploy, after `current` points at the new bundle):

1. `--on-activate CMD` runs on the device (`sh -c CMD`), e.g. `sudo systemctl restart colibri-qc@line1`;
2. the health check: `--health-cmd CMD` (exit status 0 = healthy), or else the bundle's self-test on the device
   (`colibri-sdk verify --backend B REMOTE_DIR/current`, B as --verify-backend);
3. on a failure in 1 or 2, `undo`: the bundle before it in the history is current again (or none, on a first
   deploy), the on-activate command is run once more so the service restarts on it, and HealthCheckError says
   what failed and what is current now. A bundle that was already current before the deploy is not rolled back
   (the failure is reported all the same).

Both commands see COLIBRI_BUNDLE (REMOTE_DIR/current, absolute) and COLIBRI_BUNDLE_ID in their environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from .connection import Connection
from .errors import HealthCheckError, RemoteVerifyError
from .remote import device_error_line, run_verify
from .store import DeviceStore


@dataclass(frozen=True)
class HookResult:
    """One command's outcome: `ok`, and the line that says why not (or the self-test line)."""

    ok: bool
    line: str


def run_hook(conn: Connection, command: str, env: dict, timeout: float) -> HookResult:
    result = conn.run_shell(command, env, timeout)
    output = (result.stdout + b"\n" + result.stderr).decode("utf-8", "replace")
    if result.exit_status == 0:
        return HookResult(True, "")
    return HookResult(False, f"exit status {result.exit_status}: {device_error_line(output)}")


def activate_and_check(conn: Connection, store: DeviceStore, bundle_id: str, root: str, options,
                       colibri: str, changed: bool = True, replaced_mtime: float | None = None) -> tuple:
    """Run --on-activate and the health check for the bundle just made current.

    Args:
        changed: False when the bundle was already current before this deploy: a failure is then reported but
            nothing is rolled back (the deploy changed nothing to undo).
        replaced_mtime: the activation time the switch replaced (its answer's "replaced_mtime"): a rollback gives
            it back, so --status shows the bundle's last good activation, not the failed one.

    Returns:
        (on_activate line, health line) for the result.

    Raises:
        HealthCheckError: either failed; the previous bundle was made current again.
    """
    current = f"{root.rstrip('/')}/current"
    env = {"COLIBRI_BUNDLE": current, "COLIBRI_BUNDLE_ID": bundle_id}
    timeout = options.verify_timeout
    failure, health = "", ""
    if options.on_activate:
        hook = run_hook(conn, options.on_activate, env, timeout)
        if not hook.ok:
            failure = f"--on-activate {options.on_activate!r} failed ({hook.line})"
    if not failure:
        if options.health_cmd:
            hook = run_hook(conn, options.health_cmd, env, timeout)
            health = f"health check {options.health_cmd!r} passed"
            if not hook.ok:
                failure = f"health check {options.health_cmd!r} failed ({hook.line})"
        else:
            try:
                health = run_verify(conn, colibri, current, timeout, options.verify_backend).selftest
            except RemoteVerifyError as exc:
                text = str(exc).split(": ", 1)[-1].replace("; the active bundle was not changed", "")
                failure = f"health check (the self-test of the active bundle) failed: {text}"
    if not failure:
        return ("on-activate ok" if options.on_activate else ""), health
    if not changed:
        raise HealthCheckError(f"{conn.target.label}: bundle {bundle_id} was already the active bundle, and "
                               f"{failure}; nothing was rolled back (this deploy changed nothing)")
    answer = store.undo(bundle_id, timeout=conn.target.command_timeout + 8e9 / 50e6, replaced_mtime=replaced_mtime)
    back = answer.get("current")
    now = f"bundle {back} is current again" if back else "no bundle is current now (this was the first)"
    rerun = ""
    if options.on_activate and back:
        again = run_hook(conn, options.on_activate, {**env, "COLIBRI_BUNDLE_ID": back}, timeout)
        rerun = "; --on-activate re-run for it" + (" ok" if again.ok else f" and failed too ({again.line})")
    raise HealthCheckError(f"{conn.target.label}: bundle {bundle_id} was activated, but {failure}; rolled back: "
                           f"{now}{rerun}")
