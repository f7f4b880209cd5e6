// expert_down.cu: tiled down projection of the experts scaled by the routing weight, with the ordered aggregation
// over the k slots of each token folded in (no separate aggregate kernel).
//
// colibri_down — grid (blocks, ceil(hidden / BLOCK_N)), block (COLI_DOWN_THREADS). Same tiling as colibri_gate_up
//   (expert_gate_up.cu) over the padded expert order, reducing over the intermediate dimension:
//       v = topk_weights[p] * sum_i act[p, i] * down[e, n, i]          for each pair p of the tile, column n
//   COLI_ATOMIC_AGG 0: pair_out[p, n] = v (every kept pair's row is written: each pair belongs to one expert), then
//       the fold (common.cuh fold_aggregate): the block that completes a token's kept pairs for its column slice
//       (a counter per (token, column block) in down_counters) writes, for each column n of the slice,
//           s = pair_out[t*k + 0, n] + pair_out[t*k + 1, n] + ... + pair_out[t*k + k-1, n]   (slots in order)
//           x_next[t, n] = x[t, n] + s (COLI_RESIDUAL) or s
//       slots holding NO_EXPERT (padded tokens, routing.cu; pairs dropped by capacity.cu) add nothing: their
//       pair_out rows are never written. The blocks (0, j) also write the rows of the tokens without a kept pair
//       (x[t] + 0 or 0: common.cuh fold_unrouted_rows). A fixed summation order: bitwise identical from run to run.
//   COLI_ATOMIC_AGG 1: atomicAdd(x_next[p / k, n], v); x_next was set by colibri_routing; pair_out, x, topk_ids and
//       down_counters are unused (null).
//   down: (experts, hidden, intermediate) row-major, the layer's slice; act: (tokens*k, intermediate) fp32;
//   x, x_next: (tokens, hidden) fp32; topk_ids: (tokens, k) int32; down_counters: (tokens, gridDim.y) int32, zero at
//   launch and left zero. With COLI_EXPERT_BIAS, v = topk_weights[p] * (sum + down_bias[e, n]) (an extra argument;
//   common.cuh down_epilogue).
//
// colibri_down_tc — grid (blocks, ceil(hidden / 32)), block (128): colibri_down on tensor cores when COLI_TC (fp16
//   weights, any block_m and size), tiled like colibri_gate_up_tc (expert_gate_up.cu: up to 64 rows per pass) with
//   the act rows split into hi + lo fp16; the same fold. The scalar colibri_down remains for fp32 weights.
// Both end through common.cuh down_store / FOLD_BEGIN / FOLD_END (the ordered fold or the atomic adds).
//
// Limits: routing.block_m * BLOCK_N / THREADS <= 32, (block_m + BLOCK_N) * (BLOCK_K+1) * 4 + block_m * 4 + 516
// (the fold's list) bytes <= 48 KiB (colibri_down); colibri_down_tc 33284 bytes, fixed.
// Any hidden / intermediate size.
#include "common.cuh"

#define THREADS_ COLI_DOWN_THREADS
#define BN_ COLI_DOWN_BLOCK_N
#define BK_ COLI_DOWN_BLOCK_K
#define ACC_ ((BM_ * BN_ + THREADS_ - 1) / THREADS_)
static_assert(THREADS_ % 32 == 0 && THREADS_ >= 32 && THREADS_ <= 1024, "down threads: multiple of 32 in 32..1024");
static_assert(ACC_ <= 32, "down: routing.block_m * down.block_n / down.threads must be <= 32");
static_assert((BM_ + BN_) * (BK_ + 1) * 4 + BM_ * 4 + (int)sizeof(FoldList) <= 48 * 1024,
              "down: (routing.block_m + block_n) * (block_k+1) * 4 + block_m * 4 + 516 bytes of shared memory must "
              "be <= 48 KiB");

extern "C" __global__ void __launch_bounds__(THREADS_)
colibri_down(const float* __restrict__ act, const wt* __restrict__ down, const float* __restrict__ topk_weights,
             const int* __restrict__ sorted_pairs, const int* __restrict__ block_experts, float* __restrict__ pair_out,
             float* __restrict__ x_next, const float* __restrict__ x, const int* __restrict__ topk_ids,
             int* __restrict__ down_counters
                     DOWN_BIAS_PARAMS) {
    pdl_entry();
    DOWN_BIAS_NONE
    __shared__ float as[BM_][BK_ + 1];
    __shared__ float ds[BN_][BK_ + 1];
    __shared__ int pairs[BM_];

    const int b = blockIdx.x;
    const int n0 = blockIdx.y * BN_;
    FOLD_BEGIN(THREADS_, x, topk_ids, x_next, n0, BN_);
    const int e = __ldg(block_experts + b);
    if (e < 0) return;  // the same for the whole block, before any barrier
    const int tid = threadIdx.x;
    for (int m = tid; m < BM_; m += THREADS_) pairs[m] = __ldg(sorted_pairs + b * BM_ + m);
    const wt* d_e = down + (size_t)e * H_ * I_;

    float acc[ACC_];
#pragma unroll
    for (int a = 0; a < ACC_; ++a) acc[a] = 0.0f;

    for (int k0 = 0; k0 < I_; k0 += BK_) {
        __syncthreads();  // pairs[] written (first stage); the previous stage fully consumed (later stages)
        for (int i = tid; i < BM_ * BK_; i += THREADS_) {
            const int m = i / BK_, kk = i % BK_, c = k0 + kk;
            const int p = pairs[m];
            as[m][kk] = (p >= 0 && c < I_) ? __ldg(act + (size_t)p * I_ + c) : 0.0f;
        }
        for (int i = tid; i < BN_ * BK_; i += THREADS_) {
            const int n = i / BK_, kk = i % BK_, col = n0 + n, c = k0 + kk;
            ds[n][kk] = (col < H_ && c < I_) ? wt_to_float(__ldg(d_e + (size_t)col * I_ + c)) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < ACC_; ++a) {
            const int i = tid + a * THREADS_;
            if (i < BM_ * BN_) {
                const int m = i / BN_, n = i % BN_;
                float s = acc[a];
#pragma unroll 8
                for (int kk = 0; kk < BK_; ++kk) s += as[m][kk] * ds[n][kk];
                acc[a] = s;
            }
        }
    }

#pragma unroll
    for (int a = 0; a < ACC_; ++a) {
        const int i = tid + a * THREADS_;
        if (i < BM_ * BN_) {
            const int m = i / BN_, col = n0 + i % BN_;
            const int p = pairs[m];
            if (p >= 0 && col < H_) {
                down_store(pair_out, x_next, p, col, down_epilogue(acc[a], __ldg(topk_weights + p), down_bias, e, col));
            }
        }
    }
    FOLD_END(THREADS_, sorted_pairs + (size_t)b * BM_, BM_, x, topk_ids, pair_out, x_next, down_counters, n0);
}

// colibri_down_tc: colibri_down on tensor cores (common.cuh tc_tile_rows), launched instead of it when COLI_TC.
// Empty for fp32 or quantized weights.
extern "C" __global__ void __launch_bounds__(TC_THREADS_, 1)
colibri_down_tc(const float* __restrict__ act, const wt* __restrict__ down, const float* __restrict__ topk_weights,
                const int* __restrict__ sorted_pairs, const int* __restrict__ block_experts,
                float* __restrict__ pair_out, float* __restrict__ x_next, const float* __restrict__ x,
                const int* __restrict__ topk_ids, int* __restrict__ down_counters
                     DOWN_BIAS_PARAMS) {
    pdl_entry();
    DOWN_BIAS_NONE
#if COLI_FP16 && !COLI_QUANT
    const int b = blockIdx.x;
    const int n0 = blockIdx.y * TC_BN_;
    FOLD_BEGIN(TC_THREADS_, x, topk_ids, x_next, n0, TC_BN_);
    const int e = __ldg(block_experts + b);
    if (e < 0) return;  // the same for the whole block, before any barrier
    const wt* const w[1] = {down + (size_t)e * H_ * I_};
    tc_tile_rows<1, I_, H_, false>(act, w, sorted_pairs, b * BM_, BM_, n0,  // act rows are pair indices
                                   [&](int p, int col, const float (&a)[1][4], int i) {
                                       down_store(pair_out, x_next, p, col,
                                                  down_epilogue(a[0][i], __ldg(topk_weights + p), down_bias, e, col));
                                   });
    FOLD_END(TC_THREADS_, sorted_pairs + (size_t)b * BM_, BM_, x, topk_ids, pair_out, x_next, down_counters, n0);
#endif
}
