"""Bundle folders: `stage ROOT ID FRESH KEEP SHA:PATH...`, re-hashing a folder against its manifest, listing
and pruning.

`stage` builds bundles/ID from store objects (hard links) and hashes every file of it, except the objects listed
in FRESH (comma-separated, hashed by `receive` this session); a corrupt object is deleted and reported, nothing is
switched; otherwise, with KEEP >= 0, `switch` follows at once (`pointers.op_stage`, the operation that stages and
then switches); KEEP -1 stages only.

shutil is imported where a folder is removed (`remove_tree`): every remote command starts a Python with all the
agent's modules, and the operations that remove nothing should not pay for it.
"""

import hashlib
import json
import os

from .common import AgentError, check_id, check_rel, check_sha, fsync_dir, hash_file, is_bundle_id, remove_quietly


def remove_tree(path, ignore_errors=False):
    import shutil

    shutil.rmtree(path, ignore_errors=ignore_errors)


def parse_items(items):
    pairs = []
    for item in items:
        sha, path = item.split(":", 1)
        check_rel(path)
        pairs.append((check_sha(sha), path))
    return pairs


def verify_tree(folder, pairs, skip):
    """sha256 of every file of `folder` against `pairs`; returns the list of mismatching (sha, path)."""
    bad = []
    for sha, path in pairs:
        if sha in skip:
            continue
        full = os.path.join(folder, *path.split("/"))
        if not os.path.isfile(full) or hash_file(full) != sha:
            bad.append((sha, path))
    return bad


def stage(root, bundle_id, pairs, fresh):
    """Build and verify bundles/ID; caller holds the lock. Returns {"path", "reused", "corrupt"}."""
    bundles = os.path.join(root, "bundles")
    final = os.path.join(bundles, bundle_id)
    for name in os.listdir(bundles):
        if name.startswith((".staging-", ".trash-")):
            remove_tree(os.path.join(bundles, name), ignore_errors=True)
    if os.path.isdir(final):
        bad = verify_tree(final, pairs, skip=())
        if not bad:
            return {"path": final, "reused": True, "corrupt": []}
        # A corrupt bundle folder shares its inodes with the store: drop both; the next stage rebuilds it.
        for sha, _ in bad:
            remove_quietly(os.path.join(root, "store", sha))
        os.rename(final, os.path.join(bundles, ".trash-%s-%d" % (bundle_id, os.getpid())))
        return {"path": final, "reused": False, "corrupt": sorted(set(s for s, _ in bad))}
    staging = os.path.join(bundles, ".staging-%s-%d" % (bundle_id, os.getpid()))
    missing = []
    for sha, path in pairs:
        target = os.path.join(staging, *path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(os.path.join(root, "store", sha), target)
        except FileNotFoundError:
            missing.append(sha)
    bad = verify_tree(staging, [p for p in pairs if p[0] not in missing], skip=fresh)
    corrupt = sorted(set(missing) | set(s for s, _ in bad))
    if corrupt:
        for sha in corrupt:
            remove_quietly(os.path.join(root, "store", sha))
        remove_tree(staging)
        return {"path": final, "reused": False, "corrupt": corrupt}
    os.rename(staging, final)
    fsync_dir(bundles)
    return {"path": final, "reused": False, "corrupt": []}


def manifest_pairs(folder):
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        raw = f.read()
    files = json.loads(raw.decode("utf-8"))["files"]
    return hashlib.sha256(raw).hexdigest(), [(check_sha(e["sha256"]), e["path"]) for e in files]


def check_bundle(root, bundle_id):
    """Re-hash bundles/ID against its manifest (and the manifest against the id) before switching to it.

    Raises:
        AgentError: no such folder, or a file (manifest.json included) that does not match.
    """
    check_id(bundle_id)
    folder = os.path.join(root, "bundles", bundle_id)
    if not os.path.isdir(folder):
        raise AgentError("no bundle %s under %s (see --status)" % (bundle_id, os.path.join(root, "bundles")))
    manifest_sha, pairs = manifest_pairs(folder)
    for _, path in pairs:
        check_rel(path)
    bad = verify_tree(folder, pairs, skip=())
    if not manifest_sha.startswith(bundle_id) or bad:
        names = ["manifest.json"] if not manifest_sha.startswith(bundle_id) else [p for _, p in bad]
        raise AgentError("bundle %s is corrupt (%s): not switching to it" % (bundle_id, ", ".join(names)))


def list_bundles(root):
    """Bundle folders (named by a bundle id: nothing else is listed, so nothing else is pruned), newest activation
    first: (id, mtime)."""
    bundles = os.path.join(root, "bundles")
    rows = []
    for name in os.listdir(bundles):
        full = os.path.join(bundles, name)
        if is_bundle_id(name) and os.path.isdir(full) and not os.path.islink(full):
            rows.append((name, os.stat(full).st_mtime))
    rows.sort(key=lambda r: r[1], reverse=True)
    return rows


def prune_bundles(root, keep, protected):
    """Keep the `keep` most recently activated bundles besides the `protected` ones (current and previous);
    delete the other bundle folders (list_bundles: only folders named by a bundle id). Returns the ids removed."""
    removed = []
    others = [name for name, _ in list_bundles(root) if name not in protected]
    for name in others[keep:]:
        remove_tree(os.path.join(root, "bundles", name))
        removed.append(name)
    return removed
