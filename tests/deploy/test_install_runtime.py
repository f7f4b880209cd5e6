"""`--install-runtime`: the wheels a device needs, chosen for its platform and Python with packaging.tags, shipped
from this machine and installed into a venv there without an index.

The platform choice for a JetPack 6 device (aarch64, CPython 3.10, glibc 2.35) is tested with wheel file names
only; the full install runs against the real sshd on 127.0.0.1, whose 'device' is this x86_64 machine, with wheels
fetched for it by `pip download` (skipped, saying so, when no index can be reached here)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from timeout_support import guard

from colibri_sdk import __version__
from colibri_sdk.deploy import DeployOptions, deploy, status
from colibri_sdk.deploy import installer
from colibri_sdk.deploy.errors import RuntimeInstallError
from colibri_sdk.deploy.wheels import Device, resolve, select_wheel

JETPACK6 = {"implementation": "cpython", "machine": "aarch64", "python": [3, 10],
            "soabi": "cpython-310-aarch64-linux-gnu", "libc": ["glibc", "2.35"],
            "markers": {"implementation_name": "cpython", "platform_machine": "aarch64", "python_version": "3.10",
                        "python_full_version": "3.10.12", "sys_platform": "linux", "platform_system": "Linux",
                        "os_name": "posix", "platform_python_implementation": "CPython",
                        "implementation_version": "3.10.12", "platform_release": "5.15.136-tegra",
                        "platform_version": "#1 SMP PREEMPT"}}
NUMPY = [
    "numpy-1.26.4-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
    "numpy-2.1.0-cp310-cp310-manylinux_2_35_aarch64.whl",           # the newest one this glibc runs
    "numpy-2.2.6-cp310-cp310-manylinux_2_38_aarch64.whl",           # needs glibc 2.38
    "numpy-2.3.0-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",  # CPython 3.11
    "numpy-2.3.0-cp310-cp310-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",    # x86_64
    "numpy-2.3.0-cp310-cp310-musllinux_1_2_aarch64.whl",            # musl
    "numpy-2.3.0rc1-cp310-cp310-manylinux_2_17_aarch64.whl",        # a pre-release
]
CUDA_BINDINGS = [
    "cuda_bindings-12.6.2.post1-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
    "cuda_bindings-12.9.4-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl",
    "cuda_bindings-13.0.1-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl",  # driver >= 580
]


def test_jetpack6_device_tags_and_platforms():
    device = Device.from_probe(JETPACK6)
    assert (device.machine, device.python, device.abi, device.glibc) == ("aarch64", (3, 10), "cp310", (2, 35))
    assert device.platforms[:2] == ["manylinux_2_35_aarch64", "manylinux_2_34_aarch64"]
    assert device.platforms[-3:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"]
    assert "manylinux_2_16_aarch64" not in device.platforms  # aarch64 manylinux starts at glibc 2.17


def test_platform_choice_for_jetpack6_from_file_names_only():
    device = Device.from_probe(JETPACK6)
    files = [Path(n) for n in NUMPY + CUDA_BINDINGS]
    assert select_wheel(Requirement("numpy>=1.22"), files, device).name == NUMPY[1]
    assert select_wheel(Requirement("numpy<2"), files, device).name == NUMPY[0]
    assert select_wheel(Requirement("cuda-bindings>=12,<13"), files, device).name == CUDA_BINDINGS[1]
    assert select_wheel(Requirement("cuda-bindings>=13"), files, device).name == CUDA_BINDINGS[2]
    assert select_wheel(Requirement("numpy>=2.2"), files, device) is None


def test_pip_download_command_for_what_is_missing():
    device = Device.from_probe(JETPACK6)
    assert device.pip_download([Requirement("numpy>=1.22"), Requirement("cuda-bindings>=12,<13")], "wheels") == (
        "pip download --only-binary=:all: --platform=manylinux_2_35_aarch64 --platform=manylinux2014_aarch64 "
        "--python-version=310 --implementation=cp --abi=cp310 -d wheels 'numpy>=1.22' 'cuda-bindings<13,>=12'")


def fake_wheel(folder: Path, name: str, requires=()) -> Path:
    """A wheel file holding only its METADATA (enough for the dependency walk)."""
    dist, version = name.split("-")[:2]
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: " + dist + "\nVersion: "
                   + version + "\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return path


def test_dependency_closure_follows_extras_and_markers(tmp_path):
    device = Device.from_probe(JETPACK6)
    sdk = fake_wheel(tmp_path, f"colibri_sdk-{__version__}-py3-none-any.whl", [
        "numpy>=1.22", 'cuda-bindings<13,>=12; extra == "jetson"', 'paramiko>=3.4; extra == "deploy"',
        'ml-dtypes; platform_machine == "x86_64"'])
    files = [fake_wheel(tmp_path, NUMPY[1]), fake_wheel(tmp_path, CUDA_BINDINGS[1], ["cuda-pathfinder~=1.1"]),
             fake_wheel(tmp_path, CUDA_BINDINGS[2], ["cuda-pathfinder~=1.1"])]
    chosen, missing = resolve(f"colibri-sdk[jetson]=={__version__}", files, device, local={"colibri-sdk": sdk})
    assert {k: v.name for k, v in chosen.items()} == {"colibri-sdk": sdk.name, "numpy": NUMPY[1],
                                                      "cuda-bindings": CUDA_BINDINGS[1]}
    assert [str(r) for r in missing] == ["cuda-pathfinder~=1.1"]  # no paramiko (extra), no ml-dtypes (x86_64)


def test_a_later_upper_bound_re_chooses_an_earlier_pick(tmp_path):
    # colibri-sdk's numpy>=1.22 took numpy 2.1.0; numba's numpy<2.1 then excluded it: the device got "no wheel of
    # numpy<2.1,>=1.22" although numpy 1.26.4 was in the folder (the emulated arm64 device's numba 0.60).
    device = Device.from_probe(JETPACK6)
    sdk = fake_wheel(tmp_path, f"colibri_sdk-{__version__}-py3-none-any.whl", ["numpy>=1.22", "numba>=0.59"])
    files = [fake_wheel(tmp_path, NUMPY[0]), fake_wheel(tmp_path, NUMPY[1]),
             fake_wheel(tmp_path, "numba-0.60.0-cp310-cp310-manylinux2014_aarch64.manylinux_2_17_aarch64.whl",
                        ["numpy<2.1,>=1.22"])]
    chosen, missing = resolve(f"colibri-sdk=={__version__}", files, device, local={"colibri-sdk": sdk})
    assert missing == []
    assert chosen["numpy"].name == NUMPY[0], chosen
    # a bound nothing in the folder meets is still named, with every constraint on the name
    files = [fake_wheel(tmp_path, NUMPY[1]), files[2]]
    chosen, missing = resolve(f"colibri-sdk=={__version__}", files, device, local={"colibri-sdk": sdk})
    assert [str(r) for r in missing] == ["numpy<2.1,>=1.22"], missing


# ---- on the loopback 'device' ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def sdk_wheel(tmp_path_factory):
    """colibri-sdk built once with installer.build_sdk_wheel (pip wheel --no-deps of this tree)."""
    try:
        return installer.build_sdk_wheel(tmp_path_factory.mktemp("sdk_wheel"))
    except RuntimeInstallError as exc:
        if importlib.util.find_spec("setuptools"):
            raise
        pytest.skip(f"no setuptools here and no index to fetch it from, so no colibri-sdk wheel: {exc}")


@pytest.fixture
def prebuilt(monkeypatch, sdk_wheel):
    """Deploys in this module reuse the one wheel build (it takes seconds on a busy machine)."""
    monkeypatch.setattr(installer, "build_sdk_wheel", lambda out: Path(shutil.copy(sdk_wheel, out)))
    monkeypatch.setattr(installer, "pip_cache_wheels", lambda: [])  # only what the test gives


@pytest.fixture(scope="session")
def device_wheels(tmp_path_factory):
    """Wheels of the SDK's device dependencies for this machine (the loopback 'device'), by `pip download`."""
    folder = tmp_path_factory.mktemp("wheels")
    from importlib.metadata import version

    pins = [f"numpy=={version('numpy')}", f"threadpoolctl=={version('threadpoolctl')}", f"numba=={version('numba')}",
            f"llvmlite=={version('llvmlite')}", "cuda-bindings>=12,<13"]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(folder),
                           "--disable-pip-version-check", *pins], capture_output=True, text=True, timeout=guard(1200))
    if proc.returncode != 0:
        pytest.skip(f"pip download of {pins} failed here, so no wheels for the full install: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return folder


@pytest.mark.ssh
def test_missing_wheels_are_named_with_the_pip_download_command(tmp_path, target, prebuilt):
    empty = tmp_path / "wheels"
    empty.mkdir()
    options = DeployOptions(remote_dir=str(tmp_path / "device"), remote_python=sys.executable)
    with pytest.raises(RuntimeInstallError) as info:
        installer.install_runtime(target, options, empty)
    text = str(info.value)
    assert f"no wheel for the device ({platform.machine()}, CPython {sys.version_info[0]}.{sys.version_info[1]}" in text
    # every device requirement of the package (pyproject: dependencies + the jetson extra), in the message and in
    # the pip download command that fetches it
    wanted = ("numpy>=1.22", "threadpoolctl>=3.1", "numba>=0.59", "cuda-bindings<13,>=12")
    named = text.split(" of: ", 1)[1].split(" (looked in --wheels ", 1)[0]
    assert sorted(named.split(", ")) == sorted(wanted), text
    assert "Fetch them on a machine with an index: pip download --only-binary=:all: --platform=manylinux_2_" in text
    command = text.split(f"-d {empty} ", 1)[1].split(f" ; then run again with --wheels {empty}", 1)[0]
    assert sorted(command.split(" ")) == sorted(f"'{w}'" for w in wanted), text
    assert not (tmp_path / "device" / "venv").exists()


@pytest.mark.ssh
def test_outside_the_checkout_a_colibri_sdk_wheel_in_wheels_is_used(tmp_path, target, sdk_wheel, monkeypatch):
    monkeypatch.setattr(installer, "source_tree", lambda: None)  # an installed copy, run from another folder
    monkeypatch.setattr(installer, "pip_cache_wheels", lambda: [])
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    options = DeployOptions(remote_dir=str(tmp_path / "device"), remote_python=sys.executable)
    with pytest.raises(RuntimeInstallError, match=r"run it from inside the checkout, or build the wheel there \(pip wheel --no-deps \. -w DIR: .*\) and pass --wheels DIR$"):
        installer.install_runtime(target, options, wheels)
    shutil.copy(sdk_wheel, wheels)
    with pytest.raises(RuntimeInstallError) as info:  # now only the device's dependencies are missing
        installer.install_runtime(target, options, wheels)
    named = str(info.value).split(" of: ", 1)[1].split(" (looked in --wheels ", 1)[0]
    assert "colibri-sdk" not in named and "numpy>=1.22" in named, str(info.value)


@pytest.mark.ssh
def test_cli_install_runtime_without_wheels_exits_1_with_one_line(tmp_path, sshd, known_hosts, prebuilt, capsys):
    from colibri_sdk.cli import main

    empty = tmp_path / "wheels"
    empty.mkdir()
    code = main(["deploy", "--host", f"{sshd.user}@127.0.0.1:{sshd.port}", "--identity", str(sshd.user_key),
                 "--known-hosts", str(known_hosts), "--remote-dir", str(tmp_path / "device"), "--remote-python",
                 sys.executable, "--install-runtime", "--wheels", str(empty), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "no wheel for the device" in err[0] and "pip download" in err[0]


@pytest.mark.ssh
@pytest.mark.slow
def test_install_runtime_then_verify_uses_the_recorded_venv(tmp_path, target, prebuilt, device_wheels,
                                                             real_bundles):
    root = tmp_path / "device"
    options = DeployOptions(remote_dir=str(root), remote_python=sys.executable)
    record = installer.install_runtime(target, options, device_wheels)
    venv = root / "venv"
    assert record["venv"] == str(venv) and record["version"] == f"colibri-sdk {__version__}"
    assert json.loads((root / "runtime.json").read_text())["python"] == str(venv / "bin" / "python")
    names = sorted(os.listdir(root / "wheels"))
    assert [n.split("-")[0] for n in names if not n.startswith("pip-")] == ["colibri_sdk", "cuda_bindings",
                                                                            "cuda_pathfinder", "llvmlite",
                                                                            "numba", "numpy", "threadpoolctl"]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import colibri_sdk, numpy, cuda.bindings; "
                            "print(colibri_sdk.__file__)"], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.startswith(str(venv)), probe.stderr
    # No --remote-colibri: the self-test runs in the recorded venv.
    result = deploy(real_bundles[0], target, DeployOptions(remote_dir=str(root), remote_python=sys.executable,
                                                           verify=True, verify_backend="cpu"))
    assert result.selftest.startswith("self-test passed on cpu")
    assert status(target, options).runtime["venv"] == str(venv)


def test_missing_packaging_names_the_extra(tmp_path):
    program = ("import sys; sys.modules['packaging'] = None; from colibri_sdk.cli import main; "
               "sys.exit(main(['deploy', '--host', '127.0.0.1', '--install-runtime', '--connect-timeout', '1']))")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path,
                          timeout=guard(600))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("colibri-sdk deploy: error: --install-runtime needs the Python package 'packaging' "
                                   "(extra \"deploy\"): pip install \"colibri-sdk[deploy]\" (in a source checkout: "
                                   "pip install \".[deploy]\")")


def test_an_old_setuptools_builds_with_isolation_and_a_failed_build_names_pip_s_error(tmp_path, monkeypatch):
    # setuptools 65 without wheel (a fresh Python 3.11 venv) cannot build offline: pyproject.toml asks for >= 68 and
    # wheel; the failure used to be quoted as pip's last line, "hint: See above for details."
    import importlib.metadata as metadata

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "65.5.0" if name == "setuptools" else real_version(name))
    assert installer._offline_build_possible() is False
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "  error: invalid command 'bdist_wheel'\n"
                                                       "error: subprocess-exited-with-error\n"
                                                       "hint: See above for details.\n")

    monkeypatch.setattr(installer.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeInstallError) as caught:
        installer.build_sdk_wheel(tmp_path)
    assert "--no-build-isolation" not in calls[0] and "--no-index" not in calls[0], calls[0]
    message = str(caught.value)
    assert "\n" not in message
    assert "(pip wheel exit status 1): error: invalid command 'bdist_wheel' (pip needed an index" in message, message
    assert "hint:" not in message, message
