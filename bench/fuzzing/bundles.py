"""Mutated bundles (files, manifest fields, links, FIFOs, forged digests) through `Bundle.open`, `Runtime.load(cpu)`,
the self-test and inspect, checked by re-hashing and re-reading the bundle here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import stat
import struct
from pathlib import Path

import numpy as np

from .cases import INTERESTING_U16, Tally, Wrong, canonical, flip_bytes, json_set, mutate_json, run_case

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
        raise Wrong("accepted a manifest that is not in canonical form")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if hashlib.sha256(canonical(body)).hexdigest() != manifest["manifest_sha256"]:
        raise Wrong("accepted a manifest whose digest differs")
    listed = {e["path"]: e for e in manifest["files"]}
    for folder, dirs, files in os.walk(bundle):  # does not follow links
        for name in dirs + files:
            full = Path(folder, name)
            rel = full.relative_to(bundle).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise Wrong(f"accepted a bundle holding the link {rel}")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode) or (rel != "manifest.json" and rel not in listed):
                raise Wrong(f"accepted a bundle holding {rel}, unlisted or not a regular file")
    for rel, entry in listed.items():
        data = (bundle / rel).read_bytes()
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise Wrong(f"accepted {rel}, which differs from its manifest entry")
    weights = (bundle / manifest["weights"]["file"]).read_bytes()
    _, version, L, E, K, H, I, dt, routing, composition = struct.unpack_from("<4sHHHHHHHHH", weights, 0)
    actual = dict(num_layers=L, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=dt,
                  routing=routing, composition=composition, version=version)
    recorded = manifest["weights"]["header"]
    if any(recorded.get(k, v) != v for k, v in actual.items()):
        raise Wrong(f"accepted weights whose header {actual} differs from the manifest's {recorded}")
    values = np.frombuffer(weights, "<f4" if dt == 0 else "<f2", offset=64)
    if not np.isfinite(values).all():
        raise Wrong("accepted weights holding NaN/Inf")
    for kind in ("cubin", "ptx"):
        for kernel in manifest["kernels"]:
            if kernel[kind] not in listed:
                raise Wrong(f"accepted a kernel image {kernel[kind]!r} that is not a listed file")


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
