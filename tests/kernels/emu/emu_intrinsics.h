// emu_intrinsics.h: the CUDA intrinsics the kernels use: barriers, warp shuffles, atomics, __ldg / __ldcg (recorded
// by the access model), the float and fp16 bit conversions; and COLI_EMU_EXPORT, a kernel's exported entry point.
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
#pragma once

namespace coli_emu {

// IEEE binary16 bits → float32, exact (every half value is a float).
inline float half_bits_to_float(unsigned short h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);  // normal: rebias 15 → 127
    } else if (mant == 0) {
        bits = sign;  // ±0
    } else {  // subnormal: normalise
        exp = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace coli_emu

// ---- intrinsics ------------------------------------------------------------------------------------------------
inline void __syncthreads() { coli_emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { coli_emu::warp_barrier(mask); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) { return ((lane ^ lane_mask) & (width - 1)) | (lane & ~(width - 1)); });
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) {
        const int src = lane + int(delta);
        return (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane;
    });
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) {
        const int src = lane - int(delta);
        return src >= (lane & ~(width - 1)) ? src : lane;
    });
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) { return (lane & ~(width - 1)) + (src_lane & (width - 1)); });
}

// Nothing else runs between two synchronisation points, so a plain read-modify-write is atomic here.
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline int atomicMax(int* p, int v) { const int old = *p; *p = old > v ? old : v; return old; }

// A global load: recorded by the access model when it is on (always inlined, so that each load site of a kernel
// calls record_load from its own address).
template <class T>
__attribute__((always_inline)) inline T __ldg(const T* p) {
    if (sizeof(T) >= 8 && uintptr_t(p) % sizeof(T))
        coli_emu::misaligned(sizeof(T) == 16 ? "16-byte __ldg" : "8-byte __ldg", p);
    if (coli_emu::acc_model.on) coli_emu::record_load(p, sizeof(T));
    return *p;
}

// A global load through L2 (ld.global.cg: data other blocks of the same launch wrote): the same record as __ldg.
template <class T>
__attribute__((always_inline)) inline T __ldcg(const T* p) {
    if (coli_emu::acc_model.on) coli_emu::record_load(p, sizeof(T));
    return *p;
}
// Blocks run one after another and a block's fibers switch only at synchronisation points, so every store is
// visible to every later load: a memory fence has nothing to order here (the GPU memory model is not emulated).
inline void __threadfence() {}

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __half_bits_to_float(unsigned short h) { return coli_emu::half_bits_to_float(h); }
// float32 → IEEE binary16 bits, round to nearest even (as cvt.rn.f16.f32): overflow to inf, NaN kept quiet.
inline unsigned short __float_to_half_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));  // NaN
    if (absx >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (absx < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        const float a = std::fabs(f) * 16777216.0f;  // units of 2^-24; exact (a power of two scale)
        return uint16_t(sign | uint32_t(std::nearbyint(a)));  // the default rounding mode: nearest even
    }
    const uint32_t mant = absx & 0x7fffffu, exp = (absx >> 23) - 112u;  // rebias 127 → 15
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
    return uint16_t(sign | h);
}

// Exported entry point of one kernel: int coli_emu_launch_<symbol>(grid[3], block[3], params).
#define COLI_EMU_EXPORT(symbol)                                                                                 \
    extern "C" __attribute__((visibility("default"))) int coli_emu_launch_##symbol(                            \
        const unsigned* grid, const unsigned* block, void** params) {                                          \
        return coli_emu::launch(#symbol, coli_emu::thunk<symbol>, grid, block, params);                        \
    }
