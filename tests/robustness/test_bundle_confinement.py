"""A bundle is read only through what is inside its folder: links, strict JSON, control characters in paths, paths
the manifest does not list, a weights header or NaN weights the manifest does not vouch for (docs/build.md,
"Reading rules"). Every refusal is a BundleError, one line on the command line, for verify, run and inspect."""

from __future__ import annotations

import os
import re
import shutil
import sys

import numpy as np
import pytest
from colibri_sdk.bundle import Bundle, canonical_json, file_sha256, manifest_digest
from colibri_sdk.errors import BundleError
from colibri_sdk.format.constants import HEADER_SIZE
from colibri_sdk.runtime import Runtime
from robustness_helpers import cli_error, load_manifest, save_manifest
from timeout_support import guard

COMMANDS = (("verify", "--backend", "cpu"), ("run", "--backend", "cpu", "--iters", "1"), ("inspect",))

# ---- watching opens: nothing may be opened through a link -----------------------------------------------------------
_OPENS: list | None = None


def _audit(event: str, args) -> None:
    if _OPENS is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENS.append((os.fsdecode(args[0]), args[2] if len(args) > 2 and isinstance(args[2], int) else 0))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only while _OPENS is a list


def opens_through_links(action) -> list[str]:
    """Run `action` and return every path it opened by a route that follows a symbolic link: a path whose
    resolved form differs from its plain absolute form, opened without O_NOFOLLOW. (Opens relative to a folder
    descriptor name one component and always pass O_NOFOLLOW in the reader.)"""
    global _OPENS
    _OPENS = []
    try:
        try:
            action()
        except BundleError:
            pass
        seen = list(_OPENS)
    finally:
        _OPENS = None
    return [p for p, flags in seen
            if not flags & os.O_NOFOLLOW and os.path.isabs(p) and os.path.realpath(p) != os.path.abspath(p)]


@pytest.fixture
def outside(tmp_path, small_bundle_dir):
    """A complete copy of the bundle outside the bundle under test: what a link would point at."""
    return shutil.copytree(small_bundle_dir, tmp_path / "outside")


def _link(bundle, rel: str, target) -> None:
    path = bundle / rel
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    os.symlink(target, path)


@pytest.mark.parametrize("rel", ["manifest.json", "model.colibri", "kernels", "selftest", "selftest/input.npy",
                                 "kernels/routing.sm_87.cubin"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_link_is_refused_before_a_byte_is_read_through_it(bundle, outside, rel, verify):
    """Today's bug: a linked manifest.json was read and trusted, a linked kernels/ hashed from outside. The link
    points at an identical copy, so only the link itself can be the reason for the refusal."""
    _link(bundle, rel, outside / rel)
    expected = rf"^{re.escape(str(bundle / rel) if rel == 'manifest.json' else rel)}: a symbolic link; a bundle is"

    def load():
        Bundle.open(bundle, verify=verify)

    with pytest.raises(BundleError, match=expected):
        load()
    assert opens_through_links(load) == []


def test_a_link_inside_the_bundle_to_another_file_of_it_is_refused_too(bundle):
    os.symlink("model.colibri", bundle / "kernels" / "alias")
    with pytest.raises(BundleError, match=r"^kernels/alias: a symbolic link"):
        Bundle.open(bundle)


def test_a_linked_bundle_folder_is_fine(bundle, tmp_path):
    """The folder itself may be a link (a deploy's `current`): only what is below it is confined."""
    os.symlink(bundle, tmp_path / "current")
    assert Bundle.open(tmp_path / "current").shape == Bundle.open(bundle).shape


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_linked_manifest_on_the_command_line(bundle, outside, capsys, command):
    _link(bundle, "manifest.json", outside / "manifest.json")
    err = cli_error(capsys, command[0], str(bundle), *command[1:])
    assert err.endswith("manifest.json: a symbolic link; a bundle is read only through regular files and folders "
                        "inside it (nothing through a link)")


def test_a_fifo_where_a_listed_file_belongs_is_refused_without_hanging(bundle):
    (bundle / "selftest" / "output.npy").unlink()
    os.mkfifo(bundle / "selftest" / "output.npy")
    for verify in (False, True):
        with pytest.raises(BundleError, match=r"^selftest/output\.npy: a FIFO; allowed: a regular file"):
            Bundle.open(bundle, verify=verify)


def test_an_unlisted_fifo_is_refused_by_verify(bundle):
    os.mkfifo(bundle / "kernels" / "pipe")
    with pytest.raises(BundleError, match=r"^kernels/pipe: a FIFO; a bundle holds only regular files and folders"):
        Bundle.open(bundle)


# ---- strict JSON ----------------------------------------------------------------------------------------------------
def _edit_raw(bundle, old: str, new: str) -> None:
    path = bundle / "manifest.json"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("NaN", r"NaN in the manifest; allowed: finite JSON numbers only"),
        ("Infinity", r"Infinity in the manifest; allowed: finite JSON numbers only"),
        ("-Infinity", r"-Infinity in the manifest; allowed: finite JSON numbers only"),
        ("1e400", r"the number 1e400 in the manifest is beyond float range"),
    ],
)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_nan_and_infinity_are_refused_as_one_line(bundle, capsys, value, message, command):
    """Today these passed the schema and crashed canonical_json with a traceback in verify, run and Runtime.load."""
    _edit_raw(bundle, '"atol": 0.01', f'"atol": {value}')
    err = cli_error(capsys, command[0], str(bundle), *command[1:])
    assert re.search(message, err), err
    with pytest.raises(BundleError, match=message):
        Runtime.load(bundle, backend="cpu", verify=False)


def test_duplicate_json_key_is_refused(bundle):
    _edit_raw(bundle, '"aggregation": "ordered",', '"aggregation": "ordered",\n  "aggregation": "atomic",')
    with pytest.raises(BundleError, match=r"duplicate key 'aggregation' in the manifest"):
        Bundle.open(bundle, verify=False)


# ---- path fields ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("char", ["\x00", "\x1b", "\n", "\x7f", "\u200b", "\udc80"],
                         ids=["nul", "escape", "newline", "del", "zero-width-space", "lone-surrogate"])
def test_control_characters_in_paths_are_refused_and_shown_escaped(bundle, capsys, char):
    manifest = load_manifest(bundle)
    manifest["selftest"]["input"] = f"selftest/in{char}put.npy"
    (bundle / "manifest.json").write_bytes(canonical_json(manifest))
    shown = repr(f"selftest/in{char}put.npy")
    for command in COMMANDS:
        err = cli_error(capsys, command[0], str(bundle), *command[1:])
        assert f"selftest.input: path {shown} holds the control character" in err, err
        assert char not in err  # escaped, never raw (a raw ESC would drive the terminal)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["kernels"][0].update(cubin="kernels/elsewhere.sm_87.cubin"),
         r"kernels\[0\]\.cubin = 'kernels/elsewhere\.sm_87\.cubin' is not in files"),
        (lambda m: m["kernels"][1].update(ptx="model.colibri.ptx"), r"kernels\[1\]\.ptx = 'model\.colibri\.ptx' is not in files"),
        (lambda m: m["weights"].update(file="other.colibri"), r"weights\.file = 'other\.colibri' is not in files"),
        (lambda m: m["files"].pop(0), r"kernels\[\d\]\.ptx = 'kernels/down\.(b1t16\.)?ptx' is not in files"),
    ],
    ids=["cubin", "ptx", "weights", "unlisted-ptx"],
)
def test_referenced_paths_must_be_listed_files(bundle, edit, message):
    manifest = load_manifest(bundle)
    edit(manifest)
    save_manifest(bundle, manifest)
    with pytest.raises(BundleError, match=message):
        Bundle.open(bundle, verify=False)


# ---- weights --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value"), [("top_k", 1), ("routing", 1), ("version", 0x0200)])
def test_verify_refuses_a_weights_header_the_manifest_does_not_record(bundle, key, value):
    """A careful forger keeps the digest consistent: the header comparison must still catch it, in verify too
    (today only a backend's open_weights compared, and only some fields)."""
    manifest = load_manifest(bundle)
    actual = manifest["weights"]["header"][key]
    manifest["weights"]["header"][key] = value
    save_manifest(bundle, manifest)
    with pytest.raises(BundleError, match=rf"^model\.colibri: header {key} = {actual}, but the manifest's "
                                          rf"weights\.header\.{key} = {value}; the weights do not belong"):
        Bundle.open(bundle)


@pytest.mark.parametrize(("word", "name"), [(0x7E00, "NaN"), (0x7C00, "+Inf"), (0xFC00, "-Inf")])
def test_verify_refuses_nan_or_inf_weights(bundle, capsys, word, name):
    """fp16 bit patterns written at a known element of the down_proj block; the manifest is rehashed."""
    from colibri_sdk.format import Header

    weights = bundle / "model.colibri"
    data = bytearray(weights.read_bytes())
    header = Header.unpack(bytes(data[:HEADER_SIZE]))
    offset = header.block_offset("down_proj") + 2 * 37
    data[offset:offset + 2] = word.to_bytes(2, "little")
    weights.write_bytes(bytes(data))
    save_manifest(bundle, load_manifest(bundle), rehash=("model.colibri",))
    err = cli_error(capsys, "verify", str(bundle), "--backend", "cpu")
    assert err.endswith(f"model.colibri: a NaN or Inf weight at byte offset {offset}; allowed: finite weights (the "
                        "file was damaged, or the checkpoint holds non-finite values)"), (name, err)
    Bundle.open(bundle, verify=False)  # the fast path does not read the weights


def test_nothing_else_changed_still_verifies(bundle):
    """The checks above refuse only what they name: the untouched copy verifies and its digests are its own."""
    manifest = Bundle.open(bundle).manifest
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    weights = next(e for e in manifest["files"] if e["path"] == "model.colibri")
    assert weights["sha256"] == file_sha256(bundle / "model.colibri")
    assert np.isfinite(Bundle.open(bundle).selftest()[1]).all()


@pytest.mark.parametrize("dtype", ["<f4", "<f2"])
def test_the_weights_scan_finds_every_non_finite_pattern(dtype):
    """The scan tests exponent bits; check it against np.isfinite on every special value, at a chunk offset."""
    from colibri_sdk.bundle.reader import _first_nonfinite

    dt = np.dtype(dtype)
    finite = np.array([0.0, -0.0, 1.0, -2.5, np.finfo(dt).max, np.finfo(dt).tiny, np.finfo(dt).smallest_subnormal],
                      dtype=dt)
    for special in (np.nan, np.inf, -np.inf, -np.nan):
        values = np.concatenate([finite, np.array([special], dtype=dt), finite])
        raw = values.tobytes()
        start = 1000  # the chunk's file offset; the float block begins 4 elements into it
        lo = start + 4 * dt.itemsize
        found = _first_nonfinite(raw, start, [(lo, start + len(raw), dt)])
        assert found == start + int(np.argmin(np.isfinite(values))) * dt.itemsize
    assert _first_nonfinite(finite.tobytes(), 0, [(0, finite.nbytes, dt)]) is None


@pytest.mark.parametrize(("edit", "key"), [(lambda m: m.update(arch="sm_87\x1b[2J"), "arch"),
                                           (lambda m: m["kernels"][0].update(name="rout\x00ing"), r"kernels\[0\]\.name")])
def test_control_characters_in_other_strings_are_refused(bundle, capsys, edit, key):
    """`inspect` prints these: a raw ESC would drive the terminal."""
    manifest = load_manifest(bundle)
    edit(manifest)
    save_manifest(bundle, manifest)
    err = cli_error(capsys, "inspect", str(bundle))
    assert re.search(rf"manifest\.json: {key} = '.*' holds the control character '\\x(1b|00)'", err), err
    assert "\x1b" not in err and "\x00" not in err


def test_verify_reports_hashing_progress_up_to_every_byte(bundle):
    calls = []
    Bundle.open(bundle, verify=False).verify(progress=lambda step, done, total: calls.append((step, done, total)))
    total = sum(e["size"] for e in load_manifest(bundle)["files"])
    assert calls and {c[0] for c in calls} == {"sha256"} and calls[-1][1:] == (total, total)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)


def test_weights_that_shrink_while_verified_are_refused_in_one_line(bundle):
    """The weights are read with read() (the mapping that asks for 2 MiB pages only brings them into the page
    cache, MADV_POPULATE_READ): a file truncated during the check is a BundleError, never SIGBUS (through the
    mapping, bytes past the new end would be). In a child process, so that a SIGBUS fails this test only."""
    import subprocess
    import textwrap

    manifest = load_manifest(bundle)
    weights = bundle / manifest["weights"]["file"]
    assert weights.stat().st_size > 64 << 10
    files = [e["path"] for e in manifest["files"]]
    before = sum(e["size"] for e in manifest["files"][: files.index(manifest["weights"]["file"])])
    script = textwrap.dedent(f"""
        import os
        from colibri_sdk.bundle import Bundle, reader
        from colibri_sdk.errors import BundleError
        reader._CHUNK, reader._WINDOW = 4096, 16384  # many chunks and windows in a small file
        def progress(step, done, total):
            if done > {before} + 40_000 and os.path.getsize({str(weights)!r}) > 20_000:  # 40 kB into the weights
                os.truncate({str(weights)!r}, 20_000)
        try:
            Bundle.open({str(bundle)!r}, verify=False).verify(progress=progress)
        except BundleError as exc:
            print("BundleError:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=guard(300))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert re.fullmatch(r"BundleError: model\.colibri: sha256 [0-9a-f]{64} differs from the manifest's [0-9a-f]{64}\n",
                        done.stdout), done.stdout


def test_a_process_that_locked_its_memory_still_verifies(bundle):
    """Under mlockall (real-time camera loops lock their memory) madvise(MADV_DONTNEED) on the check's mapping
    fails with EINVAL: the check goes on (the mapping is released when it closes)."""
    import subprocess
    import textwrap

    if not sys.platform.startswith("linux"):
        pytest.skip("mlockall with MCL_ONFAULT is Linux's")
    script = textwrap.dedent(f"""
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlockall(1 | 2 | 4) != 0:  # MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT
            print("mlockall refused:", os.strerror(ctypes.get_errno()))
            sys.exit(0)
        from colibri_sdk.bundle import Bundle
        Bundle.open({str(bundle)!r}, verify=True)
        print("verified")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=guard(300))
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("mlockall refused"):
        pytest.skip(f"this process may not lock its memory here ({done.stdout.strip()})")
    assert done.stdout == "verified\n"
