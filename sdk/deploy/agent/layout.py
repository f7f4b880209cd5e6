"""What under ROOT is the store's: `check_layout` refuses a ROOT holding an entry the store did not make, before
an operation changes anything there, and `make_dirs` creates the folders after that check.

The store's entries (agent/__init__.py, "Layout under ROOT"): `bundles/` holding bundle folders named by their id
(and `.staging-ID-PID` / `.trash-ID-PID` folders of a stage in progress), `store/` holding objects named by their
sha256 (`.partial` while uploading), `current` and `previous` as symbolic links to bundles/ID, `history` as a JSON
list of bundle ids, `.lock` as a regular file. Anything else there (a user's folder in bundles/, a file of theirs
named `history`) would be deleted or overwritten by a deploy: it is named and nothing is changed. Other names
directly under ROOT are left alone and not looked at.
"""

import errno
import json
import os
import re
import stat

from .common import AgentError, is_bundle_id

TEMPORARY = re.compile(r"\.(staging|trash)-[0-9a-f]{1,64}-[0-9]{1,10}\Z")  # bundles.stage's folders
OBJECT = re.compile(r"[0-9a-f]{64}(\.partial)?\Z")
POINTERS = ("current", "previous")
ADVICE = "nothing was changed: move it away or choose another --remote-dir"


def kind_of(mode):
    """What a file of this st_mode is, in words."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "a device"


def refuse(path, what, allowed):
    raise AgentError("%r %s; %s; %s" % (path, what, allowed, ADVICE))


def lstat_or_none(path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_folder(root, name, accepts, allowed):
    """ROOT/name is absent, or a real folder whose every entry `accepts(entry name, st_mode)`."""
    folder = os.path.join(root, name)
    st = lstat_or_none(folder)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        refuse(folder, "is " + kind_of(st.st_mode), "allowed: the %s/ folder a deploy made, or none" % name)
    for entry in sorted(os.listdir(folder)):
        mode = os.lstat(os.path.join(folder, entry)).st_mode
        if not accepts(entry, mode):
            noun = "a file" if stat.S_ISREG(mode) else kind_of(mode)
            refuse(os.path.join(folder, entry), "is %s the store did not make" % noun, allowed)


def is_bundle_entry(name, mode):
    return stat.S_ISDIR(mode) and (is_bundle_id(name) or TEMPORARY.match(name) is not None)


def is_object_entry(name, mode):
    return stat.S_ISREG(mode) and OBJECT.match(name) is not None


def check_pointer(root, name):
    """ROOT/name is absent or a symbolic link to bundles/ID (relative, as `set_pointer` makes it, or absolute)."""
    path = os.path.join(root, name)
    st = lstat_or_none(path)
    if st is None:
        return
    allowed = "allowed: a symbolic link to bundles/<id>, or none"
    if not stat.S_ISLNK(st.st_mode):
        refuse(path, "is %s, not the store's pointer" % kind_of(st.st_mode), allowed)
    target = os.readlink(path)
    folder = os.path.normpath(os.path.join(root, target))
    bundles = os.path.dirname(folder)
    if not is_bundle_id(os.path.basename(folder)) or os.path.basename(bundles) != "bundles" \
            or os.path.realpath(os.path.dirname(bundles)) != os.path.realpath(root):
        refuse(path, "is a symbolic link to %r, not the store's pointer" % target, allowed)


def check_history(root):
    """ROOT/history is absent or a regular file holding a JSON list of bundle ids."""
    path = os.path.join(root, "history")
    st = lstat_or_none(path)
    if st is None:
        return
    allowed = "allowed: the history a deploy wrote, or none"
    if not stat.S_ISREG(st.st_mode):
        refuse(path, "is %s" % kind_of(st.st_mode), allowed)
    try:
        with open(path, "rb") as f:
            history = json.loads(f.read(1 << 20).decode("utf-8"))
    except ValueError:
        history = None
    if not isinstance(history, list) or not all(isinstance(h, str) and is_bundle_id(h) for h in history):
        refuse(path, "is a file the store did not write (not a JSON list of bundle ids)", allowed)


def check_layout(root):
    """Refuse ROOT when an entry the store uses is not the store's (see the module docstring); an absent ROOT or
    one without such entries passes.

    Raises:
        AgentError: the entry, what it is and what is allowed there.
    """
    if not os.path.isdir(root):
        return
    check_folder(root, "bundles", is_bundle_entry, "allowed in bundles/: the bundle folders a deploy made, named by "
                                                   "their id (lowercase hex digits)")
    check_folder(root, "store", is_object_entry, "allowed in store/: objects named by their sha256 (64 lowercase "
                                                 "hex digits, .partial while uploading)")
    for name in POINTERS:
        check_pointer(root, name)
    check_history(root)
    lock = os.path.join(root, ".lock")
    st = lstat_or_none(lock)
    if st is not None and not stat.S_ISREG(st.st_mode):
        refuse(lock, "is " + kind_of(st.st_mode), "allowed: the lock file a deploy made, or none")


def make_dirs(root):
    """Create ROOT, ROOT/store and ROOT/bundles, after `check_layout`."""
    if os.path.lexists(root) and not os.path.isdir(root):
        raise OSError(errno.ENOTDIR, "the remote dir exists but is not a folder", root)
    check_layout(root)
    for sub in ("", "store", "bundles"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
