"""The operation table: `main(argv)` runs `OP ROOT ARG...` and prints exactly one JSON object on stdout.

An operation's module is imported when it runs (the bootstrap compiles a module when it is first imported): every
remote command starts a Python, and `plan` should not compile and import what only `receive` or `install` use.
"""

import errno
import importlib

from .common import AgentError, emit, root_dir

# operation -> (module, function)
OPS = {"plan": ("objects", "op_plan"), "receive": ("receiver", "op_receive"), "stage": ("pointers", "op_stage"),
       "switch": ("pointers", "op_switch"), "rollback": ("pointers", "op_rollback"), "undo": ("pointers", "op_undo"),
       "status": ("status", "op_status"), "probe": ("runtime", "op_probe"), "install": ("runtime", "op_install")}
# Every module sent (colibri_sdk.deploy.remote.agent_source), main last.
MODULES = ("common", "layout", "receiver", "objects", "runtime", "bundles", "pointers", "status", "main")


def main(argv):
    if len(argv) < 2 or argv[0] not in OPS:
        emit({"error": {"errno": "EINVAL", "path": "", "message": "usage: OP ROOT ARG... with OP in %s" % sorted(OPS)}})
        return 2
    module, function = OPS[argv[0]]
    try:
        operation = getattr(importlib.import_module("." + module, __package__), function)
        operation(root_dir(argv[1]), *argv[2:])
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        emit({"error": {"errno": name, "path": exc.filename or "", "message": exc.strerror or str(exc)}})
        return 3
    except (AgentError, ValueError, KeyError, TypeError) as exc:
        emit({"error": {"errno": "EINVAL", "path": "", "message": str(exc)}})
        return 3
    return 0
