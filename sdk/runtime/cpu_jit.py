"""The CPU backend's numba set-up, shared by its kernel modules (cpu_kernels, cpu_direct): numba imported without
PyYAML, the compile options, the storage and activation codes, and float16 widened in registers.

Compilation: `cache=True` writes the machine code next to each module (`__pycache__`) or, where the install is
read-only, under NUMBA_CACHE_DIR / the user's cache folder (numba's own rule).
"""

from __future__ import annotations

import sys

import numpy as np


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
    included) and x86 with F16C (VCVTPH2PS; Intel since 2012, AMD since 2012). Elsewhere LLVM would call
    compiler-rt's __extendhfsf2, which numba's JIT does not link, so the conversion is written in integer operations."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("f16c", False))


def make_f16_value(hardware: bool):
    """A numba intrinsic f16_value(h) -> float32: the exact value of the float16 whose bits are h (uint16), IEEE
    754 widening (subnormals exact, signed zeros, Inf and NaN kept), as NumPy's float16 → float32 cast.

    hardware: LLVM's `fpext half to float` (one vector instruction per 8 or 16 values, F16C / aarch64); else integer
    operations on 32-bit LLVM integers (numba's own integer operations widen to 64 bits, halving the vector width):
    the sign to bit 31, exponent and mantissa shifted by 13 and the float32 times 2^112 (exact, subnormals
    included), an all-ones exponent (Inf, NaN) moved to float32's all-ones exponent instead."""
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()

    @intrinsic
    def f16_value(typingctx, h):
        def codegen(context, builder, sig, args):
            if hardware:
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), f32)
            v = builder.zext(args[0], i32)
            rest = builder.shl(builder.and_(v, i32(0x7FFF)), i32(13))
            finite = builder.bitcast(builder.fmul(builder.bitcast(rest, f32), f32(2.0**112)), i32)
            special = builder.or_(rest, i32(0x70000000))  # exponent 31 -> 255, the mantissa kept (NaN stays NaN)
            is_special = builder.icmp_unsigned("==", builder.and_(v, i32(0x7C00)), i32(0x7C00))
            magnitude = builder.select(is_special, special, finite)
            sign = builder.shl(builder.and_(v, i32(0x8000)), i32(16))
            return builder.bitcast(builder.or_(sign, magnitude), f32)
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
    """A numba intrinsic prefetch(matrix, row, offset): LLVM's `llvm.prefetch` (read, keep in every cache level) of
    byte `offset` of row `row` of a 2-D array (any dtype; no bounds check: a prefetch never faults). x86 PREFETCHT0,
    aarch64 PRFM PLDL1KEEP. The hardware prefetchers stop at each 4 KiB page and look only as far ahead as the
    out-of-order window; a loop that spends many instructions on each byte (the int8 / int4 products) asks for
    the rows it reads next itself."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)

    @intrinsic
    def prefetch(typingctx, matrix, row, offset):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            stride = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
            row = context.cast(builder, args[1], sig.args[1], types.intp)
            offset = context.cast(builder, args[2], sig.args[2], types.intp)
            where = builder.add(builder.mul(row, stride), offset)
            ptr = builder.gep(builder.bitcast(ary.data, i8p), [where])
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(matrix, row, offset), codegen

    return prefetch


_prefetch = make_prefetch()

STORE_F32, STORE_F16, STORE_Q8, STORE_Q4 = 0, 1, 2, 3
ACT_SWIGLU, ACT_CLAMPED = 0, 1

# reassoc + contract let LLVM vectorise the float32 dot products (and use FMA); no nnan/ninf: silu's exp overflow
# must give the exact 0 limit, as in NumPy.
_FASTMATH = {"reassoc", "contract", "nsz"}
_JIT = dict(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")

U = np.uint64


@njit(**_JIT)
def _f16_into(src, buf):
    """buf[c] = float32(src[c]) for float16 bits src (n,) uint16 (`_f16_value`: exact, Inf and NaN kept, so a
    product with a non-finite stored value is non-finite and the CPU engine names the tensor: cpu_engine, "checked
    finite")."""
    for c in range(src.shape[0]):
        buf[c] = _f16_value(src[c])
