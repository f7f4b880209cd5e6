"""Backend selection: "cpu", "auto" (CUDA when usable, else the CPU with a one-line notice, logged, never printed),
"cuda" without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

from colibri_sdk.errors import BackendError
from colibri_sdk.runtime import Runtime, available_backends, cuda_status
from colibri_sdk.runtime import backends as backends_module

CUDA_OK, CUDA_REASON = cuda_status()
needs_no_gpu = pytest.mark.skipif(CUDA_OK, reason="a CUDA driver is present; these tests check the no-GPU path")


@pytest.fixture
def notices(caplog):
    """The messages logged under "colibri_sdk" (INFO and above) while the test runs."""
    caplog.set_level("INFO", logger="colibri_sdk")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("colibri_sdk")]


def test_cpu_backend_prints_nothing(small_bundle, capsys, notices):
    with Runtime.load(small_bundle, backend="cpu") as rt:
        assert rt.backend_name == "cpu"
        assert rt.notice is None
    assert capsys.readouterr().err == ""
    assert notices() == []


@needs_no_gpu
def test_auto_falls_back_to_cpu_with_one_line_notice(small_bundle, capsys, notices):
    with Runtime.load(small_bundle) as rt:
        assert rt.backend_name == "cpu"
    assert notices() == [f"running on the CPU backend: no usable CUDA GPU here: {CUDA_REASON}"]
    assert rt.notice == notices()[0]
    assert capsys.readouterr().err == ""  # the library logs; it never prints
    assert available_backends() == ["cpu"]


@needs_no_gpu
def test_cuda_without_gpu_is_a_backend_error(small_bundle):
    assert CUDA_REASON  # the probe says why
    with pytest.raises(BackendError, match=r"^no usable CUDA GPU here: .+; use the cpu or auto backend$"):
        Runtime.load(small_bundle, backend="cuda")


def test_unknown_backend(small_bundle):
    with pytest.raises(BackendError, match=r"backend 'tpu'; allowed: auto, cuda, cpu"):
        Runtime.load(small_bundle, backend="tpu")


def _fake_cuda_module(monkeypatch, backend_class):
    module = types.ModuleType("colibri_sdk.runtime.cuda_backend")
    module.CudaBackend = backend_class
    monkeypatch.setitem(sys.modules, "colibri_sdk.runtime.cuda_backend", module)
    monkeypatch.setattr(backends_module, "cuda_status", lambda: (True, "driver 12.6"))


def test_auto_falls_back_when_the_device_cannot_run_the_bundle(small_bundle, monkeypatch, notices):
    class NoDevice:
        def __init__(self, bundle, eager=False):
            raise BackendError("no CUDA device: cuDeviceGetCount returned 0")

    _fake_cuda_module(monkeypatch, NoDevice)
    with Runtime.load(small_bundle) as rt:
        assert rt.backend_name == "cpu"
    assert notices() == ["running on the CPU backend: no CUDA device: cuDeviceGetCount returned 0"]
    with pytest.raises(BackendError, match=r"^no CUDA device: cuDeviceGetCount returned 0$"):
        Runtime.load(small_bundle, backend="cuda")


def test_auto_takes_cuda_when_it_loads(small_bundle, monkeypatch, capsys):
    calls, seen = [], []

    class FakeCuda:
        name = "cuda"

        def __init__(self, bundle, eager=False):
            calls.append(("init", eager))

        def infer_padded(self, x, valid_tokens=None):
            calls.append(("infer", x.shape, x.dtype, x.flags.c_contiguous, list(valid_tokens)))
            seen.append(x.copy())
            return np.full(x.shape, 7.0, np.float32)

        def close(self):
            calls.append(("close",))

    _fake_cuda_module(monkeypatch, FakeCuda)
    with Runtime.load(small_bundle, eager=True) as rt:
        assert rt.backend_name == "cuda"
        y = rt.infer(np.ones((3, 64), np.float16))
        # Positions past a sequence's length are zero whatever the backend computed there.
        z = rt.infer(np.ones((2, 5, 64), np.float32), input_lengths=[2, 0])
    assert y.shape == (3, 64) and np.all(y == 7.0)
    assert z.shape == (2, 5, 64) and np.all(z[0, :2] == 7.0) and np.all(z[0, 2:] == 0) and np.all(z[1] == 0)
    padded = ("infer", (2, 8, 64), np.dtype(np.float32), True)
    # The valid tokens of each sequence travel with the padded input: 3 of sequence 0 (none of sequence 1), then
    # the lengths given.
    assert calls == [("init", True), (*padded, [3, 0]), (*padded, [2, 0]), ("close",)]
    # What the backend saw: the input, zeros elsewhere (the second call's staging holds nothing of the first).
    first = np.zeros((2, 8, 64), np.float32)
    first[0, :3] = 1
    second = np.zeros((2, 8, 64), np.float32)
    second[0, :2] = 1
    np.testing.assert_array_equal(seen[0], first)
    np.testing.assert_array_equal(seen[1], second)
    assert capsys.readouterr().err == ""


def test_cpu_path_never_imports_cuda(small_bundle):
    code = (
        "import sys, numpy as np\n"
        "from colibri_sdk.runtime import Runtime\n"
        f"rt = Runtime.load({str(small_bundle)!r}, backend='cpu')\n"
        "rt.infer(np.zeros((1, 64), np.float32)); rt.self_test(); rt.close()\n"
        # A bare `cuda` namespace package may be pre-registered by site-packages' .pth files; its submodules not.
        "heavy = ('yaml', 'torch', 'paramiko', 'transformers')\n"
        "bad = sorted(m for m in sys.modules if m.startswith('cuda.') or m.split('.')[0] in heavy)\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=guard(600))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_auto_falls_back_when_the_cuda_backend_cannot_be_imported(small_bundle, monkeypatch, notices):
    monkeypatch.setitem(sys.modules, "colibri_sdk.runtime.cuda_backend", None)  # import raises ImportError
    monkeypatch.setattr(backends_module, "cuda_status", lambda: (True, "driver 12.6"))
    with Runtime.load(small_bundle) as rt:
        assert rt.backend_name == "cpu"
    [notice] = notices()
    assert re.fullmatch(r"running on the CPU backend: backend 'cuda' cannot be imported here \(.+\)", notice)


@pytest.mark.parametrize("verify", [True, False])
def test_cpu_weights_read_first_at_load_are_mapped_in_2mib_pages(demo_bundle, verify):
    """A weights file not yet cached (a device after a reboot) is read in 2 MiB pages (colibri_sdk.format.pages):
    by Runtime.load's bundle check (verify), whose mapping asks for them, or else by the CPU backend's own mapping,
    which asks for them too."""
    import shutil

    import page_support

    with page_support.disk_folder() as folder:
        reason = page_support.file_thp_reason(folder)
        if reason:
            pytest.skip(reason)
        bundle = Path(shutil.copytree(demo_bundle, folder / "bundle"))
        page_support.drop_cached(bundle / "model.colibri")
        rt = Runtime.load(bundle, backend="cpu", verify=verify)
        try:
            backend = rt._run_for(1, 16).backend  # the CPU backend of the shape the call runs at
            assert backend.huge_pages is True and rt._backend.huge_pages is True
            rt.infer(np.full((1, 16, 256), 0.1, np.float32))
            resident, huge = backend.mapped_bytes()
            assert huge >= 4 << 20, f"{huge} of {resident} resident bytes in 2 MiB pages"
        finally:
            rt.close()
        with pytest.raises(BackendError, match="closed"):
            backend.mapped_bytes()
