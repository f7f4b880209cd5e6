// small_batch.cu: the few-token fast path (decode, camera frames): expert GEMVs bound by memory bandwidth.
// Used instead of the tiled kernels when tokens*k <= kernels.small_batch.max_pairs (decided by the launch plan).
//
// colibri_gate_up_gemv — grid (ceil(intermediate / WARPS), experts), block (COLI_SMALL_BATCH_THREADS).
//   Block (c, e): expert e (no pairs routed to it: the block exits at once), one intermediate row n per warp,
//   n = c*WARPS + warp. The warp streams row n of gate[e] and of up[e] and dots each with the x rows of the pairs
//   routed to e, CHUNK pairs per pass (a row is read once per CHUNK pairs):
//       act[p, n] = silu(gate[e, n, :] . x[p / k, :]) * (up[e, n, :] . x[p / k, :])
// colibri_down_gemv — grid (ceil(hidden / WARPS), experts), same block. One hidden row n per warp:
//       v = topk_weights[p] * (down[e, n, :] . act[p, :]);  pair_out[p, n] = v  (ordered)
//                                                           or atomicAdd(x_next[p / k, n], v)  (COLI_ATOMIC_AGG)
//   The pairs of expert e are sorted_pairs[expert_offsets[e] .. + expert_counts[e]] (routing.cu, colibri_align).
//
// Loads: a weight row is read with 16-byte vector loads (8 fp16 or 4 fp32 per lane) when its address is 16-byte
// aligned, with a scalar tail; a misaligned row (hidden or intermediate size not a multiple of 16 bytes) is read with
// scalar loads. Lane sums are combined with an xor butterfly in a fixed order: deterministic bits.
// Limits: none beyond common.cuh; no shared memory, no block barrier (warps exit independently).
#include "common.cuh"

#define THREADS_ COLI_SMALL_BATCH_THREADS
#define WARPS_ (THREADS_ / 32)
#define CHUNK_ 4
static_assert(THREADS_ % 32 == 0 && THREADS_ >= 32 && THREADS_ <= 1024,
              "small_batch threads: multiple of 32 in 32..1024");

// Lane-partial dot products of one weight row (len elements) with CHUNK_ fp32 vectors: acc[j] += row . vec[j].
__device__ __forceinline__ void row_dot(const wt* __restrict__ row, int len, const float* const vec[CHUNK_],
                                        float acc[CHUNK_]) {
    const int lane = threadIdx.x & 31;
    int scalar_from = 0;
    if ((reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
        const int nvec = len / VEC_;
        const uint4* rv = reinterpret_cast<const uint4*>(row);
#pragma unroll 2
        for (int v = lane; v < nvec; v += 32) {
            float w[VEC_];
            unpack16(__ldg(rv + v), w);
            const int h = v * VEC_;
#pragma unroll
            for (int j = 0; j < CHUNK_; ++j) {
#pragma unroll
                for (int q = 0; q < VEC_; ++q) acc[j] += w[q] * __ldg(vec[j] + h + q);
            }
        }
        scalar_from = nvec * VEC_;
    }
    for (int h = scalar_from + lane; h < len; h += 32) {
        const float w = wt_to_float(__ldg(row + h));
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) acc[j] += w * __ldg(vec[j] + h);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS_)
colibri_gate_up_gemv(const float* __restrict__ x, const wt* __restrict__ gate, const wt* __restrict__ up,
                     const int* __restrict__ expert_counts, const int* __restrict__ expert_offsets,
                     const int* __restrict__ sorted_pairs, float* __restrict__ act) {
    const int e = blockIdx.y;
    const int count = __ldg(expert_counts + e);
    const int n = blockIdx.x * WARPS_ + threadIdx.x / 32;
    if (count == 0 || n >= I_) return;  // uniform per warp; no barriers in this kernel
    const int first = __ldg(expert_offsets + e);
    const wt* g_row = gate + ((size_t)e * I_ + n) * H_;
    const wt* u_row = up + ((size_t)e * I_ + n) * H_;

    for (int c0 = 0; c0 < count; c0 += CHUNK_) {
        int pair[CHUNK_];
        const float* vec[CHUNK_];
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) {
            // Past the last pair, repeat pair c0: computed, never stored.
            pair[j] = __ldg(sorted_pairs + first + (c0 + j < count ? c0 + j : c0));
            vec[j] = x + (size_t)(pair[j] / K_) * H_;
        }
        float g[CHUNK_], u[CHUNK_];
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) g[j] = u[j] = 0.0f;
        row_dot(g_row, H_, vec, g);
        row_dot(u_row, H_, vec, u);
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) {
            const float gs = warp_sum(g[j]), us = warp_sum(u[j]);
            if ((threadIdx.x & 31) == 0 && c0 + j < count) act[(size_t)pair[j] * I_ + n] = silu(gs) * us;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS_)
colibri_down_gemv(const float* __restrict__ act, const wt* __restrict__ down, const float* __restrict__ topk_weights,
                  const int* __restrict__ expert_counts, const int* __restrict__ expert_offsets,
                  const int* __restrict__ sorted_pairs, float* __restrict__ pair_out, float* __restrict__ x_next) {
    const int e = blockIdx.y;
    const int count = __ldg(expert_counts + e);
    const int n = blockIdx.x * WARPS_ + threadIdx.x / 32;
    if (count == 0 || n >= H_) return;  // uniform per warp; no barriers in this kernel
    const int first = __ldg(expert_offsets + e);
    const wt* d_row = down + ((size_t)e * H_ + n) * I_;

    for (int c0 = 0; c0 < count; c0 += CHUNK_) {
        int pair[CHUNK_];
        const float* vec[CHUNK_];
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) {
            pair[j] = __ldg(sorted_pairs + first + (c0 + j < count ? c0 + j : c0));
            vec[j] = act + (size_t)pair[j] * I_;
        }
        float d[CHUNK_];
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) d[j] = 0.0f;
        row_dot(d_row, I_, vec, d);
#pragma unroll
        for (int j = 0; j < CHUNK_; ++j) {
            const float s = warp_sum(d[j]);
            if ((threadIdx.x & 31) == 0 && c0 + j < count) {
                const float v = __ldg(topk_weights + pair[j]) * s;
#if COLI_ATOMIC_AGG
                atomicAdd(&x_next[(size_t)(pair[j] / K_) * H_ + n], v);
#else
                pair_out[(size_t)pair[j] * H_ + n] = v;
#endif
            }
        }
    }
}
