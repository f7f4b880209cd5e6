"""Check a cubin's ELF header: a 64-bit little-endian ELF for the CUDA machine, built for the profile's SM.

ELF header fields used (System V ABI, "ELF Header"): e_ident[EI_CLASS] at byte 4, e_ident[EI_DATA] at 5,
e_ident[EI_OSABI] at 7, e_machine (u16) at 18, e_flags (u32) at 48 of the 64-bit header.
The SM number in e_flags is encoded per OSABI (measured; NVIDIA does not document it):
  OSABI 0x33 (CUDA 12.x cubins):  SM = e_flags & 0xff            (sm_87 → 0x57 in the low byte)
  OSABI 0x41 (CUDA 13.x cubins):  SM = (e_flags >> 8) & 0xff
"""

from __future__ import annotations

import struct

from ..errors import CompileError

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
EM_CUDA = 190
OSABI_CUDA12 = 0x33
OSABI_CUDA13 = 0x41
ELF64_HEADER_SIZE = 64


def cubin_sm(image: bytes, what: str = "cubin") -> int:
    """The SM number (e.g. 87) a cubin was built for, read from its ELF header.

    Raises:
        CompileError: not a 64-bit little-endian ELF, e_machine is not EM_CUDA (190), or an unknown OSABI.
    """
    if len(image) < ELF64_HEADER_SIZE or image[:4] != ELF_MAGIC:
        raise CompileError(f"{what}: not an ELF file (first bytes {bytes(image[:4])!r}; expected {ELF_MAGIC!r})")
    if image[4] != ELFCLASS64 or image[5] != ELFDATA2LSB:
        raise CompileError(f"{what}: ELF class {image[4]} / data {image[5]}; expected 64-bit little-endian (2 / 1)")
    (machine,) = struct.unpack_from("<H", image, 18)
    if machine != EM_CUDA:
        raise CompileError(f"{what}: e_machine = {machine}; expected EM_CUDA ({EM_CUDA})")
    (flags,) = struct.unpack_from("<I", image, 48)
    osabi = image[7]
    if osabi == OSABI_CUDA12:
        return flags & 0xFF
    if osabi == OSABI_CUDA13:
        return (flags >> 8) & 0xFF
    raise CompileError(
        f"{what}: ELF OSABI 0x{osabi:02x}; known: 0x{OSABI_CUDA12:02x} (CUDA 12), 0x{OSABI_CUDA13:02x} (CUDA 13)"
    )


def check_cubin_arch(image: bytes, arch: str, what: str = "cubin") -> int:
    """Raise CompileError unless the cubin's ELF header names `arch` ("sm_87"). Returns the SM number."""
    expected = int(arch.removeprefix("sm_"))
    sm = cubin_sm(image, what)
    if sm != expected:
        raise CompileError(f"{what}: ELF header names sm_{sm}; the profile's target.arch is {arch}")
    return sm
