"""NVRTC compilation (no GPU): images, resource report, compile errors, toolkit mismatch; the cubin ELF check."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from colibri_sdk.aot.cubin import EM_CUDA, check_cubin_arch, cubin_sm
from colibri_sdk.aot.nvrtc import compile_source, cuda_include_dir, nvrtc_version, parse_resources, supported_archs
from colibri_sdk.errors import CompileError

FIXTURES = Path(__file__).parent / "fixtures"
DEFINES = {"COLI_HIDDEN": 64, "COLI_INTER": 96, "COLI_EXPERTS": 4, "COLI_TOPK": 2, "COLI_MAX_TOKENS": 8,
           "COLI_FP16": 1, "COLI_ROUTING_THREADS": 128, "COLI_ROUTING_BLOCK_M": 16}


def routing_source() -> str:
    return (FIXTURES / "kernels" / "routing.cu").read_text()


def compile_routing(arch: str, **kwargs):
    return compile_source(routing_source(), "routing.cu", arch, DEFINES, [FIXTURES / "kernels"], **kwargs)


def test_headers_come_from_the_pip_package():
    include = cuda_include_dir()
    assert (include / "cuda_fp16.h").is_file()
    assert "site-packages" in include.parts or "dist-packages" in include.parts


def test_installed_nvrtc_supports_every_shipped_arch():
    assert nvrtc_version()[0] == 12
    assert {80, 87, 89, 90} <= set(supported_archs())


@pytest.mark.parametrize("arch", ["sm_80", "sm_87", "sm_89", "sm_90"])
def test_cubin_names_the_arch_and_ptx_has_no_nul(arch):
    out = compile_routing(arch)
    assert cubin_sm(out.cubin) == int(arch[3:])
    assert check_cubin_arch(out.cubin, arch) == int(arch[3:])
    assert not out.ptx.endswith(b"\x00") and b"\x00" not in out.ptx
    assert f".target {arch}".encode() in out.ptx
    assert b".entry colibri_routing" in out.ptx and b".entry colibri_align" in out.ptx
    # The PTX emitted with the cubin is the PTX of a compute_XY compilation of the same source.
    ptx_only = compile_routing("compute_" + arch[3:])
    assert ptx_only.cubin == b""
    assert ptx_only.ptx == out.ptx


def test_resource_report_per_entry_function():
    out = compile_routing("sm_87")
    assert set(out.resources) == {"colibri_routing", "colibri_align"}
    routing = out.resources["colibri_routing"]
    # __shared__ float s[COLI_ROUTING_THREADS] with COLI_ROUTING_THREADS = 128: 512 bytes.
    assert routing["shared_bytes"] == 512
    assert routing["registers"] > 0
    assert routing["spill_store_bytes"] == routing["spill_load_bytes"] == 0
    assert out.resources["colibri_align"]["shared_bytes"] == 0
    assert "-DCOLI_HIDDEN=64" in out.options and "--std=c++17" in out.options


def test_spills_are_reported():
    source = (FIXTURES / "spill" / "small_batch.cu").read_text()
    out = compile_source(source, "small_batch.cu", "sm_87", DEFINES, [FIXTURES / "kernels"])
    spill = out.resources["colibri_gate_up_gemv"]
    assert spill["registers"] <= 64
    assert spill["spill_store_bytes"] > 0 and spill["spill_load_bytes"] > 0 and spill["stack_bytes"] > 0
    assert out.resources["colibri_down_gemv"]["spill_store_bytes"] == 0


def test_parse_resources_reads_a_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_87'
ptxas info    : Function properties for k1
ptxas         .     40 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size, 8192 bytes smem, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_87'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]"""
    assert parse_resources(log) == {
        "k1": {"registers": 255, "shared_bytes": 8192, "stack_bytes": 40, "spill_store_bytes": 12, "spill_load_bytes": 16},
        "k2": {"registers": 8, "shared_bytes": 0, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0},
    }


def test_compile_error_shows_file_and_line():
    source = routing_source().replace("float acc = 0.f;", "float acc = undefined_thing;")
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "undefined_thing" in text)
    with pytest.raises(CompileError) as info:
        compile_source(source, "routing.cu", "sm_87", DEFINES, [FIXTURES / "kernels"])
    message = str(info.value)
    assert message.startswith("nvrtcCompileProgram(routing.cu, sm_87) failed: NVRTC_ERROR_COMPILATION")
    assert f'routing.cu({line}): error: identifier "undefined_thing" is undefined' in message


def test_missing_define_is_reported_from_the_header():
    defines = {k: v for k, v in DEFINES.items() if k != "COLI_HIDDEN"}
    with pytest.raises(CompileError, match=r'common.cuh\(6\): catastrophic error: #error directive: "COLI_HIDDEN must be defined'):
        compile_source(routing_source(), "routing.cu", "sm_87", defines, [FIXTURES / "kernels"])


def test_unsupported_arch_is_an_nvrtc_error():
    with pytest.raises(CompileError, match=r"nvrtcCompileProgram\(routing.cu, sm_95\) failed: NVRTC_ERROR_INVALID_OPTION"):
        compile_routing("sm_95")


def test_toolkit_mismatch_names_the_pip_package():
    major, minor = nvrtc_version()
    other = 13 if major == 12 else 12
    with pytest.raises(CompileError) as info:
        compile_routing("sm_87", toolkit=other)
    message = str(info.value)
    assert f"target.toolkit = {other}" in message and f"the installed NVRTC is {major}.{minor}" in message
    assert "pip install" in message and "nvidia-cuda-nvrtc" in message


def test_toolkit_hint_names_the_wheel_loaded_first_when_both_are_installed(monkeypatch):
    from colibri_sdk.aot import nvrtc

    installed = {"nvidia-cuda-nvrtc-cu12"}

    def version(name):
        if name not in installed:
            raise nvrtc.metadata.PackageNotFoundError(name)
        return "1"

    monkeypatch.setattr(nvrtc.metadata, "version", version)
    assert nvrtc.toolkit_hint(12, 13) == nvrtc.pip_hint(12)  # only the wanted wheel: nothing to uninstall
    installed.add("nvidia-cuda-nvrtc")  # a CUDA 13 torch installed next to it
    assert nvrtc.toolkit_hint(12, 13) == (
        'pip install "cuda-python>=12,<13" nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12; nvidia-cuda-nvrtc-cu12 is '
        "installed already, and so is nvidia-cuda-nvrtc (NVRTC 13), which cuda.bindings loads first: "
        "pip uninstall nvidia-cuda-nvrtc")


# ---- cubin ELF header ------------------------------------------------------------------------------------------------
def test_cubin_of_another_arch_is_refused():
    cubin = compile_routing("sm_80").cubin
    with pytest.raises(CompileError, match="routing cubin: ELF header names sm_80; the profile's target.arch is sm_87"):
        check_cubin_arch(cubin, "sm_87", "routing cubin")


def test_cubin_header_faults():
    cubin = bytearray(compile_routing("sm_87").cubin)
    assert struct.unpack_from("<H", cubin, 18)[0] == EM_CUDA and cubin[7] == 0x33
    with pytest.raises(CompileError, match=r"not an ELF file"):
        cubin_sm(b"PTX" + bytes(100))
    wrong_machine = bytearray(cubin)
    struct.pack_into("<H", wrong_machine, 18, 62)  # EM_X86_64
    with pytest.raises(CompileError, match=r"e_machine = 62; expected EM_CUDA \(190\)"):
        cubin_sm(bytes(wrong_machine))
    wrong_abi = bytearray(cubin)
    wrong_abi[7] = 0x00
    with pytest.raises(CompileError, match=r"ELF OSABI 0x00; known: 0x33 \(CUDA 12\), 0x41 \(CUDA 13\)"):
        cubin_sm(bytes(wrong_abi))
    class32 = bytearray(cubin)
    class32[4] = 1
    with pytest.raises(CompileError, match="expected 64-bit little-endian"):
        cubin_sm(bytes(class32))


def test_cuda13_encoding_reads_the_second_byte():
    # CUDA 13 cubins: OSABI 0x41 and the SM in bits 8..15 of e_flags (FACTS measured on NVRTC 13).
    header = bytearray(64)
    header[:8] = b"\x7fELF\x02\x01\x01\x41"
    struct.pack_into("<H", header, 18, EM_CUDA)
    struct.pack_into("<I", header, 48, (87 << 8) | 0x05)
    assert cubin_sm(bytes(header)) == 87


def test_each_compilation_runs_in_a_child_process_that_blocks_sigterm(monkeypatch):
    # NVRTC's own SIGINT/SIGTERM handler ends the process it runs in (status 4 or SIGSEGV, no cleanup), so NVRTC runs
    # in a child: the child's image is the same as this process's would be, and its signal mask blocks both signals.
    from colibri_sdk.aot import nvrtc

    out = compile_routing("sm_87")
    in_process = nvrtc._nvrtc_compile(routing_source(), "routing.cu", "sm_87", list(out.options))
    assert out.cubin == in_process[0] and out.ptx == in_process[1].rstrip(b"\x00")
    probe = ("import signal, sys\nblocked = signal.pthread_sigmask(signal.SIG_BLOCK, set())\n"
             "sys.stderr.write(f'mask {sorted(int(s) for s in blocked)}\\n')\nsys.exit(3)\n")
    monkeypatch.setattr(nvrtc, "_CHILD", nvrtc._CHILD.replace("import pickle", probe + "import pickle"))
    nvrtc._stop_idle_children()  # the next compilation starts a child of the probing _CHILD
    with pytest.raises(CompileError) as err:
        compile_routing("sm_87")
    assert str(err.value) == ("routing.cu (sm_87): the NVRTC child process ended with status 3 and no result (its "
                              "last line: mask [2, 15])")
    assert not nvrtc._IDLE  # a child that failed is not kept


def test_a_child_serves_the_next_compilation_and_a_dead_one_is_replaced():
    import os
    import signal

    from colibri_sdk.aot import nvrtc

    nvrtc._stop_idle_children()
    first = compile_routing("sm_87")
    assert [child[1].pid for child in nvrtc._IDLE] and len(nvrtc._IDLE) == 1
    pid = nvrtc._IDLE[0][1].pid
    assert compile_routing("sm_87").cubin == first.cubin
    assert [child[1].pid for child in nvrtc._IDLE] == [pid]  # the same child, not a new one
    os.kill(pid, signal.SIGKILL)
    nvrtc._IDLE[0][1].wait()
    assert compile_routing("sm_87").cubin == first.cubin  # a dead idle child is replaced, not used
    assert [child[1].pid for child in nvrtc._IDLE] != [pid]
    nvrtc._stop_idle_children()
    assert not nvrtc._IDLE
