"""The CPU backend's numba set-up, shared by its kernel modules (cpu_kernels, cpu_direct): numba imported without
PyYAML, the compile options, the storage and activation codes, and float16 widened in registers.

Compilation: `cache=True` writes the machine code next to each module (`__pycache__`) or, where the install is
read-only, under NUMBA_CACHE_DIR / the user's cache folder (numba's own rule). numba keys a cached kernel by its own
source file only, so a kernel that inlines a function of another module would keep its old machine code when only
that module changed (an upgrade, an edit): `drop_stale_cache` removes the kernel modules' cache entries whenever any
of their sources differs from the ones the entries were compiled from.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np

# The modules whose compiled kernels call one another's (their cache entries are dropped together).
KERNEL_MODULES = ("cpu_jit", "cpu_q4_integer", "cpu_direct", "cpu_kernels", "cpu_routing")
STAMP_NAME = "colibri-cpu-kernels.sha256"  # in numba's cache folder: the sources the entries there were compiled from
_checked: set = set()  # cache folders checked by this process


def _import_numba():
    """Import numba without PyYAML: numba imports yaml only to read an optional `.numba_config.yaml` in the working
    directory, which the runtime does not use (NUMBA_* environment variables still apply); the CPU runtime keeps
    its imports to NumPy, threadpoolctl and numba."""
    if "numba" in sys.modules or "yaml" in sys.modules:
        import numba
        return numba
    sys.modules["yaml"] = None  # `import yaml` raises ImportError while numba reads its configuration
    try:
        import numba
    finally:
        del sys.modules["yaml"]
    return numba


njit = _import_numba().njit


def f16_hardware() -> bool:
    """True where LLVM converts float16 to float32 in hardware: every aarch64 CPU (FCVT, the Jetson's Cortex-A78AE
    included) and x86 with F16C (VCVTPH2PS; Intel since 2012, AMD since 2012): the host's, or where NUMBA_CPU_NAME
    names the target numba compiles for, the features NUMBA_CPU_FEATURES lists (as `cpu_q4_integer.avx2_target`).
    Elsewhere LLVM would call compiler-rt's __extendhfsf2, which numba's JIT does not link (a process that asked for
    it aborted), so the conversion is written in integer operations."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    from numba.core import config

    if config.CPU_NAME:  # a named target (NUMBA_CPU_NAME, e.g. "generic" for a portable cache): its listed features
        return "+f16c" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("f16c", False))


def f16_widen_ir(builder, h, hardware: bool):
    """LLVM IR: the float32 value of the float16 whose bits are h (an i16 value), as `make_f16_value` describes."""
    from llvmlite import ir

    i32, f32 = ir.IntType(32), ir.FloatType()
    if hardware:
        return builder.fpext(builder.bitcast(h, ir.HalfType()), f32)
    v = builder.zext(h, i32)
    rest = builder.shl(builder.and_(v, i32(0x7FFF)), i32(13))
    finite = builder.bitcast(builder.fmul(builder.bitcast(rest, f32), f32(2.0**112)), i32)
    special = builder.or_(rest, i32(0x70000000))  # exponent 31 -> 255, the mantissa kept (NaN stays NaN)
    is_special = builder.icmp_unsigned("==", builder.and_(v, i32(0x7C00)), i32(0x7C00))
    magnitude = builder.select(is_special, special, finite)
    sign = builder.shl(builder.and_(v, i32(0x8000)), i32(16))
    return builder.bitcast(builder.or_(sign, magnitude), f32)


def ir_fast(value):
    """An LLVM IR floating-point instruction with the kernels' fast-math flags (`_FASTMATH`), returned."""
    value.flags.extend(("reassoc", "contract", "nsz"))
    return value


def ir_vector_load(builder, base, index, vtype, align: int):
    """LLVM IR: the vector of type vtype at element `index` of the pointer `base`, aligned to `align` bytes."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), vtype.as_pointer()), align=align)


def ir_prefetch(builder, pointer):
    """LLVM IR: a prefetch hint (`llvm.prefetch`, read, to every cache level: x86 `prefetcht0`, aarch64 `prfm
    pldl1keep`) for the cache line holding the byte at i8* `pointer`. A hint never faults, so a pointer past an
    array's end (a stream's next rows, past the matrix's last) is harmless."""
    from llvmlite import ir
    from numba.core import cgutils

    i8, i32 = ir.IntType(8), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
    builder.call(fn, [pointer, i32(0), i32(3), i32(1)])


def ir_splat(builder, value, vtype):
    """LLVM IR: a vector of type vtype with every element `value`."""
    from llvmlite import ir

    i32 = ir.IntType(32)
    first = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, i32(0))
    return builder.shuffle_vector(first, ir.Constant(vtype, ir.Undefined),
                                  ir.Constant(ir.VectorType(i32, vtype.count), [0] * vtype.count))


def ir_horizontal_sum(builder, v):
    """LLVM IR: the float sum of a float vector's elements, halves added pairwise (fast-math flags as `ir_fast`)."""
    from llvmlite import ir

    parts = [builder.extract_element(v, ir.IntType(32)(i)) for i in range(v.type.count)]
    while len(parts) > 1:
        h = len(parts) // 2
        parts = [ir_fast(builder.fadd(parts[i], parts[i + h])) for i in range(h)]
    return parts[0]


def make_f16_value(hardware: bool):
    """A numba intrinsic f16_value(h) -> float32: the exact value of the float16 whose bits are h (uint16), IEEE
    754 widening (subnormals exact, signed zeros, Inf and NaN kept), as NumPy's float16 → float32 cast.

    hardware: LLVM's `fpext half to float` (one vector instruction per 8 or 16 values, F16C / aarch64); else integer
    operations on 32-bit LLVM integers (numba's own integer operations widen to 64 bits, halving the vector width):
    the sign to bit 31, exponent and mantissa shifted by 13 and the float32 times 2^112 (exact, subnormals
    included), an all-ones exponent (Inf, NaN) moved to float32's all-ones exponent instead (`f16_widen_ir`)."""
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def f16_value(typingctx, h):
        def codegen(context, builder, sig, args):
            return f16_widen_ir(builder, args[0], hardware)
        return types.float32(types.uint16), codegen
    return f16_value


_f16_value = make_f16_value(f16_hardware())


def make_nibbles():
    """Two numba intrinsics nibble_low(b), nibble_high(b) -> float32: the low / high four bits of a uint8 b as a
    float32 0..15, split in 32-bit LLVM integers (`and 15`, `lshr 4`, then `uitofp`). numba's own integer
    operations widen to 64 bits, which vectorises to a quarter of the float32 lanes; these stay one 8-lane (AVX2)
    or 4-lane (NEON) operation each."""
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()

    @intrinsic
    def nibble_low(typingctx, b):
        def codegen(context, builder, sig, args):
            return builder.uitofp(builder.and_(builder.zext(args[0], i32), i32(15)), f32)
        return types.float32(types.uint8), codegen

    @intrinsic
    def nibble_high(typingctx, b):
        def codegen(context, builder, sig, args):
            return builder.uitofp(builder.lshr(builder.zext(args[0], i32), i32(4)), f32)
        return types.float32(types.uint8), codegen

    return nibble_low, nibble_high


_nibble_low, _nibble_high = make_nibbles()


def make_prefetch():
    """A numba intrinsic prefetch(a, offset): a hint (`ir_prefetch`) for the cache line holding byte `offset` of
    array a's data; an offset past a's end is harmless."""
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, a, offset):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            ir_prefetch(builder, builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]]))
            return context.get_dummy_value()
        return types.void(a, offset), codegen

    return prefetch


_prefetch = make_prefetch()
LINE_BYTES = 64  # a cache line (x86-64; the Jetson's Cortex-A78AE)
STREAM_AHEAD = 1024  # bytes ahead of a stream's position that its prefetch hints name (measurements: cpu_kernels)


STORE_F32, STORE_F16, STORE_Q8, STORE_Q4 = 0, 1, 2, 3
ACT_SWIGLU, ACT_CLAMPED = 0, 1

# reassoc + contract let LLVM vectorise the float32 dot products (and use FMA); no nnan/ninf: silu's exp overflow
# must give the exact 0 limit, as in NumPy.
_FASTMATH = {"reassoc", "contract", "nsz"}
_JIT = dict(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")

U = np.uint64


@njit(inline="always", **_JIT)
def _prefetch_ahead(w0, w1, w2, w3):
    """Prefetch hints (`cpu_jit._prefetch`) for every cache line of four rows (row bytes,) uint8 of a matrix,
    STREAM_AHEAD bytes on: the rest of each row and the start of the row after it, each stream's next."""
    size = U(w0.shape[0])
    for b in range(U(STREAM_AHEAD), size + U(STREAM_AHEAD), U(LINE_BYTES)):
        _prefetch(w0, b)
        _prefetch(w1, b)
        _prefetch(w2, b)
        _prefetch(w3, b)


@njit(**_JIT)
def _f16_into(src, buf):
    """buf[c] = float32(src[c]) for float16 bits src (n,) uint16 (`_f16_value`: exact, Inf and NaN kept, so a
    product with a non-finite stored value is non-finite and the CPU engine names the tensor: cpu_engine, "checked
    finite")."""
    for c in range(src.shape[0]):
        buf[c] = _f16_value(src[c])


def sources_digest() -> str:
    """SHA-256 (hex) of the KERNEL_MODULES' source files, in that order, and numba's version."""
    digest = hashlib.sha256(_import_numba().__version__.encode())
    here = Path(__file__).parent
    for name in KERNEL_MODULES:
        digest.update((here / f"{name}.py").read_bytes())
    return digest.hexdigest()


def drop_stale_cache(dispatcher) -> None:
    """Remove the KERNEL_MODULES' cached machine code (numba's `.nbi` index and `.nbc` data files) from the cache
    folder of `dispatcher` (a compiled kernel of one of them) where it was compiled from other sources than the
    installed ones (STAMP_NAME there holds `sources_digest` of the last check), then record the current digest.
    Once per folder and process; never raises. The folder is numba's own choice for the kernel (made here if
    missing, as numba would); the stamp is replaced atomically, never written through a link. A folder or stamp
    this process cannot write is left as it is (numba cannot write there either; a stamp that cannot be written
    means the entries are dropped again by the next process). A concurrent process may recompile an entry removed
    under it; nothing else changes."""
    try:
        folder = Path(dispatcher._cache._cache_path)  # numba's own choice of folder for this kernel's cache
    except (AttributeError, TypeError, ValueError):  # no such attribute in this numba, or not a path
        return
    if folder in _checked:
        return
    _checked.add(folder)
    digest = sources_digest().encode()
    stamp = folder / STAMP_NAME
    try:
        if stamp.is_file() and not stamp.is_symlink() and stamp.read_bytes() == digest:
            return
    except (OSError, ValueError):
        pass  # unreadable: entries there (if any) are of unknown sources
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path in folder.glob("*.nb[ic]"):
            if path.name.split(".", 1)[0] in KERNEL_MODULES and (path.is_symlink() or path.is_file()):
                path.unlink(missing_ok=True)
    except (OSError, ValueError):
        return
    temporary = folder / f"{STAMP_NAME}.{os.getpid()}.tmp"
    try:
        temporary.write_bytes(digest)
        os.replace(temporary, stamp)  # replaces a link or a stale file; a directory there refuses (OSError)
    except OSError:
        temporary.unlink(missing_ok=True)
