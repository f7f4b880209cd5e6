"""A --remote-dir that holds what the store did not make: the user's folder in bundles/, a `history`, `current` or
`store` of their own. The store refuses it with one line naming the entry and what is allowed, before anything
there changes, and never removes or overwrites it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from colibri_sdk.deploy import DeployOptions, RemoteCommandError, deploy, rollback, status
from colibri_sdk.deploy.agent.bundles import prune_bundles
from deploy_bundles import write_bundle

pytestmark = pytest.mark.ssh
NOTHING_CHANGED = "nothing was changed: move it away or choose another --remote-dir"


def tree(root: Path) -> dict:
    """{relative path: file bytes, or None for a folder, or 'link -> target'} under `root`."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            out[rel] = None
        else:
            out[rel] = path.read_bytes()
    return out


def options_for(root: Path, keep: int = 3) -> DeployOptions:
    return DeployOptions(remote_dir=str(root), keep=keep, remote_python=sys.executable)


def three_bundles(shared_bundle) -> list:
    return [shared_bundle(kernel_seed=i) for i in range(3)]


def test_a_folder_of_the_user_in_bundles_is_refused_before_anything_is_created(tmp_path, target, shared_bundle):
    root = tmp_path / "H"
    (root / "bundles" / "orin").mkdir(parents=True)
    (root / "bundles" / "orin" / "notes.txt").write_text("my work")
    before = tree(root)
    allowed = "allowed in bundles/: the bundle folders a deploy made, named by their id (lowercase hex digits)"
    with pytest.raises(RemoteCommandError, match=re.escape(f"{str(root / 'bundles' / 'orin')!r} is a folder the "
                                                           f"store did not make; {allowed}; {NOTHING_CHANGED}")):
        deploy(shared_bundle(), target, options_for(root))
    assert tree(root) == before  # no store/, no .lock, no bundles/<id>


def test_a_folder_put_into_a_store_is_never_pruned(tmp_path, target, shared_bundle, start_from, device_dir):
    a, b, c = three_bundles(shared_bundle)
    first = start_from([a, b])
    user = device_dir / "bundles" / "orin"
    user.mkdir()
    (user / "notes.txt").write_text("my work")
    with pytest.raises(RemoteCommandError, match=re.escape(f"{str(user)!r} is a folder the store did not make")):
        deploy(c, target, options_for(device_dir, keep=0))
    assert (user / "notes.txt").read_text() == "my work"
    assert os.readlink(device_dir / "current") == f"bundles/{first[1].bundle_id}"  # the deploy changed nothing
    with pytest.raises(RemoteCommandError, match=re.escape(f"{str(user)!r} is a folder the store did not make")):
        rollback(target, options_for(device_dir))
    with pytest.raises(RemoteCommandError, match=re.escape(f"{str(user)!r} is a folder the store did not make")):
        status(target, options_for(device_dir))


def test_prune_removes_bundle_ids_only(tmp_path):
    for name in ("0123456789abcdef", "fedcba9876543210", "orin", "ORIN0123"):
        (tmp_path / "bundles" / name).mkdir(parents=True)
    assert prune_bundles(str(tmp_path), 0, {"fedcba9876543210"}) == ["0123456789abcdef"]
    assert sorted(os.listdir(tmp_path / "bundles")) == ["ORIN0123", "fedcba9876543210", "orin"]


@pytest.mark.parametrize("name, make, message", [
    ("history", lambda p: p.write_text("mine"),
     "is a file the store did not write (not a JSON list of bundle ids); allowed: the history a deploy wrote, or "
     "none"),
    ("current", lambda p: p.write_text("mine"),
     "is a regular file, not the store's pointer; allowed: a symbolic link to bundles/<id>, or none"),
    ("previous", lambda p: p.symlink_to("/etc"),
     "is a symbolic link to '/etc', not the store's pointer; allowed: a symbolic link to bundles/<id>, or none"),
    ("store", lambda p: p.write_text("mine"),
     "is a regular file; allowed: the store/ folder a deploy made, or none"),
    ("store/notes.txt", lambda p: p.parent.mkdir() or p.write_text("mine"),
     "is a file the store did not make; allowed in store/: objects named by their sha256 (64 lowercase hex digits, "
     ".partial while uploading)"),
    ("bundles", lambda p: p.write_text("mine"),
     "is a regular file; allowed: the bundles/ folder a deploy made, or none"),
])
def test_an_entry_that_is_not_the_stores_is_refused_and_left_as_it_was(tmp_path, target, shared_bundle, name, make,
                                                                       message):
    root = tmp_path / "H"
    root.mkdir()
    make(root / name)
    before = tree(root)
    with pytest.raises(RemoteCommandError) as info:
        deploy(shared_bundle(), target, options_for(root))
    assert str(info.value).endswith(f"{str(root / name)!r} {message}; {NOTHING_CHANGED}"), str(info.value)
    assert "\n" not in str(info.value)
    assert tree(root) == before


def test_status_of_a_folder_that_is_not_a_store(tmp_path, target):
    root = tmp_path / "H"
    (root / "bundles").mkdir(parents=True)
    with pytest.raises(RemoteCommandError, match=re.escape(
            f"status in {str(root)!r}: {str(root)!r} is not a colibri store (no store/); allowed: a --remote-dir "
            f"a deploy made")):
        status(target, options_for(root))
    assert sorted(os.listdir(root)) == ["bundles"]


def test_a_store_a_deploy_made_still_deploys_and_prunes(tmp_path, target, shared_bundle, start_from, device_dir):
    a, b, c = three_bundles(shared_bundle)
    start_from([a, b])
    result = deploy(c, target, options_for(device_dir, keep=0))
    assert sorted(os.listdir(device_dir / "bundles")) == sorted([result.previous, result.bundle_id])
