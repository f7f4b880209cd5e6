// routing.cu: router and the padded expert order of one MoE layer.
//
// colibri_routing — grid (slices, groups), block (COLI_ROUTING_THREADS). The tokens are cut into groups of
//   TG_ = COLI_ROUTER_GROUP_TOKENS (the last one may be short) and the hidden rows into slices of
//   SR_ = COLI_ROUTER_SLICE_ROWS (the last one may be short); sdk/catalog.py `router_grid` sets both. Block
//   (s, g) stages the activations x[t, slice s] of group g's tokens in shared memory (0 for a padded token, whose
//   row is not read), reads its slice of the router once — rows h0 .. h0+rows of the (hidden, experts) matrix, one
//   contiguous run: thread i of a pass reads element i, i + RT_, ... (16-byte vectors for a float32 router with
//   experts a multiple of 4, up to 512 threads; else scalars) — and writes its partial logits
//   routing_partials[g, s, t, e] = sum_{h in slice s} x[t, h] * router[h, e] for every token t of the group (and,
//   with COLI_SHARED_GATE, column `experts`: x[t, slice] . shared_expert_gate[slice]). So the router is read once
//   per group of TG_ tokens (once per call up to 16 tokens), by ceil(hidden / SR_) blocks even at one token.
//   The LAST block of a group to finish (the "last block" pattern: every block writes its partials,
//   __threadfence(), then atomicAdd on routing_counters[g]; the block that sees slices - 1 goes on, reading the
//   others' partials through L2 with __ldcg) sums the partials in increasing slice order and selects per token:
//   z[e]      = sum_h x[t, h] * router[h, e] (+ router_bias[e])   fp32 accumulation; router (hidden, experts)
//   p[e]      = z (COLI_ROUTING 0) | softmax(z) (1) | sigmoid(z) (2)                    scores
//   c[e]      = p[e] (+ correction_bias[e], routing 2)                                 selection keys
//   groups    COLI_N_GROUP > 1: only the experts of the COLI_TOPK_GROUP best groups are eligible (group score: the
//             max of c in the group, or the sum of its two largest; ties towards the lower group index)
//   top-k     the k largest c among the eligible, larger first, ties towards the lower expert index (one warp per
//             token, k arg-max passes); routing 0 and ungrouped routing 1 select on z (the same order, as v1)
//   weights   routing 0: softmax over the k selected z; 1, 2: p[S_j], divided by (sum_j p[S_j] + 1e-20) with
//             COLI_NORM_TOPK; then times routed_scaling_factor (COLI_ROUTED_SCALING_BITS)
//   writes    topk_ids[t, j] (int32), topk_weights[t, j] (fp32), j = 0..k-1; with COLI_SHARED_GATE also
//             shared_scale[t] = sigmoid(x[t, :] . shared_expert_gate) (0 for a padded token)
//   A padded token (common.cuh token_valid) gets topk_ids[t, :] = NO_EXPERT (= experts), topk_weights[t, :] = 0.
//   The formulas are docs/format.md "Semantics v2" (transformers Mixtral/Qwen2-MoE/DeepseekV2/V3/GptOss routers).
//   With COLI_ATOMIC_AGG on the tiled path block (s, g) also sets the layer output x_next[t, slice s] to x[t, slice
//   s] (residual) or 0, for the down kernels to atomicAdd into (padded tokens included).
//   With COLI_ROUTING_FUSED_ALIGN (tiled path without expert capacity) the last group to finish (a second counter,
//   routing_counters[groups]) also builds the padded expert order (align_pairs below), so colibri_align is not
//   launched. On the GEMV path (COLI_GEMV) the last group to finish builds the pair order instead (common.cuh
//   build_pair_order: the valid pairs by expert, no padding rows) into pair_order, which every GEMV block copies
//   (with expert capacity colibri_capacity rebuilds it when it drops pairs); with one group (up to 16 tokens) from
//   the ids it selected, staged in shared memory, without the second counter. Each counter is set back to 0 by the
//   block that saw its final count.
//   Determinism: each logit is summed over the rows of a slice in a fixed thread-group order, over the slices in
//   increasing order, whichever block finishes last: the bits do not depend on scheduling.
//
// colibri_align — grid (1), block (COLI_ROUTING_THREADS), tiled path with expert capacity only (it runs after
//   colibri_capacity). Groups the (token, slot) pairs p = t*k + j of valid tokens by expert into the padded order:
//   expert e owns rows [offsets[e], offsets[e+1]), its count rounded up to block_m rows; the first count rows hold
//   its pairs in increasing p, the rest -1. Pairs of padded tokens (NO_EXPERT) are in no expert's rows. Tile b
//   (rows b*block_m ..) belongs to block_experts[b], or -1 past the last used row: those tiles exit at once. Sizes
//   are fixed (docs/kernels.md, "Padded expert order"): sorted_pairs (tokens*k + experts*(block_m-1)) int32,
//   block_experts (that / block_m) int32, expert_counts (experts) int32, expert_offsets (experts+1) int32. Every
//   entry is written on every call.
//
// Limits: experts <= 256, top-k <= COLI_MAX_TOP_K (common.cuh). Any hidden size. GEMV path: (tokens*k + 2*experts + 2)
// int32 more static shared memory for the pair order's scratch.
#include "common.cuh"

#define RT_ COLI_ROUTING_THREADS
static_assert(RT_ % 32 == 0 && RT_ >= 32 && RT_ <= 1024, "COLI_ROUTING_THREADS must be a multiple of 32 in 32..1024");
#if !defined(COLI_ROUTER_GROUP_TOKENS) || !defined(COLI_ROUTER_SLICE_ROWS) || !defined(COLI_ROUTING_FUSED_ALIGN)
#error "COLI_ROUTER_GROUP_TOKENS, COLI_ROUTER_SLICE_ROWS and COLI_ROUTING_FUSED_ALIGN come from sdk/catalog.py"
#endif
#define TG_ COLI_ROUTER_GROUP_TOKENS
#define SR_ COLI_ROUTER_SLICE_ROWS
#define SLICES_ ((H_ + SR_ - 1) / SR_)
#define TGROUPS_ ((T_ + TG_ - 1) / TG_)
static_assert(TG_ >= 1 && TG_ <= 16 && TG_ <= T_, "COLI_ROUTER_GROUP_TOKENS must be in 1..min(16, tokens)");
static_assert(SR_ >= 1 && SR_ <= 256, "COLI_ROUTER_SLICE_ROWS must be in 1..256");
static_assert(!COLI_ROUTING_FUSED_ALIGN || !COLI_GEMV, "COLI_ROUTING_FUSED_ALIGN is for the tiled path");

// The router's stored type: float32 in a v2 file (COLI_ROUTER_F32), else the weights' type.
#if COLI_ROUTER_F32
typedef float rw_t;
__device__ __forceinline__ float rw_to_float(rw_t v) { return v; }
#else
typedef wt rw_t;
__device__ __forceinline__ float rw_to_float(rw_t v) { return wt_to_float(v); }
#endif

// Logits of a slice: passes of EPASS_ experts; in a pass thread i takes expert e0 + i % EPASS_ and the rows
// i / EPASS_, + RGROUPS_, ... of the slice (RGROUPS_ row groups), so the threads of a pass read one contiguous run of
// the router. The row groups' sums are combined in increasing group order, RTOK_ tokens per shared-memory round.
#define EPASS_ (E_ <= RT_ ? E_ : RT_)
#define RGROUPS_ (RT_ / EPASS_)
#define PART_ 2048  // floats of one reduction round
#define RTOK_ (PART_ / RT_ > TG_ ? TG_ : PART_ / RT_)
// Vector path (a 4-byte router, experts a multiple of 4, the router 16-byte aligned, <= 512 threads: registers):
// thread i of a pass takes the 16-byte vector of experts 4c..4c+3, c = v0 + i % VPASS_, of the rows i / VPASS_,
// + VGROUPS_, ...; VTOK_ tokens of 4 experts per reduction round.
#define RVEC_ 4
#define VPR_ (E_ >= RVEC_ ? E_ / RVEC_ : 1)  // vectors per router row
#define VPASS_ (VPR_ <= RT_ ? VPR_ : RT_)
#define VGROUPS_ (RT_ / VPASS_)
#define VTOK_ (PART_ / (RVEC_ * RT_) < 1 ? 1 : PART_ / (RVEC_ * RT_) > TG_ ? TG_ : PART_ / (RVEC_ * RT_))
#define VEC_ROUTER_ (sizeof(rw_t) == 4 && E_ % RVEC_ == 0 && RT_ <= 512)
// Router loads a thread issues before it uses the first (independent loads in flight: 8, 4 above 512 threads where
// the registers are fewer; the vector path 4 of 16 bytes), as the unrolled loops before them had ptxas do
#define RBATCH_ (RT_ > 512 ? 4 : 8)
#define VBATCH_ 4
// Floats between the tokens of a round in part: RT_ (a multiple of 32 banks) plus the reduction's run per token mod
// 32, so that the reduction's lane i (token i / run, column i % run) reads bank (i + a constant) mod 32 for every
// row group: conflict-free (without the pad, the 32 / run tokens a warp spans fell on the same banks: 4-way at 8
// experts). The vector path's run is VPASS_ * RVEC_ floats and its writes stay 16-byte aligned (the pad is a
// multiple of 4).
#define RQS_ (RT_ + EPASS_ % 32)
#define VQS_ (RT_ * RVEC_ + VPASS_ * RVEC_ % 32)
#define PART_N_ (RTOK_ * RQS_ > (VEC_ROUTER_ ? VTOK_ * VQS_ : 0) ? RTOK_ * RQS_ : VTOK_ * VQS_)
#define EP_ (E_ + COLI_SHARED_GATE)  // columns of routing_partials: the experts, then the shared gate
#define WARPS_ (RT_ / 32)
// The row groups' sums of a round, when a pass's run of experts divides a warp (32 % run == 0: up to 32 experts,
// one pass, groups x run = RT_): a warp per token reads the token's RT_ (vector path RT_ * RVEC_) partials of part
// in order, 32 lanes at a time (lane l always holds expert l % run), then a butterfly over the lanes of one expert;
// lanes 0 .. run - 1 write the logits. Every lane works (the per-expert loop over the groups used run of 32 lanes:
// 8 at 8 experts). The order of the sum is fixed: the bits do not depend on scheduling. Else one thread per logit.
#define RSHFL_ (32 % EPASS_ == 0)
#define VSHFL_ (32 % (VPASS_ * RVEC_) == 0)

// Selection: routing 0, and routing 1 without groups, select on the logits (softmax is monotonic: the same experts,
// as v1); the others on the scores p (softmax or sigmoid), plus the correction bias (COLI_CORRECTION_BIAS).
#define SEL_ON_LOGITS_ (COLI_ROUTING == 0 || (COLI_ROUTING == 1 && COLI_N_GROUP == 1))
#define GSIZE_ (E_ / COLI_N_GROUP)  // experts per group
#define NEG_BIG_ (-3.402823466e38f)  // below every finite score

__device__ __forceinline__ float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

// Shared memory, one phase after the other (a barrier between them): the slice's logits, the selection, the align.
union RoutingShared {
    struct {
        float xs[TG_ * SR_];         // x[t, slice] of the group's tokens, 0 for padded tokens
        float gate[SR_];             // shared_expert_gate[slice]
        float part[PART_N_];         // one round of the row groups' sums (RQS_, VQS_ floats per token)
    } logit;
    struct {
        float z[TG_ * E_];           // logits of the group's tokens
        float keys[TG_ * E_];        // selection keys (scores, + correction bias)
        int sel[TG_ * K_];           // selected experts
        float gscore[TG_ * COLI_N_GROUP];
        unsigned char gkeep[TG_ * COLI_N_GROUP];
    } select;
    struct {
        int counts[E_];
        int offsets[E_ + 1];
    } align;
};

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

// Top-k and weights of one valid token, by one warp (all 32 lanes). logits (experts,) in shared memory; keys,
// sel_id, gscore, gkeep: the token's shared scratch. Lane l owns experts l, l+32, ... (bit q of `taken`: expert
// l + 32q chosen, or excluded by the group limit). Writes ids[0..k-1], weights[0..k-1] (global memory).
__device__ __forceinline__ void select_token(const float* logits, float* keys, int* sel_id, float* gscore,
                                             unsigned char* gkeep, const float* correction_bias, int lane,
                                             int* ids, float* weights) {
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
    (void)keys;
    (void)correction_bias;
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
    (void)gscore;
    (void)gkeep;
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
        ids[lane] = sel_id[lane];
        weights[lane] = w;
    }
    __syncwarp();  // sel_id is read above by every lane before the warp's next token overwrites it
}

// The padded expert order (docs/kernels.md "Padded expert order") from topk_ids, by one whole block. L2: read
// topk_ids with __ldcg (written by other blocks of the same launch) instead of __ldg.
template <bool L2>
__device__ __forceinline__ int load_id(const int* p) {
    return L2 ? __ldcg(p) : __ldg(p);
}

template <bool L2>
__device__ __forceinline__ void align_pairs(const int* topk_ids, int* expert_counts, int* expert_offsets,
                                            int* sorted_pairs, int* block_experts, int* counts, int* offsets) {
    const int tid = threadIdx.x;
    for (int e = tid; e < E_; e += RT_) counts[e] = 0;
    __syncthreads();
    for (int p = tid; p < PAIRS_; p += RT_) {
        const int e = load_id<L2>(topk_ids + p);
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
            if (load_id<L2>(topk_ids + p) == e) sorted_pairs[row++] = p;
        }
    }
}

// The "last block" step: every thread's global writes are made visible (__threadfence), then thread 0 counts this
// block in *counter; true in every thread of the block that saw the count reach `blocks` (it resets the counter to 0
// for the next call). Called by all threads of the block.
__device__ __forceinline__ bool last_to_arrive(int* counter, int blocks, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(counter, 1);
        *flag = done == blocks - 1;
        if (done == blocks - 1) *counter = 0;
        __threadfence();  // the other blocks' writes are read after their count
    }
    __syncthreads();
    return *flag != 0;
}

// The partial logits of one slice, scalar loads: out[t * EP_ + e] = sum over the slice's rows of xs[t, r] *
// router[h0 + r, e], for the TG_ tokens (zeros when `any` is false: no valid token, no router byte read).
__device__ __forceinline__ void slice_logits(const rw_t* __restrict__ router, int h0, int rows, bool any,
                                             const float* xs, float* part, float* __restrict__ out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e0 = 0; e0 < E_; e0 += EPASS_) {
        const int e = e0 + tid % EPASS_, g = tid / EPASS_;
        float acc[TG_];
#pragma unroll
        for (int t = 0; t < TG_; ++t) acc[t] = 0.0f;
        if (any && g < RGROUPS_ && e < E_) {
            const rw_t* col = router + (size_t)h0 * E_ + e;
            // RBATCH_ loads issued before the first is used (in the source, so the emulation's bytes in flight
            // are the hardware's: ptxas hoisted the unrolled loop's loads the same way), then the rows in order
            for (int r0 = g; r0 < rows; r0 += RBATCH_ * RGROUPS_) {
                rw_t wv[RBATCH_];
#pragma unroll
                for (int u = 0; u < RBATCH_; ++u) {
                    const int r = r0 + u * RGROUPS_;
                    if (r < rows) wv[u] = __ldg(col + (size_t)r * E_);
                }
#pragma unroll
                for (int u = 0; u < RBATCH_; ++u) {
                    const int r = r0 + u * RGROUPS_;
                    if (r < rows) {
                        const float w = rw_to_float(wv[u]);
#pragma unroll
                        for (int t = 0; t < TG_; ++t) acc[t] += xs[t * SR_ + r] * w;
                    }
                }
            }
        }
#pragma unroll
        for (int t1 = 0; t1 < TG_; t1 += RTOK_) {
#pragma unroll
            for (int q = 0; q < RTOK_; ++q)
                if (t1 + q < TG_) part[q * RQS_ + tid] = acc[t1 + q];
            __syncthreads();
            if (RSHFL_) {  // a warp per token: lane l sums part[l], [l + 32], .. (expert l % EPASS_), a butterfly
                for (int q = warp; q < RTOK_ && t1 + q < TG_; q += WARPS_) {
                    float z = 0.0f;
                    for (int i = lane; i < RT_; i += 32) z += part[q * RQS_ + i];
                    for (int off = 16; off >= EPASS_; off >>= 1) z += __shfl_xor_sync(FULL_MASK, z, off);
                    if (lane < EPASS_ && e0 + lane < E_) out[(t1 + q) * EP_ + e0 + lane] = z;
                }
            } else {
                for (int i = tid; i < RTOK_ * EPASS_; i += RT_) {
                    const int q = i / EPASS_, c = i % EPASS_, t = t1 + q;
                    if (t < TG_ && e0 + c < E_) {
                        float z = 0.0f;
                        for (int gg = 0; gg < RGROUPS_; ++gg) z += part[q * RQS_ + gg * EPASS_ + c];
                        out[t * EP_ + e0 + c] = z;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The same with 16-byte router loads (VEC_ROUTER_, the router 16-byte aligned): each thread holds 4 experts.
__device__ __forceinline__ void slice_logits_vec(const rw_t* __restrict__ router, int h0, int rows, bool any,
                                                 const float* xs, float* part, float* __restrict__ out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int v0 = 0; v0 < VPR_; v0 += VPASS_) {
        const int v = v0 + tid % VPASS_, g = tid / VPASS_;
        float acc[TG_][RVEC_];
#pragma unroll
        for (int t = 0; t < TG_; ++t)
#pragma unroll
            for (int q = 0; q < RVEC_; ++q) acc[t][q] = 0.0f;
        if (any && g < VGROUPS_ && v < VPR_) {
            const uint4* col = reinterpret_cast<const uint4*>(router + (size_t)h0 * E_) + v;
            // VBATCH_ 16-byte loads issued before the first is used (as `slice_logits`), then the rows in order
            for (int r0 = g; r0 < rows; r0 += VBATCH_ * VGROUPS_) {
                uint4 raw[VBATCH_];
#pragma unroll
                for (int u = 0; u < VBATCH_; ++u) {
                    const int r = r0 + u * VGROUPS_;
                    if (r < rows) raw[u] = ld_stream(col + (size_t)r * VPR_);
                }
#pragma unroll
                for (int u = 0; u < VBATCH_; ++u) {
                    const int r = r0 + u * VGROUPS_;
                    if (r < rows) {
                        const float w[RVEC_] = {__uint_as_float(raw[u].x), __uint_as_float(raw[u].y),
                                                __uint_as_float(raw[u].z), __uint_as_float(raw[u].w)};
#pragma unroll
                        for (int t = 0; t < TG_; ++t) {
                            const float xv = xs[t * SR_ + r];
#pragma unroll
                            for (int q = 0; q < RVEC_; ++q) acc[t][q] += xv * w[q];
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int t1 = 0; t1 < TG_; t1 += VTOK_) {
#pragma unroll
            for (int q = 0; q < VTOK_; ++q)
                if (t1 + q < TG_)
#pragma unroll
                    for (int k = 0; k < RVEC_; ++k) part[q * VQS_ + tid * RVEC_ + k] = acc[t1 + q][k];
            __syncthreads();
            if (VSHFL_) {  // a warp per token: lane l sums part[l], [l + 32], .. (expert l % run), a butterfly
                for (int q = warp; q < VTOK_ && t1 + q < TG_; q += WARPS_) {
                    float z = 0.0f;
                    for (int i = lane; i < RT_ * RVEC_; i += 32) z += part[q * VQS_ + i];
                    for (int off = 16; off >= VPASS_ * RVEC_; off >>= 1) z += __shfl_xor_sync(FULL_MASK, z, off);
                    if (lane < VPASS_ * RVEC_) out[(t1 + q) * EP_ + lane] = z;
                }
            } else {
                for (int i = tid; i < VTOK_ * VPASS_ * RVEC_; i += RT_) {
                    const int q = i / (VPASS_ * RVEC_), c = i % (VPASS_ * RVEC_) / RVEC_, k = i % RVEC_, t = t1 + q;
                    if (t < TG_ && v0 + c < VPR_) {
                        float z = 0.0f;
                        for (int gg = 0; gg < VGROUPS_; ++gg) z += part[q * VQS_ + (gg * VPASS_ + c) * RVEC_ + k];
                        out[t * EP_ + (v0 + c) * RVEC_ + k] = z;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The router arguments of a v2 file, each present only with its feature (after the v1 arguments, in this order):
//   router_bias (experts,) float32           COLI_ROUTER_BIAS
//   correction_bias (experts,) float32       COLI_CORRECTION_BIAS
//   shared_expert_gate (hidden,) float32, shared_scale (tokens,) float32 out      COLI_SHARED_GATE
// Scratch: routing_partials (groups, slices, TG_, experts + COLI_SHARED_GATE) float32, routing_counters
// (groups + 1) int32 (zero at entry, left zero); expert_counts .. block_experts: the padded expert order (null
// without COLI_ROUTING_FUSED_ALIGN); pair_order: the GEMV path's pair order (null on the tiled path).
// __launch_bounds__(RT_, 1): ptxas may use 65536 / RT_ registers (at 1024 threads it otherwise keeps to 32 and
// spills in the selection).
extern "C" __global__ void __launch_bounds__(RT_, 1)
colibri_routing(const float* __restrict__ x, const rw_t* __restrict__ router, const int* __restrict__ valid_tokens,
                int* __restrict__ topk_ids, float* __restrict__ topk_weights, float* __restrict__ x_next,
                float* __restrict__ routing_partials, int* __restrict__ routing_counters, int* __restrict__ expert_counts,
                int* __restrict__ expert_offsets, int* __restrict__ sorted_pairs, int* __restrict__ block_experts,
                PairOrder* __restrict__ pair_order
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
    pdl_entry();
    __shared__ RoutingShared sm;
#if COLI_GEMV
    __shared__ PairOrderScratch order;  // the pair order of the GEMV path (common.cuh build_pair_order)
#endif
    __shared__ int flag;
    __shared__ int any_valid;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int slice = blockIdx.x, group = blockIdx.y;
    const int h0 = slice * SR_, rows = H_ - h0 < SR_ ? H_ - h0 : SR_;
    const int t0 = group * TG_;
#if !COLI_CORRECTION_BIAS
    const float* correction_bias = nullptr;
#endif

    // 1. Stage x[t, slice] (0 for padded tokens and past the last token), set the atomic-mode output rows.
    if (tid == 0) {
        int any = 0;
        for (int t = 0; t < TG_ && t0 + t < T_; ++t) any |= token_valid(valid_tokens, t0 + t) ? 1 : 0;
        any_valid = any;
    }
    for (int i = tid; i < TG_ * SR_; i += RT_) {
        const int t = i / SR_, r = i % SR_, tt = t0 + t;
        float v = 0.0f;
        if (r < rows && tt < T_) {
            const bool valid = token_valid(valid_tokens, tt);
            const float* xr = x + (size_t)tt * H_ + h0 + r;
#if COLI_ATOMIC_AGG && !COLI_GEMV
            // The layer output row the down kernels add into (padded tokens included).
            const float xv = COLI_RESIDUAL || valid ? __ldg(xr) : 0.0f;
            x_next[(size_t)tt * H_ + h0 + r] = COLI_RESIDUAL ? xv : 0.0f;
            v = valid ? xv : 0.0f;
#else
            if (valid) v = __ldg(xr);
#endif
        }
        sm.logit.xs[i] = v;
    }
#if COLI_SHARED_GATE
    for (int r = tid; r < rows; r += RT_) sm.logit.gate[r] = __ldg(shared_expert_gate + h0 + r);
#endif
    __syncthreads();

    // 2. The slice's partial logits: router rows read once, each used for the group's TG_ tokens.
    float* out = routing_partials + (size_t)(group * SLICES_ + slice) * TG_ * EP_;
    if (VEC_ROUTER_ && (reinterpret_cast<unsigned long long>(router) & 15ull) == 0) {
        slice_logits_vec(router, h0, rows, any_valid != 0, sm.logit.xs, sm.logit.part, out);
    } else {
        slice_logits(router, h0, rows, any_valid != 0, sm.logit.xs, sm.logit.part, out);
    }
#if COLI_SHARED_GATE
    // The shared experts' gate x[t, slice] . g_sh[slice]: one warp per token, lane partials, a warp butterfly.
    for (int t = warp; t < TG_; t += WARPS_) {
        float acc = 0.0f;
        for (int r = lane; r < rows; r += 32) acc += sm.logit.xs[t * SR_ + r] * sm.logit.gate[r];
        acc = warp_sum(acc);
        if (lane == 0) out[t * EP_ + E_] = acc;
    }
#endif

    // 3. The last slice block of the group: logits = the slices' partials in increasing slice order.
    if (!last_to_arrive(routing_counters + group, SLICES_, &flag)) return;
    const float* in = routing_partials + (size_t)group * SLICES_ * TG_ * EP_;
    for (int i = tid; i < TG_ * E_; i += RT_) {
        const int t = i / E_, e = i % E_;
        float z = 0.0f;
        if (t0 + t < T_ && token_valid(valid_tokens, t0 + t))  // padded tokens' logits are never used
            for (int s = 0; s < SLICES_; ++s) z += __ldcg(in + ((size_t)s * TG_ + t) * EP_ + e);
#if COLI_ROUTER_BIAS
        z += __ldg(router_bias + e);
#endif
        sm.select.z[i] = z;
    }
#if COLI_SHARED_GATE
    for (int t = tid; t < TG_ && t0 + t < T_; t += RT_) {
        float z = 0.0f;
        const bool valid = token_valid(valid_tokens, t0 + t);
        if (valid)
            for (int s = 0; s < SLICES_; ++s) z += __ldcg(in + ((size_t)s * TG_ + t) * EP_ + E_);
        shared_scale[t0 + t] = valid ? sigmoidf_(z) : 0.0f;
    }
#endif
    __syncthreads();

    // 4. Top-k and weights: warp w takes the group's tokens w, w + warps, ...
    for (int t = warp; t < TG_ && t0 + t < T_; t += WARPS_) {
        const int tt = t0 + t;
        if (!token_valid(valid_tokens, tt)) {  // the same for the whole warp
            if (lane < K_) {
                topk_ids[tt * K_ + lane] = NO_EXPERT;
                topk_weights[tt * K_ + lane] = 0.0f;
#if COLI_GEMV
                if (TGROUPS_ == 1) order.ids[tt * K_ + lane] = NO_EXPERT;
#endif
            }
            continue;
        }
        select_token(sm.select.z + t * E_, sm.select.keys + t * E_, sm.select.sel + t * K_,
                     sm.select.gscore + t * COLI_N_GROUP, sm.select.gkeep + t * COLI_N_GROUP, correction_bias, lane,
                     topk_ids + tt * K_, topk_weights + tt * K_);
#if COLI_GEMV
        if (TGROUPS_ == 1 && lane < K_) order.ids[tt * K_ + lane] = sm.select.sel[t * K_ + lane];
#endif
    }

#if COLI_ROUTING_FUSED_ALIGN
    // 5. The last group: the padded expert order of all pairs (topk_ids of every group, read through L2).
    if (!last_to_arrive(routing_counters + TGROUPS_, TGROUPS_, &flag)) return;
    align_pairs<true>(topk_ids, expert_counts, expert_offsets, sorted_pairs, block_experts, sm.align.counts,
                      sm.align.offsets);
#else
    (void)expert_counts;
    (void)expert_offsets;
    (void)sorted_pairs;
    (void)block_experts;
#endif
#if COLI_GEMV
    // 5. GEMV path: the pair order of all pairs, once for the layer's GEMV blocks (colibri_capacity rebuilds it after
    // dropping pairs). One token group (up to 16 tokens): this block selected every pair and staged the ids above
    // (no second counter, no global read); more: the last group to finish reads topk_ids of every group through L2.
    if (TGROUPS_ > 1) {
        if (!last_to_arrive(routing_counters + TGROUPS_, TGROUPS_, &flag)) return;
        for (int p = tid; p < PAIRS_; p += RT_) order.ids[p] = __ldcg(topk_ids + p);
    }
    build_pair_order<RT_>(pair_order, order);
#else
    (void)pair_order;
#endif
}

extern "C" __global__ void __launch_bounds__(RT_)
colibri_align(const int* __restrict__ topk_ids, int* __restrict__ expert_counts, int* __restrict__ expert_offsets,
              int* __restrict__ sorted_pairs, int* __restrict__ block_experts) {
    pdl_entry();
    __shared__ int counts[E_];
    __shared__ int offsets[E_ + 1];
    align_pairs<false>(topk_ids, expert_counts, expert_offsets, sorted_pairs, block_experts, counts, offsets);
}
