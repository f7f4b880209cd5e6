// capacity.cu: expert capacity of one MoE layer: the (token, slot) pairs above an expert's capacity are dropped.
//
// The semantics are colibri_sdk.capacity's (sdk/capacity.py, docs/runtime.md "Expert capacity"), exactly:
//   T  = the valid tokens of the call (common.cuh token_valid; padded tokens take no capacity)
//   C  = max(COLI_CAPACITY_MIN, ceil(T * k * factor / experts)), in IEEE double as Python computes it (factor
//        exact: NUM * 2^-SHIFT); 0 when T = 0
//   the pairs of expert e in priority order: policy "score" (flags bit 1 clear): routing weight descending, ties
//   by token ascending; "position" (bit 1 set): token ascending (a token routes to an expert at most once);
//   order "choice" (flags bit 2 set): slot ascending first (every first choice before any second choice), then
//   the policy;
//   hard: the first C pairs are kept; soft (flags bit 0 set): also, beyond them, the pairs in slot 0 (the token's
//   first choice) in the same order, at most C of them.
//   Mode, policy and order are a launch argument (`flags`, sdk/catalog.py capacity_flags), the factor a compile-time
//   constant.
//   A dropped pair gets topk_ids = NO_EXPERT and topk_weights = 0, so every later kernel (GEMV and tiled paths,
//   both aggregations) skips it; the layer's dropped-pair count goes to dropped[layer].
//
// colibri_capacity — grid (1), block (COLI_ROUTING_THREADS), launched after colibri_routing of each layer, only
//   when the bundle sets a capacity (sdk/catalog.py launch_plan). Thread i takes pairs i, i + THREADS, ...:
//   1. rank[p]       = the pairs of p's expert before p in priority order (-1 for NO_EXPERT pairs); a scan of all
//                      pairs per pair: tokens*k * tokens*k / THREADS loads per thread, no order dependence;
//   2. keep[p]       = rank < C, or (soft) slot 0 and fewer than C slot-0 pairs of that expert with rank in
//                      [C, rank[p]);
//   3. drop the pairs with keep 0, count them (a shared-memory sum: a count, order-free), write dropped[layer];
//   4. GEMV path (COLI_GEMV) with at least one pair dropped: rebuild the pair order of the kept pairs into pair_order
//      (common.cuh build_pair_order; colibri_routing built it from the pairs before the drops; null on the tiled
//      path, where colibri_align follows). Skipping this launch (the self-test's dropless run) leaves routing's.
//   Scratch: rank (2 * tokens * k) int32: rank[0..pairs), keep[pairs..2*pairs). Every entry written on every call.
//
// Limits: those of routing.cu (experts <= 256, top-k <= COLI_MAX_TOP_K); factor in (0, 64], min_capacity in
// 1..2^20 (the profile's checks).
#include "common.cuh"

#ifndef COLI_CAPACITY  // a bundle without capacity never launches this kernel; the defaults only let it compile
#define COLI_CAPACITY 0
#endif
#define CAPACITY_SOFT_ 1      // flags bit 0: mode soft (else hard)
#define CAPACITY_POSITION_ 2  // flags bit 1: policy position (else score)
#define CAPACITY_CHOICE_ 4    // flags bit 2: order choice, slot first (else the policy alone)
#ifndef COLI_CAPACITY_MIN
#define COLI_CAPACITY_MIN 1  // min_capacity (profile capacity.min_capacity)
#endif
#ifndef COLI_CAPACITY_FACTOR_NUM
#define COLI_CAPACITY_FACTOR_NUM 1
#endif
#ifndef COLI_CAPACITY_FACTOR_SHIFT
#define COLI_CAPACITY_FACTOR_SHIFT 0
#endif

#define CT_ COLI_ROUTING_THREADS
static_assert(CT_ % 32 == 0 && CT_ >= 32 && CT_ <= 1024, "COLI_ROUTING_THREADS must be a multiple of 32 in 32..1024");
static_assert(COLI_CAPACITY_FACTOR_NUM >= 1 && COLI_CAPACITY_FACTOR_SHIFT >= 0,
              "the capacity factor is COLI_CAPACITY_FACTOR_NUM * 2^-COLI_CAPACITY_FACTOR_SHIFT, > 0");
static_assert(COLI_CAPACITY_MIN >= 1, "min_capacity is at least 1");

// Pair q comes before pair p (same expert) in the priority order: by slot first with `choice`, then the policy.
__device__ __forceinline__ bool capacity_before(int q, int p, const float* __restrict__ weights, bool position,
                                                bool choice) {
    const int tq = q / K_, tp = p / K_;
    if (choice && q % K_ != p % K_) return q % K_ < p % K_;
    if (position) return tq < tp;
    const float wq = weights[q], wp = weights[p];
    return wq > wp || (wq == wp && tq < tp);
}

extern "C" __global__ void __launch_bounds__(CT_)
colibri_capacity(const int* __restrict__ valid_tokens, int* __restrict__ topk_ids, float* __restrict__ topk_weights,
                 int* __restrict__ rank, int* __restrict__ dropped, PairOrder* __restrict__ pair_order, int layer,
                 int flags) {
    pdl_entry();
    __shared__ int s_valid;
    __shared__ int s_dropped;
#if COLI_GEMV
    __shared__ PairOrderScratch order;
#endif
    const int tid = threadIdx.x;
    const bool soft = (flags & CAPACITY_SOFT_) != 0, position = (flags & CAPACITY_POSITION_) != 0;
    const bool choice = (flags & CAPACITY_CHOICE_) != 0;
    int* keep = rank + PAIRS_;
    if (tid == 0) {
        s_valid = 0;
        s_dropped = 0;
    }
    __syncthreads();
    int valid = 0;
    for (int t = tid; t < T_; t += CT_) valid += token_valid(valid_tokens, t) ? 1 : 0;
    if (valid) atomicAdd(&s_valid, valid);  // a count: order-free
    __syncthreads();

    // C = ceil(T * k * factor / experts) in double, the operations of colibri_sdk.capacity.Capacity.limit.
    double factor = (double)COLI_CAPACITY_FACTOR_NUM;
#pragma unroll 1
    for (int i = 0; i < COLI_CAPACITY_FACTOR_SHIFT; ++i) factor *= 0.5;  // exact: a power-of-two scaling
    const double q = (double)(s_valid * K_) * factor / (double)E_;
    long long c_ll = (long long)q;
    if ((double)c_ll < q) ++c_ll;
    if (c_ll < 1) c_ll = 1;  // the exact ceil of a positive value: q underflows to 0 for a tiny factor
    if (c_ll < COLI_CAPACITY_MIN) c_ll = COLI_CAPACITY_MIN;
    const int cap = s_valid ? (int)(c_ll < PAIRS_ ? c_ll : PAIRS_) : 0;

    // 1. The rank of each pair among its expert's pairs.
    for (int p = tid; p < PAIRS_; p += CT_) {
        const int e = topk_ids[p];
        int r = -1;
        if (e < E_) {
            r = 0;
#pragma unroll 1
            for (int o = 0; o < PAIRS_; ++o)
                if (o != p && topk_ids[o] == e && capacity_before(o, p, topk_weights, position, choice)) ++r;
        }
        rank[p] = r;
    }
    __syncthreads();

    // 2. Which pairs stay.
    for (int p = tid; p < PAIRS_; p += CT_) {
        const int r = rank[p];
        int k = r >= 0 && r < cap;
        if (soft && r >= cap && p % K_ == 0) {
            const int e = topk_ids[p];
            int extra = 0;  // slot-0 pairs of expert e kept beyond C before p
#pragma unroll 1
            for (int o = 0; o < PAIRS_; o += K_)
                if (topk_ids[o] == e && rank[o] >= cap && rank[o] < r) ++extra;
            k = extra < cap;
        }
        keep[p] = k;
    }
    __syncthreads();

    // 3. Drop and count.
    int n = 0;
    for (int p = tid; p < PAIRS_; p += CT_) {
        if (rank[p] >= 0 && !keep[p]) {
            topk_ids[p] = NO_EXPERT;
            topk_weights[p] = 0.0f;
            ++n;
        }
    }
    if (n) atomicAdd(&s_dropped, n);
    __syncthreads();
    if (tid == 0) dropped[layer] = s_dropped;
#if COLI_GEMV
    // 4. GEMV path: the pair order colibri_routing built holds the dropped pairs: rebuilt from the kept ones (the
    // drops above are this block's own stores, visible after the barrier). Without a drop it is already right.
    if (s_dropped) {  // uniform
        for (int p = tid; p < PAIRS_; p += CT_) order.ids[p] = topk_ids[p];
        build_pair_order<CT_>(pair_order, order);
    }
#else
    (void)pair_order;
#endif
}
