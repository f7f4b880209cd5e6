// expert_gate_up.cu: tiled gate/up projection of the experts, fused with silu(gate) * up (many-token path).
//
// colibri_gate_up — grid (blocks, ceil(intermediate / BLOCK_N)), block (COLI_GATE_UP_THREADS).
//   Block (b, c) takes tile b of the padded expert order (routing.cu, colibri_align): block_m rows, all routed to
//   expert e = block_experts[b] (-1: unused tile, the block exits), and intermediate columns c*BLOCK_N ...
//   For each row r holding pair p = sorted_pairs[r] (token t = p / k; -1 rows are padding) and column n:
//       act[p, n] = silu(sum_h x[t, h] * gate[e, n, h]) * (sum_h x[t, h] * up[e, n, h])
//   The hidden dimension is walked in stages of BLOCK_K: the x rows and the gate and up tiles of a stage are loaded
//   once into shared memory (as fp32), then each thread updates its (row, column) accumulators. Each thread owns
//   outputs tid, tid + THREADS, ... of the block_m x BLOCK_N tile (column fastest). Sums run over h in increasing
//   order, so every output has fixed bits whatever the tile it lands in.
//   gate, up: (experts, intermediate, hidden) row-major, the layer's slice; x: (tokens, hidden) fp32;
//   act: (tokens*k, intermediate) fp32. Every act row is written: each pair belongs to exactly one expert.
//   With COLI_EXPERT_BIAS / COLI_ACTIVATION the epilogue adds gate_bias[e, n], up_bias[e, n] (extra arguments) and
//   applies the clamped SwiGLU (common.cuh gate_up_epilogue), as every expert kernel does.
//
// colibri_gate_up_tc — grid (blocks, ceil(intermediate / 32)), block (128): the same on tensor cores, when COLI_TC
//   (fp16 weights on the tiled path: any routing.block_m, any hidden and intermediate size). Block (b, c) takes the
//   rows of tile b up to 64 at a time (4 tiles of 16 per pass; a tile of fewer than 16 rows is padded with zero
//   rows, 16-row tiles of padding only are skipped), so an expert's gate and up rows c*32 .. + 31 are streamed once
//   per pass; warp w computes columns c*32 + 8w .. + 7 of each 16-row tile with mma.sync m16n8k16 (common.cuh
//   tc_tile_rows): the weight tiles of a 64-element stage are copied to shared memory with cp.async (16 bytes per
//   copy; rows not 32-byte aligned through their aligned windows), the x rows split into two fp16 terms (hi + lo,
//   close to fp32 accuracy; |x| must stay below 65504). The scalar colibri_gate_up remains for fp32 weights.
//
// Limits: block_m * BLOCK_N / THREADS <= 32 accumulators per thread, (block_m + 2*BLOCK_N) * (BLOCK_K+1) * 4 bytes
// of static shared memory <= 48 KiB (colibri_gate_up); colibri_gate_up_tc 46592 bytes, fixed. Any hidden /
// intermediate size (tails are zero-filled or masked).
#include "common.cuh"

#define THREADS_ COLI_GATE_UP_THREADS
#define BN_ COLI_GATE_UP_BLOCK_N
#define BK_ COLI_GATE_UP_BLOCK_K
#define ACC_ ((BM_ * BN_ + THREADS_ - 1) / THREADS_)
static_assert(THREADS_ % 32 == 0 && THREADS_ >= 32 && THREADS_ <= 1024, "gate_up threads: multiple of 32 in 32..1024");
static_assert(ACC_ <= 32, "gate_up: routing.block_m * gate_up.block_n / gate_up.threads must be <= 32");
static_assert((BM_ + 2 * BN_) * (BK_ + 1) * 4 <= 48 * 1024,
              "gate_up: (routing.block_m + 2*block_n) * (block_k+1) * 4 bytes of shared memory must be <= 48 KiB");

extern "C" __global__ void __launch_bounds__(THREADS_)
colibri_gate_up(const float* __restrict__ x, const wt* __restrict__ gate, const wt* __restrict__ up,
                const int* __restrict__ sorted_pairs, const int* __restrict__ block_experts, float* __restrict__ act
                     GATE_UP_BIAS_PARAMS) {
    pdl_entry();
    GATE_UP_BIAS_NONE
    __shared__ float xs[BM_][BK_ + 1];  // +1: rows start in different banks
    __shared__ float gs[BN_][BK_ + 1];
    __shared__ float us[BN_][BK_ + 1];
    __shared__ int pairs[BM_];

    const int b = blockIdx.x;
    const int e = __ldg(block_experts + b);
    if (e < 0) return;  // the same for the whole block, before any barrier
    const int n0 = blockIdx.y * BN_;
    const int tid = threadIdx.x;
    for (int m = tid; m < BM_; m += THREADS_) pairs[m] = __ldg(sorted_pairs + b * BM_ + m);
    const wt* g_e = gate + (size_t)e * I_ * H_;
    const wt* u_e = up + (size_t)e * I_ * H_;

    float acc_g[ACC_], acc_u[ACC_];
#pragma unroll
    for (int a = 0; a < ACC_; ++a) acc_g[a] = acc_u[a] = 0.0f;

    for (int k0 = 0; k0 < H_; k0 += BK_) {
        __syncthreads();  // pairs[] written (first stage); the previous stage fully consumed (later stages)
        for (int i = tid; i < BM_ * BK_; i += THREADS_) {
            const int m = i / BK_, kk = i % BK_, h = k0 + kk;
            const int p = pairs[m];
            xs[m][kk] = (p >= 0 && h < H_) ? __ldg(x + (size_t)(p / K_) * H_ + h) : 0.0f;
        }
        for (int i = tid; i < BN_ * BK_; i += THREADS_) {
            const int n = i / BK_, kk = i % BK_, col = n0 + n, h = k0 + kk;
            const bool inside = col < I_ && h < H_;
            gs[n][kk] = inside ? wt_to_float(__ldg(g_e + (size_t)col * H_ + h)) : 0.0f;
            us[n][kk] = inside ? wt_to_float(__ldg(u_e + (size_t)col * H_ + h)) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < ACC_; ++a) {
            const int i = tid + a * THREADS_;
            if (i < BM_ * BN_) {
                const int m = i / BN_, n = i % BN_;
                float g = acc_g[a], u = acc_u[a];
#pragma unroll 8
                for (int kk = 0; kk < BK_; ++kk) {
                    const float xv = xs[m][kk];
                    g += xv * gs[n][kk];
                    u += xv * us[n][kk];
                }
                acc_g[a] = g;
                acc_u[a] = u;
            }
        }
    }

#pragma unroll
    for (int a = 0; a < ACC_; ++a) {
        const int i = tid + a * THREADS_;
        if (i < BM_ * BN_) {
            const int m = i / BN_, col = n0 + i % BN_;
            const int p = pairs[m];
            if (p >= 0 && col < I_) act[(size_t)p * I_ + col] = gate_up_epilogue(acc_g[a], acc_u[a], gate_bias, up_bias, e, col);
        }
    }
}

// colibri_gate_up_tc: the same output on tensor cores (common.cuh tc_tile_rows), launched instead of colibri_gate_up
// when COLI_TC (fp16 weights on the tiled path, any routing.block_m and sizes). Empty for fp32 or quantized weights.
extern "C" __global__ void __launch_bounds__(TC_THREADS_, 1)
colibri_gate_up_tc(const float* __restrict__ x, const wt* __restrict__ gate, const wt* __restrict__ up,
                   const int* __restrict__ sorted_pairs, const int* __restrict__ block_experts,
                   float* __restrict__ act
                     GATE_UP_BIAS_PARAMS) {
    pdl_entry();
    GATE_UP_BIAS_NONE
#if COLI_FP16 && !COLI_QUANT
    const int b = blockIdx.x;
    const int e = __ldg(block_experts + b);
    if (e < 0) return;  // the same for the whole block, before any barrier
    const wt* const w[2] = {gate + (size_t)e * I_ * H_, up + (size_t)e * I_ * H_};
    tc_tile_rows<2, H_, I_, true>(x, w, sorted_pairs, b * BM_, BM_, blockIdx.y * TC_BN_,
                                  [&](int p, int col, const float (&a)[2][4], int i) {
                                      act[(size_t)p * I_ + col] =
                                          gate_up_epilogue(a[0][i], a[1][i], gate_bias, up_bias, e, col);
                                  });
#endif
}
