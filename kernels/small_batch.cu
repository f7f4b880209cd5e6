// small_batch.cu: the few-token fast path (decode, camera frames): expert GEMVs bound by memory bandwidth.
// Used instead of align + the tiled kernels when tokens*k <= kernels.small_batch.max_pairs (COLI_GEMV 1, decided by
// the launch plan). The expert order of the valid pairs (common.cuh PairOrder: no padding rows) is built once per
// layer by colibri_routing's last block (and rebuilt by colibri_capacity when it drops pairs) into the pair_order
// buffer; each block copies it into shared memory (load_pair_order: one coalesced loop, one barrier): no align
// kernel.
//
// colibri_gate_up_gemv — grid (ceil(intermediate / WARPS), min(experts, tokens*k)), block (COLI_SMALL_BATCH_THREADS).
//   Block (c, s) takes the s-th expert e selected by a valid token (increasing expert index; slots past the last
//   selected expert exit after the copy of the order) and intermediate row n = c*WARPS + warp per warp.
//   Chunk-major (float and int8/int4 weights): for each chunk of CHUNK_ columns each warp loads its part of row n
//   of gate[e] and of up[e] into registers (16-byte loads, L1 bypassed; the next chunk's loads are issued before
//   this chunk is used), then for
//   each group of PASS_ pairs routed to e (8; 4 for int4 and above 512 threads) their x rows of the chunk are staged
//   in shared memory (a bank-conflict-free layout, SP_) and multiplied, each staged unit read once for gate and up;
//   chunk sums go to a shared partial per (pair, row), so every weight byte is streamed once:
//       act[p, n] = silu(gate[e, n, :] . x[p / k, :]) * (up[e, n, :] . x[p / k, :])       only pairs p routed to e
//   (with biases and the clamped SwiGLU when the file has them: common.cuh gate_up_epilogue)
// colibri_down_gemv — grid (ceil(hidden / (ROWS*WARPS))), same block; ROWS = 2 (1 above 512 threads). Rows
//   n0 .. n0 + ROWS*WARPS - 1 of the layer output, ROWS consecutive hidden rows per warp. For every selected expert
//   in increasing index, its rows of down[e] are streamed and the act rows of its pairs staged as above:
//       y[p / k, n] += topk_weights[p] * (down[e, n, :] . act[p, :])        (shared memory, one writer per element)
//   then x_next[t, n] = x[t, n] + y[t, n] (COLI_RESIDUAL) or y[t, n] for every token. The slots of a token are summed
//   in increasing expert index, a fixed order: bitwise deterministic, no atomics, no aggregate kernel, in both
//   aggregation modes. Padded tokens (NO_EXPERT) get y = 0.
//
// colibri_shared_gate_up, colibri_shared_down — the shared experts of a v2 file (COLI_SHARED_EXPERTS), over every
//   valid token after the routed output: described at their definitions, at the end of this file.
// The expert epilogue (biases, clamped SwiGLU; common.cuh gate_up_epilogue / down_epilogue) follows COLI_EXPERT_BIAS
//   and COLI_ACTIVATION; the bias blocks are extra arguments after the quantized ones.
//
// Loads: a weight row (float, int8 or int4) of any length and start is read with 16-byte vector loads through its
// aligned window (Window, chunk_dot: from its start rounded down to 32 bytes; the bytes outside the row masked, or,
// for codes, multiplied by staged zeros). Lane sums are combined with an xor butterfly in a fixed order, then chunks
// in order: deterministic bits.
// Quantized weights (COLI_QUANT 1 int8, 2 int4; docs/format.md "Matrix storage"): a row holds codes (int8 bytes, or
// int4 nibbles q+8 with column 2j in the low nibble of byte j), its scales (one per COLI_GROUP_SIZE columns along
// the reduction dimension, 0 = one per row, the last group partial) and, with COLI_ZERO_POINTS, int8 zero points,
// in their own blocks (extra kernel arguments, after the float ones). A lane dequantizes in registers:
// w = scale * (q - zero), one float32 rounding as the reference; the codes are streamed in 16-byte loads (16 int8
// or 32 int4 per lane), a vector of a shifted window spanning up to two scale groups. The scales (and zero points)
// of a block's rows, one contiguous run per scale block, are staged in shared memory by the whole block with
// 16-byte loads over the run's aligned window (stage_run) when they fit in QS_MAX_ entries per matrix; else each
// lane reads the scales of its vector's groups. Scales are fp16 (COLI_SCALE_FP16 1) or fp32; the router of such a
// file is fp32.
// Limits: common.cuh; tokens * ROWS*WARPS * 4 bytes of output tile <= 16 KiB; build_pair_order walks the tokens*k
// pairs once per expert thread, once per layer in colibri_routing (small for the shapes of this path).
#include "common.cuh"

#define THREADS_ COLI_SMALL_BATCH_THREADS
#define WARPS_ (THREADS_ / 32)
// Pairs per pass over a weight row (accumulators per row stream) and hidden rows per warp in colibri_down_gemv:
// blocks of more than 512 threads have 64 registers per thread, so they take half; int4 takes 4 pairs per pass as
// well, its chunks being twice as wide (CHUNK_ below: the stage keeps its size).
#define PASS_ (THREADS_ > 512 || COLI_QUANT == 2 ? 4 : 8)
#define DOWN_ROWS_ (THREADS_ > 512 ? 1 : 2)
#define TILE_ (WARPS_ * DOWN_ROWS_)
// Blocks per SM the routed GEMV kernels are compiled for (__launch_bounds__ min blocks): int8/int4 512 / threads
// (2 at 256 threads), so ptxas keeps a thread within 128 registers and two or more blocks share an SM: one block's
// dequantization and FMAs run while another's loads are in flight, and twice the bytes are in flight per SM (the
// latency limit of the time model, docs/kernels.md). q_fma_vec's rolled word loop is what makes 128 fit without
// spills (checked for the Mixtral shape, the test shapes and odd sizes with and without zero points; 3 blocks of
// 256, 80 registers, spilled). Above 512 threads and for float weights: 1 (float weights fit in 128 as they are).
#define QMINB_ (COLI_QUANT && THREADS_ < 512 ? 512 / THREADS_ : 1)
// colibri_down_gemv: 512 / threads for every storage. Its multi-pass y terms (every lane adds its pair's) took the
// float kernel to 138 registers at 256 threads, one block per SM; bounded, ptxas keeps it at 122 (fp16) and 96
// (fp32) without spills at sm_80-90, two blocks per SM and twice the bytes in flight.
#define DMINB_ (THREADS_ < 512 ? 512 / THREADS_ : 1)
static_assert(THREADS_ % 32 == 0 && THREADS_ >= 32 && THREADS_ <= 1024,
              "small_batch threads: multiple of 32 in 32..1024");
#if COLI_QUANT
#define QEPV_ (COLI_QUANT == 2 ? 32 : 16)  // codes per 16-byte vector
#define VCOLS_ QEPV_
// Columns of the reduction dimension staged per step: 32 vectors per row, one per lane (int8 512, int4 1024).
#define CHUNK_ (32 * QEPV_)
// A group holds whole vectors' worth of columns, so a vector of a row's window (which starts anywhere in a group
// when the row is not 32-byte aligned) spans at most two groups (q_fma_vec).
static_assert(GS_ % QEPV_ == 0, "a scale group must be a multiple of the codes per 16-byte vector");
typedef unsigned char ws_t;  // stored weight: code bytes
#else
typedef wt ws_t;  // stored weight: fp16 bits or fp32
#define VCOLS_ VEC_
#define CHUNK_ (64 * VEC_)  // columns staged per step: 64 vectors per row, two per lane (fp16 512, fp32 256)
#define QROW_BYTES_(cols) ((cols) * (int)sizeof(wt))
#endif
// A weight row (float elements or int8/int4 codes) is read through its aligned window (chunk_dot): the
// 16-byte vectors from its start rounded down to 32 bytes (a sector, so that a warp's 32 vectors touch 16 whole
// sectors). A row of `cols` columns whose byte length is not a multiple of 32 may start up to 31 bytes
// (< 2 * VCOLS_ columns) into its window (a shift); the staged
// activations then begin MARGIN_(cols) = 2 * VCOLS_ columns before each chunk, and the row takes NCHUNKS_(cols)
// chunks of CHUNK_ / VCOLS_ vectors. Rows of whole sectors start 32-byte aligned (the weights buffer does; every
// expert matrix of a .colibri file starts at a multiple of its row length): no margin.
#define NVC_ (CHUNK_ / VCOLS_)           // vectors per row per chunk
#define VPL_ ((NVC_ + 31) / 32)          // of them per lane
#define MARGIN_(cols) (QROW_BYTES_(cols) % 32 ? 2 * VCOLS_ : 0)
#define NCHUNKS_(cols) (((cols) + (MARGIN_(cols) ? 2 * VCOLS_ - 1 : 0) + CHUNK_ - 1) / CHUNK_)
#define SW_ (CHUNK_ + 2 * VCOLS_)        // staged columns per pair (margin included)
// The stage: PASS_ rows of SWR_ floats (SW_ rounded up to whole 32-column blocks, 128 bytes: one pass of the 32
// shared-memory banks), column c of a row at SP_(c): the 16-byte units (4 columns) of block b = c / 32 rotated by
// b mod R_ within the block, R_ = VCOLS_ / 4 units per lane vector (fp32 1, fp16 2, int8 4, int4 8). A 16-byte
// shared access is served a quarter-warp (8 lanes, 128 bytes) per wavefront, conflict-free when the 8 lanes' units
// fall in 8 different unit slots (u mod 8). In chunk_dot lane l reads its vector i = 32 u + l as R_ float4s, the
// t-th at unit R_ i + t (+ the margin's 2 R_ units, rows of whole sectors: none): 8 lanes span R_ blocks, 8 / R_
// lanes in each, at slots t, t + R_, ... of their block, and the rotations 0 .. R_ - 1 of the R_ consecutive
// blocks move them onto the 8 different slots (fp16: lanes 0-3 slots t, t+2, t+4, t+6 of block 0, lanes 4-7 the
// same + 1 in block 1; int8: 2 lanes per block, slots t, t+4 rotated by 0..3; int4: one lane per block, slot t
// rotated by 0..7). Unrotated, the lanes of a quarter-warp sit R_ units apart: an R_-way conflict (and scalar
// 4-byte reads of lanes 8, 16 or 32 floats apart, as before: 8-, 16- or, int4's 16 lanes, 16-way). The vectors of
// rows at a margin, and int8/int4 rows at any shift that is a multiple of 4 columns, stay conflict-free (they span
// R_ + 1 blocks, whose rotations still give the 8 lanes 8 different slots: checked for every such offset); other
// shifts (odd sizes) read the stage element by element. The staging stores (stage_rows) write 8 consecutive units
// per quarter-warp, one whole block: conflict-free.
#define SWR_ ((SW_ + 31) / 32 * 32)
#define R_ (VCOLS_ / 4)
#define SP_(c) (((c) & ~31) | (((((c) >> 2) + ((c) >> 5) % R_) & 7) << 2) | ((c) & 3))
static_assert(T_ * TILE_ * 4 <= 16 * 1024 && 2 * T_ * WARPS_ * 4 <= 16 * 1024,
              "small_batch: batch*tokens * rows per block * 4 bytes must be <= 16 KiB (lower max_pairs or threads)");

// Stage columns c0 .. c0 + NEED - 1 of rows src[rows[j]] (c0 = q * CHUNK_ - MARGIN, NEED = CHUNK_ + MARGIN; j < cnt,
// rows of row_len floats) into stage[j] (column c at SP_(c)): columns outside [0, row_len) are staged as 0 (never
// used: the weights there are masked or meet them as zeros). c0 is a multiple of 4: float4 loads and 16-byte
// stores where the rows are 16-byte aligned, over NEED rounded up to whole 32-column blocks (the lanes past NEED
// load a needed vector again and store zeros: one instruction per warp, 8 units of one block per quarter-warp);
// else scalar loads in runs of 32 consecutive floats that start on a 32-byte sector (one warp, 4 whole sectors),
// the run of row j shifted by the row's offset in its sector (its scalar stores span two blocks: up to 2-way).
template <int MARGIN>
__device__ __forceinline__ void stage_rows(const float* __restrict__ src, int row_len, const int* rows, int cnt,
                                           int q, float (*stage)[SWR_]) {
    constexpr int need = CHUNK_ + MARGIN;
    const int c0 = q * CHUNK_ - MARGIN;
    const int lo = c0 > 0 ? c0 : 0, end = c0 + need < row_len ? c0 + need : row_len;  // staged row columns [lo, end)
    if (row_len % 4 == 0) {  // every row and every chunk start is 16-byte aligned (the buffer is 256-byte aligned)
        constexpr int per_row = (need + 31) / 32 * 8;  // 16-byte units, whole blocks
        for (int i = threadIdx.x; i < cnt * per_row; i += THREADS_) {
            const int j = i / per_row, c = (i % per_row) * 4, col = c0 + c;
            // Columns outside the row load the nearest in-row vector (the same sector as a neighbouring lane's) and
            // store zeros: every lane of a warp executes the load, so the access model sees one instruction.
            const bool in_row = col >= lo && col < end;
            const int at = col < lo ? lo : col < end ? col : end - 4;
            float4 v = __ldg(reinterpret_cast<const float4*>(src + (size_t)rows[j] * row_len + at));
            if (!in_row) v.x = v.y = v.z = v.w = 0.0f;
            *reinterpret_cast<float4*>(&stage[j][SP_(c)]) = v;
        }
    } else {
        constexpr int per_row = (need + 7 + 31) / 32 * 32;  // a whole number of warp runs per row
        for (int i = threadIdx.x; i < cnt * per_row; i += THREADS_) {
            const int j = i / per_row, t = i % per_row;
            const long long first = (long long)rows[j] * row_len + c0;  // element of stage column 0
            const int off = (int)(((first % 8) + 8) % 8);                // its place in a 32-byte sector
            const int c = t - off, col = c0 + c;
            // The staged columns of the row: [lo, end). A run (32 lanes) with any of them loads for every lane, at
            // the nearest of them (same sector), so that a warp's lanes stay one instruction in the access model.
            const int run = c0 - off + (t & ~31);  // column of the run's first lane
            if (run < end && run + 31 >= lo) {
                const int at = col < lo ? lo : col >= end ? end - 1 : col;
                const float v = __ldg(src + (size_t)rows[j] * row_len + at);
                if (c >= 0 && c < need) stage[j][SP_(c)] = col == at ? v : 0.0f;
            } else if (c >= 0 && c < need) {
                stage[j][SP_(c)] = 0.0f;
            }
        }
    }
}

// The aligned window of a weight row (float elements, int8 codes or int4 nibbles): vector k holds columns
// k*VCOLS_ - shift .. k*VCOLS_ - shift + VCOLS_ - 1 (16 bytes hold VCOLS_ columns, so a byte offset b in the sector is
// b * VCOLS_ / 16 columns); nv vectors cover the row. It reads at most 31 bytes before the row (inside the weights
// buffer, which starts 256-byte aligned) and 15 after it (the weights allocation has catalog.WEIGHTS_TAIL_BYTES
// more); the columns outside the row are masked (float) or meet zero activations (codes: finite weights).
struct Window {
    const uint4* base;
    int shift, nv;
};
__device__ __forceinline__ Window window(const void* row, int cols) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(row);
    const int shift = (int)(a & 31ull) * VCOLS_ / 16;
    return Window{reinterpret_cast<const uint4*>(a & ~31ull), shift, (cols + shift + VCOLS_ - 1) / VCOLS_};
}

// The lane's vectors of chunk q of NROWS windows: vector q*NVC_ + 32u + lane for u < VPL_. A load is issued by the
// whole warp when any of its 32 vectors lies in the chunk and the window (uniform per warp): lanes past them load
// the last such vector again (a sector the instruction fetches anyway; chunk_dot skips those lanes), so each load
// is one warp instruction over whole sectors, the same lanes in every row. (Lanes that skip a load would, in the
// emulator's access model, where g++ leaves the row loop rolled and all rows share one load site, pair with another
// row's load of other lanes: the half sectors of the fp16 colibri_down_gemv's odd rows.)
template <int NROWS>
__device__ __forceinline__ void load_chunk(const Window win[NROWS], int q, uint4 raw[NROWS][VPL_]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < NROWS; ++r)
#pragma unroll
        for (int u = 0; u < VPL_; ++u) {
            const int first = q * NVC_ + 32 * u;  // the warp's first vector
            const int end = q * NVC_ + NVC_ < win[r].nv ? q * NVC_ + NVC_ : win[r].nv;
            const int k = first + lane < end ? first + lane : end - 1;
            raw[r][u] = 32 * u < NVC_ && first < end ? ld_stream(win[r].base + k) : make_uint4(0, 0, 0, 0);
        }
}

// The staged columns c .. c + 3 of pair j (c a multiple of 4: one 16-byte unit, LDS.128).
__device__ __forceinline__ float4 stage4(const float (*stage)[SWR_], int j, int c) {
    return *reinterpret_cast<const float4*>(&stage[j][SP_(c)]);
}

// Weights in flight (PREFETCH_, blocks of up to 512 threads; above, 64 registers per thread leave no room): chunk
// q + 1's vectors are loaded into `next` while chunk q, in `raw`, is staged and multiplied, so a warp has two
// chunks of loads in flight instead of one and the loads overlap the shared-memory work. Call first_chunk once per
// row set, then next_chunk at the top of every chunk q = 0, 1, ...
#define PREFETCH_ (THREADS_ <= 512)
// One staged unit read for all the warp's rows (chunk_dot) up to 512 threads; above, 64 registers take one row at a
// time (the two-row loops spilled there: fp16 hidden 200 at 1024 threads, int4 g32 with zero points at hidden 2048).
#define SHARE_ROWS_ (THREADS_ <= 512)
template <int NROWS>
__device__ __forceinline__ void first_chunk(const Window win[NROWS], bool rows, uint4 next[NROWS][VPL_]) {
    if (PREFETCH_ && rows) load_chunk<NROWS>(win, 0, next);
}
template <int NROWS>
__device__ __forceinline__ void next_chunk(const Window win[NROWS], bool rows, int q, int nchunks,
                                           uint4 raw[NROWS][VPL_], uint4 next[NROWS][VPL_]) {
    if (!rows) return;  // uniform per warp
    if (PREFETCH_) {
#pragma unroll
        for (int r = 0; r < NROWS; ++r)
#pragma unroll
            for (int u = 0; u < VPL_; ++u) raw[r][u] = next[r][u];
        if (q + 1 < nchunks) load_chunk<NROWS>(win, q + 1, next);
    } else {
        load_chunk<NROWS>(win, q, raw);
    }
}

// acc[r][j] += row r's vector raw[r] . stage[j][h .. h + VEC_) for the pairs j < cnt and the NROWS rows, h a multiple
// of 4: each staged 16-byte unit is read once (LDS.128) for all rows (gate and up, or the down rows of a warp); unit
// by unit, 4 weights of each row live at a time; each accumulator summed in element order as before.
template <int NROWS>
__device__ __forceinline__ void fma_vec(const uint4 raw[NROWS], const float (*stage)[SWR_], int h, int cnt,
                                        float acc[NROWS][PASS_]) {
#pragma unroll
    for (int t = 0; t < VEC_; t += 4) {
        float w[NROWS][VEC_];
#pragma unroll
        for (int r = 0; r < NROWS; ++r) unpack16(raw[r], w[r]);  // only elements t .. t + 3 are used below
#pragma unroll
        for (int j = 0; j < PASS_; ++j) {
            if (j < cnt) {
                const float4 a = stage4(stage, j, h + t);
#pragma unroll
                for (int r = 0; r < NROWS; ++r) {
                    float s = acc[r][j];
                    s += w[r][t] * a.x;
                    s += w[r][t + 1] * a.y;
                    s += w[r][t + 2] * a.z;
                    s += w[r][t + 3] * a.w;
                    acc[r][j] = s;
                }
            }
        }
    }
}
// acc[j] += w[VEC_] . stage[j][h .. h + VEC_), elements e_lo .. e_hi - 1 only, any h (scalar reads: odd sizes).
__device__ __forceinline__ void fma_vec_masked(const float w[VEC_], const float (*stage)[SWR_], int h, int e_lo,
                                               int e_hi, int cnt, float acc[PASS_]) {
#pragma unroll
    for (int j = 0; j < PASS_; ++j) {
        if (j < cnt) {
            float a = acc[j];
#pragma unroll
            for (int q = 0; q < VEC_; ++q)
                if (q >= e_lo && q < e_hi) a += w[q] * stage[j][SP_(h + q)];
            acc[j] = a;
        }
    }
}

#if COLI_QUANT
// The scales and zero points of one quantized weight row (its codes are read through its Window): staged in shared
// memory (s: float, z: the row's groups 0..G-1; chunk_dot<.., true>) or in global memory (s: st; chunk_dot<.., false>).
// z is null without zero points.
struct QRow {
    const void* s;
    const signed char* z;
};
template <bool STAGED>
__device__ __forceinline__ float q_scale(const QRow& r, int g) {
    return STAGED ? static_cast<const float*>(r.s)[g] : st_to_float(__ldg(static_cast<const st*>(r.s) + g));
}
template <bool STAGED>
__device__ __forceinline__ int q_zero(const QRow& r, int g) {
    if (!COLI_ZERO_POINTS) return 0;
    return STAGED ? (int)r.z[g] : (int)__ldg(r.z + g);
}
#else
struct QRow {};  // float rows have no scales
#endif

// Lane partials of chunk q of NROWS weight rows (windows win, `cols` columns; the lane's vectors in raw; for codes
// their scales in rows) against the staged activations (stage column 0 = row column q*CHUNK_ - margin):
// acc[r][j] += its products for pairs j < cnt. STAGED: the rows' scales are in shared memory (codes only).
#if !COLI_QUANT
template <int NROWS, bool STAGED = false>
__device__ __forceinline__ void chunk_dot(const Window win[NROWS], const QRow*, const uint4 raw[NROWS][VPL_], int q,
                                          int cols, int margin, const float (*stage)[SWR_], int cnt,
                                          float acc[NROWS][PASS_]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < VPL_; ++u) {
        const int i = 32 * u + lane, k = q * NVC_ + i;
        if (i >= NVC_) continue;
        bool whole = true;  // every row's vector k aligned and inside the row (even sizes): one shared read for all
#pragma unroll
        for (int r = 0; r < NROWS; ++r)
            whole = whole && win[r].shift == 0 && (k + 1) * VCOLS_ <= cols;
        if (whole && SHARE_ROWS_) {
            uint4 v[NROWS];
#pragma unroll
            for (int r = 0; r < NROWS; ++r) v[r] = raw[r][u];
            fma_vec<NROWS>(v, stage, i * VCOLS_ + margin, cnt, acc);
            continue;
        }
#pragma unroll
        for (int r = 0; r < NROWS; ++r) {
            if (k >= win[r].nv) continue;
            const int col = k * VCOLS_ - win[r].shift, h = i * VCOLS_ - win[r].shift + margin;
            if (!SHARE_ROWS_ && win[r].shift == 0 && col + VCOLS_ <= cols) {  // this row's whole aligned vector
                float one[1][PASS_];
#pragma unroll
                for (int j = 0; j < PASS_; ++j) one[0][j] = acc[r][j];
                fma_vec<1>(&raw[r][u], stage, h, cnt, one);
#pragma unroll
                for (int j = 0; j < PASS_; ++j) acc[r][j] = one[0][j];
                continue;
            }
            float w[VEC_];
            unpack16(raw[r][u], w);
            fma_vec_masked(w, stage, h, col < 0 ? -col : 0, cols - col < VCOLS_ ? cols - col : VCOLS_, cnt, acc[r]);
        }
    }
}
#endif

#if COLI_QUANT
// Scale staging: the scales (and zero points) of all rows of a block, consecutive rows of one expert, hence one
// contiguous run of each scale block, are copied to shared memory by the whole block before its rows are streamed,
// when they fit in QS_MAX_ entries per matrix (decided at compile time); else each lane reads the scales of its
// vector's groups from global memory.
#ifdef COLI_QUANT_STAGE_MAX  // tests set it to 0 to run the global-scale path
#define QS_MAX_ COLI_QUANT_STAGE_MAX
#else
#define QS_MAX_ 2048
#endif
#define QS_GU_ (WARPS_ * QGROUPS_(H_) <= QS_MAX_)    // colibri_gate_up_gemv: WARPS_ rows of gate and of up
#define QS_DOWN_ (TILE_ * QGROUPS_(I_) <= QS_MAX_)   // colibri_down_gemv: TILE_ rows of down
#define QS_GU_N_ (QS_GU_ ? WARPS_ * QGROUPS_(H_) : 1)
#define QS_DOWN_N_ (QS_DOWN_ ? TILE_ * QGROUPS_(I_) : 1)

// The scales (as float) and zero points of rows first_row .. first_row + nrows - 1 (`groups` each) into s_sh, z_sh.
// Every thread of the block calls it; the caller's next barrier makes the copy visible.
__device__ __forceinline__ void stage_scales(const st* __restrict__ scales, const signed char* __restrict__ zeros,
                                             size_t first_row, int nrows, int groups, float* s_sh,
                                             signed char* z_sh) {
    const size_t at = first_row * (size_t)groups;
    const int n = nrows * groups;
    stage_run<THREADS_>(scales + at, n, [&](int i, const unsigned* w, int m) {
#if COLI_SCALE_FP16
        s_sh[i] = st_to_float((st)((w[m / 2] >> (16 * (m % 2))) & 0xffffu));
#else
        s_sh[i] = __uint_as_float(w[m]);
#endif
    });
    if (COLI_ZERO_POINTS)
        stage_run<THREADS_>(zeros + at, n,
                  [&](int i, const unsigned* w, int m) { z_sh[i] = (signed char)((w[m / 4] >> (8 * (m % 4))) & 255u); });
}

// acc[r][j] += the dequantized vector u of row r . stage[j][h .. h + QEPV_) for the pairs j < cnt and the NROWS
// rows, whose vectors all hold columns col .. col + QEPV_ - 1 of rows of `cols` columns (the same window shift);
// those outside the row (col < 0: the previous row's codes; past the row: the next row's, an int4 padding nibble or
// the buffer's tail) are finite weights against staged zeros. A vector spans at most two groups: elements from
// `split` on take the next group's scale and zero point. VEC4 (h a multiple of 4): the stage is read one 16-byte
// unit at a time (LDS.128, SP_), each unit once for all rows; else element by element. Each accumulator is summed
// in element order either way, as before.
template <int NROWS, bool STAGED, bool VEC4>
__device__ __forceinline__ void q_fma_vec(const uint4 raw[NROWS][VPL_], int u, const QRow rows[NROWS], int col,
                                          int cols, const float (*stage)[SWR_], int h, int cnt,
                                          float acc[NROWS][PASS_]) {
    int ga = 0, gb = 0, split = QEPV_;
    if (GS_ != 0) {
        constexpr int G = GS_ == 0 ? 1 : GS_;
        ga = (col < 0 ? 0 : col) / G;
        const int next = (ga + 1) * G;  // first column of the next group
        split = next - col;
        gb = split < QEPV_ && next < cols ? ga + 1 : ga;
    }
    float sa[NROWS], sb[NROWS];
    int za[NROWS], zb[NROWS];
#pragma unroll
    for (int r = 0; r < NROWS; ++r) {
        sa[r] = q_scale<STAGED>(rows[r], ga);
        sb[r] = q_scale<STAGED>(rows[r], gb);
        za[r] = q_zero<STAGED>(rows[r], ga);
        zb[r] = q_zero<STAGED>(rows[r], gb);
    }
    constexpr int STEP = VEC4 ? 4 : 1;  // elements per shared read
    constexpr int EPW = QEPV_ / 4;       // codes per 32-bit word (int4 8, int8 4)
    // Word-major, the word loop kept rolled: the codes of one 32-bit word per row are live at a time, and ptxas
    // cannot hoist the stage reads of later words ahead (which held the quantized GEMVs at 144-239 registers, one
    // block per SM); the words move down each step (w.x <- w.y <- w.z <- w.w), so word wi is always in .x.
    uint4 w[NROWS];
#pragma unroll
    for (int r = 0; r < NROWS; ++r) w[r] = raw[r][u];
#pragma unroll 1
    for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int e0 = 0; e0 < EPW; e0 += STEP) {  // element-major: STEP weights per row live at a time
            const int i0 = wi * EPW + e0;
            float f[NROWS][STEP];
#pragma unroll
            for (int r = 0; r < NROWS; ++r) {
#pragma unroll
                for (int t = 0; t < STEP; ++t) {
                    const int i = i0 + t;
#if COLI_QUANT == 2
                    const int qv = (int)((w[r].x >> (4 * (e0 + t))) & 15u) - 8;  // element i: nibble i of the 16 bytes
#else
                    const int qv = (int)(signed char)((w[r].x >> (8 * (e0 + t))) & 255u);
#endif
                    // one rounding, as the reference
                    f[r][t] = i < split ? sa[r] * (float)(qv - za[r]) : sb[r] * (float)(qv - zb[r]);
                }
            }
#pragma unroll
            for (int j = 0; j < PASS_; ++j) {
                if (j < cnt) {
                    float a[4];
                    if (VEC4) {
                        const float4 v = stage4(stage, j, h + i0);
                        a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
                    } else {
                        a[0] = stage[j][SP_(h + i0)];
                    }
#pragma unroll
                    for (int r = 0; r < NROWS; ++r)
#pragma unroll
                        for (int t = 0; t < STEP; ++t) acc[r][j] += f[r][t] * a[t];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < NROWS; ++r) w[r] = make_uint4(w[r].y, w[r].z, w[r].w, 0u);
    }
}

// q_fma_vec for row r of the NROWS alone, element by element.
template <int NROWS, bool STAGED>
__device__ __forceinline__ void q_fma_row(const uint4 raw[NROWS][VPL_], int u, int r, const QRow rows[NROWS], int col,
                                          int cols, const float (*stage)[SWR_], int h, int cnt,
                                          float acc[NROWS][PASS_]) {
    uint4 raw1[1][VPL_];
    raw1[0][u] = raw[r][u];
    float one[1][PASS_];
#pragma unroll
    for (int j = 0; j < PASS_; ++j) one[0][j] = acc[r][j];
    q_fma_vec<1, STAGED, false>(raw1, u, &rows[r], col, cols, stage, h, cnt, one);
#pragma unroll
    for (int j = 0; j < PASS_; ++j) acc[r][j] = one[0][j];
}

// chunk_dot for int8/int4 rows: the same windows, chunks and staged columns as float rows. Rows with the same shift,
// a multiple of 4 columns (every row of whole sectors: shift 0), share each 16-byte shared read; the others (odd
// sizes) are taken one at a time, element by element (16-byte reads for one row cost registers: int4 g32 with zero
// points spilled at 255).
// Blocks of more than 512 threads (SHARE_ROWS_ 0) dequantize one row at a time, element by element, with 4-byte
// shared reads (as before: lanes 16 or 32 floats apart, conflicted; no shipped profile runs them): 16-byte reads
// of two rows, or of one, spilled there (int4 g32 with zero points, hidden 2048).
template <int NROWS, bool STAGED>
__device__ __forceinline__ void chunk_dot(const Window win[NROWS], const QRow rows[NROWS],
                                          const uint4 raw[NROWS][VPL_], int q, int cols, int margin,
                                          const float (*stage)[SWR_], int cnt, float acc[NROWS][PASS_]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < VPL_; ++u) {
        const int i = 32 * u + lane, k = q * NVC_ + i;
        if (i >= NVC_) continue;
        bool same = win[0].shift % 4 == 0;
#pragma unroll
        for (int r = 0; r < NROWS; ++r) same = same && win[r].shift == win[0].shift && k < win[r].nv;
        if (same && SHARE_ROWS_) {
            q_fma_vec<NROWS, STAGED, true>(raw, u, rows, k * VCOLS_ - win[0].shift, cols, stage,
                                           i * VCOLS_ - win[0].shift + margin, cnt, acc);
            continue;
        }
#pragma unroll
        for (int r = 0; r < NROWS; ++r) {
            if (k >= win[r].nv) continue;
            q_fma_row<NROWS, STAGED>(raw, u, r, rows, k * VCOLS_ - win[r].shift, cols, stage,
                                     i * VCOLS_ - win[r].shift + margin, cnt, acc);
        }
    }
}

// The scales of row `row` of a matrix with `cols` columns: staged (s_sh, z_sh: its groups in shared memory) or, with
// s_sh null, in the global scale and zero-point blocks.
__device__ __forceinline__ QRow q_row(const st* scales, const signed char* zeros, size_t row, int cols,
                                      const float* s_sh, const signed char* z_sh) {
    const size_t g = (size_t)QGROUPS_(cols);
    if (s_sh) return QRow{s_sh, COLI_ZERO_POINTS ? z_sh : nullptr};
    return QRow{scales + row * g, COLI_ZERO_POINTS ? zeros + row * g : nullptr};
}
#endif

// The window of row `row` of a weight matrix (float elements or codes) with `cols` columns.
__device__ __forceinline__ Window row_window(const ws_t* matrix, size_t row, int cols) {
    return window(reinterpret_cast<const unsigned char*>(matrix) + row * (size_t)QROW_BYTES_(cols), cols);
}

extern "C" __global__ void __launch_bounds__(THREADS_, QMINB_)
colibri_gate_up_gemv(const float* __restrict__ x, const ws_t* __restrict__ gate, const ws_t* __restrict__ up,
                     const int* __restrict__ valid_tokens, const PairOrder* __restrict__ pair_order,
                     float* __restrict__ act
#if COLI_QUANT  // the scale and zero-point blocks (zero points: null without them), after the float arguments
                     , const st* __restrict__ gate_scales, const st* __restrict__ up_scales,
                     const signed char* __restrict__ gate_zeros, const signed char* __restrict__ up_zeros
#endif
                     GATE_UP_BIAS_PARAMS) {
    pdl_entry();
    GATE_UP_BIAS_NONE
    __shared__ PairOrder order;
    __shared__ __align__(16) float stage[PASS_][SWR_];
    __shared__ int tokens[PASS_];
    __shared__ float part[2][T_][WARPS_];  // gate and up dot products of the expert's pairs, summed over chunks
    (void)valid_tokens;  // not read: the pair order holds the valid pairs (the argument keeps the plan's places)
    const int slot = blockIdx.y;
    load_pair_order<THREADS_>(pair_order, order);
    if (slot >= order.nused) return;  // uniform
    const int e = order.used[slot], count = order.counts[e], first = order.offsets[e];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, n = blockIdx.x * WARPS_ + warp;
    const bool has_row = n < I_;  // warps past the last row still take part in the barriers
    const size_t row = (size_t)e * I_ + (has_row ? n : 0);
    const Window win[2] = {row_window(gate, row, H_), row_window(up, row, H_)};
#if COLI_QUANT
    constexpr bool staged = QS_GU_;
    __shared__ float qs[2][QS_GU_N_];
    __shared__ signed char qz[2][COLI_ZERO_POINTS ? QS_GU_N_ : 1];
    constexpr int G = QGROUPS_(H_);
    if (staged) {  // compile-time; visible after the first barrier of the chunk loop below
        const int r0 = blockIdx.x * WARPS_, nrows = I_ - r0 < WARPS_ ? I_ - r0 : WARPS_;
        stage_scales(gate_scales, gate_zeros, (size_t)e * I_ + r0, nrows, G, qs[0], qz[0]);
        stage_scales(up_scales, up_zeros, (size_t)e * I_ + r0, nrows, G, qs[1], qz[1]);
    }
    // The rows' scale pointers are rebuilt where they are used, not held across the loops (registers).
#define GU_ROWS_                                                                                                      \
    const QRow rows[2] = {q_row(gate_scales, gate_zeros, row, H_, staged ? qs[0] + warp * G : nullptr,              \
                                qz[0] + (COLI_ZERO_POINTS ? warp * G : 0)),                                          \
                          q_row(up_scales, up_zeros, row, H_, staged ? qs[1] + warp * G : nullptr,                  \
                                qz[1] + (COLI_ZERO_POINTS ? warp * G : 0))};
#else
    constexpr bool staged = false;
#define GU_ROWS_ const QRow* rows = nullptr;
#endif

    // Chunk-major: each chunk of the two rows is loaded once into registers and used by every pass of the expert's
    // pairs, so an expert's weights (codes and scales included) are streamed once however many pairs it has.
    uint4 next[2][VPL_];
    first_chunk<2>(win, has_row, next);
    for (int q = 0; q < NCHUNKS_(H_); ++q) {
        uint4 raw[2][VPL_];
        next_chunk<2>(win, has_row, q, NCHUNKS_(H_), raw, next);
        for (int g0 = 0; g0 < count; g0 += PASS_) {
            const int cnt = count - g0 < PASS_ ? count - g0 : PASS_;
            __syncthreads();  // stage and tokens[] of the previous pass fully used
            if ((int)threadIdx.x < cnt) tokens[threadIdx.x] = order.sorted[first + g0 + threadIdx.x] / K_;
            __syncthreads();
            stage_rows<MARGIN_(H_)>(x, H_, tokens, cnt, q, stage);
            __syncthreads();
            if (has_row) {  // uniform per warp
                float acc[2][PASS_];
#pragma unroll
                for (int j = 0; j < PASS_; ++j) acc[0][j] = acc[1][j] = 0.0f;
                GU_ROWS_
                chunk_dot<2, staged>(win, rows, raw, q, H_, MARGIN_(H_), stage, cnt, acc);
#pragma unroll
                for (int j = 0; j < PASS_; ++j) {
                    if (j < cnt) {
                        const float g = warp_sum(acc[0][j]), u = warp_sum(acc[1][j]);
                        if (lane == 0) {  // the warp's own entries: no barrier needed
                            part[0][g0 + j][warp] = q == 0 ? g : part[0][g0 + j][warp] + g;
                            part[1][g0 + j][warp] = q == 0 ? u : part[1][g0 + j][warp] + u;
                        }
                    }
                }
            }
        }
    }
    if (has_row && lane == 0)
        for (int j = 0; j < count; ++j)
            act[(size_t)order.sorted[first + j] * I_ + n] =
                gate_up_epilogue(part[0][j][warp], part[1][j][warp], gate_bias, up_bias, e, n);
#undef GU_ROWS_
}

extern "C" __global__ void __launch_bounds__(THREADS_, DMINB_)
colibri_down_gemv(const float* __restrict__ x, const float* __restrict__ act, const ws_t* __restrict__ down,
                  const PairOrder* __restrict__ pair_order, const float* __restrict__ topk_weights,
                  float* __restrict__ x_next
#if COLI_QUANT
                  , const st* __restrict__ down_scales, const signed char* __restrict__ down_zeros
#endif
                     DOWN_BIAS_PARAMS) {
    pdl_entry();
    DOWN_BIAS_NONE
    __shared__ PairOrder order;
    __shared__ __align__(16) float stage[PASS_][SWR_];
    __shared__ int pairs[PASS_];
    __shared__ float wts[PASS_];  // their routing weights
    __shared__ float y[T_][TILE_];
    const int n0 = blockIdx.x * TILE_;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < T_ * TILE_; i += THREADS_) y[i / TILE_][i % TILE_] = 0.0f;
    load_pair_order<THREADS_>(pair_order, order);  // its barrier also orders the zero fill above before the updates

    const int n_first = n0 + warp * DOWN_ROWS_;  // the warp's rows: n_first .. n_first + DOWN_ROWS_ - 1
    const bool any_row = n_first < H_;
    const int yj = lane / DOWN_ROWS_, yr = lane % DOWN_ROWS_;  // lane's (pair, row) of a one-pass expert
    static_assert(PASS_ * DOWN_ROWS_ <= 32, "a one-pass expert's y values: one lane each");

#if COLI_QUANT
    constexpr bool staged = QS_DOWN_;
    constexpr int G = QGROUPS_(I_);
    __shared__ float qs[QS_DOWN_N_];
    __shared__ signed char qz[COLI_ZERO_POINTS ? QS_DOWN_N_ : 1];
#else
    constexpr bool staged = false;
#endif
    for (int s = 0; s < order.nused; ++s) {
        const int e = order.used[s], count = order.counts[e], first = order.offsets[e];
        Window win[DOWN_ROWS_];
#if COLI_QUANT
        if (staged) {  // compile-time; visible after the first barrier of the chunk loop below
            __syncthreads();  // the previous expert's scales fully used
            const int nrows = H_ - n0 < TILE_ ? H_ - n0 : TILE_;
            stage_scales(down_scales, down_zeros, (size_t)e * H_ + n0, nrows, G, qs, qz);
        }
#endif
#pragma unroll
        for (int r = 0; r < DOWN_ROWS_; ++r)
            win[r] = row_window(down, (size_t)e * H_ + (n_first + r < H_ ? n_first + r : n_first), I_);
        // Chunk-major as in colibri_gate_up_gemv: each chunk of the warp's rows is loaded once for all passes; the
        // chunk's products are added into y per pair (experts in increasing index, chunks in order: a fixed order).
        // An expert with at most PASS_ pairs (one pass per chunk: every expert at a few tokens) keeps its running y
        // values in lanes instead: lane L = j * DOWN_ROWS_ + r holds y of pair j, row r (read with the first chunk,
        // the chunks' terms added in the same order, written after the last), so the chunk loop has no one-lane
        // shared-memory update (active lanes 1/32 per chunk before); more pairs update y per chunk as above.
        const bool one_pass = count <= PASS_;  // uniform
        float yv = 0.0f, yw = 0.0f;            // lane L's running y and routing weight
        uint4 next[DOWN_ROWS_][VPL_];
        first_chunk<DOWN_ROWS_>(win, any_row, next);
        for (int q = 0; q < NCHUNKS_(I_); ++q) {
            uint4 raw[DOWN_ROWS_][VPL_];
            next_chunk<DOWN_ROWS_>(win, any_row, q, NCHUNKS_(I_), raw, next);
            for (int g0 = 0; g0 < count; g0 += PASS_) {
                const int cnt = count - g0 < PASS_ ? count - g0 : PASS_;
                __syncthreads();  // stage and pairs[] of the previous pass fully used
                if ((int)threadIdx.x < cnt) {
                    const int p = order.sorted[first + g0 + threadIdx.x];
                    pairs[threadIdx.x] = p;
                    wts[threadIdx.x] = __ldg(topk_weights + p);
                }
                __syncthreads();
                stage_rows<MARGIN_(I_)>(act, I_, pairs, cnt, q, stage);
                __syncthreads();
                if (any_row) {  // uniform per warp
                    float acc[DOWN_ROWS_][PASS_];
#pragma unroll
                    for (int r = 0; r < DOWN_ROWS_; ++r)
#pragma unroll
                        for (int j = 0; j < PASS_; ++j) acc[r][j] = 0.0f;
#if COLI_QUANT  // the rows' scale pointers are rebuilt where they are used, not held across the loops (registers)
                    QRow rows[DOWN_ROWS_];
#pragma unroll
                    for (int r = 0; r < DOWN_ROWS_; ++r) {
                        const int n = n_first + r < H_ ? n_first + r : n_first, local = n - n0;
                        rows[r] = q_row(down_scales, down_zeros, (size_t)e * H_ + n, I_,
                                        staged ? qs + local * G : nullptr, qz + (COLI_ZERO_POINTS ? local * G : 0));
                    }
#else
                    const QRow* rows = nullptr;
#endif
                    chunk_dot<DOWN_ROWS_, staged>(win, rows, raw, q, I_, MARGIN_(I_), stage, cnt, acc);
                    float mine = 0.0f;  // the sum of lane L's (pair, row)
#pragma unroll
                    for (int j = 0; j < PASS_; ++j) {
                        if (j < cnt) {
#pragma unroll
                            for (int r = 0; r < DOWN_ROWS_; ++r) {
                                const float v = warp_sum(acc[r][j]);
                                if (lane == j * DOWN_ROWS_ + r) mine = v;
                            }
                        }
                    }
                    // More passes: lane L adds its (pair, row) term into y, every lane a different element (the
                    // pairs of one expert are distinct tokens), each element's terms in the same order as before
                    // (experts, chunks); the down bias once per pair (with the first chunk): w * (v_0 + b) + w * v_1.
                    // Was lane 0 alone, pair by pair (active lanes 1/32).
                    if (!one_pass && lane < cnt * DOWN_ROWS_ && n_first + yr < H_)
                        y[pairs[yj] / K_][warp * DOWN_ROWS_ + yr] +=
                            q == 0 ? down_epilogue(mine, wts[yj], down_bias, e, n_first + yr) : wts[yj] * mine;
                    if (one_pass && lane < cnt * DOWN_ROWS_ && n_first + yr < H_) {  // the same sums, in lanes
                        if (q == 0) {
                            yw = wts[yj];
                            yv = y[pairs[yj] / K_][warp * DOWN_ROWS_ + yr];
                        }
                        yv += q == 0 ? down_epilogue(mine, yw, down_bias, e, n_first + yr) : yw * mine;
                        if (q == NCHUNKS_(I_) - 1) y[pairs[yj] / K_][warp * DOWN_ROWS_ + yr] = yv;
                    }
                }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < T_ * TILE_; i += THREADS_) {
        const int t = i / TILE_, n = n0 + i % TILE_;
        if (n < H_) {
            const size_t at = (size_t)t * H_ + n;
            x_next[at] = (COLI_RESIDUAL ? __ldg(x + at) : 0.0f) + y[t][i % TILE_];
        }
    }
}

// ---- shared experts (COLI_SHARED_EXPERTS S >= 1, each COLI_SHARED_INTER = Is wide) --------------------------------
// Run for every valid token after the layer's routed output is complete (docs/kernels.md "Shared experts"), with
// the GEMV loads above; the shared blocks of the layer (docs/format.md v2 "Blocks") hold S experts one after the
// other, so gate and up are one (S*Is, hidden) matrix and down S matrices (hidden, Is).
//
// colibri_shared_gate_up — grid (ceil(S*Is / WARPS)), block (COLI_SMALL_BATCH_THREADS). Row r = s*Is + i per warp:
//       shared_act[s, t, i] = silu(shared_gate[r, :] . x[t, :]) * (shared_up[r, :] . x[t, :])   every valid t
//   the valid tokens taken PASS_ at a time (each weight row is streamed once per PASS_ valid tokens); rows of padded
//   tokens are written 0. shared_act: (S, tokens, Is) float32.
// colibri_shared_down — grid (ceil(hidden / (ROWS*WARPS))), same block and rows per warp as colibri_down_gemv:
//       x_next[t, n] += scale_t * (sum_{s=0..S-1} shared_down[s, n, :] . shared_act[s, t, :])    every valid t
//   scale_t = shared_scale[t] (sigmoid(x . shared_expert_gate), written by colibri_routing; COLI_SHARED_GATE) or 1;
//   the sum over s in increasing order, one writer per element: bitwise deterministic. Padded tokens are skipped
//   (their output rows stay the input row or zeros).
// Quantized shared experts read their scales (and zero points) from global memory (no staging).
#if COLI_SHARED_EXPERTS
#define SN_ COLI_SHARED_EXPERTS
#define SI_ COLI_SHARED_INTER
#define SROWS_ (SN_ * SI_)

// The valid tokens in increasing order into list[0 .. *n); every thread calls it (it has a barrier).
__device__ __forceinline__ void valid_token_list(const int* __restrict__ valid_tokens, int* list, int* n) {
    if (threadIdx.x == 0) {
        int c = 0;
        for (int t = 0; t < T_; ++t)
            if (token_valid(valid_tokens, t)) list[c++] = t;
        *n = c;
    }
    __syncthreads();
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS_, 1)
colibri_shared_gate_up(const float* __restrict__ x, const ws_t* __restrict__ shared_gate, const ws_t* __restrict__ shared_up,
                       const int* __restrict__ valid_tokens, float* __restrict__ shared_act
#if COLI_QUANT
                       , const st* __restrict__ shared_gate_scales, const st* __restrict__ shared_up_scales,
                       const signed char* __restrict__ shared_gate_zeros, const signed char* __restrict__ shared_up_zeros
#endif
) {
    pdl_entry();
#if COLI_SHARED_EXPERTS
    __shared__ __align__(16) float stage[PASS_][SWR_];
    __shared__ int tokens[T_];
    __shared__ int ntokens;
    valid_token_list(valid_tokens, tokens, &ntokens);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, r = blockIdx.x * WARPS_ + warp;
    const bool has_row = r < SROWS_;
    const int s = (has_row ? r : 0) / SI_, i = (has_row ? r : 0) % SI_;
    if (has_row) {
        for (int t = lane; t < T_; t += 32)
            if (!token_valid(valid_tokens, t)) shared_act[((size_t)s * T_ + t) * SI_ + i] = 0.0f;
    }
    const size_t row = (size_t)(has_row ? r : 0);
    const Window win[2] = {row_window(shared_gate, row, H_), row_window(shared_up, row, H_)};
#if COLI_QUANT
    const QRow rows[2] = {q_row(shared_gate_scales, shared_gate_zeros, row, H_, nullptr, nullptr),
                          q_row(shared_up_scales, shared_up_zeros, row, H_, nullptr, nullptr)};
#else
    const QRow* rows = nullptr;
#endif
    for (int g0 = 0; g0 < ntokens; g0 += PASS_) {  // pass-major: the rows streamed once per PASS_ valid tokens
        const int cnt = ntokens - g0 < PASS_ ? ntokens - g0 : PASS_;
        float acc[2][PASS_];
#pragma unroll
        for (int j = 0; j < PASS_; ++j) acc[0][j] = acc[1][j] = 0.0f;
        uint4 next[2][VPL_];
        first_chunk<2>(win, has_row, next);
        for (int q = 0; q < NCHUNKS_(H_); ++q) {
            uint4 raw[2][VPL_];
            next_chunk<2>(win, has_row, q, NCHUNKS_(H_), raw, next);
            __syncthreads();  // the previous chunk fully used
            stage_rows<MARGIN_(H_)>(x, H_, tokens + g0, cnt, q, stage);
            __syncthreads();
            if (has_row) chunk_dot<2, false>(win, rows, raw, q, H_, MARGIN_(H_), stage, cnt, acc);
        }
        if (has_row) {  // uniform per warp
#pragma unroll
            for (int j = 0; j < PASS_; ++j) {
                if (j < cnt) {
                    const float g = warp_sum(acc[0][j]), u = warp_sum(acc[1][j]);  // plain SwiGLU, no biases
                    if (lane == 0) shared_act[((size_t)s * T_ + tokens[g0 + j]) * SI_ + i] = silu(g) * u;
                }
            }
        }
    }
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS_, 1)
colibri_shared_down(const float* __restrict__ shared_act, const ws_t* __restrict__ shared_down,
                    const int* __restrict__ valid_tokens, const float* __restrict__ shared_scale,
                    float* __restrict__ x_next
#if COLI_QUANT
                    , const st* __restrict__ shared_down_scales, const signed char* __restrict__ shared_down_zeros
#endif
) {
    pdl_entry();
#if COLI_SHARED_EXPERTS
    __shared__ __align__(16) float stage[PASS_][SWR_];
    __shared__ int tokens[T_];
    __shared__ int ntokens;
    valid_token_list(valid_tokens, tokens, &ntokens);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int n_first = blockIdx.x * TILE_ + warp * DOWN_ROWS_;  // the warp's rows: n_first .. + DOWN_ROWS_ - 1
    const bool any_row = n_first < H_;
    for (int g0 = 0; g0 < ntokens; g0 += PASS_) {
        const int cnt = ntokens - g0 < PASS_ ? ntokens - g0 : PASS_;
        float total[DOWN_ROWS_][PASS_];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS_; ++r)
#pragma unroll
            for (int j = 0; j < PASS_; ++j) total[r][j] = 0.0f;
        for (int s = 0; s < SN_; ++s) {
            float acc[DOWN_ROWS_][PASS_];
#pragma unroll
            for (int r = 0; r < DOWN_ROWS_; ++r)
#pragma unroll
                for (int j = 0; j < PASS_; ++j) acc[r][j] = 0.0f;
            Window win[DOWN_ROWS_];
#if COLI_QUANT
            QRow rows[DOWN_ROWS_];
#else
            const QRow* rows = nullptr;
#endif
#pragma unroll
            for (int r = 0; r < DOWN_ROWS_; ++r) {
                const size_t row = (size_t)s * H_ + (n_first + r < H_ ? n_first + r : n_first);
                win[r] = row_window(shared_down, row, SI_);
#if COLI_QUANT
                rows[r] = q_row(shared_down_scales, shared_down_zeros, row, SI_, nullptr, nullptr);
#endif
            }
            uint4 next[DOWN_ROWS_][VPL_];
            first_chunk<DOWN_ROWS_>(win, any_row, next);
            for (int q = 0; q < NCHUNKS_(SI_); ++q) {
                uint4 raw[DOWN_ROWS_][VPL_];
                next_chunk<DOWN_ROWS_>(win, any_row, q, NCHUNKS_(SI_), raw, next);
                __syncthreads();
                stage_rows<MARGIN_(SI_)>(shared_act + (size_t)s * T_ * SI_, SI_, tokens + g0, cnt, q, stage);
                __syncthreads();
                if (any_row) chunk_dot<DOWN_ROWS_, false>(win, rows, raw, q, SI_, MARGIN_(SI_), stage, cnt, acc);
            }
            if (any_row) {  // every lane ends with the same sums
#pragma unroll
                for (int r = 0; r < DOWN_ROWS_; ++r)
#pragma unroll
                    for (int j = 0; j < PASS_; ++j)
                        if (j < cnt) total[r][j] += warp_sum(acc[r][j]);
            }
        }
        if (any_row && lane == 0) {
#pragma unroll
            for (int j = 0; j < PASS_; ++j) {
                if (j < cnt) {
                    const int t = tokens[g0 + j];
                    const float scale = COLI_SHARED_GATE ? __ldg(shared_scale + t) : 1.0f;
#pragma unroll
                    for (int r = 0; r < DOWN_ROWS_; ++r) {
                        if (n_first + r < H_) {
                            const size_t at = (size_t)t * H_ + n_first + r;
                            x_next[at] = x_next[at] + scale * total[r][j];
                        }
                    }
                }
            }
        }
    }
#endif
}
