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
//   Block (e, j) takes expert e (no rows: it exits) and output columns n0 = 32j .. n0 + 31. Warp w owns columns
//   n0 + 16(w & 1) .. + 15 (two n8 tiles of mma.sync m16n8k16) and span w >> 1 (elements 32(w >> 1) .. + 31) of
//   every 64-element stage: each A fragment is read by the two warps of its span and used for both of their n8
//   tiles (with one n8 tile per warp, all four warps read each: twice the shared-memory bytes); at the end of a
//   pass the span-1 warps hand their sums to the span-0 warps through shared memory. The expert's rows of the
//   padded order (routing.cu colibri_align: sorted_pairs[expert_offsets[e] .. expert_offsets[e+1]), any
//   routing.block_m) are taken MT_ tiles of 16 rows per pass (tiles of padding rows only left out), so the weights
//   of a block are streamed once per MT_*16 = 32 of the expert's pairs (the access model's 64 tokens x top-2 over 8
//   experts: at most 21 per expert): weight bytes read ~ the selected experts' stored bytes at such shapes.
//   Per stage of 64 reduction elements: the codes of the block's 32 rows and the activation rows (split into fp16
//   hi + lo, as common.cuh tc_pass: close to fp32; |a| must stay below 65504) go to shared memory. Code rows of any
//   length and start are read through their 32-byte-aligned windows with 16-byte cp.async copies, each window
//   sector once per pass (qtc_stage_codes: a head sector and a ring of QRING_ sectors per row, which holds QSTAGES_
//   = 3 stages: stages s + 1 and s + 2 are in flight while stage s is multiplied; the sector a row shares with the
//   next row, its last, is read from the next row's head), so an odd row costs the sectors its bytes span, not two
//   per stage (as the GEMV's windows, small_batch.cu; the bytes outside the row meet zero activations). Within a
//   span, an mma step sums a permutation of 16 of its elements that the A and B fragments agree on (qtc_pass), so a
//   lane reads its A fragment as one 16-byte word per row (hi and lo interleaved) and its codes for the span as one
//   4-byte (int4) or 8-byte (int8) word. A lane builds its B fragment from its row's codes with Marlin's
//   magic-number step (common.cuh codes_pair_sub): fp16 (q - zero), exact. The mma sums a * (q - zero) over one
//   group into a partial, and the partial times the row's scale (fp32) is added to the accumulator at the group's
//   end (the scale factors out of a group's sum: the same w = scale * (q - zero), one rounding less on w). Group
//   sizes 32/64/128 are multiples of the 32-element span, so a span never straddles two groups; a partial last
//   group ends with the reduction dimension.
//   Scales (and zero points): the block's 32 rows are one contiguous run of each scale block, copied once per block
//   to shared memory (group-major) with 16-byte loads over the run's aligned window (stage_run) when 32 * groups
//   <= QS_MAX_ entries per matrix; else each lane reads the scales of its columns at a group's end (the same
//   values, less coalesced).
// Limits: common.cuh; int4 needs a group size; static shared memory (sizes below) <= 48 KiB.
#include "common.cuh"

// Blocks per SM colibri_gate_up_qtc is compiled for (__launch_bounds__ min blocks): int4 4 (ptxas keeps it within
// 128 registers, 117-122 without spills at sm_80-90 for the Mixtral, Qwen3 and odd shapes of
// tests/kernels/test_compile_quant_tc.py, where 1 left it at 130-146: three blocks per SM), int8 1 (bounded, it
// spilled: at 4 blocks, 128 registers, for the int8 layer of scripts/gpu_check.sh; at 3, 168, for the tiled shape
// of tests/fakecuda/test_quantized_bundle_on_fake.py; float weights: empty entry points). More resident blocks
// put more code stages in flight per SM (the latency limit of the time model, docs/kernels.md).
#define QMINB_ (COLI_QUANT == 2 ? 4 : 1)

#if COLI_QUANT
#define MT_ 2                                   // 16-row tiles per pass over the weights
#define QNT_ 2                                  // n8 tiles per warp: 16 output columns
#define QSB_ (COLI_QUANT == 2 ? TC_BK_ / 2 : TC_BK_)  // code bytes of one row per stage
#define QN32_ (QSB_ / 32)                       // 32-byte sectors of one row per stage (int8 2, int4 1)
#define QSTAGES_ 3                              // code stages in the ring: two copied while one is multiplied
#define QRING_ (QSTAGES_ * QN32_ + 1)           // ring slots of a row: the sectors of QSTAGES_ stages
#define QSP_ (32 * (1 + QRING_) + (COLI_QUANT == 2 ? 16 : 32))  // shared pitch: head, ring, a pad (bank spread)
#define QOFF_ (COLI_QUANT == 2 ? 8 : 128)       // unsigned code u = q + QOFF_
#define QSPAN_ 32                               // reduction elements of one warp's span (two mma steps)
#define QLB_ (COLI_QUANT == 2 ? 4 : 8)          // code bytes of one lane per span: elements 8c .. 8c + 7
#define QA_PITCH_ (TC_BK_ + 4)                  // words per activation row: 16 chunks of 4 words, 4 to spread banks
#define QRED_ (MT_ * QNT_ * NMAT * 4)           // accumulators of one lane
#define QSR_ (TC_BN_ + 1)                       // staged scales and zero points per group: the block's rows, 1 pad
#ifdef COLI_QUANT_STAGE_MAX  // tests set it to 0 to run the global-scale path
#define QS_MAX_ COLI_QUANT_STAGE_MAX
#else
#define QS_MAX_ 2048
#endif
static_assert(GS_ % QSPAN_ == 0, "a group holds whole spans");
static_assert(QSB_ % 32 == 0, "a stage holds whole 32-byte sectors of a row");
static_assert(TC_BK_ == 2 * QSPAN_ && TC_THREADS_ == 128 && TC_BN_ == 32, "4 warps: 2 column halves x 2 spans");

// The shared memory of one block: activation rows of a pass, the code stages of NMAT matrices, their scales, and
// in the same bytes as the activations (after the pass) the accumulators the span-1 warps hand over.
// a[r][4q .. 4q + 3]: chunk q (stage elements 4q .. 4q + 3) of row r as
// {hi 4q | 4q+1, hi 4q+2 | 4q+3, lo 4q | 4q+1, lo 4q+2 | 4q+3} (fp16 pairs, low half first). codes[m][r]: sector 0
// of row r's window (its head, kept for the whole pass), then QRING_ ring slots that hold the window's sectors
// j >= 1 at slot 1 + (j - 1) % QRING_.
template <int NMAT, int QSN>
struct QtcShared {
    union {
        unsigned a[MT_ * 16][QA_PITCH_];
        float red[2][QRED_][32];
    };
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

// Row r of a block's run of code rows (first: the block's first row, nrows rows of ROWB bytes, consecutive in
// memory) through its 32-byte-aligned window: win = the row's start rounded down to 32 bytes, shift = the row's
// offset in it, nsec = the window's sectors. Rows are contiguous, so unless the next row starts on a sector
// boundary the row's last sector is the next row's sector 0: `shares` (when that sector is read after the first
// stage and the next row is the block's) makes the row read it from the next row's head instead of fetching it a
// second time.
struct QtcRow {
    const unsigned char* win;
    int shift, nsec;
    bool shares;
};
template <int ROWB>
__device__ __forceinline__ QtcRow qtc_row(const unsigned char* first, int r, int nrows) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(first + (size_t)r * ROWB);
    const int shift = (int)(a & 31ull), nsec = (shift + ROWB + 31) >> 5;
    return QtcRow{reinterpret_cast<const unsigned char*>(a - (unsigned long long)shift), shift, nsec,
                  r + 1 < nrows && ((a + ROWB) & 31ull) != 0 && nsec - 1 > QN32_};
}
// Byte offset in a matrix's codes[][] of the shared copy of window sector j of row r (a sector the stage reads).
__device__ __forceinline__ int qtc_slot(const QtcRow& row, int r, int j) {
    return row.shares && j == row.nsec - 1 ? (r + 1) * QSP_ : r * QSP_ + (j == 0 ? 0 : 32 * (1 + (j - 1) % QRING_));
}

// The copies of stage s (row bytes s*QSB_ .. + QSB_) of one matrix's code rows into codes[r] (QSP_ bytes per row):
// each window sector once per pass. Stage 0 fetches sectors 0 .. QN32_ (QN32_ + 1 when the row is not
// sector-aligned: its first stage spans one more), stage s >= 1 the QN32_ sectors after those (sectors s*QN32_ + 1
// .., or s*QN32_ .. for an aligned row), all within the window; the row's last sector comes from the next row's head
// when it `shares`. Item i of a stage: sector q = i / 64, row (i % 64) / 2, half i % 2, so a warp instruction reads
// 16 whole sectors of 16 rows (16-byte cp.async, 32 consecutive halves of sectors). A load is issued by the whole
// warp: in an instruction where some lane has nothing to fetch (past the window or the matrix, a shared sector),
// that lane copies a vector another lane of the instruction fetches into a slot nobody reads (found by a warp max;
// none: no lane loads), so each load is one warp instruction over the sectors fetched, the same lanes in every row.
// It reads at most 31 bytes before a row (inside the weights buffer, which starts 256-byte aligned) and 15 past it
// (the weights allocation has catalog.WEIGHTS_TAIL_BYTES more).
template <int ROWB>
__device__ __forceinline__ void qtc_stage_codes(const unsigned char* first, int nrows, int s, unsigned char* codes) {
    const int lane = threadIdx.x & 31, ns = s == 0 ? QN32_ + 1 : QN32_;
    constexpr int JMIN = (ROWB + 31) / 32;  // the fewest sectors of a row's window (an aligned row)
    for (int base = (int)threadIdx.x - lane; base < ns * 64; base += TC_THREADS_) {  // uniform per warp
        const int i = base + lane, q = i >> 6, r = (i & 63) >> 1, h = i & 1, r_last = ((base & 63) >> 1) + 15;
        const QtcRow row = qtc_row<ROWB>(first, r, nrows);
        const int j = (s == 0 ? 0 : s * QN32_ + (row.shift > 0)) + q;
        unsigned char* dst = codes + r * QSP_ + (j == 0 ? 0 : 32 * (1 + (j - 1) % QRING_)) + 16 * h;
        const unsigned char* src = row.win + 32 * j + 16 * h;
        // Uniform: every row of the instruction fetches a sector before its last one (so none is shared or cut).
        if ((s > 0 || q < QN32_) && (s == 0 ? q : s * QN32_ + 1 + q) < JMIN - 1 && r_last < nrows) {
            cp_async16(dst, src);
        } else {
            const bool valid = r < nrows && j < row.nsec && 32 * j + 16 * h < row.shift + ROWB &&
                               !(row.shares && j == row.nsec - 1) && (s > 0 || q < QN32_ || row.shift > 0);
            // key: 32 + the vector's offset from the block's first row (>= -31), 0 for nothing to fetch
            int key = valid ? (int)(src - first) + 32 : 0;
#pragma unroll
            for (int d = 16; d > 0; d >>= 1) {
                const int other = __shfl_xor_sync(FULL_MASK, key, d);
                key = other > key ? other : key;
            }
            if (key != 0)  // uniform
                cp_async16(dst, valid ? src : first + (key - 32));
        }
    }
}

// Copy the scales (and zero points) of rows n0 .. n0 + nrows - 1 of every matrix to shared memory: one contiguous
// run of each block, 16-byte loads (common.cuh stage_run), stored group-major, QSR_ entries per group (block row r
// of group g at g * QSR_ + qtc_srow(r)): the lanes reading one group's scales of their rows 2c and 2c + 1 (qtc_pass)
// read 4 consecutive words each time, one wavefront. The caller's next barrier makes them visible.
__device__ __forceinline__ int qtc_srow(int r) { return 16 * (r & 1) + (r >> 1); }
template <int NMAT, int QSN, int KLEN>
__device__ __forceinline__ void qtc_stage_scales(const QtcMatrix (&w)[NMAT], int n0, int nrows,
                                                 QtcShared<NMAT, QSN>& sh) {
    constexpr int G = QGROUPS_(KLEN);
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
        float* s_sh = sh.scales[m];
        stage_run<TC_THREADS_>(w[m].scales + (size_t)n0 * G, nrows * G, [&](int i, const unsigned* v, int k) {
#if COLI_SCALE_FP16
            s_sh[(i % G) * QSR_ + qtc_srow(i / G)] = st_to_float((st)((v[k / 2] >> (16 * (k % 2))) & 0xffffu));
#else
            s_sh[(i % G) * QSR_ + qtc_srow(i / G)] = __uint_as_float(v[k]);
#endif
        });
        if (COLI_ZERO_POINTS) {
            signed char* z_sh = sh.zeros[m];
            stage_run<TC_THREADS_>(w[m].zeros + (size_t)n0 * G, nrows * G, [&](int i, const unsigned* v, int k) {
                z_sh[(i % G) * QSR_ + qtc_srow(i / G)] = (signed char)((v[k / 4] >> (8 * (k % 4))) & 255u);
            });
        }
    }
}

// Stage the activations of one reduction stage: a[r][4q ..] (QtcShared) from src[rows[r]][k0 + 4q .. + 3], split
// into hi = fp16(a) and lo = fp16(a - hi) (common.cuh tc_pass: close to fp32; |a| must stay below 65504), 0 past
// KLEN and for a row -1, for the rows r < 8 * nhalf. KLEN a multiple of 4: thread i takes chunk q = i % 16 of rows
// r = i / 16 + 8n (n < nhalf; src_rows[n] = rows[r], read once per pass by qtc_pass), one 16-byte load and one
// 16-byte store each, so a warp fills two rows, 8 lanes (one store phase) 128 consecutive bytes. Else (rows only
// 4-byte aligned) one element per thread and load, 32 consecutive elements per warp (whole sectors), its hi and lo
// halves stored into their chunk's entry. Every thread of the block calls it.
template <int KLEN>
__device__ __forceinline__ void qtc_stage_activations(const float* __restrict__ src, const int* rows,
                                                      const int (&src_rows)[2 * MT_], int nhalf, int k0,
                                                      unsigned (*a)[QA_PITCH_]) {
    static_assert(TC_THREADS_ == 8 * (TC_BK_ / 4), "a block stages 8 rows at a time");
    if (KLEN % 4 != 0) {
        for (int i = threadIdx.x; i < 8 * nhalf * TC_BK_; i += TC_THREADS_) {
            const int r = i / TC_BK_, kk = i % TC_BK_, k = k0 + kk, row = rows[r];
            const float v = row >= 0 && k < KLEN ? __ldg(src + (size_t)row * KLEN + k) : 0.0f;
            const unsigned short hi = float_to_half_bits(v);
            unsigned short* entry = reinterpret_cast<unsigned short*>(&a[r][4 * (kk / 4)]);
            entry[kk % 4] = hi;
            entry[4 + kk % 4] = float_to_half_bits(v - half_to_float(hi));
        }
        return;
    }
#pragma unroll
    for (int n = 0; n < 2 * MT_; ++n) {
        if (n >= nhalf) break;  // uniform
        const int r = threadIdx.x / (TC_BK_ / 4) + 8 * n, q = threadIdx.x % (TC_BK_ / 4), k = k0 + 4 * q;
        const int row = src_rows[n];
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row >= 0 && k < KLEN) {  // then k + 3 < KLEN too
            const float4 f = __ldg(reinterpret_cast<const float4*>(src + (size_t)row * KLEN + k));
            v[0] = f.x;
            v[1] = f.y;
            v[2] = f.z;
            v[3] = f.w;
        }
        unsigned hi[2], lo[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned short h0 = float_to_half_bits(v[2 * h]), h1 = float_to_half_bits(v[2 * h + 1]);
            const unsigned short l0 = float_to_half_bits(v[2 * h] - half_to_float(h0));
            const unsigned short l1 = float_to_half_bits(v[2 * h + 1] - half_to_float(h1));
            hi[h] = (unsigned)h0 | ((unsigned)h1 << 16);
            lo[h] = (unsigned)l0 | ((unsigned)l1 << 16);
        }
        *reinterpret_cast<uint4*>(&a[r][4 * q]) = make_uint4(hi[0], hi[1], lo[0], lo[1]);
    }
}

// The 4 (int4) or 8 (int8) code bytes of this lane in one span, little-endian from window byte t0 of row r (shared
// copies through qtc_slot): one aligned 4- or 8-byte read when t0 is aligned to it (then inside one sector), else
// byte by byte (a row at an odd start).
__device__ __forceinline__ void qtc_lane_codes(const unsigned char* codes, const QtcRow& row, int r, int t0,
                                               unsigned (&cw)[QLB_ / 4]) {
    if (t0 % QLB_ == 0) {
        const unsigned char* p = codes + qtc_slot(row, r, t0 >> 5) + (t0 & 31);
#if COLI_QUANT == 2
        cw[0] = *reinterpret_cast<const unsigned*>(p);
#else
        const unsigned long long v = *reinterpret_cast<const unsigned long long*>(p);
        cw[0] = (unsigned)v;
        cw[1] = (unsigned)(v >> 32);
#endif
        return;
    }
#pragma unroll
    for (int h = 0; h < QLB_ / 4; ++h) {
        unsigned v = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = t0 + 4 * h + e;
            v |= (unsigned)codes[qtc_slot(row, r, t >> 5) + (t & 31)] << (8 * e);
        }
        cw[h] = v;
    }
}

// acc[t][j][m] (t < ntiles) += A_t · W_m^T over this warp's spans of the reduction dimension KLEN, for the rows
// sh.rows[t*16 ..] of src (row length KLEN, -1: a zero row; rows from 8 * nhalf on are neither staged nor read:
// they are padding, the A fragment's rows g + 8 of a tile half of padding are zero registers; ntiles = the tiles
// of the nhalf halves) and output columns n0 + 16h + 8j .. + 7 (h = warp & 1,
// n8 tile j) of NTOT: warp w takes span w >> 1 (elements 32(w >> 1) .. + 31) of every 64-element stage, so each
// A fragment is read by two warps and used for both of a warp's n8 tiles; qtc_expert adds the two spans' sums.
// Within a span, mma step st (0, 1) gives lane c (mma_m16n8k16's k indices 2c, 2c+1, 2c+8, 2c+9) the elements
// 4q .. 4q + 3 of chunk q = 8·span + 2c + st (k index 2c + i: element 4q + i; 2c + 8 + i: 4q + 2 + i): the sum over
// a step is over a permutation of 16 elements, as the A and B fragments agree on it, so a lane's A fragment is
// one 16-byte read per row (hi and lo) and its codes for the span one 4- or 8-byte read (elements 8c .. 8c + 7).
// acc[t][j][m][i] is D[g + 8*(i/2)][2c + i%2] of the 16x8 tile (common.cuh mma_m16n8k16). Every thread of the
// block calls it (barriers).
template <int NMAT, int QSN, int KLEN, int NTOT, bool STAGED>
__device__ __forceinline__ void qtc_pass(const float* __restrict__ src, const QtcMatrix (&w)[NMAT], int n0,
                                         int nhalf, QtcShared<NMAT, QSN>& sh, float acc[MT_][QNT_][NMAT][4]) {
    constexpr int ROWB = QROW_BYTES_(KLEN), G = QGROUPS_(KLEN), GDIV = GS_ == 0 ? 1 : GS_;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, g = lane / 4, c = lane % 4;
    const int nh = warp & 1, span = warp >> 1, ntiles = (nhalf + 1) / 2;
    const int nrows = NTOT - n0 < TC_BN_ ? NTOT - n0 : TC_BN_;
    int src_rows[2 * MT_];  // the source rows this thread stages (qtc_stage_activations)
#pragma unroll
    for (int n = 0; n < 2 * MT_; ++n) src_rows[n] = sh.rows[tid / (TC_BK_ / 4) + 8 * n];
    float part[MT_][QNT_][NMAT][4];
#pragma unroll
    for (int t = 0; t < MT_; ++t)
#pragma unroll
        for (int j = 0; j < QNT_; ++j)
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[t][j][m][i] = 0.0f;

    constexpr int STAGES = (KLEN + TC_BK_ - 1) / TC_BK_;
#pragma unroll
    for (int s = 0; s < QSTAGES_ - 1; ++s) {  // the codes of stages 0 .. QSTAGES_ - 2
        if (s < STAGES) {
#pragma unroll
            for (int m = 0; m < NMAT; ++m)  // m unrolled: w[m] stays in registers
                qtc_stage_codes<ROWB>(w[m].codes + (size_t)n0 * ROWB, nrows, s, &sh.codes[m][0][0]);
        }
        cp_async_commit();
    }
    for (int k0 = 0; k0 < KLEN; k0 += TC_BK_) {
        // The previous stage fully used (the first: rows[] and the staged scales written): a[] and the ring slots
        // of stage s - 1 may be overwritten. The codes of stage s + QSTAGES_ - 1 are copied while stage s is
        // multiplied (the ring holds QSTAGES_ stages' sectors); one commit group per stage, empty past the last, so
        // that the wait retires exactly stage s.
        __syncthreads();
        const int s = k0 / TC_BK_, b0 = s * QSB_;  // the stage and its first code byte in a row
        if (s + QSTAGES_ - 1 < STAGES) {
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
                qtc_stage_codes<ROWB>(w[m].codes + (size_t)n0 * ROWB, nrows, s + QSTAGES_ - 1, &sh.codes[m][0][0]);
        }
        cp_async_commit();
        qtc_stage_activations<KLEN>(src, sh.rows, src_rows, nhalf, k0, sh.a);
        cp_async_wait<QSTAGES_ - 1>();  // this thread's copies of stage s have landed
        __syncthreads();     // everyone's, and a[]
        const int ks = k0 + QSPAN_ * span;  // this warp's span: elements ks .. ks + 31
        if (ks >= KLEN) continue;           // uniform per warp (the next barrier is reached by every warp)
        const int grp = GS_ == 0 ? 0 : ks / GDIV;
        // This lane's code words for the span, and its rows' bias: B rows 16h + 8j + g. Bytes past the row meet
        // zero activations (finite codes).
        unsigned cw[NMAT][QNT_][QLB_ / 4], bias[NMAT][QNT_];
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {
#pragma unroll
            for (int j = 0; j < QNT_; ++j) {
                const int brow = 16 * nh + 8 * j + g;
                const QtcRow row = qtc_row<ROWB>(w[m].codes + (size_t)n0 * ROWB, brow, nrows);
                qtc_lane_codes(&sh.codes[m][0][0], row, brow, row.shift + b0 + (QSB_ / 2) * span + QLB_ * c,
                               cw[m][j]);
                int z = 0;
                if (COLI_ZERO_POINTS && n0 + brow < NTOT)
                    z = STAGED ? (int)sh.zeros[m][grp * QSR_ + qtc_srow(brow)]
                               : (int)__ldg(w[m].zeros + (size_t)(n0 + brow) * G + grp);
                bias[m][j] = bias_pair(1024 + QOFF_ + z);
            }
        }
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            unsigned b[NMAT][QNT_][2];
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
#pragma unroll
                for (int j = 0; j < QNT_; ++j) {
#if COLI_QUANT == 2  // bytes 2q, 2q + 1 of the chunk: elements 4q (low nibble), 4q + 1 | 4q + 2, 4q + 3
                    const unsigned word = cw[m][j][0] >> (16 * st), y0 = word & 255u, y1 = (word >> 8) & 255u;
                    b[m][j][0] = codes_pair_sub(y0 & 15u, y0 >> 4, bias[m][j]);
                    b[m][j][1] = codes_pair_sub(y1 & 15u, y1 >> 4, bias[m][j]);
#else  // bytes 4q .. 4q + 3, two's complement: u = q + 128 = byte ^ 0x80
                    const unsigned word = cw[m][j][st] ^ 0x80808080u;
                    b[m][j][0] = codes_pair_sub(word & 255u, (word >> 8) & 255u, bias[m][j]);
                    b[m][j][1] = codes_pair_sub((word >> 16) & 255u, word >> 24, bias[m][j]);
#endif
                }
            }
            const int q = (QSPAN_ / 4) * span + 2 * c + st;  // the chunk of the stage
#pragma unroll
            for (int t = 0; t < MT_; ++t) {
                if (t < ntiles) {  // uniform
                    const uint4 u0 = *reinterpret_cast<const uint4*>(&sh.a[t * 16 + g][4 * q]);
                    const uint4 u1 = 2 * t + 1 < nhalf ? *reinterpret_cast<const uint4*>(&sh.a[t * 16 + g + 8][4 * q])
                                                       : make_uint4(0u, 0u, 0u, 0u);  // uniform
                    const unsigned ahi[4] = {u0.x, u1.x, u0.y, u1.y}, alo[4] = {u0.z, u1.z, u0.w, u1.w};
#pragma unroll
                    for (int m = 0; m < NMAT; ++m) {
#pragma unroll
                        for (int j = 0; j < QNT_; ++j) {
                            mma_m16n8k16(part[t][j][m], ahi, b[m][j], part[t][j][m]);
                            mma_m16n8k16(part[t][j][m], alo, b[m][j], part[t][j][m]);
                        }
                    }
                }
            }
        }
        // The group ends for this warp when its next span (two spans on) is in another group or past the row.
        const bool group_end = ks + 2 * QSPAN_ >= KLEN || (GS_ != 0 && (ks + 2 * QSPAN_) / GDIV != grp);
        if (group_end) {  // uniform: acc += scale * partial, then a new partial
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
#pragma unroll
                for (int j = 0; j < QNT_; ++j) {
                    float sc[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int r = 16 * nh + 8 * j + 2 * c + e;
                        sc[e] = n0 + r >= NTOT ? 0.0f
                                : STAGED ? sh.scales[m][grp * QSR_ + qtc_srow(r)]
                                         : st_to_float(__ldg(w[m].scales + (size_t)(n0 + r) * G + grp));
                    }
#pragma unroll
                    for (int t = 0; t < MT_; ++t) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            acc[t][j][m][i] += sc[i % 2] * part[t][j][m][i];
                            part[t][j][m][i] = 0.0f;
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy outlives the pass (the last groups are empty)
}

// Rows of the padded order of expert e, MT_*16 at a time: pairs[] (pair index, -1 padding) and rows[] (the src row
// of each: pair / k for x, the pair for act); then qtc_pass, the span-1 warps' sums added to the span-0 warps'
// (through shared memory), and the epilogue `store(p, col, acc, i)` by the span-0 warps (acc = acc[t][j]).
template <int NMAT, int KLEN, int NTOT, bool X_ROWS, class Store>
__device__ __forceinline__ void qtc_expert(const float* __restrict__ src, const QtcMatrix (&w)[NMAT],
                                           const int* __restrict__ sorted_pairs, int start, int end, int n0,
                                           Store store) {
    constexpr int G = QGROUPS_(KLEN);
    constexpr bool STAGED = TC_BN_ * G <= QS_MAX_;
    constexpr int QSN = STAGED ? QSR_ * G : 1;
    static_assert(sizeof(QtcShared<NMAT, QSN>) <= 48 * 1024,
                  "expert_quant_tc.cu: static shared memory above 48 KiB (activation, code and scale stages)");
    __shared__ __align__(16) QtcShared<NMAT, QSN> sh;
    if (STAGED) qtc_stage_scales<NMAT, QSN, KLEN>(w, n0, NTOT - n0 < TC_BN_ ? NTOT - n0 : TC_BN_, sh);
    const int lane = threadIdx.x & 31, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
    const int nh = warp & 1, span = warp >> 1;
    for (int r0 = start; r0 < end; r0 += MT_ * 16) {
        __syncthreads();  // pairs[], rows[] and red[] of the previous pass fully used
        for (int i = threadIdx.x; i < MT_ * 16; i += TC_THREADS_) {
            const int p = r0 + i < end ? __ldg(sorted_pairs + r0 + i) : -1;
            sh.pairs[i] = p;
            sh.rows[i] = p < 0 ? -1 : X_ROWS ? p / K_ : p;
        }
        __syncthreads();  // pairs[] written
        // The 8-row halves of the pass that hold a pair: the expert's pairs come first, its padding rows (-1) last
        // (routing.cu align_pairs), so a pass of padding rows only (block_m > 32) ends the expert.
        int nhalf = 0;
#pragma unroll
        for (int h = 0; h < 2 * MT_; ++h) nhalf += sh.pairs[8 * h] >= 0 ? 1 : 0;
        if (nhalf == 0) break;  // uniform
        const int ntiles = (nhalf + 1) / 2;
        float acc[MT_][QNT_][NMAT][4];
#pragma unroll
        for (int t = 0; t < MT_; ++t)
#pragma unroll
            for (int j = 0; j < QNT_; ++j)
#pragma unroll
                for (int m = 0; m < NMAT; ++m)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[t][j][m][i] = 0.0f;
        qtc_pass<NMAT, QSN, KLEN, NTOT, STAGED>(src, w, n0, nhalf, sh, acc);  // its barriers order rows[]
        __syncthreads();  // every warp done with a[], which red[] overwrites
        if (span == 1) {  // uniform per warp: hand the sums over, lane-major (each write one wavefront)
#pragma unroll
            for (int t = 0; t < MT_; ++t)
#pragma unroll
                for (int j = 0; j < QNT_; ++j)
#pragma unroll
                    for (int m = 0; m < NMAT; ++m)
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            if (t < ntiles) sh.red[nh][((t * QNT_ + j) * NMAT + m) * 4 + i][lane] = acc[t][j][m][i];
        }
        __syncthreads();  // red[] written
        if (span == 1) continue;  // uniform per warp; the span-0 warps store (the next barrier: the pass's first)
#pragma unroll
        for (int t = 0; t < MT_; ++t) {
            if (t < ntiles) {
#pragma unroll
                for (int j = 0; j < QNT_; ++j) {
#pragma unroll
                    for (int m = 0; m < NMAT; ++m)
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            acc[t][j][m][i] += sh.red[nh][((t * QNT_ + j) * NMAT + m) * 4 + i][lane];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int mr = t * 16 + g + 8 * (i / 2), col = n0 + 16 * nh + 8 * j + 2 * c + i % 2;
                        const int p = sh.pairs[mr];
                        if (p >= 0 && col < NTOT) store(p, col, acc[t][j], i);
                    }
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
extern "C" __global__ void __launch_bounds__(TC_THREADS_, QMINB_)
colibri_gate_up_qtc(const float* __restrict__ x, const unsigned char* __restrict__ gate,
                    const unsigned char* __restrict__ up, const int* __restrict__ sorted_pairs,
                    const int* __restrict__ expert_offsets, float* __restrict__ act,
                    const void* __restrict__ gate_scales, const void* __restrict__ up_scales,
                    const signed char* __restrict__ gate_zeros, const signed char* __restrict__ up_zeros
                     GATE_UP_BIAS_PARAMS) {
    pdl_entry();
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
    pdl_entry();
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
