#include "common.cuh"
// One warp: A (16x16 fp16, row-major) and B (16x8 fp16, stored column-major: B[k][n] at b[n*16 + k]) copied to shared
// memory with cp_async16, fragments built as common.cuh documents, D = A·B + C written row-major (16x8 fp32).
extern "C" __global__ void mma_tile(const unsigned short* __restrict__ a, const unsigned short* __restrict__ b,
                                    const float* __restrict__ c, float* __restrict__ d) {
    __shared__ __align__(16) unsigned short as[16 * 16];
    __shared__ __align__(16) unsigned short bs[8 * 16];
    const int lane = threadIdx.x;
    cp_async16(as + 8 * lane, a + 8 * lane);  // 32 x 16 bytes = A
    if (lane < 16) cp_async16(bs + 8 * lane, b + 8 * lane);  // 16 x 16 bytes = B
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int g = lane / 4, q = lane % 4;
    auto pair = [](const unsigned short* p) { return (unsigned)p[0] | ((unsigned)p[1] << 16); };
    const unsigned af[4] = {pair(as + g * 16 + 2 * q), pair(as + (g + 8) * 16 + 2 * q), pair(as + g * 16 + 2 * q + 8),
                            pair(as + (g + 8) * 16 + 2 * q + 8)};
    const unsigned bf[2] = {pair(bs + g * 16 + 2 * q), pair(bs + g * 16 + 2 * q + 8)};
    const float cf[4] = {__ldg(c + g * 8 + 2 * q), __ldg(c + g * 8 + 2 * q + 1), __ldg(c + (g + 8) * 8 + 2 * q),
                         __ldg(c + (g + 8) * 8 + 2 * q + 1)};
    float df[4];
    mma_m16n8k16(df, af, bf, cf);
    d[g * 8 + 2 * q] = df[0];
    d[g * 8 + 2 * q + 1] = df[1];
    d[(g + 8) * 8 + 2 * q] = df[2];
    d[(g + 8) * 8 + 2 * q + 1] = df[3];
}

// One thread copies two 16-byte vectors with cp_async16 in two commit groups and stores the shared destinations
// (4 words each) after each step: before any wait (out[0..1]), after wait<1> (out[2..3]), after wait<0> (out[4..5]).
extern "C" __global__ void cp_async_groups(const unsigned* __restrict__ src, unsigned* __restrict__ out) {
    __shared__ __align__(16) unsigned s[2][4];
    if (threadIdx.x != 0) return;
    cp_async16(s[0], src);
    cp_async_commit();
    cp_async16(s[1], src + 4);
    cp_async_commit();
    for (int i = 0; i < 8; ++i) out[i] = s[i / 4][i % 4];
    cp_async_wait<1>();
    for (int i = 0; i < 8; ++i) out[8 + i] = s[i / 4][i % 4];
    cp_async_wait<0>();
    for (int i = 0; i < 8; ++i) out[16 + i] = s[i / 4][i % 4];
}
