// expert_quant_tc.cu: the tiled (many-token) expert projections on tensor cores for int8 and int4 weights
// (COLI_QUANT 1 / 2; docs/format.md "Matrix storage"): codes streamed, dequantized in registers into fp16 mma
// operands, fp32 accumulation. Launched instead of colibri_gate_up / colibri_down (and their _tc forms) when the
// weights are quantized and tokens*k > kernels.small_batch.max_pairs; with float weights (COLI_QUANT 0) the entry
// points are empty and never launched.
//
// colibri_gate_up_qtc — grid (experts, ceil(intermediate / 32)), block (128):
//     act[p, n] = act_fn(sum_h x[p / k, h] * Wg[e, n, h] + bg[e, n], sum_h x[p / k, h] * Wu[e, n, h] + bu[e, n])
//       (common.cuh gate_up_epilogue: SwiGLU or the clamped SwiGLU; biases with COLI_EXPERT_BIAS)
// colibri_down_qtc — grid (experts, ceil(hidden / 32)), block (128):
//     v = topk_weights[p] * (sum_i act[p, i] * Wd[e, n, i] + bd[e, n]);  pair_out[p, n] = v (ordered) | atomicAdd(x_next) (atomic)
//   ordered: then the fold of expert_down.cu (common.cuh fold_aggregate over the expert's rows: the block that
//   completes a token's kept pairs for its 32 columns writes x_next[t] = (x[t] +) the slots' sum in slot order;
//   blocks (0, j) write the rows of tokens without a kept pair, fold_unrouted_rows).
//   with W[e, n, c] = scale[e, n, g] * (q[e, n, c] - zero[e, n, g]), g = c / COLI_GROUP_SIZE (0: one per row).
//   Block (e, j) takes expert e (no rows: it exits) and output columns n0 = 32j .. n0 + 31; warp w owns columns
//   n0 + 8w .. + 7 (one n8 tile of mma.sync m16n8k16). The expert's rows of the padded order (routing.cu
//   colibri_align: sorted_pairs[expert_offsets[e] .. expert_offsets[e+1]), any routing.block_m) are taken MT_ tiles
//   of 16 rows per pass, so the weights of a block are streamed once per MT_*16 rows (once for experts with at most
//   64 pairs): weight bytes read ~ the selected experts' stored bytes.
//   Per stage of 64 reduction elements: the codes of the block's 32 rows (16-byte cp.async copies when rows are
//   16-byte aligned: int8 rows of a multiple of 16 columns, int4 of 32; else byte loads, consecutive threads on
//   consecutive bytes) and the activation rows (split into fp16 hi + lo, as common.cuh tc_tile: close to fp32; |a|
//   must stay below 65504) go to shared memory. A lane builds its B fragment from its row's codes with Marlin's
//   magic-number step (common.cuh codes_pair_sub): fp16 (q - zero), exact. The mma sums a * (q - zero) over one
//   group into a partial, and the partial times the row's scale (fp32) is added to the accumulator at the group's
//   end (the scale factors out of a group's sum: the same w = scale * (q - zero), one rounding less on w). Group
//   sizes 32/64/128 are multiples of the 16-element mma step, so a step never straddles two groups; a partial last
//   group ends with the reduction dimension.
//   Scales (and zero points): the block's 32 rows are one contiguous run of each scale block, copied once per block
//   to shared memory by consecutive threads (coalesced) when 32 * groups <= QS_MAX_ entries per matrix; else each
//   lane reads the scales of its two columns at a group's end (the same values, less coalesced).
// Limits: common.cuh; int4 needs a group size; static shared memory (sizes below) <= 48 KiB.
#include "common.cuh"

#if COLI_QUANT
#define MT_ 4                                   // 16-row tiles per pass over the weights
#define QSB_ (COLI_QUANT == 2 ? TC_BK_ / 2 : TC_BK_)  // code bytes of one row per stage
#define QSP_ (QSB_ + 16)                        // shared pitch: 16-byte aligned rows, spread over banks
#define QOFF_ (COLI_QUANT == 2 ? 8 : 128)       // unsigned code u = q + QOFF_
#ifdef COLI_QUANT_STAGE_MAX  // tests set it to 0 to run the global-scale path
#define QS_MAX_ COLI_QUANT_STAGE_MAX
#else
#define QS_MAX_ 2048
#endif
static_assert(GS_ % 16 == 0, "a group holds whole 16-element mma steps");

// The shared memory of one block: activation rows of a pass, the code stage of NMAT matrices, their scales.
template <int NMAT, int QSN>
struct QtcShared {
    unsigned short a_hi[MT_ * 16][TC_PITCH_];
    unsigned short a_lo[MT_ * 16][TC_PITCH_];
    unsigned char codes[NMAT][TC_BN_][QSP_];
    float scales[NMAT][QSN];
    signed char zeros[NMAT][COLI_ZERO_POINTS ? QSN : 1];
    int pairs[MT_ * 16];
    int rows[MT_ * 16];
};

// One matrix of the block: codes, scales and zero points (null without zero points) of expert e's first row.
struct QtcMatrix {
    const unsigned char* codes;
    const st* scales;
    const signed char* zeros;
};

// Copy the scales (and zero points) of rows n0 .. n0 + nrows - 1 of every matrix to shared memory, consecutive
// threads on consecutive entries. The caller's next barrier makes them visible.
template <int NMAT, int QSN, int KLEN>
__device__ __forceinline__ void qtc_stage_scales(const QtcMatrix (&w)[NMAT], int n0, int nrows,
                                                 QtcShared<NMAT, QSN>& sh) {
    constexpr int G = QGROUPS_(KLEN);
    for (int i = threadIdx.x; i < nrows * G; i += TC_THREADS_) {
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {
            sh.scales[m][i] = st_to_float(__ldg(w[m].scales + (size_t)n0 * G + i));
            if (COLI_ZERO_POINTS) sh.zeros[m][i] = __ldg(w[m].zeros + (size_t)n0 * G + i);
        }
    }
}

// acc[t][m] (t < ntiles) += A_t · W_m^T over the whole reduction dimension KLEN, for the rows sh.rows[t*16 ..] of
// src (row length KLEN, -1: a zero row) and output columns n0 .. n0 + 31 of NTOT. acc[t][m][i] is D[g + 8*(i/2)]
// [2c + i%2] of warp w's 16x8 tile (common.cuh mma_m16n8k16). Every thread of the block calls it (barriers).
template <int NMAT, int QSN, int KLEN, int NTOT, bool STAGED>
__device__ __forceinline__ void qtc_pass(const float* __restrict__ src, const QtcMatrix (&w)[NMAT], int n0,
                                         int ntiles, QtcShared<NMAT, QSN>& sh, float acc[MT_][NMAT][4]) {
    constexpr int ROWB = QROW_BYTES_(KLEN), G = QGROUPS_(KLEN);
    constexpr bool ALIGNED = ROWB % 16 == 0;  // every 16-byte chunk of a stage lies inside the row or past its end
    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, g = lane / 4, c = lane % 4;
    const int brow = warp * 8 + g;          // B fragment: the block's row of this lane (output column n0 + brow)
    const int srow = warp * 8 + 2 * c;      // accumulators: the block's rows srow, srow + 1
    float part[MT_][NMAT][4];
#pragma unroll
    for (int t = 0; t < MT_; ++t)
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[t][m][i] = 0.0f;

    for (int k0 = 0; k0 < KLEN; k0 += TC_BK_) {
        __syncthreads();  // the previous stage fully used (first stage: rows[] and the staged scales written)
        const int b0 = COLI_QUANT == 2 ? k0 / 2 : k0;  // first code byte of the stage in a row
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {  // m unrolled: w[m] stays in registers
            if (ALIGNED) {
                for (int i = tid; i < TC_BN_ * (QSB_ / 16); i += TC_THREADS_) {
                    const int r = i / (QSB_ / 16), v = (i % (QSB_ / 16)) * 16;
                    if (n0 + r < NTOT && b0 + v < ROWB) {
                        cp_async16(&sh.codes[m][r][v], w[m].codes + (size_t)(n0 + r) * ROWB + b0 + v);
                    } else {
#pragma unroll
                        for (int q = 0; q < 16; ++q) sh.codes[m][r][v + q] = 0;
                    }
                }
            } else {
                for (int i = tid; i < TC_BN_ * QSB_; i += TC_THREADS_) {
                    const int r = i / QSB_, v = i % QSB_;
                    sh.codes[m][r][v] = (n0 + r < NTOT && b0 + v < ROWB)
                                            ? __ldg(w[m].codes + (size_t)(n0 + r) * ROWB + b0 + v) : (unsigned char)0;
                }
            }
        }
        cp_async_commit();
        for (int i = tid; i < ntiles * 16 * TC_BK_; i += TC_THREADS_) {
            const int r = i / TC_BK_, kk = i % TC_BK_, k = k0 + kk;
            const float a = (sh.rows[r] >= 0 && k < KLEN) ? __ldg(src + (size_t)sh.rows[r] * KLEN + k) : 0.0f;
            const unsigned short hi = float_to_half_bits(a);
            sh.a_hi[r][kk] = hi;
            sh.a_lo[r][kk] = float_to_half_bits(a - half_to_float(hi));
        }
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < TC_BK_; kb += 16) {
            const int k = k0 + kb;
            if (k >= KLEN) break;  // uniform
            const int grp = GS_ == 0 ? 0 : k / (GS_ == 0 ? 1 : GS_);
            unsigned b[NMAT][2];
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
                int z = 0;
                if (COLI_ZERO_POINTS && n0 + brow < NTOT)
                    z = STAGED ? (int)sh.zeros[m][brow * G + grp]
                               : (int)__ldg(w[m].zeros + (size_t)(n0 + brow) * G + grp);
                const unsigned bias = bias_pair(1024 + QOFF_ + z);
                const unsigned char* row = sh.codes[m][brow];
#if COLI_QUANT == 2  // byte j of the stage: columns 2j (low nibble), 2j + 1
                const unsigned lo = row[kb / 2 + c], hi = row[kb / 2 + c + 4];
                b[m][0] = codes_pair_sub(lo & 15u, lo >> 4, bias);
                b[m][1] = codes_pair_sub(hi & 15u, hi >> 4, bias);
#else  // two's complement bytes; u = q + 128 = byte ^ 0x80
                const unsigned lo = row[kb + 2 * c] ^ 0x80u, lo1 = row[kb + 2 * c + 1] ^ 0x80u;
                const unsigned hi = row[kb + 2 * c + 8] ^ 0x80u, hi1 = row[kb + 2 * c + 9] ^ 0x80u;
                b[m][0] = codes_pair_sub(lo, lo1, bias);
                b[m][1] = codes_pair_sub(hi, hi1, bias);
#endif
            }
#pragma unroll
            for (int t = 0; t < MT_; ++t) {
                if (t < ntiles) {  // uniform
                    const int r = t * 16 + g, col = kb + 2 * c;  // A fragment (common.cuh mma_m16n8k16)
                    const unsigned ahi[4] = {half_pair(&sh.a_hi[r][col]), half_pair(&sh.a_hi[r + 8][col]),
                                             half_pair(&sh.a_hi[r][col + 8]), half_pair(&sh.a_hi[r + 8][col + 8])};
                    const unsigned alo[4] = {half_pair(&sh.a_lo[r][col]), half_pair(&sh.a_lo[r + 8][col]),
                                             half_pair(&sh.a_lo[r][col + 8]), half_pair(&sh.a_lo[r + 8][col + 8])};
#pragma unroll
                    for (int m = 0; m < NMAT; ++m) {
                        mma_m16n8k16(part[t][m], ahi, b[m], part[t][m]);
                        mma_m16n8k16(part[t][m], alo, b[m], part[t][m]);
                    }
                }
            }
            const bool group_end = k + 16 >= KLEN || (GS_ != 0 && (k + 16) % (GS_ == 0 ? 1 : GS_) == 0);
            if (group_end) {  // uniform: acc += scale * partial, then a new partial
#pragma unroll
                for (int m = 0; m < NMAT; ++m) {
                    float s[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int r = srow + j;
                        s[j] = n0 + r >= NTOT ? 0.0f
                               : STAGED ? sh.scales[m][r * G + grp]
                                        : st_to_float(__ldg(w[m].scales + (size_t)(n0 + r) * G + grp));
                    }
#pragma unroll
                    for (int t = 0; t < MT_; ++t) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            acc[t][m][i] += s[i % 2] * part[t][m][i];
                            part[t][m][i] = 0.0f;
                        }
                    }
                }
            }
        }
    }
}

// Rows of the padded order of expert e, MT_*16 at a time: pairs[] (pair index, -1 padding) and rows[] (the src row
// of each: pair / k for x, the pair for act); then qtc_pass and the epilogue `store(t, m_row, col, acc[t])`.
template <int NMAT, int KLEN, int NTOT, bool X_ROWS, class Store>
__device__ __forceinline__ void qtc_expert(const float* __restrict__ src, const QtcMatrix (&w)[NMAT],
                                           const int* __restrict__ sorted_pairs, int start, int end, int n0,
                                           Store store) {
    constexpr int G = QGROUPS_(KLEN);
    constexpr bool STAGED = TC_BN_ * G <= QS_MAX_;
    constexpr int QSN = STAGED ? TC_BN_ * G : 1;
    __shared__ __align__(16) QtcShared<NMAT, QSN> sh;
    if (STAGED) qtc_stage_scales<NMAT, QSN, KLEN>(w, n0, NTOT - n0 < TC_BN_ ? NTOT - n0 : TC_BN_, sh);
    const int lane = threadIdx.x & 31, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
    for (int r0 = start; r0 < end; r0 += MT_ * 16) {
        __syncthreads();  // pairs[] and rows[] of the previous pass fully used
        for (int i = threadIdx.x; i < MT_ * 16; i += TC_THREADS_) {
            const int p = r0 + i < end ? __ldg(sorted_pairs + r0 + i) : -1;
            sh.pairs[i] = p;
            sh.rows[i] = p < 0 ? -1 : X_ROWS ? p / K_ : p;
        }
        const int left = (end - r0 + 15) / 16, ntiles = left < MT_ ? left : MT_;
        float acc[MT_][NMAT][4];
#pragma unroll
        for (int t = 0; t < MT_; ++t)
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[t][m][i] = 0.0f;
        qtc_pass<NMAT, QSN, KLEN, NTOT, STAGED>(src, w, n0, ntiles, sh, acc);  // its barriers order rows[]
#pragma unroll
        for (int t = 0; t < MT_; ++t) {
            if (t < ntiles) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int m = t * 16 + g + 8 * (i / 2), col = n0 + warp * 8 + 2 * c + i % 2, p = sh.pairs[m];
                    if (p >= 0 && col < NTOT) store(p, col, acc[t], i);
                }
            }
        }
    }
}
#endif  // COLI_QUANT

// Arguments as colibri_gate_up_tc but expert_offsets (experts + 1) in place of block_experts, then the scale
// blocks of gate and up and their zero-point blocks (null without zero points), as the GEMV kernels take them, then
// the gate and up biases (COLI_EXPERT_BIAS; absent from the launch otherwise). The epilogue (biases, SwiGLU or
// clamped SwiGLU) is common.cuh gate_up_epilogue, as in every expert kernel.
extern "C" __global__ void __launch_bounds__(TC_THREADS_, 1)
colibri_gate_up_qtc(const float* __restrict__ x, const unsigned char* __restrict__ gate,
                    const unsigned char* __restrict__ up, const int* __restrict__ sorted_pairs,
                    const int* __restrict__ expert_offsets, float* __restrict__ act,
                    const void* __restrict__ gate_scales, const void* __restrict__ up_scales,
                    const signed char* __restrict__ gate_zeros, const signed char* __restrict__ up_zeros
                     GATE_UP_BIAS_PARAMS) {
    GATE_UP_BIAS_NONE
#if COLI_QUANT
    const int e = blockIdx.x, start = __ldg(expert_offsets + e), end = __ldg(expert_offsets + e + 1);
    if (start >= end) return;  // an expert without pairs; uniform, before any barrier
    constexpr int G = QGROUPS_(H_);
    const size_t first = (size_t)e * I_;  // expert e's first row
    const QtcMatrix w[2] = {
        {gate + first * QROW_BYTES_(H_), static_cast<const st*>(gate_scales) + first * G,
         COLI_ZERO_POINTS ? gate_zeros + first * G : nullptr},
        {up + first * QROW_BYTES_(H_), static_cast<const st*>(up_scales) + first * G,
         COLI_ZERO_POINTS ? up_zeros + first * G : nullptr}};
    qtc_expert<2, H_, I_, true>(x, w, sorted_pairs, start, end, blockIdx.y * TC_BN_,
                                [&](int p, int col, const float (&a)[2][4], int i) {
                                    act[(size_t)p * I_ + col] =
                                        gate_up_epilogue(a[0][i], a[1][i], gate_bias, up_bias, e, col);
                                });
#endif
}

// Arguments as colibri_down_tc (x, topk_ids and down_counters included) but expert_offsets in place of
// block_experts, then the down scale and zero-point blocks, then the down bias (COLI_EXPERT_BIAS); common.cuh
// down_epilogue.
extern "C" __global__ void __launch_bounds__(TC_THREADS_, 1)
colibri_down_qtc(const float* __restrict__ act, const unsigned char* __restrict__ down,
                 const float* __restrict__ topk_weights, const int* __restrict__ sorted_pairs,
                 const int* __restrict__ expert_offsets, float* __restrict__ pair_out, float* __restrict__ x_next,
                 const float* __restrict__ x, const int* __restrict__ topk_ids, int* __restrict__ down_counters,
                 const void* __restrict__ down_scales, const signed char* __restrict__ down_zeros
                     DOWN_BIAS_PARAMS) {
    DOWN_BIAS_NONE
#if COLI_QUANT
    const int n0 = blockIdx.y * TC_BN_;
#if !COLI_ATOMIC_AGG
    __shared__ FoldList fold;
    const int ncols = H_ - n0 < TC_BN_ ? H_ - n0 : TC_BN_;
    if (blockIdx.x == 0) fold_unrouted_rows<TC_THREADS_>(x, topk_ids, x_next, n0, ncols, fold);  // uniform
#endif
    const int e = blockIdx.x, start = __ldg(expert_offsets + e), end = __ldg(expert_offsets + e + 1);
    if (start >= end) return;  // uniform, before any barrier
    constexpr int G = QGROUPS_(I_);
    const size_t first = (size_t)e * H_;
    const QtcMatrix w[1] = {{down + first * QROW_BYTES_(I_), static_cast<const st*>(down_scales) + first * G,
                             COLI_ZERO_POINTS ? down_zeros + first * G : nullptr}};
    qtc_expert<1, I_, H_, false>(act, w, sorted_pairs, start, end, n0,
                                 [&](int p, int col, const float (&a)[1][4], int i) {
                                     const float v = down_epilogue(a[0][i], __ldg(topk_weights + p), down_bias, e,
                                                                   col);
#if COLI_ATOMIC_AGG
                                     atomicAdd(&x_next[(size_t)(p / K_) * H_ + col], v);
#else
                                     pair_out[(size_t)p * H_ + col] = v;
#endif
                                 });
#if !COLI_ATOMIC_AGG
    fold_aggregate<TC_THREADS_>(sorted_pairs + start, end - start, x, topk_ids, pair_out, x_next, down_counters, n0,
                                ncols, fold);
#endif
#endif
}
