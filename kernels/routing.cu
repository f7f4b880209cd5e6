// routing.cu: router and the padded expert order of one MoE layer.
//
// colibri_routing — grid (tokens), block (COLI_ROUTING_THREADS). One block per token t; a padded token (common.cuh,
//   token_valid) writes topk_ids[t, :] = NO_EXPERT (= experts), topk_weights[t, :] = 0 and reads nothing else:
//   z[e]      = sum_h x[t, h] * router[h, e] (+ router_bias[e])   fp32 accumulation; router (hidden, experts)
//   p[e]      = z (COLI_ROUTING 0) | softmax(z) (1) | sigmoid(z) (2)                    scores
//   c[e]      = p[e] (+ correction_bias[e], routing 2)                                 selection keys
//   groups    COLI_N_GROUP > 1: only the experts of the COLI_TOPK_GROUP best groups are eligible (group score: the
//             max of c in the group, or the sum of its two largest; ties towards the lower group index)
//   top-k     the k largest c among the eligible, larger first, ties towards the lower expert index (warp 0, k
//             arg-max passes); routing 0 and ungrouped routing 1 select on z (the same order, as v1)
//   weights   routing 0: softmax over the k selected z; 1, 2: p[S_j], divided by (sum_j p[S_j] + 1e-20) with
//             COLI_NORM_TOPK; then times routed_scaling_factor (COLI_ROUTED_SCALING_BITS)
//   writes    topk_ids[t, j] (int32), topk_weights[t, j] (fp32), j = 0..k-1; with COLI_SHARED_GATE also
//             shared_scale[t] = sigmoid(x[t, :] . shared_expert_gate) (0 for a padded token)
//   The formulas are docs/format.md "Semantics v2" (transformers Mixtral/Qwen2-MoE/DeepseekV2/V3/GptOss routers).
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

// The router's stored type: float32 in a v2 file (COLI_ROUTER_F32), else the weights' type.
#if COLI_ROUTER_F32
typedef float rw_t;
#define RVEC_ 4
__device__ __forceinline__ float rw_to_float(rw_t v) { return v; }
__device__ __forceinline__ void runpack16(uint4 raw, float out[RVEC_]) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}
#else
typedef wt rw_t;
#define RVEC_ VEC_
__device__ __forceinline__ float rw_to_float(rw_t v) { return wt_to_float(v); }
__device__ __forceinline__ void runpack16(uint4 raw, float out[RVEC_]) { unpack16(raw, out); }
#endif

// Logit partial-sum groups: THREADS/E groups of E threads when E <= THREADS, else one group looping over experts.
#define GROUPS_ ((RT_ >= E_) ? (RT_ / E_) : 1)
// Vector path: VPR_ 16-byte vectors per router row (a power of two), ROWS_ rows read at once; the partial sums
// are combined per warp (VPR_ < 32) or per thread group (VPR_ >= 32) into VGROUPS_ groups.
#define VPR_ (E_ / RVEC_)
#define VEC_PATH_ (E_ % RVEC_ == 0 && (VPR_ & (VPR_ - 1)) == 0 && RT_ % VPR_ == 0)
#define ROWS_ (VEC_PATH_ ? RT_ / VPR_ : 1)
#define VGROUPS_ (!VEC_PATH_ ? 1 : VPR_ < 32 ? RT_ / 32 : RT_ / VPR_)
#define PART_ ((VGROUPS_ > GROUPS_ ? VGROUPS_ : GROUPS_) * E_)

// Selection: routing 0, and routing 1 without groups, select on the logits (softmax is monotonic: the same experts,
// as v1); the others on the scores p (softmax or sigmoid), plus the correction bias (COLI_CORRECTION_BIAS).
#define SEL_ON_LOGITS_ (COLI_ROUTING == 0 || (COLI_ROUTING == 1 && COLI_N_GROUP == 1))
#define GSIZE_ (E_ / COLI_N_GROUP)  // experts per group
#define NEG_BIG_ (-3.402823466e38f)  // below every finite score

__device__ __forceinline__ float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

// The group limit (warp 0, COLI_N_GROUP > 1): marks in `taken` (bit q of lane l: expert l + 32q) every expert of a
// group that is not among the COLI_TOPK_GROUP best, so the top-k passes never pick it. A group's score is the
// largest key of its experts (COLI_GROUP_SCORE 1) or the sum of its two largest (2; equal keys count twice); the
// best groups are taken in order of score, ties towards the lower group index (transformers DeepseekV2/V3
// TopkRouter; sdk/reference.py select_topk).
__device__ __forceinline__ unsigned group_limit(const float* key, float* gscore, unsigned char* gkeep, int lane) {
    for (int g = lane; g < COLI_N_GROUP; g += 32) {
        float m1 = NEG_BIG_, m2 = NEG_BIG_;
        for (int i = 0; i < GSIZE_; ++i) {
            const float v = key[g * GSIZE_ + i];
            if (v > m1) {
                m2 = m1;
                m1 = v;
            } else if (v > m2) {
                m2 = v;
            }
        }
        gscore[g] = COLI_GROUP_SCORE == 2 ? m1 + m2 : m1;
        gkeep[g] = 0;
    }
    __syncwarp();
    if (lane == 0) {
#pragma unroll 1
        for (int j = 0; j < COLI_TOPK_GROUP; ++j) {
            int best = -1;
            for (int g = 0; g < COLI_N_GROUP; ++g)  // increasing g and a strict >: ties keep the lower group
                if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            gkeep[best] = 1;
        }
    }
    __syncwarp();
    unsigned taken = 0;
    for (int q = 0, e = lane; e < E_; ++q, e += 32)
        if (!gkeep[e / GSIZE_]) taken |= 1u << q;
    return taken;
}

// The router arguments of a v2 file, each present only with its feature (after the v1 arguments, in this order):
//   router_bias (experts,) float32           COLI_ROUTER_BIAS
//   correction_bias (experts,) float32       COLI_CORRECTION_BIAS
//   shared_expert_gate (hidden,) float32, shared_scale (tokens,) float32 out      COLI_SHARED_GATE
extern "C" __global__ void __launch_bounds__(RT_)
colibri_routing(const float* __restrict__ x, const rw_t* __restrict__ router, const int* __restrict__ valid_tokens,
                int* __restrict__ topk_ids, float* __restrict__ topk_weights, float* __restrict__ x_next
#if COLI_ROUTER_BIAS
                , const float* __restrict__ router_bias
#endif
#if COLI_CORRECTION_BIAS
                , const float* __restrict__ correction_bias
#endif
#if COLI_SHARED_GATE
                , const float* __restrict__ shared_expert_gate, float* __restrict__ shared_scale
#endif
) {
    __shared__ float part[PART_];
    __shared__ float logits[E_];
    __shared__ int sel_id[K_];
#if !SEL_ON_LOGITS_
    __shared__ float keys[E_];  // selection keys
#endif
#if COLI_N_GROUP > 1
    __shared__ float gscore[COLI_N_GROUP];
    __shared__ unsigned char gkeep[COLI_N_GROUP];
#endif
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
#if COLI_SHARED_GATE
        if (threadIdx.x == 0) shared_scale[t] = 0.0f;
#endif
        return;
    }

    // 1. Router logits, fp32 accumulation.
    if (VEC_PATH_ && (reinterpret_cast<unsigned long long>(router) & 15ull) == 0) {
        // Row h of the router is VPR_ vectors; thread i always holds experts c..c+RVEC_-1, c = (i % VPR_) * RVEC_,
        // of rows i / VPR_, + ROWS_, ... (ROWS_ rows in flight per block).
        const int c = (threadIdx.x % VPR_) * RVEC_;
        float acc[RVEC_];
#pragma unroll
        for (int q = 0; q < RVEC_; ++q) acc[q] = 0.0f;
        const uint4* rv = reinterpret_cast<const uint4*>(router) + c / RVEC_;
#pragma unroll 4
        for (int h = threadIdx.x / VPR_; h < H_; h += ROWS_) {
            float w[RVEC_];
            runpack16(ld_stream(rv + (size_t)h * VPR_), w);
            const float xv = __ldg(xt + h);
#pragma unroll
            for (int q = 0; q < RVEC_; ++q) acc[q] += xv * w[q];
        }
        if (VPR_ < 32) {  // lanes l, l ^ VPR_, ... hold the same experts: combine them, a fixed butterfly
#pragma unroll
            for (int offset = 16; offset >= (VPR_ < 32 ? VPR_ : 32); offset >>= 1) {
#pragma unroll
                for (int q = 0; q < RVEC_; ++q) acc[q] += __shfl_xor_sync(FULL_MASK, acc[q], offset);
            }
        }
        if (VPR_ >= 32 || (threadIdx.x & 31) < VPR_) {
            const int g = VPR_ < 32 ? threadIdx.x / 32 : threadIdx.x / VPR_;
#pragma unroll
            for (int q = 0; q < RVEC_; ++q) part[g * E_ + c + q] = acc[q];
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
            for (int h = g; h < H_; h += GROUPS_)
                acc += __ldg(xt + h) * rw_to_float(__ldg(router + (size_t)h * E_ + e));
            part[g * E_ + e] = acc;
        }
    } else {
        for (int e = threadIdx.x; e < E_; e += RT_) {
            float acc = 0.0f;
            for (int h = 0; h < H_; ++h) acc += __ldg(xt + h) * rw_to_float(__ldg(router + (size_t)h * E_ + e));
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
#if COLI_ROUTER_BIAS
    // Each logit is written and biased by the same thread (e = threadIdx.x + i*RT_ in both loops above).
    for (int e = threadIdx.x; e < E_; e += RT_) logits[e] += __ldg(router_bias + e);
#endif
#if COLI_SHARED_GATE
    {  // the shared experts' gate sigmoid(x . g_sh): thread partials, warp butterflies, warps in order
        __shared__ float sg_part[RT_ / 32];
        float acc = 0.0f;
        for (int h = threadIdx.x; h < H_; h += RT_) acc += __ldg(xt + h) * __ldg(shared_expert_gate + h);
        acc = warp_sum(acc);
        if ((threadIdx.x & 31) == 0) sg_part[threadIdx.x / 32] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            float z = 0.0f;
            for (int w = 0; w < RT_ / 32; ++w) z += sg_part[w];
            shared_scale[t] = sigmoidf_(z);
        }
    }
#endif
    __syncthreads();

    // 2. Top-k and weights, warp 0. Lane l owns experts l, l+32, ... (bit q of `taken`: expert l + 32q chosen, or
    // excluded by the group limit).
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
#if COLI_ROUTING == 1  // softmax over all experts: its max and denominator
        float lane_max = NEG_BIG_;
        for (int e = lane; e < E_; e += 32) lane_max = logits[e] > lane_max ? logits[e] : lane_max;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, lane_max, offset);
            lane_max = other > lane_max ? other : lane_max;
        }
        const float z_max = lane_max;
        float lane_sum = 0.0f;
        for (int e = lane; e < E_; e += 32) lane_sum += expf(logits[e] - z_max);
        const float denom = warp_sum(lane_sum);
#endif
#if SEL_ON_LOGITS_
        const float* key = logits;
#else
        for (int e = lane; e < E_; e += 32) {
#if COLI_ROUTING == 1
            keys[e] = expf(logits[e] - z_max) / denom;
#else
            keys[e] = sigmoidf_(logits[e]) + (COLI_CORRECTION_BIAS ? __ldg(correction_bias + e) : 0.0f);
#endif
        }
        __syncwarp();
        const float* key = keys;
#endif
#if COLI_N_GROUP > 1
        unsigned int taken = group_limit(key, gscore, gkeep, lane);
#else
        unsigned int taken = 0;
#endif
        for (int j = 0; j < K_; ++j) {
            float best = 0.0f;
            int best_e = -1;  // -1: nothing yet; ranks below every expert
            for (int q = 0, e = lane; e < E_; ++q, e += 32) {
                const float z = key[e];
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
            // Every lane now holds the same (best, best_e): the order above is total on (key desc, index asc),
            // and k <= the eligible experts, so best_e >= 0.
            if (lane == (best_e & 31)) taken |= 1u << (best_e >> 5);
            if (lane == 0) sel_id[j] = best_e;
        }
        __syncwarp();
        // Weights of the k selected experts (every lane computes all k, in slot order: the same bits everywhere).
        float w = 0.0f;
#if COLI_ROUTING == 0
        // softmax over the k selected logits; logits[sel_id[0]] is the largest, so every exp() <= 1.
        const float z_top = logits[sel_id[0]];
        float denom_k = 0.0f;
        for (int j = 0; j < K_; ++j) denom_k += expf(logits[sel_id[j]] - z_top);
        if (lane < K_) w = expf(logits[sel_id[lane]] - z_top) / denom_k;
#else
#if COLI_ROUTING == 1
#define SCORE_(e) (expf(logits[e] - z_max) / denom)
#else
#define SCORE_(e) sigmoidf_(logits[e])
#endif
        if (lane < K_) w = SCORE_(sel_id[lane]);
#if COLI_NORM_TOPK
        float sum = 0.0f;
        for (int j = 0; j < K_; ++j) sum += SCORE_(sel_id[j]);
        w = w / (sum + 1e-20f);
#endif
#undef SCORE_
#endif
        if (COLI_ROUTED_SCALING_BITS != 0x3f800000u) w *= __uint_as_float(COLI_ROUTED_SCALING_BITS);
        if (lane < K_) {
            topk_ids[t * K_ + lane] = sel_id[lane];
            topk_weights[t * K_ + lane] = w;
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
