// routing.cu: router and the padded expert order of one MoE layer.
//
// colibri_routing — grid (tokens), block (COLI_ROUTING_THREADS). One block per token t; a padded token (common.cuh,
//   token_valid) writes topk_ids[t, :] = NO_EXPERT (= experts), topk_weights[t, :] = 0 and reads nothing else:
//   z[e]      = sum_h x[t, h] * router[h, e]                fp32 accumulation; router (hidden, experts), row-major
//   top-k     the k largest z, larger first, ties towards the lower expert index (warp 0, k arg-max passes)
//   weights   COLI_ROUTING 0: softmax over the k selected logits; 1: softmax over all experts, then select
//   writes    topk_ids[t, j] (int32), topk_weights[t, j] (fp32), j = 0..k-1
//   with COLI_ATOMIC_AGG on the tiled path it also sets the layer output row x_next[t, :] to x[t, :] (residual) or 0,
//   for the down kernels to atomicAdd into (padded tokens included).
//   Logits: when experts is a multiple of the 16-byte vector (8 fp16 / 4 fp32) and the router is 16-byte aligned,
//   thread i reads router vectors i, i + THREADS, ... (consecutive lanes, consecutive 16 bytes; a vector holds VEC
//   experts of one row h); else thread i takes expert i % E and every (THREADS/E)-th row. Either way the partial
//   sums of each expert are added in thread-group order: the result does not depend on scheduling.
//
// colibri_align — grid (1), block (COLI_ROUTING_THREADS), tiled path only. Groups the (token, slot) pairs
//   p = t*k + j of valid tokens by expert into the padded order: expert e owns rows [offsets[e], offsets[e+1]), its
//   count rounded up to block_m rows; the first count rows hold its pairs in increasing p, the rest -1. Pairs of
//   padded tokens (NO_EXPERT) are in no expert's rows. Tile b (rows b*block_m ..) belongs to block_experts[b], or
//   -1 past the last used row: those tiles exit at once. Sizes are fixed (docs/kernels.md, "Padded expert order"):
//   sorted_pairs (tokens*k + experts*(block_m-1)) int32, block_experts (that / block_m) int32,
//   expert_counts (experts) int32, expert_offsets (experts+1) int32. Every entry is written on every call.
//
// Limits: experts <= 256, top-k <= COLI_MAX_TOP_K (common.cuh). Any hidden size.
#include "common.cuh"

#define RT_ COLI_ROUTING_THREADS
static_assert(RT_ % 32 == 0 && RT_ >= 32 && RT_ <= 1024, "COLI_ROUTING_THREADS must be a multiple of 32 in 32..1024");
// Logit partial-sum groups: THREADS/E groups of E threads when E <= THREADS, else one group looping over experts.
#define GROUPS_ ((RT_ >= E_) ? (RT_ / E_) : 1)
// Vector path: VPR_ 16-byte vectors per router row (a power of two), ROWS_ rows read at once; the partial sums
// are combined per warp (VPR_ < 32) or per thread group (VPR_ >= 32) into VGROUPS_ groups.
#define VPR_ (E_ / VEC_)
#define VEC_PATH_ (E_ % VEC_ == 0 && (VPR_ & (VPR_ - 1)) == 0 && RT_ % VPR_ == 0)
#define ROWS_ (VEC_PATH_ ? RT_ / VPR_ : 1)
#define VGROUPS_ (!VEC_PATH_ ? 1 : VPR_ < 32 ? RT_ / 32 : RT_ / VPR_)
#define PART_ ((VGROUPS_ > GROUPS_ ? VGROUPS_ : GROUPS_) * E_)

extern "C" __global__ void __launch_bounds__(RT_)
colibri_routing(const float* __restrict__ x, const wt* __restrict__ router, const int* __restrict__ valid_tokens,
                int* __restrict__ topk_ids, float* __restrict__ topk_weights, float* __restrict__ x_next) {
    __shared__ float part[PART_];
    __shared__ float logits[E_];
    __shared__ int sel_id[K_];
    __shared__ float sel_z[K_];
    const int t = blockIdx.x;
    const float* xt = x + (size_t)t * H_;

#if COLI_ATOMIC_AGG && !COLI_GEMV
    // The layer output row the down kernels add into.
    float* out = x_next + (size_t)t * H_;
    for (int h = threadIdx.x; h < H_; h += RT_) out[h] = COLI_RESIDUAL ? __ldg(xt + h) : 0.0f;
#endif
    if (!token_valid(valid_tokens, t)) {  // the same for the whole block, before any barrier
        if (threadIdx.x < K_) {
            topk_ids[t * K_ + threadIdx.x] = NO_EXPERT;
            topk_weights[t * K_ + threadIdx.x] = 0.0f;
        }
        return;
    }

    // 1. Router logits, fp32 accumulation.
    if (VEC_PATH_ && (reinterpret_cast<unsigned long long>(router) & 15ull) == 0) {
        // Row h of the router is VPR_ vectors; thread i always holds experts c..c+VEC_-1, c = (i % VPR_) * VEC_, of
        // rows i / VPR_, + ROWS_, ... (ROWS_ rows in flight per block).
        const int c = (threadIdx.x % VPR_) * VEC_;
        float acc[VEC_];
#pragma unroll
        for (int q = 0; q < VEC_; ++q) acc[q] = 0.0f;
        const uint4* rv = reinterpret_cast<const uint4*>(router) + c / VEC_;
#pragma unroll 4
        for (int h = threadIdx.x / VPR_; h < H_; h += ROWS_) {
            float w[VEC_];
            unpack16(ld_stream(rv + (size_t)h * VPR_), w);
            const float xv = __ldg(xt + h);
#pragma unroll
            for (int q = 0; q < VEC_; ++q) acc[q] += xv * w[q];
        }
        if (VPR_ < 32) {  // lanes l, l ^ VPR_, ... hold the same experts: combine them, a fixed butterfly
#pragma unroll
            for (int offset = 16; offset >= (VPR_ < 32 ? VPR_ : 32); offset >>= 1) {
#pragma unroll
                for (int q = 0; q < VEC_; ++q) acc[q] += __shfl_xor_sync(FULL_MASK, acc[q], offset);
            }
        }
        if (VPR_ >= 32 || (threadIdx.x & 31) < VPR_) {
            const int g = VPR_ < 32 ? threadIdx.x / 32 : threadIdx.x / VPR_;
#pragma unroll
            for (int q = 0; q < VEC_; ++q) part[g * E_ + c + q] = acc[q];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E_; e += RT_) {
            float z = 0.0f;
            for (int q = 0; q < VGROUPS_; ++q) z += part[q * E_ + e];
            logits[e] = z;
        }
    } else if (RT_ >= E_) {
        const int e = threadIdx.x % E_;
        const int g = threadIdx.x / E_;
        if (g < GROUPS_) {
            float acc = 0.0f;
            for (int h = g; h < H_; h += GROUPS_) acc += __ldg(xt + h) * wt_to_float(__ldg(router + (size_t)h * E_ + e));
            part[g * E_ + e] = acc;
        }
    } else {
        for (int e = threadIdx.x; e < E_; e += RT_) {
            float acc = 0.0f;
            for (int h = 0; h < H_; ++h) acc += __ldg(xt + h) * wt_to_float(__ldg(router + (size_t)h * E_ + e));
            part[e] = acc;
        }
    }
    if (!(VEC_PATH_ && (reinterpret_cast<unsigned long long>(router) & 15ull) == 0)) {
        __syncthreads();
        for (int e = threadIdx.x; e < E_; e += RT_) {
            float z = 0.0f;
            for (int g = 0; g < GROUPS_; ++g) z += part[g * E_ + e];
            logits[e] = z;
        }
    }
    __syncthreads();

    // 2. Top-k and weights, warp 0. Lane l owns experts l, l+32, ... (bit q of `taken`: expert l + 32q chosen).
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        unsigned int taken = 0;
        for (int j = 0; j < K_; ++j) {
            float best = 0.0f;
            int best_e = -1;  // -1: nothing yet; ranks below every expert
            for (int q = 0, e = lane; e < E_; ++q, e += 32) {
                const float z = logits[e];
                // e increases, so a strict > keeps the lower index on ties.
                if (!((taken >> q) & 1u) && (best_e < 0 || z > best)) {
                    best = z;
                    best_e = e;
                }
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                const float other = __shfl_xor_sync(FULL_MASK, best, offset);
                const int other_e = __shfl_xor_sync(FULL_MASK, best_e, offset);
                if (other_e >= 0 && (best_e < 0 || other > best || (other == best && other_e < best_e))) {
                    best = other;
                    best_e = other_e;
                }
            }
            // Every lane now holds the same (best, best_e): the order above is total on (logit desc, index asc),
            // and k <= experts, so best_e >= 0.
            if (lane == (best_e & 31)) taken |= 1u << (best_e >> 5);
            if (lane == 0) {
                sel_id[j] = best_e;
                sel_z[j] = best;
            }
        }
        __syncwarp();
        // sel_z[0] is the largest logit: subtracting it keeps every exp() <= 1.
        const float z_max = sel_z[0];
#if COLI_ROUTING == 1
        float lane_sum = 0.0f;
        for (int e = lane; e < E_; e += 32) lane_sum += expf(logits[e] - z_max);
        const float denom = warp_sum(lane_sum);
#else
        float denom = 0.0f;
        for (int j = 0; j < K_; ++j) denom += expf(sel_z[j] - z_max);
#endif
        if (lane < K_) {
            topk_ids[t * K_ + lane] = sel_id[lane];
            topk_weights[t * K_ + lane] = expf(sel_z[lane] - z_max) / denom;
        }
    }
}

extern "C" __global__ void __launch_bounds__(RT_)
colibri_align(const int* __restrict__ topk_ids, int* __restrict__ expert_counts, int* __restrict__ expert_offsets,
              int* __restrict__ sorted_pairs, int* __restrict__ block_experts) {
    __shared__ int counts[E_];
    __shared__ int offsets[E_ + 1];
    const int tid = threadIdx.x;

    for (int e = tid; e < E_; e += RT_) counts[e] = 0;
    __syncthreads();
    for (int p = tid; p < PAIRS_; p += RT_) {
        const int e = __ldg(topk_ids + p);
        if (e < E_) atomicAdd(&counts[e], 1);  // a count: order-free; NO_EXPERT pairs are skipped
    }
    __syncthreads();
    if (tid == 0) {
        int offset = 0;
#pragma unroll 1
        for (int e = 0; e < E_; ++e) {
            offsets[e] = offset;
            offset += (counts[e] + BM_ - 1) / BM_ * BM_;
        }
        offsets[E_] = offset;
    }
    __syncthreads();

    const int used = offsets[E_];
    for (int e = tid; e < E_; e += RT_) {
        expert_counts[e] = counts[e];
        expert_offsets[e] = offsets[e];
    }
    if (tid == 0) expert_offsets[E_] = used;
    for (int r = tid; r < PADDED_; r += RT_) sorted_pairs[r] = -1;
    for (int b = tid; b < BLOCKS_; b += RT_) {
        const int row = b * BM_;
        int expert = -1;
        if (row < used) {
            // The expert whose rows contain `row` (experts without pairs own an empty range and never match).
#pragma unroll 1
            for (int e = 0; e < E_; ++e) {
                if (offsets[e] <= row && row < offsets[e + 1]) {
                    expert = e;
                    break;
                }
            }
        }
        block_experts[b] = expert;
    }
    __syncthreads();  // the -1 fill above is ordered before the scatter below (same block: visible after the barrier)

    // Scatter: the thread of expert e walks all pairs in increasing order, so the order is deterministic.
    for (int e = tid; e < E_; e += RT_) {
        int row = offsets[e];
#pragma unroll 1
        for (int p = 0; p < PAIRS_; ++p) {
            if (__ldg(topk_ids + p) == e) sorted_pairs[row++] = p;
        }
    }
}
