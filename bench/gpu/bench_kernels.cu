// bench_kernels.cu: helper kernels of the GPU check (bench/gpu_bench.py), not part of any bundle.
//
//   colibri_bench_fill(words, n, seed, chunk)
//                                         words[i], i < n, = two fp16 values from a hash of (chunk * 2^31 + i, seed)
//                                         (buffers over 8 GiB are filled in chunks of 2^31 words): sign random,
//                                         magnitude in [2^-8, 2^-5), around the Mixtral fan-ins' 1/sqrt(4096) =
//                                         2^-6 and 1/sqrt(14336) ~ 2^-6.9, so outputs stay O(1); no NaN, no Inf
//   colibri_bench_read(src, n, sink)      reads n 16-byte vectors once (the read-only streaming floor); sink[0] is
//                                         written only when the xor of everything read equals a magic word
//   colibri_bench_spin(cycles)            one thread busy-waits `cycles` clocks: keeps the GPU busy while the host
//                                         enqueues the launches and events of a timed sequence (no host gaps)
// Grid/block: any; the fill and read kernels are grid-stride loops. Counts are 32-bit (every 8-byte argument is a
// pointer, which the fake driver checks): n < 2^32 words / vectors per launch.
// No CUDA header is included (NVRTC needs no include path), as in kernels/.

__device__ __forceinline__ unsigned int colibri_bench_hash(unsigned long long i, unsigned int seed) {
    // murmur3's 64-bit finaliser (public domain), folded to 32 bits
    unsigned long long h = i * 0x9E3779B97F4A7C15ull ^ (unsigned long long)seed * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return (unsigned int)(h ^ (h >> 32));
}

// 16 random bits -> IEEE binary16 bits: sign (1 bit), biased exponent 7..9 (2^-8 .. 2^-6), 10 mantissa bits.
__device__ __forceinline__ unsigned int colibri_bench_half(unsigned int r) {
    const unsigned int sign = (r & 1u) << 15;
    const unsigned int exponent = 7u + ((r >> 1) & 3u) % 3u;
    const unsigned int mantissa = (r >> 6) & 0x3FFu;
    return sign | (exponent << 10) | mantissa;
}

extern "C" __global__ void colibri_bench_fill(unsigned int* __restrict__ words, unsigned int n, unsigned int seed,
                                              unsigned int chunk) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long base = (unsigned long long)chunk << 31;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int h = colibri_bench_hash(base + i, seed);
        words[i] = colibri_bench_half(h & 0xFFFFu) | (colibri_bench_half(h >> 16) << 16);
    }
}

extern "C" __global__ void colibri_bench_read(const uint4* __restrict__ src, unsigned int n,
                                              unsigned int* __restrict__ sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four independent 16-byte loads in flight per thread
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

extern "C" __global__ void colibri_bench_spin(unsigned int cycles) {
#ifdef COLI_CPU_EMULATION  // the CPU emulation has no clock: nothing to wait for there
    (void)cycles;
#else
    if (threadIdx.x != 0) return;
    const long long start = clock64();
    while (clock64() - start < (long long)cycles) {
    }
#endif
}
