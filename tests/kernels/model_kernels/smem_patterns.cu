// smem_patterns.cu: small kernels with known shared-memory request patterns and alignment faults, for
// tests/kernels/test_kernel_model.py (one warp, 32 threads; out: 32 floats, in: at least 256 floats, 16-byte aligned).
//
//   smem_conflict_free   s[lane]                    32-bit, 32 banks once: 1 wavefront per request
//   smem_two_way         s[2 * lane]                lanes l and l + 16 share a bank: 2
//   smem_sixteen_way     s[16 * lane]               16 lanes per bank (banks 0 and 16): 16
//   smem_broadcast       s[0] by every lane         one word: 1
//   smem_vec128          float4 s4[lane]            128-bit, 4 quarter-warp phases, no conflict: 4 (ideal 4)
//   smem_vec128_two_way  float4 s4[2 * lane]        each phase's lanes 32 bytes apart: 2 per phase, 8 (ideal 4)
//   smem_half_warp       s[lane] for lanes < 16     16 active lanes, 1 wavefront
//   ldg_misaligned       a 16-byte __ldg 4 bytes past an aligned address: a launch error
//   cp_async_misaligned  a cp.async 16-byte copy to a shared address 4 bytes past an aligned one: a launch error
//   cp_async_war         each thread reads its neighbour's slot, then refills its own with a cp.async without a
//                        barrier in between: a write-after-read race the random landing exposes
//   cp_async_war_fixed   the same with the barrier
#include "cuda_shim.h"

#define LANE (threadIdx.x & 31)

extern "C" __global__ void smem_conflict_free(const float* in, float* out) {
    __shared__ float s[1024];
    s[LANE] = in[LANE];
    __syncthreads();
    out[LANE] = s[LANE];
}

extern "C" __global__ void smem_two_way(const float* in, float* out) {
    __shared__ float s[1024];
    s[LANE] = in[LANE];
    s[LANE + 32] = in[LANE];
    __syncthreads();
    out[LANE] = s[2 * LANE];
}

extern "C" __global__ void smem_sixteen_way(const float* in, float* out) {
    __shared__ float s[1024];
    for (int i = LANE; i < 1024; i += 32) s[i] = in[i % 256];
    __syncthreads();
    out[LANE] = s[16 * LANE];
}

extern "C" __global__ void smem_broadcast(const float* in, float* out) {
    __shared__ float s[1024];
    if (LANE == 0) s[0] = in[0];
    __syncthreads();
    out[LANE] = s[0];
}

extern "C" __global__ void smem_vec128(const float* in, float* out) {
    __shared__ __align__(16) float4 s4[256];
    s4[LANE] = reinterpret_cast<const float4*>(in)[LANE];
    __syncthreads();
    const float4 v = s4[LANE];
    out[LANE] = v.x + v.y + v.z + v.w;
}

extern "C" __global__ void smem_vec128_two_way(const float* in, float* out) {
    __shared__ __align__(16) float4 s4[256];
    s4[2 * LANE] = reinterpret_cast<const float4*>(in)[LANE];
    __syncthreads();
    const float4 v = s4[2 * LANE];
    out[LANE] = v.x + v.y + v.z + v.w;
}

extern "C" __global__ void smem_half_warp(const float* in, float* out) {
    __shared__ float s[1024];
    s[LANE] = in[LANE];
    __syncthreads();
    if (LANE < 16) out[LANE] = s[LANE];
}

extern "C" __global__ void ldg_misaligned(const float* in, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(in + 1 + 4 * LANE));
    out[LANE] = __uint_as_float(v.x);
}

extern "C" __global__ void cp_async_misaligned(const float* in, float* out) {
    __shared__ __align__(16) float s[1024];
    coli_emu_cp_async16(&s[1 + 4 * LANE], in + 4 * LANE);
    coli_emu_cp_async_commit();
    coli_emu_cp_async_wait(0);
    __syncthreads();
    out[LANE] = s[1 + 4 * LANE];
}

template <bool BARRIER>
__device__ __forceinline__ void war(const float* in, float* out) {
    __shared__ __align__(16) float4 slot[32];
    const float4* in4 = reinterpret_cast<const float4*>(in);
    slot[LANE] = in4[LANE];
    __syncthreads();
    const float v = slot[(LANE + 1) % 32].x;  // the neighbour's slot
    if (BARRIER) __syncthreads();             // every read done before any slot is refilled
    coli_emu_cp_async16(&slot[LANE], in4 + 32 + LANE);
    coli_emu_cp_async_commit();
    __syncthreads();
    coli_emu_cp_async_wait(0);
    __syncthreads();
    out[LANE] = v + 0.0f * slot[LANE].x;
}
extern "C" __global__ void cp_async_war(const float* in, float* out) { war<false>(in, out); }
extern "C" __global__ void cp_async_war_fixed(const float* in, float* out) { war<true>(in, out); }
