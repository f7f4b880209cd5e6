"""libcolibri with several compiled shapes (docs/c_runtime.md, "Several shapes"), on the fake CUDA driver.

Each shape's modules run on the kernel emulation built with that shape's -D constants (the fake's
COLIBRI_FAKE_CUDA_KERNEL_MAP: image hash -> library). A call lands on the smallest shape that holds it; its output
equals, bit for bit, the Python runtime's CUDA backend on the same fake driver and emulated kernels (both run the same
kernels at the same shape), and matches the NumPy reference engine (the CPU backend) within the bundle's tolerance.
Hostile `shapes` records are refused with one line, by the C runtime and, where it checks the same rule, by the Python
bundle reader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from c_runtime_support import manifest
from timeout_support import guard

from colibri_sdk.bundle.reader import canonical_json, manifest_digest

BUNDLE_ERR = 2
# (bundle of the session fixture `bundles`, fake compute capability, calls, the shape index each call lands on)
CASES = {
    # orin as shipped: batch [1, 4] x tokens 16, two shapes (batch 2 is padded to 4 with sequences of no token)
    "two shapes": ("orin", "8.7", ["1x16", "1x4", "2x16:5,16"], [0, 0, 1]),
    # a100 as shipped: batch 1 x tokens [1, 16, 64], three shapes (1, 4 and 16 tokens; the 64-token one stays unrun)
    "three shapes": ("a100", "8.0", ["1x1", "1x4", "1x16"], [0, 1, 1]),
}


def fnv1a(data: bytes) -> str:
    """FNV-1a 64 of the bytes, as the fake driver keys its COLIBRI_FAKE_CUDA_KERNEL_MAP."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def kernel_map(bundle: Path, out: Path, run: set[int]) -> Path:
    """The map from each shape's kernel images (cubin; PTX up to its NUL) to the emulation of that shape's constants.

    Only the shapes of `run` (indexes) get an emulation of their own: a shape no call lands on is loaded and captured
    but never launched, so its images map to the first run shape's emulation (no g++ build for it)."""
    from fakecuda_support import emulation_library

    m = manifest(bundle)
    entries = m.get("shapes", [m])
    own = {i: emulation_library(entry["kernels"]) for i, entry in enumerate(entries) if i in run}
    lines, seen = [], set()
    for i, entry in enumerate(entries):
        lib = own.get(i, own[min(run)])
        for kernel in entry["kernels"]:
            for kind in ("cubin", "ptx"):
                data = (bundle / kernel[kind]).read_bytes()
                key = fnv1a(data.split(b"\0", 1)[0] if kind == "ptx" else data)
                if key not in seen:  # an image two shapes share is the same code: either emulation runs it
                    seen.add(key)
                    lines.append(f"{key} {lib}")
    out.write_text("\n".join(lines) + "\n")
    return out


def write_inputs(folder: Path, calls: list[str], hidden: int) -> dict[str, np.ndarray]:
    """One N(0, 1) float32 input (batch, tokens, hidden) per call, written raw as in_BxT.f32."""
    rng = np.random.default_rng(2026)
    inputs = {}
    for call in calls:
        dims = call.split(":")[0]
        b, t = (int(v) for v in dims.split("x"))
        x = rng.standard_normal((b, t, hidden)).astype(np.float32)
        x.tofile(folder / f"in_{dims}.f32")
        inputs[call] = x
    return inputs


def lengths_of(call: str):
    return [int(v) for v in call.split(":")[1].split(",")] if ":" in call else None


PYTHON_CUDA = """
import json, sys
import numpy as np
from colibri_sdk.runtime import Runtime
bundle, folder, hidden, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
with Runtime.load(bundle, backend="cuda") as rt:
    for call in calls:
        dims, _, lengths = call.partition(":")
        b, t = (int(v) for v in dims.split("x"))
        x = np.fromfile(f"{folder}/in_{dims}.f32", np.float32).reshape(b, t, hidden)
        y = rt.infer(x, input_lengths=[int(v) for v in lengths.split(",")] if lengths else None)
        y.astype(np.float32).tofile(f"{folder}/py_{dims}.f32")
    print(json.dumps({"backend": rt.backend_name, "shapes_chosen": rt.stats().as_dict()["shapes_chosen"]}))
"""


def run_python_cuda(c_build: Path, bundle: Path, folder: Path, hidden: int, calls: list[str], cc: str, kmap: Path):
    """The Python runtime's CUDA backend on the same fake driver (the build folder's libcuda.so.1) and kernel map."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLIBRI_FAKE_CUDA_")}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(c_build), env.get("LD_LIBRARY_PATH")) if p)
    env.update(COLIBRI_FAKE_CUDA_CC=cc, COLIBRI_FAKE_CUDA_KERNEL_MAP=str(kmap),
               COLIBRI_FAKE_CUDA_KERNELS=str(kmap))  # every image is mapped: the fallback must never be used
    done = subprocess.run([sys.executable, "-c", PYTHON_CUDA, str(bundle), str(folder), str(hidden), *calls],
                          capture_output=True, text=True, timeout=guard(1200), env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_call_runs_at_the_smallest_shape_that_holds_it(run_c, c_build, bundles, tmp_path, case):
    from colibri_sdk.runtime import Runtime

    name, cc, calls, expected = CASES[case]
    bundle, m = bundles[name], manifest(bundles[name])
    hidden = m["weights"]["header"]["hidden_size"]
    shapes = [(e["batch"], e["tokens"]) for e in m["shapes"]]
    largest = shapes[-1]
    kmap = kernel_map(bundle, tmp_path / "kernels.map", set(expected))
    inputs = write_inputs(tmp_path, calls, hidden)
    too_large = [f"!{largest[0] + 1}x{largest[1]}", f"!{largest[0]}x{largest[1] + 1}"]
    run = run_c(["shapes", bundle, tmp_path, *calls, *too_large], kernels=kmap, cc=cc, kernel_map=kmap, asan=False)
    assert run.rc == 0 and run.result["passed"], run
    assert not [line for line in run.log if line.startswith("!")], "the fake driver complained"
    # the shapes, smallest first; each call where Python's Runtime.shape_for puts it; the graphs replayed per shape
    assert [(s["batch"], s["tokens"]) for s in run.result["shapes"]] == shapes
    assert run.result["chosen"] == expected and run.result["allocs"] == 0, run.result
    assert [s["calls"] for s in run.result["shapes"]] == [expected.count(i) for i in range(len(shapes))]
    assert [s["launches"] for s in run.result["shapes"]] == [len(e["launch"]) for e in m["shapes"]]
    assert len(run.calls("cuGraphInstantiate")) == len(shapes)  # one graph per shape, captured at init
    assert len(run.calls("cuGraphLaunch")) == len(calls)
    # a call larger than the largest shape: refused in the Python runtime's words
    refused = run.result["refused"].split("\x1f")
    for spec, message in zip(too_large, refused):
        b, t = spec[1:].split("x")
        assert message == (f"colibri_set_input_shape: input batch {b} x tokens {t} is larger than every compiled "
                           f"shape; the largest is batch {largest[0]} x tokens {largest[1]} (build with a larger "
                           "shape.batch / shape.tokens)"), refused
    # the same calls through the Python runtime: its CUDA backend on the same fake driver, bit for bit ...
    py = run_python_cuda(c_build, bundle, tmp_path, hidden, calls, cc, kmap)
    assert py["backend"] == "cuda"
    assert py["shapes_chosen"] == {f"{shapes[i][0]}x{shapes[i][1]}": expected.count(i) for i in set(expected)}
    tol = m["selftest"]
    with Runtime.load(bundle, backend="cpu") as reference:
        for call in calls:
            dims = call.split(":")[0]
            ours = np.fromfile(tmp_path / f"out_{dims}.f32", np.float32).reshape(inputs[call].shape)
            theirs = np.fromfile(tmp_path / f"py_{dims}.f32", np.float32).reshape(inputs[call].shape)
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), call
            # ... and the NumPy reference engine within the bundle's tolerance (and zeros past each length)
            expected_y = reference.infer(inputs[call], input_lengths=lengths_of(call))
            np.testing.assert_allclose(ours, expected_y, rtol=tol["rtol"], atol=tol["atol"], err_msg=call)
            for b, length in enumerate(lengths_of(call) or []):
                assert not ours[b, length:].any(), call


# ---- hostile `shapes` records ------------------------------------------------------------------------------------
def _rewrite(bundle: Path, change) -> None:
    m = manifest(bundle)
    change(m)
    m["manifest_sha256"] = manifest_digest(m)
    (bundle / "manifest.json").write_bytes(canonical_json(m))


def _shrink_input(m: dict) -> None:
    entry = m["shapes"][0]
    entry["buffers"][entry["io_buffers"]["input"]] = 4


def _drop_largest_launch(m: dict) -> None:
    m["shapes"][-1]["launch"].pop()


# case: (edit, the C runtime's message, the Python reader's message or None where only a backend checks it)
HOSTILE = {
    "shapes out of order": (
        lambda m: m["shapes"].reverse(),
        "manifest.json: shapes must be sorted smallest first (by batch*tokens, batch, tokens) without duplicates; "
        "got [(4, 16), (1, 16)]",
        r"shapes must be sorted smallest first \(by batch\*tokens, batch, tokens\) without duplicates; got "
        r"\[\(4, 16\), \(1, 16\)\]"),
    "a shape beyond the last": (
        lambda m: m["shapes"][0].update(batch=2, tokens=32),
        "manifest.json: shapes[0] is batch 2 x tokens 32, beyond the largest (last) shape batch 4 x tokens 16",
        r"shapes\[0\] is batch 2 x tokens 32, beyond the largest \(last\) shape batch 4 x tokens 16"),
    "top level differs from the last": (
        _drop_largest_launch,
        "manifest.json: shapes[1].launch differs from the top-level launch; allowed: the last (largest) shape is "
        "the top-level one",
        r"shapes\[1\]\.launch differs from the top-level launch"),
    "plan names a missing buffer": (
        lambda m: m["shapes"][0]["launch"][1]["args"][0].update(name="nope"),
        "manifest.json: shapes[0].launch[1].args[0] names buffer nope; allowed: a key of shapes[0].buffers",
        None),
    "io buffer too small": (
        _shrink_input,
        "manifest.json: shapes[0].io_buffers.input is buffer x0 of 4 bytes; allowed: at least 4096 (batch 1 x "
        "tokens 16)",
        r"shapes\[0\]\.buffers = .* differs from the catalogue's .* at batch 1 x tokens 16"),
    "io_buffers names another buffer": (
        lambda m: m["shapes"][0]["io_buffers"].update(output="x1"),
        None,
        r"shapes\[0\]\.io_buffers = .* differs from the catalogue's"),
    "profile.shape differs": (
        lambda m: m["profile"]["shape"].update(batch=[1, 2]),
        None,
        r"profile\.shape = \{\"batch\": \[1, 2\], \"tokens\": 16\} gives the shapes \[\(1, 16\), \(2, 16\)\]; "
        r"allowed: the compiled shapes \[\(1, 16\), \(4, 16\)\]"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_shapes_are_refused_with_their_message(run_c, bundles, tmp_path, case):
    from colibri_sdk.bundle import Bundle
    from colibri_sdk.errors import BundleError

    change, c_message, py_message = HOSTILE[case]
    bundle = Path(shutil.copytree(bundles["orin"], tmp_path / "b"))
    _rewrite(bundle, change)
    if c_message is not None:
        run = run_c(["init", bundle, BUNDLE_ERR, c_message])
        assert run.rc == 0, run
        assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, run
    if py_message is not None:
        with pytest.raises(BundleError, match=py_message):
            Bundle.open(bundle)


def test_shape_calls_under_address_sanitizer(run_c, bundles, tmp_path):
    """The shape calls and their refusals (NULL pointers, an index out of range, no call yet, too large) under
    AddressSanitizer + UBSan + LeakSanitizer, on the smallest shape (one token: the emulation is slow under them)."""
    bundle = bundles["a100"]
    kmap = kernel_map(bundle, tmp_path / "kernels.map", {0})
    write_inputs(tmp_path, ["1x1"], manifest(bundle)["weights"]["header"]["hidden_size"])
    run = run_c(["shapes", bundle, tmp_path, "1x1", "!2x1", "!0x1"], kernels=kmap, cc="8.0", kernel_map=kmap)
    assert run.rc == 0 and run.result["passed"] and run.result["chosen"] == [0], run
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, run
    assert "LeakSanitizer" not in run.stderr, run
    assert run.result["refused"].split("\x1f")[1] == ("colibri_set_input_shape: batch 0 x tokens 1; allowed: 1 or "
                                                      "more each")
