"""A bundle file changed on this machine after the bundle's check, just before it is read to be sent: cut short,
grown, replaced by a link to /dev/zero, a FIFO, a folder, or deleted. Each is a BundleError naming the file, the
deploy never hangs and never reads past the manifest's size, and the device's `current` bundle is untouched."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from deploy_bundles import write_bundle
from timeout_support import guard

from colibri_sdk.deploy import deploy
from colibri_sdk.errors import BundleError

LARGE = 6 << 20  # above transfer.SMALL_BYTES: model.colibri gets a channel of its own


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def grow(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 5000)


def to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def to_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def to_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


CHANGES = {
    "large-cut-short": ("model.colibri", LARGE, truncate, r"'model\.colibri' changed on this machine: it now ends "
                                                          r"after \d+ bytes, the manifest says \d+"),
    "large-grown": ("model.colibri", LARGE, grow, r"'model\.colibri' changed on this machine: it is now longer"),
    "small-grown": ("kernels/router.ptx", 3 << 20, grow, r"'kernels/router\.ptx' changed on this machine: it is now "
                                                         r"longer"),
    "link-to-dev-zero": ("model.colibri", LARGE, to_dev_zero, r"model\.colibri: a symbolic link; allowed: a regular "
                                                              r"file inside the bundle"),
    "fifo": ("model.colibri", 3 << 20, to_fifo, r"model\.colibri: a FIFO; allowed: a regular file"),
    "folder": ("kernels/router.ptx", 3 << 20, to_folder, r"router\.ptx: a folder; allowed: a regular file"),
    "deleted": ("model.colibri", LARGE, Path.unlink, r"model\.colibri: cannot be opened: No such file"),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_file_changed_before_it_is_read_is_a_bundle_error(tmp_path, target, options, device_dir, monkeypatch,
                                                            shared_bundle, start_from, case):
    from colibri_sdk.deploy import transfer

    name, model_bytes, change, message = CHANGES[case]
    start_from([shared_bundle()])
    before = os.readlink(device_dir / "current")
    b = write_bundle(tmp_path / "b", model_bytes=model_bytes, model_seed=1, kernel_seed=1)
    real, changed = transfer.read_chunks, []

    def changing(path, offset, chunk=transfer.CHUNK_BYTES):  # after the bundle's check, before the first read
        if Path(path) == b / name and not changed:
            changed.append(case)
            change(Path(path))
        yield from real(path, offset, chunk)

    monkeypatch.setattr(transfer, "read_chunks", changing)
    outcome = []

    def run():
        try:
            deploy(b, target, options)
            outcome.append(None)
        except Exception as exc:  # the assertion below names it
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(guard(300))
    assert not worker.is_alive(), f"{case}: the deploy still runs after {guard(300):g} s"
    assert changed == [case]
    (error,) = outcome
    assert isinstance(error, BundleError), repr(error)
    assert "\n" not in str(error)
    assert re.search(message, str(error)), str(error)
    assert os.readlink(device_dir / "current") == before
