"""Mutation fuzzing of every file the SDK reads: .colibri weights, bundles, device profiles, HF checkpoints.

Each case mutates a valid input with a seeded generator (byte flips, header fields, structure-aware JSON / YAML
edits, links, FIFOs, forged digests), runs the SDK's own reader on it (`ColibriFile`; `Bundle.open` +
`Runtime.load(cpu)` + self-test + inspect; `load_profile`; `convert`), and sorts the outcome into one column:

    typed                a ColibriError with a one-line message (a multi-line one counts as a crash; one over
                         1,000 characters is listed as a note under the table)
    accepted-correct     accepted, and an independent check agrees with what was accepted (below)
    crash                any other exception escaped the SDK
    hang                 the case ran past --timeout seconds (SIGALRM)
    silent-wrong         accepted, but the independent check disagrees (e.g. a file that differs from its manifest)
    read-outside-folder  a file under the "outside" folder (a copy the links point at) was opened

The independent checks are written here from the specs, not with the code under test: .colibri sizes and tensor
offsets from docs/format.md; a bundle's files re-hashed with hashlib, its canonical JSON recomputed, its weights
header and values read with struct/NumPy; a profile's values against docs/profiles.md's ranges; a converted
checkpoint's tensors against safetensors' own loader (Mixtral layout: w1 = gate, w3 = up, w2 = down, gate.T =
router). Opens are watched with an audit hook (sys.addaudithook, the "open" event). Everything runs in this
process, so a segfault would end the run (none has happened).

    python bench/fuzz.py                        # the full counts: 10,000 / 3,000 / 3,000 / 1,000
    python bench/fuzz.py --scale 0.1            # a tenth of each
    python bench/fuzz.py --only bundle --seed 7
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL = {"colibri": 10_000, "bundle": 3_000, "profile": 3_000, "checkpoint": 1_000}
COLUMNS = ("tried", "typed", "accepted-correct", "crash", "hang", "silent-wrong", "read-outside-folder")
BAD = ("crash", "hang", "silent-wrong", "read-outside-folder")
LONG_MESSAGE = 1000  # characters: a typed error quoting more than this is noted (a value should be shortened)


class _Hang(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` in the SDK can swallow it."""


class _Wrong(Exception):
    """An independent check disagrees with what the SDK accepted."""


# ---- watching opens ---------------------------------------------------------------------------------------------
_WATCH: dict = {"outside": None, "hits": []}


def _audit(event: str, args) -> None:
    root = _WATCH["outside"]
    if root is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if os.path.isabs(path) and os.path.realpath(path).startswith(root):
        _WATCH["hits"].append(path)


sys.addaudithook(_audit)


@dataclasses.dataclass
class Tally:
    """Counts per column, and the first few examples of each bad column (case, detail)."""

    name: str
    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COLUMNS, 0))
    examples: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)

    def note(self, what: str, case: str, detail: str) -> None:
        """Something to fix that is not a column (e.g. a typed error whose message quotes a huge value)."""
        self.notes.setdefault(what, [0, []])
        self.notes[what][0] += 1
        if len(self.notes[what][1]) < 3:
            self.notes[what][1].append((case, detail[:160]))

    def add(self, column: str, case: str, detail: str = "") -> None:
        self.counts["tried"] += 1
        self.counts[column] += 1
        if column in BAD and len(self.examples.setdefault(column, [])) < 5:
            self.examples[column].append((case, detail[:300]))


def run_case(tally: Tally, case: str, action, outside: Path | None, timeout: float) -> None:
    """Run `action()` (returns normally when the SDK accepted and the independent check agreed) and tally it."""
    from colibri_sdk.errors import ColibriError

    def on_alarm(signum, frame):
        raise _Hang()

    _WATCH["outside"], _WATCH["hits"] = (str(outside.resolve()) + os.sep if outside else None), []
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    column, detail = "accepted-correct", ""
    try:
        with contextlib.redirect_stdout(io.StringIO()), np.errstate(all="ignore"):
            action()
    except _Hang:
        column = "hang"
    except _Wrong as exc:
        column, detail = "silent-wrong", str(exc)
    except ColibriError as exc:
        message = str(exc)
        column, detail = ("typed", message) if "\n" not in message else ("crash", message)
        if column == "typed" and len(message) > LONG_MESSAGE:
            tally.note("message over 1,000 characters", case, message)
    except Exception as exc:  # noqa: BLE001 (anything else escaping the SDK is what this counts)
        column, detail = "crash", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        hits, _WATCH["outside"] = list(_WATCH["hits"]), None
    if hits:
        column, detail = "read-outside-folder", hits[0]
    tally.add(column, case, detail)


# ---- shared mutation helpers ------------------------------------------------------------------------------------
INTERESTING_U16 = (0, 1, 2, 3, 7, 8, 9, 16, 255, 256, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF)
JSON_VALUES = (None, True, False, -1, 0, 1, 2, 7, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e-300, "", "x",
               "../x", "/etc/passwd", "a\x00b", "\x1b[31mred", "kernels/../model.colibri", "model.colibri",
               "selftest/input.npy", "kernels", "\u200b", [], {}, [1, 2], [8, 7], {"a": 1}, "x" * 5000)


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    """A few random bit flips, byte overwrites, a truncation or an extension."""
    out = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and out:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind == 1 and out:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
    elif kind == 2:
        del out[rng.randrange(len(out) + 1):]
    elif kind == 3:
        out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif out:
        a = rng.randrange(len(out))
        out[a:a] = out[a:a + rng.randint(1, 64)]
    return bytes(out)


def json_paths(value, prefix=()):
    """Every (path, value) in a JSON tree (paths are tuples of keys / indices)."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_paths(item, prefix + (index,))


def json_set(tree, path, value=None, delete=False):
    node = tree
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def mutate_json(tree, rng: random.Random):
    """Replace, delete or duplicate one node of a JSON tree (in place); returns a description."""
    paths = [p for p, _ in json_paths(tree) if p]
    path = rng.choice(paths)
    if rng.random() < 0.2:
        json_set(tree, path, delete=True)
        return f"delete {path}"
    value = rng.choice(JSON_VALUES)
    json_set(tree, path, value)
    return f"set {path} = {value!r:.40}"


# ---- .colibri -----------------------------------------------------------------------------------------------------
def colibri_base(folder: Path, dtype: int) -> Path:
    from colibri_sdk.format import Header, write_model

    h = Header(num_layers=2, num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, dtype=dtype)
    rng = np.random.default_rng(1)
    L, E, H, I = 2, 4, 8, 16
    return write_model(folder / f"base{dtype}.colibri", h, rng.standard_normal((L, E, I, H)),
                       rng.standard_normal((L, E, I, H)), rng.standard_normal((L, E, H, I)),
                       rng.standard_normal((L, H, E)))


def check_colibri(path: Path) -> None:
    """Open with the SDK; check header, size and four tensors against docs/format.md's layout read here."""
    from colibri_sdk.format import ColibriFile

    raw = path.read_bytes()
    with ColibriFile(path) as f:
        h = f.header
        magic, version, L, E, K, H, I, dt, routing, composition = struct.unpack_from("<4sHHHHHHHHH", raw, 0)
        fields = (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size, h.dtype, h.routing,
                  h.composition)
        if magic != b"COLI" or fields != (L, E, K, H, I, dt, routing, composition):
            raise _Wrong(f"header read as {fields}, the bytes say {(magic, L, E, K, H, I, dt, routing, composition)}")
        if any(raw[22:64]) or not (1 <= K <= E) or min(L, E, H, I) < 1 or dt not in (0, 1) or routing > 1 \
                or composition > 1:
            raise _Wrong(f"accepted a header the spec refuses: {raw[:64].hex()}")
        item = {0: 4, 1: 2}[dt]
        expert = I * H
        sizes = {"gate_proj": L * E * expert, "up_proj": L * E * expert, "down_proj": L * E * expert,
                 "router": L * H * E}
        if len(raw) != 64 + item * sum(sizes.values()):
            raise _Wrong(f"accepted {len(raw)} bytes; the header implies {64 + item * sum(sizes.values())}")
        np_dtype = np.dtype("<f4" if dt == 0 else "<f2")
        base = 64
        for kind in ("gate_proj", "up_proj", "down_proj", "router"):
            if kind == "router":
                index, count, got = L - 1, H * E, f.router(L - 1)
            else:
                index, count, got = (L - 1) * E + (E - 1), expert, f.tensor(kind, L - 1, E - 1)
            want = np.frombuffer(raw, np_dtype, count=count, offset=base + index * count * item)
            if got.size != count or got.tobytes() != want.tobytes():
                raise _Wrong(f"{kind}: the tensor read differs from the bytes at the spec's offset")
            base += sizes[kind] * item
        f.layout()


def fuzz_colibri(count: int, seed: int, work: Path, timeout: float) -> Tally:
    tally = Tally(".colibri")
    bases = [colibri_base(work, 0).read_bytes(), colibri_base(work, 1).read_bytes()]
    rng = random.Random(seed)
    target = work / "case.colibri"
    for i in range(count):
        data = bytearray(rng.choice(bases))
        if rng.random() < 0.5:  # a header field set to an interesting value
            offset = rng.choice((4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 40, 62))
            struct.pack_into("<H", data, offset, rng.choice(INTERESTING_U16))
            if rng.random() < 0.3:
                data = bytearray(flip_bytes(bytes(data), rng))
        else:
            data = bytearray(flip_bytes(bytes(data), rng))
        target.write_bytes(bytes(data))
        run_case(tally, f"colibri#{i}", lambda: check_colibri(target), None, timeout)
    return tally


# ---- bundles ------------------------------------------------------------------------------------------------------
def canonical(manifest: dict) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()


def forge(bundle: Path, manifest: dict, rehash=()) -> None:
    """Write a consistent manifest: the given files rehashed, the digest recomputed (what a careful forger does)."""
    for entry in manifest.get("files", []) if isinstance(manifest.get("files"), list) else []:
        if isinstance(entry, dict) and entry.get("path") in rehash:
            full = bundle / entry["path"]
            entry["size"] = full.stat().st_size
            entry["sha256"] = hashlib.sha256(full.read_bytes()).hexdigest()
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    try:
        manifest["manifest_sha256"] = hashlib.sha256(canonical(body)).hexdigest()
        (bundle / "manifest.json").write_bytes(canonical(manifest))
    except (ValueError, TypeError):
        (bundle / "manifest.json").write_text(json.dumps(manifest))


def independent_bundle_check(bundle: Path) -> None:
    """What an accepted bundle must satisfy, checked without the SDK's reader."""
    raw = (bundle / "manifest.json").read_bytes()
    manifest = json.loads(raw)
    if raw != canonical(manifest):
        raise _Wrong("accepted a manifest that is not in canonical form")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if hashlib.sha256(canonical(body)).hexdigest() != manifest["manifest_sha256"]:
        raise _Wrong("accepted a manifest whose digest differs")
    listed = {e["path"]: e for e in manifest["files"]}
    for folder, dirs, files in os.walk(bundle):  # does not follow links
        for name in dirs + files:
            full = Path(folder, name)
            rel = full.relative_to(bundle).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise _Wrong(f"accepted a bundle holding the link {rel}")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode) or (rel != "manifest.json" and rel not in listed):
                raise _Wrong(f"accepted a bundle holding {rel}, unlisted or not a regular file")
    for rel, entry in listed.items():
        data = (bundle / rel).read_bytes()
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise _Wrong(f"accepted {rel}, which differs from its manifest entry")
    weights = (bundle / manifest["weights"]["file"]).read_bytes()
    _, version, L, E, K, H, I, dt, routing, composition = struct.unpack_from("<4sHHHHHHHHH", weights, 0)
    actual = dict(num_layers=L, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=dt,
                  routing=routing, composition=composition, version=version)
    recorded = manifest["weights"]["header"]
    if any(recorded.get(k, v) != v for k, v in actual.items()):
        raise _Wrong(f"accepted weights whose header {actual} differs from the manifest's {recorded}")
    values = np.frombuffer(weights, "<f4" if dt == 0 else "<f2", offset=64)
    if not np.isfinite(values).all():
        raise _Wrong("accepted weights holding NaN/Inf")
    for kind in ("cubin", "ptx"):
        for kernel in manifest["kernels"]:
            if kernel[kind] not in listed:
                raise _Wrong(f"accepted a kernel image {kernel[kind]!r} that is not a listed file")


def bundle_action(bundle: Path):
    def action():
        from colibri_sdk.bundle import Bundle, bundle_summary
        from colibri_sdk.commands.inspect import inspect_bundle
        from colibri_sdk.errors import BundleError
        from colibri_sdk.runtime import Runtime

        inspect_bundle(bundle)
        opened = Bundle.open(bundle, verify=True)
        bundle_summary(opened)
        with Runtime.load(bundle, backend="cpu", verify=False) as rt:
            result = rt.self_test()
        if not result.passed:
            raise BundleError(str(result))  # what `colibri-sdk verify` reports: typed
        independent_bundle_check(bundle)

    return action


def mutate_bundle(bundle: Path, outside: Path, rng: random.Random) -> str:
    manifest = json.loads((bundle / "manifest.json").read_text())
    files = [e["path"] for e in manifest["files"]]
    kind = rng.randrange(9)
    if kind == 0:  # a JSON node replaced or deleted, the digest forged (or not)
        what = mutate_json(manifest, rng)
        if rng.random() < 0.7:
            forge(bundle, manifest)
        else:
            (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return what
    if kind == 1:  # raw text: non-standard JSON numbers, duplicate keys, byte damage
        text = (bundle / "manifest.json").read_text()
        numbers = list(re.finditer(r"(?<=: )-?\d+(\.\d+)?(e-?\d+)?", text))
        choice = rng.randrange(3)
        if choice == 0 and numbers:
            m = rng.choice(numbers)
            text = text[:m.start()] + rng.choice(("NaN", "Infinity", "-Infinity", "1e400", "-1e999")) + text[m.end():]
        elif choice == 1:
            lines = text.splitlines(keepends=True)
            i = rng.randrange(1, len(lines) - 1)
            lines.insert(i, lines[i])
            text = "".join(lines)
        else:
            (bundle / "manifest.json").write_bytes(flip_bytes(text.encode(), rng))
            return "manifest bytes"
        (bundle / "manifest.json").write_text(text)
        return "manifest text"
    if kind == 2:  # a listed file's bytes, rehashed (a forger) or not (damage)
        rel = rng.choice(files)
        (bundle / rel).write_bytes(flip_bytes((bundle / rel).read_bytes(), rng))
        if rng.random() < 0.6:
            forge(bundle, manifest, rehash=(rel,))
        return f"bytes of {rel}"
    if kind == 3:  # a file or folder replaced by a link to the identical copy outside (or to another file)
        rel = rng.choice(files + ["kernels", "selftest", "manifest.json", "model.colibri"])
        full = bundle / rel
        shutil.rmtree(full) if full.is_dir() else full.unlink()
        target = outside / rel if rng.random() < 0.8 else outside / rng.choice(files)
        os.symlink(target, full)
        if rng.random() < 0.3 and rel in files:
            forge(bundle, manifest, rehash=(rel,))
        return f"link {rel}"
    if kind == 4:  # something extra: a file, a folder, a link, a FIFO
        where = bundle / rng.choice(("", "kernels", "selftest"))
        extra = rng.randrange(4)
        if extra == 0:
            (where / "extra.bin").write_bytes(b"x")
        elif extra == 1:
            (where / "extra").mkdir()
        elif extra == 2:
            os.symlink(outside / "model.colibri", where / "extra")
        else:
            os.mkfifo(where / "extra")
        return f"extra {extra}"
    if kind == 5:  # a listed file replaced by a FIFO (hang bait)
        rel = rng.choice(files)
        (bundle / rel).unlink()
        os.mkfifo(bundle / rel)
        return f"fifo {rel}"
    if kind == 6:  # self-test vectors of another dtype / shape, rehashed
        key = rng.choice(("input", "output"))
        path = bundle / "selftest" / f"{key}.npy"
        x = np.load(path)
        replacement = rng.choice((x.astype(np.float64), x[..., :-1], x.astype(np.float16), np.array([np.nan] * 3),
                                  x * np.float32(1e19), x.astype(">f4")))
        np.save(path, replacement)
        forge(bundle, manifest, rehash=(f"selftest/{key}.npy",))
        return f"selftest {key}"
    if kind == 7:  # the weights' header or one value, rehashed
        path = bundle / manifest["weights"]["file"]
        data = bytearray(path.read_bytes())
        if rng.random() < 0.5:
            struct.pack_into("<H", data, rng.choice((4, 6, 8, 10, 12, 14, 16, 18, 20)), rng.choice(INTERESTING_U16))
        else:
            struct.pack_into("<H", data, 64 + 2 * rng.randrange((len(data) - 64) // 2), rng.choice((0x7C00, 0x7E00,
                                                                                                  0xFC00, 0x3C00)))
        path.write_bytes(bytes(data))
        forge(bundle, manifest, rehash=(manifest["weights"]["file"],))
        return "weights"
    # kind 8: a path field pointed elsewhere, forged
    field = rng.choice((("weights", "file"), ("selftest", "input"), ("kernels", 0, "cubin"), ("kernels", 1, "ptx"),
                        ("files", rng.randrange(len(files)), "path")))
    json_set(manifest, field, rng.choice(("../outside/model.colibri", "/etc/hostname", "kernels/x\x00y",
                                          "kernels//a", "./model.colibri", "selftest\\input.npy", "kernels",
                                          "model.colibri", "selftest/output.npy", "\u00e9")))
    forge(bundle, manifest)
    return f"path {field}"


def bundle_base(folder: Path) -> Path:
    """The small bundle of tests/robustness: 1 layer, 6 experts, top-2, hidden 64, fp16, built for orin."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.format import Header, write_model
    from colibri_sdk.profile import load_profile

    h = Header(num_layers=1, num_experts=6, top_k=2, hidden_size=64, intermediate_size=96, dtype=1)
    rng = np.random.default_rng(5)
    L, E, H, I = 1, 6, 64, 96
    weights = write_model(folder / "small.colibri", h, rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                          rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                          rng.standard_normal((L, E, H, I)) / np.sqrt(I), rng.standard_normal((L, H, E)))
    return build_bundle(load_profile("orin"), folder / "base_bundle", weights).path


def fuzz_bundles(count: int, seed: int, work: Path, timeout: float, base: Path | None = None) -> Tally:
    tally = Tally("bundle")
    base = base or bundle_base(work)
    outside = Path(shutil.copytree(base, work / "outside"))
    rng = random.Random(seed)
    for i in range(count):
        case = work / f"b{i}"
        shutil.copytree(base, case)
        what = mutate_bundle(case, outside, rng)
        run_case(tally, f"bundle#{i} ({what})", bundle_action(case), outside, timeout)
        shutil.rmtree(case, ignore_errors=True)
    return tally


# ---- profiles -----------------------------------------------------------------------------------------------------
YAML_VALUES = ("-1", "0", "1", "16", "48", "1e400", ".nan", ".inf", "-.inf", "true", "no", "null", "~", '"x"', "''",
               "[1, 2]", "{a: 1}", "!!python/object/apply:os.system ['true']", "*a", "&a 5", "99999999999999999999999",
               "sm_87a", "sm_087", "sm_90", "sm_8\uff17", "0x10", "0o17", "1_000", '"\\x00"', "'unclosed", "[unclosed",
               "!!binary aGk=", "2001-12-14", "fp32", "atomic", "!!float 3", "1e5", "65536", "166912", "12020")


def mutate_profile(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    kind = rng.randrange(8)
    values = [i for i, line in enumerate(lines) if re.match(r"\s*[a-z_]+: \S", line)]
    if not values or not lines:
        return text + "\nx: 1\n"
    if kind <= 2:
        i = rng.choice(values)
        key = lines[i].split(":")[0]
        lines[i] = f"{key}: {rng.choice(YAML_VALUES)}"
    elif kind == 3:
        del lines[rng.randrange(len(lines))]
    elif kind == 4:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif kind == 5:  # anchors, aliases and merge keys
        i = rng.choice(values)
        key, _, value = lines[i].partition(": ")
        indent = key[: len(key) - len(key.lstrip())]
        lines[i] = f"{key}: &v {value}"
        j = rng.choice(values)
        other = lines[j].split(":")[0]
        lines[j] = rng.choice((f"{other}: *v", f"{indent}<<: {{}}", f"{other}:\n{indent}  <<: *v"))
    elif kind == 6:  # indentation or a tab
        i = rng.randrange(len(lines))
        lines[i] = rng.choice(("\t", "  ", "", " ")) + lines[i].lstrip()
    else:
        return flip_bytes(text.encode(), rng).decode("utf-8", "replace")
    return "\n".join(lines) + "\n"


def independent_profile_check(profile) -> None:
    """docs/profiles.md's ranges, checked on the accepted profile's data."""
    from colibri_sdk.profile import ARCH_SHARED_MEMORY

    d = profile.to_dict()
    t, hw, shape = d["target"], d["hardware"], d["shape"]

    def is_int(v):
        return type(v) is int

    m = re.fullmatch(r"sm_([1-9][0-9]{1,2})", t["arch"]) if isinstance(t["arch"], str) else None
    if not m or int(m.group(1)) not in ARCH_SHARED_MEMORY:
        raise _Wrong(f"accepted target.arch {t['arch']!r}")
    optin, per_sm = ARCH_SHARED_MEMORY[int(m.group(1))]
    def sizes(v):  # an int, or 1..8 ints strictly increasing (docs/profiles.md, shape.batch / shape.tokens)
        values = v if type(v) is list else [v]
        ok = 1 <= len(values) <= 8 and all(is_int(x) and 1 <= x <= 65536 for x in values)
        return ok and all(a < b for a, b in zip(values, values[1:]))

    checks = [
        sizes(shape["batch"]) and sizes(shape["tokens"])
        and max(shape["batch"] if type(shape["batch"]) is list else [shape["batch"]])
        * max(shape["tokens"] if type(shape["tokens"]) is list else [shape["tokens"]]) <= 65536,
        d["dtype"] in ("fp16", "fp32"), d["aggregation"] in ("ordered", "atomic"),
        type(d["allow_spills"]) is bool, type(t["unified_memory"]) is bool,
        is_int(t["toolkit"]) and is_int(t["min_driver"]) and t["min_driver"] >= 1000 * t["toolkit"],
        all(is_int(hw[k]) for k in ("sm_count", "shared_memory_per_block", "shared_memory_per_block_optin",
                                     "shared_memory_per_sm")),
        hw["shared_memory_per_block"] <= 49152 and hw["shared_memory_per_block"] <= hw["shared_memory_per_block_optin"]
        <= optin and hw["shared_memory_per_block_optin"] <= hw["shared_memory_per_sm"] <= per_sm,
        isinstance(hw["memory_bandwidth_gbs"], (int, float)) and not isinstance(hw["memory_bandwidth_gbs"], bool)
        and 0 < hw["memory_bandwidth_gbs"] < 1e5,
        all(is_int(v) for k in d["kernels"].values() for v in k.values()),
    ]
    if not all(checks):
        raise _Wrong(f"accepted a profile outside docs/profiles.md's ranges (check {checks.index(False)})")
    canonical(d)  # it goes into a manifest: strict JSON must hold it


def fuzz_profiles(count: int, seed: int, work: Path, timeout: float) -> Tally:
    from colibri_sdk.profile import load_profile, packaged_dir

    tally = Tally("profile")
    base = (packaged_dir() / "orin.yaml").read_text()
    rng = random.Random(seed)
    path = work / "board.yaml"
    for i in range(count):
        text = base
        for _ in range(rng.choice((1, 1, 2, 3))):
            text = mutate_profile(text, rng)
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        run_case(tally, f"profile#{i}", lambda: independent_profile_check(load_profile(path, toolchain=False)),
                 None, timeout)
    return tally


# ---- checkpoints --------------------------------------------------------------------------------------------------
CONFIG = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
          "hidden_size": 4, "intermediate_size": 8}
PREFIX = "model.layers.0.block_sparse_moe."


def checkpoint_base(folder: Path) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    tensors = {PREFIX + "gate.weight": rng.standard_normal((2, 4)).astype(np.float32)}
    for e in range(2):
        tensors[f"{PREFIX}experts.{e}.w1.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
        tensors[f"{PREFIX}experts.{e}.w3.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
        tensors[f"{PREFIX}experts.{e}.w2.weight"] = rng.standard_normal((4, 8)).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def mutate_safetensors_header(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(("dtype", "shape", "data_offsets", "name"))
    if field == "dtype":
        header[name]["dtype"] = rng.choice(("F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "x"))
    elif field == "shape":
        header[name]["shape"] = rng.choice(([], [0], [2, 2], [8, 4, 1], [-1, 4], [2**40, 4], [4, 8]))
    elif field == "data_offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice(([b, a], [a, b + 4], [a + 4, b], [0, 0], [a, 2**62]))
    else:
        header[name.replace("w1", "w9") if "w1" in name else name + "x"] = header.pop(name)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])


def mutate_checkpoint(folder: Path, outside: Path, rng: random.Random) -> str:
    kind = rng.randrange(6)
    config = json.loads((folder / "config.json").read_text())
    if kind == 0:
        what = mutate_json(config, rng)
        (folder / "config.json").write_text(json.dumps(config))
        return what
    if kind == 1:
        key = rng.choice(list(CONFIG))
        config[key] = rng.choice((0, 1, 2, 3, 9, 17, -1, 2**16, 2**70, 1.0, "2", None, True, "qwen3_moe", "llama"))
        (folder / "config.json").write_text(json.dumps(config))
        return f"config {key}"
    if kind == 2:
        (folder / "config.json").write_bytes(flip_bytes((folder / "config.json").read_bytes(), rng))
        return "config bytes"
    if kind == 3:
        mutate_safetensors_header(folder / "model.safetensors", rng)
        return "safetensors header"
    if kind == 4:
        st = folder / "model.safetensors"
        st.write_bytes(flip_bytes(st.read_bytes(), rng))
        return "safetensors bytes"
    # kind 5: an index, with or without the single file, naming shards inside, missing, or outside
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    shard = rng.choice(("model-00001.safetensors", "../outside/model.safetensors", str(outside / "model.safetensors"),
                        "missing.safetensors", "model.safetensors", "config.json"))
    if shard == "model-00001.safetensors":
        shutil.copyfile(folder / "model.safetensors", folder / shard)
    weight_map = {name: shard for name in tensors if rng.random() < 0.9}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if rng.random() < 0.5:
        os.replace(folder / "model.safetensors", folder / "moved.bin")
    return f"index → {shard}"


def independent_checkpoint_check(folder: Path, output: Path, dtype: str) -> None:
    """The converted file against safetensors' own loader, in transformers' file order (single file first)."""
    from safetensors.numpy import load_file

    from colibri_sdk.format import ColibriFile

    config = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").is_file():
        tensors = load_file(str(folder / "model.safetensors"))
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        tensors = {}
        for shard in sorted(set(index.values())):
            tensors.update(load_file(str(folder / shard)))
    cast = np.float16 if dtype == "fp16" else np.float32
    with ColibriFile(output) as f:
        h = f.header
        sizes = (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size)
        expect = tuple(config[k] for k in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                                           "hidden_size", "intermediate_size"))
        if config.get("model_type") != "mixtral" or sizes != expect:
            raise _Wrong(f"converted {config.get('model_type')!r} with sizes {sizes}; config.json says {expect}")
        pairs = [(f.router(0), tensors[PREFIX + "gate.weight"].T)]
        for e in range(h.num_experts):
            for kind, name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                pairs.append((f.tensor(kind, 0, e), tensors[f"{PREFIX}experts.{e}.{name}.weight"]))
        for got, want in pairs:
            if got.shape != want.shape or not np.array_equal(got, want.astype(cast)):
                raise _Wrong("a converted tensor differs from the checkpoint's")


def fuzz_checkpoints(count: int, seed: int, work: Path, timeout: float) -> Tally:
    from colibri_sdk.convert import convert

    tally = Tally("checkpoint")
    base = checkpoint_base(work / "base_ckpt")
    outside = Path(shutil.copytree(base, work / "outside_ckpt"))
    rng = random.Random(seed)
    for i in range(count):
        folder = Path(shutil.copytree(base, work / f"c{i}"))
        what = mutate_checkpoint(folder, outside, rng)
        if rng.random() < 0.3:
            try:  # a second mutation on top of the first (it may not apply to an already broken file)
                what += "; " + mutate_checkpoint(folder, outside, rng)
            except Exception:  # noqa: BLE001 (a mutator failing on a broken file is not a finding)
                pass
        dtype = rng.choice(("fp16", "fp32"))
        output = work / f"c{i}.colibri"

        def action(folder=folder, output=output, dtype=dtype):
            convert(folder, output, dtype=dtype, progress=False)
            independent_checkpoint_check(folder, output, dtype)

        run_case(tally, f"checkpoint#{i} ({what})", action, outside, timeout)
        shutil.rmtree(folder, ignore_errors=True)
        output.unlink(missing_ok=True)
    return tally


# ---- main ---------------------------------------------------------------------------------------------------------
TARGETS = {"colibri": fuzz_colibri, "bundle": fuzz_bundles, "profile": fuzz_profiles, "checkpoint": fuzz_checkpoints}


def run(counts: dict[str, int], seed: int, timeout: float, work: Path | None = None) -> list[Tally]:
    """Fuzz each target `counts[name]` times; returns the tallies in TARGETS order."""
    import logging

    logging.getLogger("colibri_sdk").setLevel(logging.ERROR)  # the converter's both-files warning, once per case
    tallies = []
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-", dir=work) as tmp:
        for name, fn in TARGETS.items():
            if counts.get(name):
                folder = Path(tmp, name)
                folder.mkdir()
                tallies.append(fn(counts[name], seed, folder, timeout))
    return tallies


def table(tallies: list[Tally]) -> str:
    head = f"{'input':<11}" + "".join(f"{c:>{len(c) + 2}}" for c in COLUMNS)
    rows = [head] + [f"{t.name:<11}" + "".join(f"{t.counts[c]:>{len(c) + 2},}" for c in COLUMNS) for t in tallies]
    for t in tallies:
        for column, examples in t.examples.items():
            for case, detail in examples:
                rows.append(f"  {t.name} {column}: {case}: {detail}")
        for what, (count, examples) in t.notes.items():
            rows.append(f"  {t.name} note: {count} typed errors with a {what}, e.g.")
            rows += [f"    {case}: {detail}" for case, detail in examples]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count (default 1: the full counts)")
    parser.add_argument("--only", choices=tuple(TARGETS), nargs="+", help="fuzz only these inputs")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it counts as a hang")
    args = parser.parse_args()
    counts = {k: max(1, round(v * args.scale)) for k, v in FULL.items() if not args.only or k in args.only}
    start = time.perf_counter()
    tallies = run(counts, args.seed, args.timeout)
    print(f"colibri-sdk fuzz: seed {args.seed}, scale {args.scale:g}, timeout {args.timeout:g} s per case, "
          f"{time.perf_counter() - start:.0f} s")
    print(table(tallies))
    return 1 if any(t.counts[c] for t in tallies for c in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
