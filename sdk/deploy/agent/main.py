"""The operation table: `main(argv)` runs `OP ROOT ARG...` and prints exactly one JSON object on stdout."""

import errno

from .common import AgentError, emit, root_dir
from .objects import op_plan
from .pointers import op_rollback, op_stage, op_switch, op_undo
from .receiver import op_receive
from .runtime import op_install, op_probe
from .status import op_status

OPS = {"plan": op_plan, "receive": op_receive, "stage": op_stage, "switch": op_switch, "rollback": op_rollback,
       "undo": op_undo, "status": op_status, "probe": op_probe, "install": op_install}
# Dependency order of the modules, as the bootstrap installs them (colibri_sdk.deploy.remote.agent_source).
MODULES = ("common", "receiver", "objects", "runtime", "bundles", "pointers", "status", "main")


def main(argv):
    if len(argv) < 2 or argv[0] not in OPS:
        emit({"error": {"errno": "EINVAL", "path": "", "message": "usage: OP ROOT ARG... with OP in %s" % sorted(OPS)}})
        return 2
    try:
        OPS[argv[0]](root_dir(argv[1]), *argv[2:])
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        emit({"error": {"errno": name, "path": exc.filename or "", "message": exc.strerror or str(exc)}})
        return 3
    except (AgentError, ValueError, KeyError, TypeError) as exc:
        emit({"error": {"errno": "EINVAL", "path": "", "message": str(exc)}})
        return 3
    return 0
