// common.cuh: definitions shared by every colibri kernel source.
//
// Compile-time constants (sdk/catalog.py `compile_defines`, passed as -D by the build):
//   COLI_HIDDEN, COLI_INTER        hidden and intermediate size (any value >= 1; tails are handled)
//   COLI_EXPERTS, COLI_TOPK        experts per layer (<= 256) and experts per token (<= COLI_MAX_TOP_K, <= experts)
//   COLI_MAX_TOP_K                 the SDK's top-k limit (sdk/catalog.py MAX_TOP_K; the code below allows <= 32)
//   COLI_MAX_TOKENS                batch * tokens of the fixed shape (padded tokens included)
//   COLI_BATCH, COLI_SEQ_TOKENS    the fixed batch and tokens per sequence (COLI_MAX_TOKENS = their product)
//   COLI_GEMV                      1: the launch plan takes the GEMV path (small_batch.cu), 0: the tiled path
//   COLI_TC                        1: the tiled path runs on tensor cores (colibri_gate_up_tc, colibri_down_tc)
//   COLI_FP16                      1: weights stored as IEEE fp16, 0: fp32. Activations and accumulation: fp32
//   COLI_ATOMIC_AGG                1: the down kernels atomicAdd into the layer output (order not fixed)
//                                  0: per-(token, slot) rows summed in slot order, folded into the tiled down
//                                  kernels (fold_aggregate below) or colibri_down_gemv
//   COLI_ROUTING                   0: softmax over the k selected logits, 1: softmax over all, then select
//   COLI_RESIDUAL                  1: layer output = input + MoE(input), 0: layer output = MoE(input)
//   COLI_QUANT                     storage of the expert matrices: 0 float (COLI_FP16), 1 int8, 2 int4 (read by
//                                  small_batch.cu and expert_quant_tc.cu; the router is then float32: COLI_FP16 0).
//                                  Default 0
//   COLI_SCALE_FP16                quantized weights: 1 fp16 scales, 0 fp32. Default 0
//   COLI_GROUP_SIZE                columns per scale group along the reduction dimension (0 = one per row). Default 0
//   COLI_ZERO_POINTS               1: one int8 zero point per group. Default 0
//   v2 model features (docs/kernels.md "Model features"; every one defaults to "none"):
//   COLI_ROUTER_F32                1: the router (and every bias) is float32 whatever COLI_FP16 (a v2 file). Default 0
//   COLI_ROUTING                   2: sigmoid scores (v2 sigmoid_topk), the k selected scores as weights
//   COLI_NORM_TOPK                 1: renormalise the k weights, w / (sum + 1e-20) (routing 1, 2). Default 0
//   COLI_N_GROUP, COLI_TOPK_GROUP  group-limited selection: the experts form N_GROUP groups of consecutive experts,
//                                  only the TOPK_GROUP best groups are eligible. Default 1, 1 (no limit)
//   COLI_GROUP_SCORE               a group's score: 1 its largest selection score, 2 the sum of its two largest
//   COLI_ROUTER_BIAS               1: a float32 (experts,) bias added to the logits. Default 0
//   COLI_CORRECTION_BIAS           1: a float32 (experts,) bias added to the sigmoid scores for selection only
//   COLI_ROUTED_SCALING_BITS       the float32 bits of routed_scaling_factor (multiplies the weights). Default 1.0
//   COLI_EXPERT_BIAS               1: float32 biases on the routed experts' gate, up (experts, I) and down (experts, H)
//   COLI_ACTIVATION                0 SwiGLU, 1 the clamped SwiGLU of gpt-oss with COLI_SWIGLU_LIMIT_BITS and
//                                  COLI_SWIGLU_ALPHA_BITS (float32 bits). Default 0
//   COLI_SHARED_EXPERTS            shared experts per layer (0: none), each COLI_SHARED_INTER wide, run for every
//                                  valid token (small_batch.cu colibri_shared_*). Default 0
//   COLI_SHARED_GATE               1: the shared experts' sum is scaled by sigmoid(x . shared_expert_gate). Default 0
//   COLI_<KERNEL>_<PARAM>          the profile's kernels.<kernel>.<param>
// No CUDA header is included: fp16 is converted with one PTX instruction, so NVRTC needs no include path.
#pragma once

#if !defined(COLI_HIDDEN) || !defined(COLI_INTER) || !defined(COLI_EXPERTS) || !defined(COLI_TOPK) || \
    !defined(COLI_MAX_TOKENS) || !defined(COLI_FP16) || !defined(COLI_ATOMIC_AGG) || !defined(COLI_ROUTING) || \
    !defined(COLI_RESIDUAL) || !defined(COLI_ROUTING_BLOCK_M) || !defined(COLI_MAX_TOP_K) || !defined(COLI_BATCH) || \
    !defined(COLI_SEQ_TOKENS) || !defined(COLI_GEMV) || !defined(COLI_TC)
#error "colibri kernels need the -D constants of sdk/catalog.py compile_defines"
#endif

#ifndef COLI_QUANT
#define COLI_QUANT 0
#endif
#ifndef COLI_SCALE_FP16
#define COLI_SCALE_FP16 0
#endif
#ifndef COLI_GROUP_SIZE
#define COLI_GROUP_SIZE 0
#endif
#ifndef COLI_ZERO_POINTS
#define COLI_ZERO_POINTS 0
#endif

#ifndef COLI_ROUTER_F32
#define COLI_ROUTER_F32 0
#endif
#ifndef COLI_NORM_TOPK
#define COLI_NORM_TOPK 0
#endif
#ifndef COLI_N_GROUP
#define COLI_N_GROUP 1
#endif
#ifndef COLI_TOPK_GROUP
#define COLI_TOPK_GROUP 1
#endif
#ifndef COLI_GROUP_SCORE
#define COLI_GROUP_SCORE 0
#endif
#ifndef COLI_ROUTER_BIAS
#define COLI_ROUTER_BIAS 0
#endif
#ifndef COLI_CORRECTION_BIAS
#define COLI_CORRECTION_BIAS 0
#endif
#ifndef COLI_ROUTED_SCALING_BITS
#define COLI_ROUTED_SCALING_BITS 0x3f800000u  // 1.0f
#endif
#ifndef COLI_EXPERT_BIAS
#define COLI_EXPERT_BIAS 0
#endif
#ifndef COLI_ACTIVATION
#define COLI_ACTIVATION 0
#endif
#ifndef COLI_SWIGLU_LIMIT_BITS
#define COLI_SWIGLU_LIMIT_BITS 0u
#endif
#ifndef COLI_SWIGLU_ALPHA_BITS
#define COLI_SWIGLU_ALPHA_BITS 0u
#endif
#ifndef COLI_SHARED_EXPERTS
#define COLI_SHARED_EXPERTS 0
#endif
#ifndef COLI_SHARED_INTER
#define COLI_SHARED_INTER 0
#endif
#ifndef COLI_SHARED_GATE
#define COLI_SHARED_GATE 0
#endif
static_assert(COLI_ROUTING >= 0 && COLI_ROUTING <= 2, "COLI_ROUTING: 0 topk_softmax, 1 softmax_topk, 2 sigmoid_topk");
static_assert(COLI_N_GROUP >= 1 && COLI_EXPERTS % COLI_N_GROUP == 0, "COLI_N_GROUP must divide COLI_EXPERTS");
static_assert(COLI_TOPK_GROUP >= 1 && COLI_TOPK_GROUP <= COLI_N_GROUP, "COLI_TOPK_GROUP must be in 1..COLI_N_GROUP");
static_assert(COLI_N_GROUP == 1 || COLI_GROUP_SCORE == 1 || COLI_GROUP_SCORE == 2,
              "COLI_GROUP_SCORE must be 1 (max) or 2 (top-two sum) with COLI_N_GROUP > 1");
static_assert(COLI_GROUP_SCORE != 2 || COLI_EXPERTS / COLI_N_GROUP >= 2, "top-two group score: >= 2 experts per group");
static_assert(COLI_TOPK <= COLI_TOPK_GROUP * (COLI_EXPERTS / COLI_N_GROUP), "COLI_TOPK exceeds the eligible experts");
static_assert(!COLI_CORRECTION_BIAS || COLI_ROUTING == 2, "COLI_CORRECTION_BIAS needs sigmoid routing (2)");
static_assert(COLI_ACTIVATION == 0 || COLI_ACTIVATION == 1, "COLI_ACTIVATION: 0 SwiGLU, 1 clamped SwiGLU");
static_assert((COLI_SHARED_EXPERTS == 0) == (COLI_SHARED_INTER == 0), "COLI_SHARED_EXPERTS and COLI_SHARED_INTER");
static_assert(!COLI_SHARED_GATE || COLI_SHARED_EXPERTS, "COLI_SHARED_GATE needs shared experts");

#define H_ COLI_HIDDEN
#define I_ COLI_INTER
#define E_ COLI_EXPERTS
#define K_ COLI_TOPK
#define T_ COLI_MAX_TOKENS
#define PAIRS_ (COLI_MAX_TOKENS * COLI_TOPK)
#define BM_ COLI_ROUTING_BLOCK_M
// Padded expert order (sdk/catalog.py `sizes`): rows and tiles of block_m rows, at most.
#define PADDED_ (PAIRS_ + E_ * (BM_ - 1))
#define BLOCKS_ (PADDED_ / BM_)

static_assert(H_ >= 1 && I_ >= 1, "COLI_HIDDEN and COLI_INTER must be >= 1");
static_assert(E_ >= 1 && E_ <= 256, "COLI_EXPERTS must be in 1..256");
static_assert(COLI_MAX_TOP_K >= 1 && COLI_MAX_TOP_K <= 32, "COLI_MAX_TOP_K must be in 1..32 (one lane per slot)");
static_assert(K_ >= 1 && K_ <= COLI_MAX_TOP_K && K_ <= E_, "COLI_TOPK must be in 1..COLI_MAX_TOP_K and <= COLI_EXPERTS");
static_assert(T_ >= 1, "COLI_MAX_TOKENS must be >= 1");
static_assert(COLI_BATCH * COLI_SEQ_TOKENS == T_, "COLI_MAX_TOKENS must be COLI_BATCH * COLI_SEQ_TOKENS");
static_assert((long long)PADDED_ < 0x7fffffffLL, "tokens*top_k + experts*(block_m-1) must fit in int32");
static_assert(BM_ >= 1 && (BM_ & (BM_ - 1)) == 0, "COLI_ROUTING_BLOCK_M must be a power of two");

#define FULL_MASK 0xffffffffu

// Padded tokens: the runtime's input copy writes valid_tokens[b] (int32, b < COLI_BATCH), the number of valid tokens
// of sequence b (its first ones). Token t = b * COLI_SEQ_TOKENS + i is valid when i < valid_tokens[b]. A padded
// token selects NO_EXPERT in every slot (weight 0): every kernel skips it, and its output row is its input
// (residual composition) or zeros.
#define NO_EXPERT E_
__device__ __forceinline__ bool token_valid(const int* __restrict__ valid_tokens, int t) {
    return t % COLI_SEQ_TOKENS < __ldg(valid_tokens + t / COLI_SEQ_TOKENS);
}

// Weight stream: read once per layer, so it bypasses L1 (activations staged there stay); 16 bytes per lane.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
#ifdef COLI_CPU_EMULATION
    return __ldg(p);
#else
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
#endif
}

// IEEE binary16 bits → float32 (exact).
__device__ __forceinline__ float half_to_float(unsigned short v) {
#ifdef COLI_CPU_EMULATION  // g++ through tests/kernels/emu/cuda_shim.h: no PTX
    return __half_bits_to_float(v);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#endif
}

#if COLI_QUANT
// int8/int4 expert storage (docs/format.md "Matrix storage"), shared by the GEMV and the tensor-core kernels: the
// scale group along the reduction dimension (0 = one per row), a row's code bytes and scale groups, the scale type.
#define GS_ COLI_GROUP_SIZE
#define QROW_BYTES_(cols) (COLI_QUANT == 2 ? ((cols) + 1) / 2 : (cols))
#define QGROUPS_(cols) (GS_ == 0 ? 1 : ((cols) + GS_ - 1) / GS_)
static_assert(COLI_QUANT == 1 || COLI_QUANT == 2, "COLI_QUANT: 0 float, 1 int8, 2 int4");
static_assert(GS_ == 0 || GS_ == 32 || GS_ == 64 || GS_ == 128, "COLI_GROUP_SIZE: 0 (per row), 32, 64 or 128");
static_assert(COLI_QUANT == 1 || GS_ != 0, "int4 needs a group size");
#if COLI_SCALE_FP16
typedef unsigned short st;  // scale: IEEE binary16 bits
__device__ __forceinline__ float st_to_float(st v) { return half_to_float(v); }
#else
typedef float st;
__device__ __forceinline__ float st_to_float(st v) { return v; }
#endif
#endif

#if COLI_FP16
typedef unsigned short wt;  // IEEE binary16 bits
__device__ __forceinline__ float wt_to_float(wt v) { return half_to_float(v); }
#else
typedef float wt;
__device__ __forceinline__ float wt_to_float(wt v) { return v; }
#endif

// Weight elements in one 16-byte vector.
#define VEC_ (16 / (int)sizeof(wt))

// Unpack one 16-byte vector of weights into VEC_ floats, element order as in memory (little-endian).
__device__ __forceinline__ void unpack16(uint4 raw, float out[VEC_]) {
#if COLI_FP16
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = wt_to_float((wt)(w[i] & 0xffffu));
        out[2 * i + 1] = wt_to_float((wt)(w[i] >> 16));
    }
#else
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
#endif
}

// silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); for very negative g, exp overflows to inf and the result is -0,
// the exact limit (as sdk/reference.py `silu`).
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// The bias arguments of the routed-expert kernels: the last parameters of a gate/up (gate_bias, up_bias: float32
// (experts, intermediate) of the layer) or down (down_bias: (experts, hidden)) kernel when the file has expert biases
// (COLI_EXPERT_BIAS; the launch plan appends them), else absent from the signature and null in the body:
//     kernel(..., float* act GATE_UP_BIAS_PARAMS) { GATE_UP_BIAS_NONE ... gate_up_epilogue(g, u, gate_bias, ...) }
#if COLI_EXPERT_BIAS
#define GATE_UP_BIAS_PARAMS , const float* __restrict__ gate_bias, const float* __restrict__ up_bias
#define GATE_UP_BIAS_NONE
#define DOWN_BIAS_PARAMS , const float* __restrict__ down_bias
#define DOWN_BIAS_NONE
#else
#define GATE_UP_BIAS_PARAMS
#define GATE_UP_BIAS_NONE const float* gate_bias = nullptr; const float* up_bias = nullptr;
#define DOWN_BIAS_PARAMS
#define DOWN_BIAS_NONE const float* down_bias = nullptr;
#endif

// ---- the expert epilogues (docs/format.md "Semantics v2"; every expert kernel uses these) ------------------------
// The activation of a routed expert on its gate and up projections g, u (biases included):
//   COLI_ACTIVATION 0: silu(g) * u
//   COLI_ACTIVATION 1: g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1)
//                      (gpt-oss, transformers GptOssExperts._apply_gate; NaN propagates as in the reference)
__device__ __forceinline__ float expert_activation(float g, float u) {
#if COLI_ACTIVATION == 1
    const float limit = __uint_as_float(COLI_SWIGLU_LIMIT_BITS), alpha = __uint_as_float(COLI_SWIGLU_ALPHA_BITS);
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return g * (1.0f / (1.0f + expf(-(g * alpha)))) * (u + 1.0f);
#else
    return silu(g) * u;
#endif
}

// act[p, n] of routed expert e from the raw dot products g = gate[e, n] . x, u = up[e, n] . x:
// the gate and up biases (float32 (experts, intermediate), COLI_EXPERT_BIAS; null otherwise), then the activation.
__device__ __forceinline__ float gate_up_epilogue(float g, float u, const float* __restrict__ gate_bias,
                                                  const float* __restrict__ up_bias, int e, int n) {
#if COLI_EXPERT_BIAS
    g += __ldg(gate_bias + (size_t)e * COLI_INTER + n);
    u += __ldg(up_bias + (size_t)e * COLI_INTER + n);
#endif
    return expert_activation(g, u);
}

// The contribution of routed expert e to output column n: weight * (down[e, n] . act + down_bias[e, n]) (the bias
// float32 (experts, hidden), COLI_EXPERT_BIAS; null otherwise), as the reference: w_j * y_e.
__device__ __forceinline__ float down_epilogue(float v, float weight, const float* __restrict__ down_bias, int e,
                                               int n) {
#if COLI_EXPERT_BIAS
    v += __ldg(down_bias + (size_t)e * COLI_HIDDEN + n);
#endif
    return weight * v;
}

// Sum over the 32 lanes of a warp by an xor butterfly: a fixed order, and every lane ends with the same bits
// (each step adds two values in both lanes, and float addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

// ---- tensor cores and asynchronous copies (sm_80+) -----------------------------------------------------------------
// Building blocks of a tensor-core expert path; the CPU emulation implements them in plain C++ (cuda_shim.h).
//
// mma_m16n8k16: D = A·B + C for one warp (all 32 lanes), A 16x16 and B 16x8 fp16, C and D 16x8 fp32
// (PTX `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`). Fragments, as in the PTX ISA ("Matrix fragments for
// mma.m16n8k16 with floating point type"), lane = 4*g + c (g = lane / 4, c = lane % 4); each a/b word holds two fp16,
// the lower column (A) or row (B) in the low half:
//   a[0] = A[g][2c, 2c+1]      a[1] = A[g+8][2c, 2c+1]      a[2] = A[g][2c+8, 2c+9]      a[3] = A[g+8][2c+8, 2c+9]
//   b[0] = B[2c, 2c+1][g]      b[1] = B[2c+8, 2c+9][g]
//   c, d: [0] = X[g][2c]  [1] = X[g][2c+1]  [2] = X[g+8][2c]  [3] = X[g+8][2c+1]
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
#ifdef COLI_CPU_EMULATION
    coli_emu_mma_m16n8k16(d, a, b, c);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
                   "f"(c[3]));
#endif
}

// Programmatic dependent launch (COLI_PDL 1: the profile's `programmatic_dependent_launch`, sm_90 and newer). A
// launch with the programmatic stream serialization attribute (launch plan "pdl") may be scheduled while the launch
// before it on the stream finishes, so its start-up overlaps that launch's tail instead of following its end. Every
// kernel calls pdl_entry() before it touches global memory: griddepcontrol.wait returns once the previous grid has
// completed and its writes are visible (at once for a launch without the attribute), then
// griddepcontrol.launch_dependents lets the next launch be scheduled once every block of this one has issued it
// (PTX ISA 7.8, "griddepcontrol"). Without COLI_PDL, and in the CPU emulation (one launch after another), nothing.
#ifndef COLI_PDL
#define COLI_PDL 0
#endif
__device__ __forceinline__ void pdl_entry() {
#if COLI_PDL && !defined(COLI_CPU_EMULATION)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// cp_async16: copy 16 bytes global → shared without going through registers (PTX `cp.async.cg.shared.global`, L1
// bypassed); both addresses 16-byte aligned. cp_async_commit closes a group of copies; cp_async_wait<N>() waits
// until at most N groups are pending (then a __syncthreads makes the data visible to the block).
__device__ __forceinline__ void cp_async16(void* shared_dst, const void* global_src) {
#ifdef COLI_CPU_EMULATION
    coli_emu_cp_async16(shared_dst, global_src);
#else
    unsigned dst;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(dst) : "l"(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef COLI_CPU_EMULATION
    coli_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef COLI_CPU_EMULATION
    coli_emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// ---- tensor-core tile of the tiled path (COLI_TC) ------------------------------------------------------------------
// float → fp16 bits, round to nearest even (PTX cvt.rn.f16.f32).
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
#ifdef COLI_CPU_EMULATION
    return __float_to_half_bits(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

#define TC_THREADS_ 128  // 4 warps
#define TC_BN_ 32        // output columns per block: 8 per warp (one n8 tile; the int8/int4 tiles: 16, two)
#define TC_BK_ 64        // reduction elements per shared-memory stage
#define TC_PITCH_ (TC_BK_ + 8)  // halves per shared row: 16-byte rows, rows spread over banks

// Two fp16 from shared memory as one mma operand word (the lower index in the low half).
__device__ __forceinline__ unsigned half_pair(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Stage the activations of one reduction stage for the tensor-core tiles: a_hi[r][kk] and a_lo[r][kk] = the fp16 hi
// and lo parts of src[rows[r]][k0 + kk] (hi = fp16(a), lo = fp16(a - hi); 0 past KLEN and for a row -1), for
// r < nrows and kk < TC_BK_. A thread takes two neighbouring elements: one 8-byte load (two 4-byte loads when KLEN is
// odd, rows then being only 4-byte aligned) and one 32-bit store each of the hi and lo pairs, so a warp fills one
// row with a row index broadcast and two store wavefronts (one each element: six). Every thread of the block calls it.
template <int KLEN>
__device__ __forceinline__ void tc_stage_activations(const float* __restrict__ src, const int* rows, int nrows, int k0,
                                                     unsigned short (*a_hi)[TC_PITCH_],
                                                     unsigned short (*a_lo)[TC_PITCH_]) {
    static_assert(TC_BK_ % 2 == 0, "stages of whole element pairs");
    for (int i = threadIdx.x; i < nrows * (TC_BK_ / 2); i += TC_THREADS_) {
        const int r = i / (TC_BK_ / 2), kk = 2 * (i % (TC_BK_ / 2)), k = k0 + kk, row = rows[r];
        float a0 = 0.0f, a1 = 0.0f;
        if (row >= 0) {
            const float* p = src + (size_t)row * KLEN + k;
            if (KLEN % 2 == 0) {
                if (k < KLEN) {  // then k + 1 < KLEN too
                    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
                    a0 = v.x;
                    a1 = v.y;
                }
            } else {
                if (k < KLEN) a0 = __ldg(p);
                if (k + 1 < KLEN) a1 = __ldg(p + 1);
            }
        }
        const unsigned short h0 = float_to_half_bits(a0), h1 = float_to_half_bits(a1);
        const unsigned short l0 = float_to_half_bits(a0 - half_to_float(h0));
        const unsigned short l1 = float_to_half_bits(a1 - half_to_float(h1));
        *reinterpret_cast<unsigned*>(&a_hi[r][kk]) = (unsigned)h0 | ((unsigned)h1 << 16);
        *reinterpret_cast<unsigned*>(&a_lo[r][kk]) = (unsigned)l0 | ((unsigned)l1 << 16);
    }
}

#define TC_STAGES_ 3  // weight stages in flight: cp.async groups issued TC_STAGES_ - 1 stages ahead of the mma
#define TC_MT_ 4      // 16-row tiles per pass of the fp16 tensor-core kernels: weights streamed once per 64 rows
#define TC_ROWS_ (TC_MT_ * 16)

// The shared memory of one fp16 tensor-core block (colibri_gate_up_tc: NMAT 2, colibri_down_tc: 1): the activation
// rows of a pass as fp16 hi + lo, TC_STAGES_ stages of the NMAT weight tiles, the pass's pair and source rows.
template <int NMAT>
struct TcShared {
    unsigned short a_hi[TC_ROWS_][TC_PITCH_];
    unsigned short a_lo[TC_ROWS_][TC_PITCH_];
    unsigned short ws[TC_STAGES_][NMAT][TC_BN_][TC_PITCH_];
    int pairs[TC_ROWS_];  // pair index of each row of the pass, -1: padding
    int rows[TC_ROWS_];   // its source row: pair / k (x) or the pair (act), -1: a zero row
};

// Weight rows of KLEN fp16 (row pitch KLEN * 2 bytes). KLEN % 16 == 0: every row starts on a 32-byte sector (the
// matrices do), stage kt holds row elements 64kt .. 64kt + 63, zeros past the row. Else (a "windowed" row) a row is
// read through its aligned window, as the GEMV path does (docs/kernels.md "The GEMV path"): the 16-byte vectors from
// its start rounded down to 32 bytes to its end, stage kt holding window elements 64kt .. 64kt + 63; row element k
// is window element k + shift (shift = (start mod 32) / 2, 0..15), so a row stage needs window stages kt and kt + 1,
// and the elements past the row (the next row, the allocation's tail: catalog.WEIGHTS_TAIL_BYTES) are masked when
// the B fragment is built. Each copy is one 16-byte cp.async from a 16-byte-aligned address: whole sectors per warp.
template <int KLEN>
struct TcRowLayout {
    static constexpr bool WINDOWED = KLEN % 16 != 0;
    static constexpr int STAGES = WINDOWED ? (KLEN + 15 + TC_BK_ - 1) / TC_BK_ : (KLEN + TC_BK_ - 1) / TC_BK_;
};

// Issue stage j of the weight tiles of rows n0 .. n0 + TC_BN_ - 1 into buffer ws[j % TC_STAGES_] (cp_async16; the
// aligned layout stores zeros past the matrix directly, the windowed one leaves them to the mask). Every thread of
// the block calls it; the caller commits the group.
template <int NMAT, int KLEN, int NTOT>
__device__ __forceinline__ void tc_issue_stage(const wt* const (&w)[NMAT], int n0, int j,
                                               unsigned short (*ws)[NMAT][TC_BN_][TC_PITCH_]) {
    const int buf = j % TC_STAGES_;
    for (int i = threadIdx.x; i < TC_BN_ * (TC_BK_ / 8); i += TC_THREADS_) {
        const int r = i / (TC_BK_ / 8), v = (i % (TC_BK_ / 8)) * 8, col = n0 + r;
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {
            const wt* row = w[m] + (size_t)col * KLEN;
            if (TcRowLayout<KLEN>::WINDOWED) {
                const unsigned lead = (unsigned)((size_t)row & 31u);  // bytes of the window before the row
                const wt* base = row - lead / 2;                       // 32-byte aligned
                const int e = j * TC_BK_ + v;                           // first window element of the vector
                if (col < NTOT && 2 * e < (int)lead + 2 * KLEN) cp_async16(&ws[buf][m][r][v], base + e);
            } else {
                const int k = j * TC_BK_ + v;
                if (col < NTOT && k < KLEN) {
                    cp_async16(&ws[buf][m][r][v], row + k);
                } else {
#pragma unroll
                    for (int q = 0; q < 8; ++q) ws[buf][m][r][v + q] = 0;
                }
            }
        }
    }
}

// The B fragment word of rows k, k + 1 (row elements, k even) of this lane's weight row (common.cuh
// mma_m16n8k16: low half first) for row stage kt. Aligned: one 32-bit read of buffer kt. Windowed: two 16-bit reads
// at window elements k + shift, k + 1 + shift (buffer kt or kt + 1), 0 past the row or for a row past the matrix.
template <int NMAT, int KLEN>
__device__ __forceinline__ unsigned tc_b_word(const unsigned short (*ws)[NMAT][TC_BN_][TC_PITCH_], int m, int brow,
                                              int kt, int kk, int shift, bool valid) {
    if (!TcRowLayout<KLEN>::WINDOWED) return half_pair(&ws[kt % TC_STAGES_][m][brow][kk]);
    unsigned word = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = kt * TC_BK_ + kk + h, pos = kk + h + shift;  // pos < 2 * TC_BK_
        const int buf = (kt + pos / TC_BK_) % TC_STAGES_;
        const unsigned v = valid && k < KLEN ? ws[buf][m][brow][pos % TC_BK_] : 0u;
        word |= v << (16 * h);
    }
    return word;
}

// acc[t][m] (t < ntiles) += A_t · W_m^T over the whole reduction dimension KLEN, for the rows sh.rows[16t ..] of
// src (fp32, row length KLEN; -1: a zero row), split into hi + lo fp16 (hi = fp16(a), lo = fp16(a - hi): the two
// products carry about 22 bits of a, so the result is close to fp32; |a| < 65504), and the NMAT fp16 matrices W_m
// (NTOT, KLEN) row-major, output columns n0 .. n0 + TC_BN_ - 1. The weight stages are copied with cp_async16 in a
// TC_STAGES_-stage pipeline (TcRowLayout): stage j + 2 is issued while stage j is multiplied (aligned rows: two
// stages in flight), or while row stage j reads window stages j and j + 1 (windowed rows: one in flight); one
// commit group per stage, empty past the last, so that the wait always retires exactly the stages needed. Each
// weight stage is used by all ntiles tiles (up to TC_MT_ = 4, 64 rows): the weights are streamed once per pass.
// Warp w owns output columns n0 + 8w .. n0 + 8w + 7; acc[t][m][i] is D[g + 8*(i/2)][2c + i%2] of its 16x8 tile t
// (common.cuh mma_m16n8k16). Every thread of the block calls it (it has barriers).
template <int NMAT, int KLEN, int NTOT>
__device__ __forceinline__ void tc_pass(const float* __restrict__ src, const wt* const (&w)[NMAT], int n0,
                                        int ntiles, TcShared<NMAT>& sh, float acc[TC_MT_][NMAT][4]) {
    typedef TcRowLayout<KLEN> L;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, g = lane / 4, c = lane % 4;
    const int brow = warp * 8 + g;  // B fragment: the block's weight row of this lane (output column n0 + brow)
    const bool valid = n0 + brow < NTOT;
    int shift[NMAT];
#pragma unroll
    for (int m = 0; m < NMAT; ++m) shift[m] = (int)(((size_t)(w[m] + (size_t)(n0 + brow) * KLEN) & 31u) / 2);
    constexpr int RSTAGES = (KLEN + TC_BK_ - 1) / TC_BK_;
#pragma unroll
    for (int s = 0; s < TC_STAGES_ - 1; ++s) {  // prologue: stages 0 and 1
        if (s < L::STAGES) tc_issue_stage<NMAT, KLEN, NTOT>(w, n0, s, sh.ws);
        cp_async_commit();
    }
    for (int kt = 0; kt < RSTAGES; ++kt) {
        const int k0 = kt * TC_BK_;
        __syncthreads();  // row stage kt - 1 fully used: its buffers and a_hi / a_lo may be overwritten
        if (kt + TC_STAGES_ - 1 < L::STAGES) tc_issue_stage<NMAT, KLEN, NTOT>(w, n0, kt + TC_STAGES_ - 1, sh.ws);
        cp_async_commit();
        tc_stage_activations<KLEN>(src, sh.rows, ntiles * 16, k0, sh.a_hi, sh.a_lo);
        if (L::WINDOWED) {
            cp_async_wait<TC_STAGES_ - 2>();  // this thread's copies of window stages kt and kt + 1 have landed
        } else {
            cp_async_wait<TC_STAGES_ - 1>();  // stage kt
        }
        __syncthreads();  // everyone's
#pragma unroll
        for (int kb = 0; kb < TC_BK_; kb += 16) {
            if (k0 + kb >= KLEN) break;  // uniform: the rest of the last stage is zeros
            unsigned b[NMAT][2];
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
                b[m][0] = tc_b_word<NMAT, KLEN>(sh.ws, m, brow, kt, kb + 2 * c, shift[m], valid);
                b[m][1] = tc_b_word<NMAT, KLEN>(sh.ws, m, brow, kt, kb + 2 * c + 8, shift[m], valid);
            }
#pragma unroll
            for (int t = 0; t < TC_MT_; ++t) {
                if (t < ntiles) {  // uniform
                    const int r = t * 16 + g, col = kb + 2 * c;  // A fragment (common.cuh mma_m16n8k16)
                    const unsigned hi[4] = {half_pair(&sh.a_hi[r][col]), half_pair(&sh.a_hi[r + 8][col]),
                                            half_pair(&sh.a_hi[r][col + 8]), half_pair(&sh.a_hi[r + 8][col + 8])};
                    const unsigned lo[4] = {half_pair(&sh.a_lo[r][col]), half_pair(&sh.a_lo[r + 8][col]),
                                            half_pair(&sh.a_lo[r][col + 8]), half_pair(&sh.a_lo[r + 8][col + 8])};
#pragma unroll
                    for (int m = 0; m < NMAT; ++m) {
                        mma_m16n8k16(acc[t][m], hi, b[m], acc[t][m]);
                        mma_m16n8k16(acc[t][m], lo, b[m], acc[t][m]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy outlives the pass (the trailing groups are empty)
}

// One tile of the padded expert order (routing.cu align_pairs): rows start .. start + nrows - 1 of sorted_pairs, all
// of expert e, valid rows first (-1 padding after them). Taken TC_ROWS_ rows per pass (fewer than 16: the rest of
// the 16-row tile are zero rows), skipping the 16-row tiles that hold padding only: the weights of the block's
// columns are streamed once per pass. X_ROWS: the source row of pair p is p / k (x), else p (act). Then
// `store(p, col, acc_t, i)` for each valid row and column < NTOT (acc_t = acc[t], element i as tc_pass lays it).
template <int NMAT, int KLEN, int NTOT, bool X_ROWS, class Store>
__device__ __forceinline__ void tc_tile_rows(const float* __restrict__ src, const wt* const (&w)[NMAT],
                                             const int* __restrict__ sorted_pairs, int start, int nrows, int n0,
                                             Store store) {
    __shared__ __align__(16) TcShared<NMAT> sh;
    const int lane = threadIdx.x & 31, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
    for (int r0 = 0; r0 < nrows; r0 += TC_ROWS_) {
        __syncthreads();  // pairs[] and rows[] of the previous pass fully used
        for (int i = threadIdx.x; i < TC_ROWS_; i += TC_THREADS_) {
            const int p = r0 + i < nrows ? __ldg(sorted_pairs + start + r0 + i) : -1;
            sh.pairs[i] = p;
            sh.rows[i] = p < 0 ? -1 : X_ROWS ? p / K_ : p;
        }
        __syncthreads();
        int ntiles = 0;  // 16-row tiles with a valid row: valid rows come first, so those whose first row is valid
#pragma unroll
        for (int t = 0; t < TC_MT_; ++t) ntiles += sh.pairs[t * 16] >= 0 ? 1 : 0;
        if (ntiles == 0) break;  // uniform: the rest of the tile is padding
        float acc[TC_MT_][NMAT][4];
#pragma unroll
        for (int t = 0; t < TC_MT_; ++t)
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[t][m][i] = 0.0f;
        tc_pass<NMAT, KLEN, NTOT>(src, w, n0, ntiles, sh, acc);
#pragma unroll
        for (int t = 0; t < TC_MT_; ++t) {
            if (t < ntiles) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = t * 16 + g + 8 * (i / 2), col = n0 + warp * 8 + 2 * c + i % 2, p = sh.pairs[row];
                    if (p >= 0 && col < NTOT) store(p, col, acc[t], i);
                }
            }
        }
    }
}

// ---- scale and zero-point runs through aligned windows (small_batch.cu GEMV, expert_quant_tc.cu tiles) ------------
// Entries [0, n) of a run of T (fp16 / fp32 scales, int8 zero points) starting anywhere: put(i, words, m) receives
// entry i as entry m of the 16-byte vector `words`. The run is read with 16-byte loads through its aligned window
// (from its start rounded down to 32 bytes to its end rounded up to 16: at most 31 bytes before it, inside the
// weights buffer, and 15 after it, inside catalog.WEIGHTS_TAIL_BYTES), 32 consecutive vectors per warp instruction;
// lanes past the window load its last vector again (as small_batch.cu load_chunk). Every thread of a block of
// NTHREADS calls it.
template <int NTHREADS, typename T, typename Put>
__device__ __forceinline__ void stage_run(const T* __restrict__ src, int n, Put put) {
    constexpr int per = 16 / (int)sizeof(T);
    const unsigned long long a = reinterpret_cast<unsigned long long>(src);
    const uint4* base = reinterpret_cast<const uint4*>(a & ~31ull);
    const int lead = (int)(a & 31ull) / (int)sizeof(T);  // entries of the window before the run
    const int nvec = (lead + n + per - 1) / per, lane = threadIdx.x & 31;
    for (int v0 = (int)threadIdx.x - lane; v0 < nvec; v0 += NTHREADS) {  // uniform per warp
        // No branch around the load: its entries i of a lane past the window are >= n, so nothing is put.
        const uint4 raw = __ldg(base + (v0 + lane < nvec ? v0 + lane : nvec - 1));
        const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int m = 0; m < per; ++m) {
            const int i = (v0 + lane) * per + m - lead;
            if (i >= 0 && i < n) put(i, w, m);
        }
    }
}

// ---- integer codes → fp16 mma operands (kernels/expert_quant_tc.cu) -----------------------------------------------
// Marlin's "magic number" dequantization (IST-DASLab/marlin, vLLM csrc/moe/marlin_moe): the fp16 with bits 0x6400 | u
// is 1024 + u exactly for u in 0..1023, so ORing an unsigned code into the mantissa converts it without a cvt, and
// one sub.f16x2 of 1024 + offset (+ zero point) leaves the signed value q - zero, exact for |q - zero| <= 1023.
// codes_pair_sub: the mma operand word {u_lo - (bias - 1024), u_hi - (bias - 1024)} (low half first) for u_lo, u_hi
// in 0..1023 and bias2 both halves the fp16 bits of an integer bias in 1024..2047 (bias_pair).
__device__ __forceinline__ unsigned bias_pair(int bias) {
    const unsigned h = float_to_half_bits((float)bias);
    return h | (h << 16);
}
__device__ __forceinline__ unsigned codes_pair_sub(unsigned u_lo, unsigned u_hi, unsigned bias2) {
    const unsigned magic = u_lo | (u_hi << 16) | 0x64006400u;
#ifdef COLI_CPU_EMULATION
    const float b = __half_bits_to_float((unsigned short)(bias2 & 0xffffu));
    const unsigned lo = __float_to_half_bits(__half_bits_to_float((unsigned short)(magic & 0xffffu)) - b);
    const unsigned hi = __float_to_half_bits(__half_bits_to_float((unsigned short)(magic >> 16)) - b);
    return lo | (hi << 16);
#else
    unsigned d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(magic), "r"(bias2));
    return d;
#endif
}

// ---- ordered aggregation folded into the tiled down kernels (COLI_ATOMIC_AGG 0, tiled path) -----------------------
// docs/kernels.md "Aggregation folded into down (tiled path)". The down kernels write pair_out[p, n0 .. n0 + ncols)
// (routing weight * down per pair) for the pairs of their rows and their column slice, then count them: a counter
// per (token, column block) in `down_counters` ((tokens, gridDim.y) int32, zero at every launch: docs/kernels.md
// "Counters"). The block whose count completes a token's kept pairs (topk_ids[t, j] != NO_EXPERT: padded tokens and
// pairs dropped by colibri_capacity are not kept) sums that token's slots over its column slice, in order:
//     s = 0; for j in 0..k-1: if kept(j): s += pair_out[t*k + j, n]          x_next[t, n] = x[t, n] + s  or  s
// (the "last block" pattern of the CUDA samples' threadFenceReduction: stores, __threadfence, atomicAdd; the last
// block reads the other blocks' rows through L2 with __ldcg after a fence) and sets the counter back to 0. The same
// float32 additions in the same order as the former separate aggregate kernel: bitwise deterministic whatever the
// block order. Tokens with no kept pair are written by the blocks with blockIdx.x == 0 (fold_unrouted_rows).
#define FOLD_ROWS_ 128  // the entries of FoldList: pairs (or tokens) examined per step, min(FOLD_ROWS_, threads)

// A list of tokens in shared memory, built by one step of the fold.
struct FoldList {
    int tokens[FOLD_ROWS_];
    int count;
};

// The number of kept (token, slot) pairs of token t: slots whose expert is not NO_EXPERT.
__device__ __forceinline__ int kept_pairs(const int* __restrict__ topk_ids, int t) {
    int kept = 0;
#pragma unroll
    for (int j = 0; j < K_; ++j) kept += __ldg(topk_ids + t * K_ + j) < E_ ? 1 : 0;
    return kept;
}

// x_next[t, n0 .. n0 + ncols) for the n tokens of the list: the sum of their kept slots' pair_out rows in slot
// order (+ x with COLI_RESIDUAL). pair_out rows of other blocks are read through L2 (__ldcg): written in this launch.
template <int THREADS>
__device__ __forceinline__ void fold_write_rows(const FoldList& list, const float* __restrict__ x,
                                                const int* __restrict__ topk_ids, const float* pair_out,
                                                float* __restrict__ x_next, int n0, int ncols) {
    const int n = list.count;
    for (int i = threadIdx.x; i < n * ncols; i += THREADS) {
        const int t = list.tokens[i / ncols], col = n0 + i % ncols;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < K_; ++j)
            if (__ldg(topk_ids + t * K_ + j) < E_) s += __ldcg(pair_out + ((size_t)t * K_ + j) * H_ + col);
        x_next[(size_t)t * H_ + col] = COLI_RESIDUAL ? __ldg(x + (size_t)t * H_ + col) + s : s;
    }
}

// Every thread of the block calls it, after writing its pair_out entries of column slice n0 .. n0 + ncols for the
// pairs rows[0 .. nrows) (global memory: the block's rows of the padded order, -1 for padding rows). Not inlined:
// inlined into colibri_down it made ptxas spill (sm_80, 32 registers); called once per block, the call costs little.
#ifdef COLI_CPU_EMULATION
#define COLI_NOINLINE __attribute__((noinline))  // g++: the CUDA keyword __noinline__ is a GCC attribute name
#else
#define COLI_NOINLINE __noinline__
#endif
template <int THREADS>
__device__ COLI_NOINLINE void fold_aggregate(const int* __restrict__ rows, int nrows, const float* __restrict__ x,
                                               const int* __restrict__ topk_ids, const float* pair_out,
                                               float* __restrict__ x_next, int* __restrict__ counters, int n0,
                                               int ncols, FoldList& list) {
    constexpr int STEP = THREADS < FOLD_ROWS_ ? THREADS : FOLD_ROWS_;
    __threadfence();  // release: this thread's pair_out stores are visible device-wide before its block counts them
    for (int r0 = 0; r0 < nrows; r0 += STEP) {
        __syncthreads();  // every thread fenced (first step); the previous step's list fully used
        if (threadIdx.x == 0) list.count = 0;
        __syncthreads();
        if ((int)threadIdx.x < STEP && r0 + (int)threadIdx.x < nrows) {
            const int p = __ldg(rows + r0 + threadIdx.x);
            if (p >= 0) {  // a block holds at most one pair of a token (one expert), so one count per token
                const int t = p / K_;
                int* counter = counters + (size_t)t * gridDim.y + blockIdx.y;
                if (atomicAdd(counter, 1) == kept_pairs(topk_ids, t) - 1) {
                    *counter = 0;  // every block of (t, column block) has counted: zero for the next launch
                    list.tokens[atomicAdd(&list.count, 1)] = t;
                }
            }
        }
        __threadfence();  // acquire, before the barrier: rows counted by other blocks are read after their counts
        __syncthreads();
        fold_write_rows<THREADS>(list, x, topk_ids, pair_out, x_next, n0, ncols);
    }
}

// Called by every thread of the blocks with blockIdx.x == 0 (one per column slice, whether or not they have rows):
// x_next[t, n0 .. n0 + ncols) of the tokens without a kept pair (padded tokens, tokens whose every pair the
// capacity dropped) = x[t] + 0 (COLI_RESIDUAL) or 0, as the sum over no slot. No other block writes these rows.
template <int THREADS>
__device__ __forceinline__ void fold_unrouted_rows(const float* __restrict__ x, const int* __restrict__ topk_ids,
                                                   float* __restrict__ x_next, int n0, int ncols, FoldList& list) {
    constexpr int STEP = THREADS < FOLD_ROWS_ ? THREADS : FOLD_ROWS_;
    for (int t0 = 0; t0 < T_; t0 += STEP) {
        __syncthreads();  // the previous step's list fully used
        if (threadIdx.x == 0) list.count = 0;
        __syncthreads();
        const int t = t0 + (int)threadIdx.x;
        if ((int)threadIdx.x < STEP && t < T_ && kept_pairs(topk_ids, t) == 0)
            list.tokens[atomicAdd(&list.count, 1)] = t;
        __syncthreads();
        const int n = list.count;
        for (int i = threadIdx.x; i < n * ncols; i += THREADS) {
            const int u = list.tokens[i / ncols], col = n0 + i % ncols;
            const float s = 0.0f;
            x_next[(size_t)u * H_ + col] = COLI_RESIDUAL ? __ldg(x + (size_t)u * H_ + col) + s : s;
        }
    }
    __syncthreads();  // the list is free for the caller's fold_aggregate
}

// ---- the output of the tiled down kernels (colibri_down, colibri_down_tc; expert_quant_tc.cu could use them too) ----
// down_store: the contribution v of pair p to output column col: pair_out[p, col] (ordered: summed by the fold) or
// atomicAdd into x_next[p / k, col] (COLI_ATOMIC_AGG).
__device__ __forceinline__ void down_store(float* __restrict__ pair_out, float* __restrict__ x_next, int p, int col,
                                           float v) {
#if COLI_ATOMIC_AGG
    atomicAdd(&x_next[(size_t)(p / K_) * H_ + col], v);
#else
    pair_out[(size_t)p * H_ + col] = v;
#endif
}

// The ordered aggregation's two steps in a tiled down kernel whose blocks (b, j) own output columns n0 .. n0 +
// min(width, H - n0) - 1 (both empty with COLI_ATOMIC_AGG). FOLD_BEGIN, before the block's early exit: the block's
// FoldList, and blocks (0, j) write the rows of the tokens without a kept pair (fold_unrouted_rows). FOLD_END, after
// the block's pair_out stores: fold_aggregate over its rows of the padded order (global memory, -1 for padding).
#if COLI_ATOMIC_AGG
#define FOLD_BEGIN(THREADS, x, topk_ids, x_next, n0, width)
#define FOLD_END(THREADS, rows, nrows, x, topk_ids, pair_out, x_next, counters, n0)
#else
#define FOLD_BEGIN(THREADS, x, topk_ids, x_next, n0, width)                              \
    __shared__ FoldList fold_list_;                                                     \
    const int fold_ncols_ = H_ - (n0) < (width) ? H_ - (n0) : (width);                  \
    if (blockIdx.x == 0) fold_unrouted_rows<THREADS>(x, topk_ids, x_next, n0, fold_ncols_, fold_list_)
#define FOLD_END(THREADS, rows, nrows, x, topk_ids, pair_out, x_next, counters, n0) \
    fold_aggregate<THREADS>(rows, nrows, x, topk_ids, pair_out, x_next, counters, n0, fold_ncols_, fold_list_)
#endif

// ---- the pair order of the GEMV path (COLI_GEMV; docs/kernels.md "Pair order (GEMV path)") ------------------------
// The valid (token, slot) pairs p = t*k + j grouped by expert, without padding rows: expert e's pairs are
// sorted[offsets[e] .. + counts[e]] in increasing p; used[0 .. nused) lists the experts with pairs in increasing
// index (-1 after them), sorted holds -1 after the last pair. Built once per layer from topk_ids (build_pair_order:
// by the last block of colibri_routing, and again by colibri_capacity when it drops pairs) into the `pair_order`
// scratch buffer, (1 + 3 * experts + tokens * k) int32 in this layout (sdk/launch_plan.py PAIR_ORDER); every GEMV
// block copies it into shared memory with one coalesced loop and one barrier (load_pair_order). Every entry is
// written on every build. (Defined for every bundle, as small_batch.cu is compiled for every bundle; built and read
// on the GEMV path only.)
struct PairOrder {
    int nused;
    int counts[E_];
    int offsets[E_];
    int used[E_];
    int sorted[PAIRS_];
};
#define PAIR_ORDER_INTS_ (1 + 3 * E_ + PAIRS_)
static_assert(sizeof(PairOrder) == 4ull * PAIR_ORDER_INTS_, "PairOrder: int32 fields, no padding");

// The builder's shared memory: ids[p] = topk_ids[p], staged by the caller.
struct PairOrderScratch {
    int ids[PAIRS_];
    int counts[E_];
    int offsets[E_];
    int nused, total;
};

// build_pair_order: out = the pair order of the experts s.ids[0 .. PAIRS_) (topk_ids, NO_EXPERT for padded and
// dropped pairs), which the block's threads have written before the call (the first barrier here orders them), by
// one whole block of THREADS threads (it has barriers; every thread calls it). Counts by shared atomics
// (order-free), an exclusive scan over the experts by warp 0 (lane l takes experts l*EPL .. l*EPL + EPL - 1), then
// the thread of each expert walks all pairs in increasing order and writes its own (pairs * ceil(experts / THREADS)
// shared reads per thread, broadcasts): a deterministic order.
template <int THREADS>
__device__ __forceinline__ void build_pair_order(PairOrder* __restrict__ out, PairOrderScratch& s) {
    constexpr int EPL = (E_ + 31) / 32;
    const int tid = threadIdx.x;
    for (int e = tid; e < E_; e += THREADS) s.counts[e] = 0;
    __syncthreads();
    for (int p = tid; p < PAIRS_; p += THREADS) {
        const int e = s.ids[p];
        if (e < E_) atomicAdd(&s.counts[e], 1);  // a count: order-free; NO_EXPERT pairs are skipped
    }
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        int sum = 0, nz = 0;
        for (int i = 0; i < EPL; ++i) {
            const int e = lane * EPL + i;
            if (e < E_) {
                sum += s.counts[e];
                nz += s.counts[e] > 0;
            }
        }
        int incl_sum = sum, incl_nz = nz;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int a = __shfl_up_sync(FULL_MASK, incl_sum, offset);
            const int b = __shfl_up_sync(FULL_MASK, incl_nz, offset);
            if (lane >= offset) {
                incl_sum += a;
                incl_nz += b;
            }
        }
        int run = incl_sum - sum, slot = incl_nz - nz;
        for (int i = 0; i < EPL; ++i) {
            const int e = lane * EPL + i;
            if (e < E_) {
                s.offsets[e] = run;
                out->counts[e] = s.counts[e];
                out->offsets[e] = run;
                run += s.counts[e];
                if (s.counts[e] > 0) out->used[slot++] = e;
            }
        }
        if (lane == 31) {
            s.nused = incl_nz;
            s.total = incl_sum;
            out->nused = incl_nz;
        }
    }
    __syncthreads();
    for (int i = tid; i < E_; i += THREADS)
        if (i >= s.nused) out->used[i] = -1;
    // The thread of expert e walks all pairs in increasing order (every lane reads the same entry: a broadcast).
    for (int e = tid; e < E_; e += THREADS) {
        int row = s.offsets[e];
#pragma unroll 1
        for (int p = 0; p < PAIRS_; ++p)
            if (s.ids[p] == e) out->sorted[row++] = p;
    }
    for (int p = s.total + tid; p < PAIRS_; p += THREADS) out->sorted[p] = -1;  // slots after the last pair
}

// load_pair_order: the block's copy of the pair order (`src`, written by an earlier launch): consecutive threads
// copy consecutive int32 entries, then one barrier. Every thread of a block of THREADS calls it.
template <int THREADS>
__device__ __forceinline__ void load_pair_order(const PairOrder* __restrict__ src, PairOrder& dst) {
    const int* from = reinterpret_cast<const int*>(src);
    int* to = reinterpret_cast<int*>(&dst);
    for (int i = threadIdx.x; i < PAIR_ORDER_INTS_; i += THREADS) to[i] = __ldg(from + i);
    __syncthreads();
}
