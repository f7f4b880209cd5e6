// cuda_shim.h: the CUDA C subset of kernels/*.cu on the CPU, so that g++ compiles the unmodified kernel sources
// and tests/kernels/emulator.py runs a launch plan without a GPU.
//
// An emulation of the LOGIC only (indexing, tails, barriers, warp exchanges, atomics): it says nothing about GPU
// timing, the GPU memory model, occupancy or register use.
//
// Execution model: one launch runs its blocks one after another on the calling thread. The threads of a block are
// fibers (ucontext) of that thread, switched only at the synchronisation points: __syncthreads, __syncwarp and the
// warp shuffles. So
//   - `__shared__` variables are function statics, one copy shared by the block's fibers; they live in the ELF
//     section `coli_shared`, which is filled with a NaN pattern before every block (a read before a write shows);
//   - atomics need no lock (nothing runs in between), yet their order follows the schedule;
//   - the schedule is chosen per launch (coli_emu_set_schedule): fibers in increasing order, decreasing order, or a
//     fresh pseudo-random order every round; blocks likewise. Results of the ordered aggregation must not depend
//     on it; a missing barrier usually does;
//   - global loads through `__ldg` are recorded when the access model is on (coli_emu_access_enable): the k-th
//     execution of one load site by each lane of a warp is one warp-level instruction; its 32-byte sectors and
//     requested bytes are summed per address class (bench/kernel_access.py, docs/kernels.md "Access model");
//   - with COLI_EMU_SMEM_MODEL (a library built for bench/kernel_model.py), shared-memory accesses too: the
//     wavefronts of each warp-level request, the active lanes and the global bytes in flight (emu/smem_model.h);
//   - alignment: a 16-byte __ldg and both addresses of a 16-byte cp.async must be 16-byte aligned (an error of the
//     launch otherwise, as the GPU raises a misaligned-address fault); under the random schedule a cp.async copy
//     lands at a random synchronisation point of its thread between issue and the wait that retires it (at the
//     issue itself included), so a stage refilled before every thread is done with it, or read before its wait,
//     shows up as a wrong result;
//   - strict rules, each an error of the launch rather than a hang: a __syncthreads must be reached by every
//     thread of the block, a full-mask warp operation by all 32 lanes (a thread that exited before counts as
//     missing), and a state where no fiber can move is a deadlock. A segmentation fault inside a kernel is
//     reported with the block and thread instead of killing the process.
// Only the intrinsics the kernels use are defined; anything else fails to compile, which is the point.
#pragma once

#include <csetjmp>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <sys/mman.h>
#include <ucontext.h>
#include <algorithm>
#include <unordered_map>
#include <utility>
#include <deque>
#include <vector>

#define COLI_CPU_EMULATION 1

// ---- qualifiers --------------------------------------------------------------------------------------------------
#define __global__
#define __device__ static
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("coli_shared"), aligned(16)))
// __restrict__ is a g++ extension already.

// ---- vector and index types --------------------------------------------------------------------------------------
struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }

// Set by the scheduler before every switch into a fiber.
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace coli_emu {

constexpr int kMaxThreads = 1024;
constexpr int kWarps = kMaxThreads / 32;
constexpr size_t kStackBytes = 256 << 10;
constexpr uint32_t kSharedPoison = 0x7FC0BAD0u;  // a float32 NaN; as an int32 a large positive value

enum class Wait { none, block, warp, done };

struct Fiber {
    ucontext_t ctx;
    Wait wait;
    unsigned gen;  // the barrier generation it waits to see change
};

struct State {
    Fiber fibers[kMaxThreads];
    char* stacks = nullptr;
    ucontext_t sched;
    int nthreads = 0;
    int current = 0;
    int alive = 0;
    unsigned long long events = 0;  // bumped on every arrival, release and exit: progress for deadlock detection
    // __syncthreads
    int block_arrived = 0;
    unsigned block_gen = 0;
    // warps: arrivals, generation, exchange slots [parity][lane]
    int warp_arrived[kWarps];
    unsigned warp_gen[kWarps];
    uint32_t exchange[kWarps][2][32];
    int exited[kWarps];  // lanes of the warp that have returned
    // schedule: 0 increasing, 1 decreasing, else pseudo-random (xorshift state)
    int mode = 0;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    bool failed = false;
    char error[512] = {0};
    void (*thunk)(void**) = nullptr;
    void** params = nullptr;
    sigjmp_buf fault_jump;
    volatile void* fault_addr = nullptr;
    const char* symbol = "";
};

inline State g;

// Access-model hooks of the synchronisation points (defined with the access model below).
inline void model_arrive(bool consume);
inline void model_block_release();

// cp.async (common.cuh cp_async16 / cp_async_commit / cp_async_wait): per thread, the copies issued since its last
// commit and its committed groups, oldest first. A copy reads global memory when issued (a load the access model
// records) and lands in shared memory only when a wait retires its group, so a kernel that reads a stage before
// waiting for it reads the NaN poison or stale data, as a GPU may.
struct AsyncCopy {
    void* dst;
    unsigned char bytes[16];
};
struct AsyncCopies {
    std::vector<AsyncCopy> open;
    std::deque<std::vector<AsyncCopy>> groups;
};
inline AsyncCopies async_copies[kMaxThreads];

inline uint64_t next_random() {
    uint64_t x = g.rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return g.rng = x;
}

inline void set_thread(int tid) {
    g.current = tid;
    threadIdx = {tid % blockDim.x, (tid / blockDim.x) % blockDim.y, tid / (blockDim.x * blockDim.y)};
}

// Give control back to the scheduler; the fiber is resumed later at this point.
inline void yield() { swapcontext(&g.fibers[g.current].ctx, &g.sched); }

// Record the first error, then park the fiber for good; the scheduler ends the launch.
[[noreturn]] inline void fail(const char* what) {
    if (!g.failed) {
        g.failed = true;
        std::snprintf(g.error, sizeof g.error, "%s: block (%u, %u, %u) thread %d: %s", g.symbol, blockIdx.x,
                      blockIdx.y, blockIdx.z, g.current, what);
    }
    for (;;) yield();
}

// A misaligned vector access: the launch fails naming the access and the address.
[[noreturn]] inline void misaligned(const char* what, const void* p) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s at %p is not 16-byte aligned", what, p);
    fail(msg);
}

#if COLI_EMU_SMEM_MODEL
#define COLI_EMU_NOSAN __attribute__((no_sanitize_thread, noinline))
#else
#define COLI_EMU_NOSAN
#endif

// A cp.async copy lands: its 16 bytes are written to shared memory (not a request of the kernel's own).
COLI_EMU_NOSAN inline void land(const AsyncCopy& c) { std::memcpy(c.dst, c.bytes, 16); }

// Under the random schedule, at a synchronisation point of the current thread, each of its copies in flight lands
// with probability 1/2 (the rest stay in flight; their groups keep their order for the waits).
inline void land_some_copies() {
    if (g.mode < 2) return;
    AsyncCopies& a = async_copies[g.current];
    auto some = [](std::vector<AsyncCopy>& copies) {
        size_t kept = 0;
        for (size_t i = 0; i < copies.size(); ++i) {
            if (next_random() % 2) land(copies[i]);
            else copies[kept++] = copies[i];
        }
        copies.resize(kept);
    };
    some(a.open);
    for (std::vector<AsyncCopy>& group : a.groups) some(group);
}

inline int warp_size_of(int warp) {
    const int rest = g.nthreads - warp * 32;
    return rest < 32 ? rest : 32;
}

inline void land_some_copies();

inline void block_barrier() {
    Fiber& f = g.fibers[g.current];
    ++g.events;
    model_arrive(false);  // global loads stay in flight across a barrier
    land_some_copies();
    if (++g.block_arrived == g.nthreads) {
        g.block_arrived = 0;
        ++g.block_gen;
        model_block_release();
        return;
    }
    f.wait = Wait::block;
    f.gen = g.block_gen;
    while (g.block_gen == f.gen) {
        yield();
        if (g.alive < g.nthreads && g.block_gen == f.gen) fail("__syncthreads not reached by every thread: some returned");
    }
    f.wait = Wait::none;
}

// All lanes of the calling warp meet here; returns the generation at arrival (its parity picks exchange slots).
inline unsigned warp_barrier(unsigned mask) {
    const int warp = g.current / 32;
    if (mask != 0xffffffffu || warp_size_of(warp) != 32) fail("warp operation without all 32 lanes (mask or block size)");
    if (g.exited[warp]) fail("warp operation with a full mask after a lane of the warp returned");
    model_arrive(true);
    land_some_copies();
    Fiber& f = g.fibers[g.current];
    const unsigned gen = g.warp_gen[warp];
    ++g.events;
    if (++g.warp_arrived[warp] == 32) {
        g.warp_arrived[warp] = 0;
        ++g.warp_gen[warp];
        return gen;
    }
    f.wait = Wait::warp;
    f.gen = gen;
    while (g.warp_gen[warp] == gen) {
        yield();
        if (g.exited[warp] && g.warp_gen[warp] == gen) fail("warp operation with a full mask after a lane of the warp returned");
    }
    f.wait = Wait::none;
    return gen;
}

// Lane `lane` gets the value of lane src(lane). Slots alternate by generation parity: a lane cannot write the next
// exchange's slot before every lane has passed this exchange's barrier, i.e. has read.
template <class T, class Src>
inline T exchange(unsigned mask, T v, Src src) {
    static_assert(sizeof(T) == 4, "shuffles of 4-byte values only");
    const int warp = g.current / 32, lane = g.current % 32;
    const unsigned parity = g.warp_gen[warp] & 1u;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    g.exchange[warp][parity][lane] = bits;
    warp_barrier(mask);
    const int from = src(lane);
    bits = g.exchange[warp][parity][(from >= 0 && from < 32) ? from : lane];
    T out;
    std::memcpy(&out, &bits, 4);
    return out;
}

extern "C" char __start_coli_shared[] __attribute__((weak));
extern "C" char __stop_coli_shared[] __attribute__((weak));

COLI_EMU_NOSAN inline void poison_shared() {
    for (char* p = __start_coli_shared; p + 4 <= __stop_coli_shared; p += 4) std::memcpy(p, &kSharedPoison, 4);
}

inline void fiber_main() {
    g.thunk(g.params);
    model_arrive(true);
    g.fibers[g.current].wait = Wait::done;
    --g.alive;
    ++g.events;
    ++g.exited[g.current / 32];
    // returning resumes uc_link, the scheduler
}

// Order of the fibers (or blocks) in round r: 0..n-1, n-1..0 or an affine pseudo-random permutation.
struct Order {
    int n, a = 1, c = 0;
    explicit Order(int count) : n(count) {
        if (g.mode >= 2 && n > 1) {
            do a = 1 + int(next_random() % uint64_t(n)); while (gcd(a, n) != 1);
            c = int(next_random() % uint64_t(n));
        }
    }
    static int gcd(int x, int y) { return y ? gcd(y, x % y) : x; }
    int operator[](int i) const {
        if (g.mode == 1) return n - 1 - i;
        if (g.mode >= 2) return int((long long)a * i % n + c) % n;
        return i;
    }
};

inline void describe_deadlock() {
    int at_block = 0, at_warp = 0, done = 0;
    for (int t = 0; t < g.nthreads; ++t) {
        const Wait w = g.fibers[t].wait;
        at_block += w == Wait::block;
        at_warp += w == Wait::warp;
        done += w == Wait::done;
    }
    std::snprintf(g.error, sizeof g.error,
                  "%s: block (%u, %u, %u): deadlock, %d threads wait at __syncthreads, %d at a warp operation, "
                  "%d returned (of %d): a barrier not reached by every thread",
                  g.symbol, blockIdx.x, blockIdx.y, blockIdx.z, at_block, at_warp, done, g.nthreads);
    g.failed = true;
}

// Run one block to completion; false on an error (g.error says which).
inline bool run_block() {
    const int n = g.nthreads;
    g.alive = n;
    g.block_arrived = 0;
    const int warps = (n + 31) / 32;
    for (int w = 0; w < warps; ++w) g.warp_arrived[w] = g.exited[w] = 0;
    for (int t = 0; t < n; ++t) async_copies[t] = AsyncCopies{};  // copies never waited for die with their block
    poison_shared();
    for (int t = 0; t < n; ++t) {
        Fiber& f = g.fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g.stacks + size_t(t) * kStackBytes;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = &g.sched;
        f.wait = Wait::none;
        makecontext(&f.ctx, fiber_main, 0);
    }
    while (g.alive > 0) {
        const unsigned long long before = g.events;
        const Order order{n};
        for (int i = 0; i < n; ++i) {
            const int t = order[i];
            const Fiber& f = g.fibers[t];
            // Skip the fibers still waiting (no switch); one whose barrier can no longer complete is resumed and fails.
            if (f.wait == Wait::done) continue;
            if (f.wait == Wait::block && g.block_gen == f.gen && g.alive == n) continue;
            if (f.wait == Wait::warp && g.warp_gen[t / 32] == f.gen && !g.exited[t / 32]) continue;
            set_thread(t);
            swapcontext(&g.sched, &g.fibers[t].ctx);
            if (g.failed) return false;
        }
        if (g.alive > 0 && g.events == before) {
            describe_deadlock();
            return false;
        }
    }
    return true;
}

// ---- access model: warp-level global loads → 32-byte sectors ---------------------------------------------------
// Address classes: registered regions (coli_emu_access_region) carry a class 0..kClasses-2; any other address
// (shared memory, the stack) falls in the last class.
constexpr int kClasses = 4;
struct AccessStats {
    unsigned long long instructions, sectors, min_sectors, bytes;
};
struct InstrKey {
    uintptr_t site;
    uint32_t warp, occurrence;
    bool operator==(const InstrKey& o) const { return site == o.site && warp == o.warp && occurrence == o.occurrence; }
};
struct InstrKeyHash {
    size_t operator()(const InstrKey& k) const {
        return std::hash<uintptr_t>()(k.site) ^ (size_t(k.warp) << 40) ^ (size_t(k.occurrence) * 0x9E3779B97F4A7C15ull);
    }
};
struct AccessRegion {
    uintptr_t lo, hi;
    int cls;
};
struct Access {
    bool on = false;
    // with the access model on: run only the blocks whose linear index is a multiple of `sample` (a model of
    // statistically alike blocks; outputs of the others stay unwritten); blocks_run counts the blocks run
    long long sample = 1, blocks_run = 0;
    std::vector<AccessRegion> regions;
    AccessStats stats[kClasses] = {};
    // per (site, thread): executions so far in this block; per instruction: the lanes' (address, bytes)
    std::unordered_map<uint64_t, uint32_t> seen;
    std::unordered_map<InstrKey, std::vector<std::pair<uintptr_t, uint32_t>>, InstrKeyHash> pending;
};
inline Access acc_model;

inline int access_class(uintptr_t a) {
    for (const AccessRegion& r : acc_model.regions)
        if (a >= r.lo && a < r.hi) return r.cls;
    return kClasses - 1;
}

// The site is this call's return address: __ldg is inlined, so each load site in a kernel calls from its own place.
inline void note_load(uint32_t bytes);

__attribute__((noinline)) inline void record_load(const void* p, uint32_t bytes) {
    const uintptr_t site = uintptr_t(__builtin_return_address(0));
    note_load(bytes);
    const uint64_t who = (uint64_t(site) << 11) ^ uint64_t(g.current);
    const uint32_t occurrence = acc_model.seen[who]++;
    acc_model.pending[InstrKey{site, uint32_t(g.current / 32), occurrence}].emplace_back(uintptr_t(p), bytes);
}

inline void note_global_request(uintptr_t site, size_t lanes, unsigned long long bytes);

// One warp-level instruction per pending entry: sectors touched, the distinct bytes its lanes asked for.
inline void flush_accesses() {
    std::vector<uintptr_t> sectors;
    for (auto& [key, lanes] : acc_model.pending) {
        std::sort(lanes.begin(), lanes.end());
        sectors.clear();
        unsigned long long bytes = 0;
        uintptr_t covered = 0;  // bytes below this address are counted already
        for (const auto& [a, n] : lanes) {
            const uintptr_t lo = a > covered ? a : covered, hi = a + n;
            if (hi > lo) bytes += hi - lo;
            if (hi > covered) covered = hi;
            for (uintptr_t s = a >> 5; s <= (a + n - 1) >> 5; ++s) sectors.push_back(s);
        }
        std::sort(sectors.begin(), sectors.end());
        const size_t touched = size_t(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
        note_global_request(key.site, lanes.size(), bytes);
        AccessStats& st = acc_model.stats[access_class(lanes.front().first)];
        st.instructions += 1;
        st.sectors += touched;
        st.min_sectors += (bytes + 31) / 32;
        st.bytes += bytes;
    }
    acc_model.pending.clear();
    acc_model.seen.clear();
}

}  // namespace coli_emu

#include "smem_model.h"

namespace coli_emu {

inline void on_fault(int, siginfo_t* info, void*) {
    g.fault_addr = info->si_addr;
    siglongjmp(g.fault_jump, 1);
}

// Launch `thunk(params)` as a grid; 0 on success, 1 with coli_emu_error() set.
inline int launch(const char* symbol, void (*thunk)(void**), const unsigned* grid, const unsigned* block,
                  void** params) {
    g.failed = false;
    g.error[0] = 0;
    g.symbol = symbol;
    const long long threads = (long long)block[0] * block[1] * block[2];
    if (threads < 1 || threads > kMaxThreads || grid[0] < 1 || grid[1] < 1 || grid[2] < 1) {
        std::snprintf(g.error, sizeof g.error, "%s: block %ux%ux%u, grid %ux%ux%u; allowed: 1..%d threads, grid >= 1",
                      symbol, block[0], block[1], block[2], grid[0], grid[1], grid[2], kMaxThreads);
        return 1;
    }
    if (!g.stacks) {
        void* p = mmap(nullptr, kStackBytes * kMaxThreads, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            std::snprintf(g.error, sizeof g.error, "cannot map %zu bytes of fiber stacks", kStackBytes * kMaxThreads);
            return 1;
        }
        g.stacks = static_cast<char*>(p);
    }
    g.thunk = thunk;
    g.params = params;
    g.nthreads = int(threads);
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};

    static char alt_stack[1 << 16];
    stack_t ss{}, old_ss{};
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof alt_stack;
    sigaltstack(&ss, &old_ss);
    struct sigaction sa{}, old_segv{}, old_bus{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);

    int rc = 0;
    if (sigsetjmp(g.fault_jump, 1)) {
        std::snprintf(g.error, sizeof g.error, "%s: block (%u, %u, %u) thread %d: memory fault at address %p", symbol,
                      blockIdx.x, blockIdx.y, blockIdx.z, g.current, const_cast<void*>(g.fault_addr));
        rc = 1;
    } else {
        const long long blocks = (long long)grid[0] * grid[1] * grid[2];
        const Order order{int(blocks)};
        for (long long i = 0; i < blocks && rc == 0; ++i) {
            const long long b = order[int(i)];
            if (acc_model.on && acc_model.sample > 1 && b % acc_model.sample) continue;
            ++acc_model.blocks_run;
            blockIdx = {unsigned(b % grid[0]), unsigned(b / grid[0] % grid[1]), unsigned(b / grid[0] / grid[1])};
            if (!run_block()) rc = 1;
            if (acc_model.on) flush_accesses();
            model_block_release();
        }
    }
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_ss, nullptr);
    return rc;
}

// Call kernel F with the arguments cuLaunchKernel would pass: params[i] points at argument i.
template <class... A, size_t... I>
inline void call(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<A*>(params[I])...);
}

template <class... A>
constexpr size_t arity(void (*)(A...)) { return sizeof...(A); }

template <auto F>
void thunk(void** params) { call(F, params, std::make_index_sequence<arity(F)>{}); }

// IEEE binary16 bits → float32, exact (every half value is a float).
inline float half_bits_to_float(unsigned short h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);  // normal: rebias 15 → 127
    } else if (mant == 0) {
        bits = sign;  // ±0
    } else {  // subnormal: normalise
        exp = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace coli_emu

// ---- intrinsics ------------------------------------------------------------------------------------------------
inline void __syncthreads() { coli_emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { coli_emu::warp_barrier(mask); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) { return ((lane ^ lane_mask) & (width - 1)) | (lane & ~(width - 1)); });
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) {
        const int src = lane + int(delta);
        return (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane;
    });
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) {
        const int src = lane - int(delta);
        return src >= (lane & ~(width - 1)) ? src : lane;
    });
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return coli_emu::exchange(mask, v, [&](int lane) { return (lane & ~(width - 1)) + (src_lane & (width - 1)); });
}

// Nothing else runs between two synchronisation points, so a plain read-modify-write is atomic here.
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline int atomicMax(int* p, int v) { const int old = *p; *p = old > v ? old : v; return old; }

// A global load: recorded by the access model when it is on (always inlined, so that each load site of a kernel
// calls record_load from its own address).
template <class T>
__attribute__((always_inline)) inline T __ldg(const T* p) {
    if (sizeof(T) == 16 && uintptr_t(p) % 16) coli_emu::misaligned("16-byte __ldg", p);
    if (coli_emu::acc_model.on) coli_emu::record_load(p, sizeof(T));
    return *p;
}

// A global load through L2 (ld.global.cg: data other blocks of the same launch wrote): the same record as __ldg.
template <class T>
__attribute__((always_inline)) inline T __ldcg(const T* p) {
    if (coli_emu::acc_model.on) coli_emu::record_load(p, sizeof(T));
    return *p;
}
// Blocks run one after another and a block's fibers switch only at synchronisation points, so every store is
// visible to every later load: a memory fence has nothing to order here (the GPU memory model is not emulated).
inline void __threadfence() {}

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __half_bits_to_float(unsigned short h) { return coli_emu::half_bits_to_float(h); }
// float32 → IEEE binary16 bits, round to nearest even (as cvt.rn.f16.f32): overflow to inf, NaN kept quiet.
inline unsigned short __float_to_half_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));  // NaN
    if (absx >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (absx < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        const float a = std::fabs(f) * 16777216.0f;  // units of 2^-24; exact (a power of two scale)
        return uint16_t(sign | uint32_t(std::nearbyint(a)));  // the default rounding mode: nearest even
    }
    const uint32_t mant = absx & 0x7fffffu, exp = (absx >> 23) - 112u;  // rebias 127 → 15
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
    return uint16_t(sign | h);
}

// Exported entry point of one kernel: int coli_emu_launch_<symbol>(grid[3], block[3], params).
#define COLI_EMU_EXPORT(symbol)                                                                                 \
    extern "C" __attribute__((visibility("default"))) int coli_emu_launch_##symbol(                            \
        const unsigned* grid, const unsigned* block, void** params) {                                          \
        return coli_emu::launch(#symbol, coli_emu::thunk<symbol>, grid, block, params);                        \
    }

// ---- tensor cores and asynchronous copies (common.cuh mma_m16n8k16, cp_async16) ----------------------------------
// mma: every lane deposits its fragments, the warp meets, each lane computes its four D entries from the whole A
// and B (fp16 → float exactly, products summed in k order 0..15 in float, then + C: the GPU's internal order and
// precision are not specified, so results may differ in the last bits), the warp meets again before the slots are
// reused.
namespace coli_emu {
inline uint32_t mma_a[kWarps][32][4], mma_b[kWarps][32][2];

inline float mma_half(uint32_t word, int high) { return half_bits_to_float(uint16_t(high ? word >> 16 : word & 0xffffu)); }

inline void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    const int warp = g.current / 32, lane = g.current % 32;
    for (int i = 0; i < 4; ++i) mma_a[warp][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) mma_b[warp][lane][i] = b[i];
    warp_barrier(0xffffffffu);
    // A[row][col] and B[k][col] from the fragments of the lanes that hold them.
    auto A = [&](int row, int col) {
        const int gg = row % 8, cc = (col % 8) / 2, reg = (row >= 8) + 2 * (col >= 8);
        return mma_half(mma_a[warp][4 * gg + cc][reg], col & 1);
    };
    auto B = [&](int k, int col) {
        const int cc = (k % 8) / 2, reg = k >= 8;
        return mma_half(mma_b[warp][4 * col + cc][reg], k & 1);
    };
    const int gg = lane / 4, cc = lane % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = gg + 8 * (i / 2), col = 2 * cc + (i % 2);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        out[i] = s + c[i];
    }
    warp_barrier(0xffffffffu);
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

}  // namespace coli_emu

inline void coli_emu_mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    coli_emu::mma_m16n8k16(d, a, b, c);
}
// A 16-byte copy: read now (through __ldg, so the access model records it at this site), written at the wait that
// retires its group.
__attribute__((always_inline)) inline void coli_emu_cp_async16(void* dst, const void* src) {
    if (uintptr_t(dst) % 16) coli_emu::misaligned("cp.async 16-byte copy: shared destination", dst);
    if (uintptr_t(src) % 16) coli_emu::misaligned("cp.async 16-byte copy: global source", src);
    coli_emu::smem.in_copy = true;  // its load is a copy's, in flight until the wait
    const uint4 v = __ldg(static_cast<const uint4*>(src));
    coli_emu::smem.in_copy = false;
    coli_emu::AsyncCopy c{dst, {}};
    std::memcpy(c.bytes, &v, 16);
    if (coli_emu::g.mode >= 2 && coli_emu::next_random() % 4 == 0) {  // lands at once
        coli_emu::land(c);
        return;
    }
    coli_emu::async_copies[coli_emu::g.current].open.push_back(c);
}
inline void coli_emu_cp_async_commit() {
    coli_emu::AsyncCopies& a = coli_emu::async_copies[coli_emu::g.current];
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}
// Retire the oldest committed groups until at most `pending` remain (copies not yet committed stay in flight).
inline void coli_emu_cp_async_wait(int pending) {
    coli_emu::AsyncCopies& a = coli_emu::async_copies[coli_emu::g.current];
    coli_emu::note_copies_in_flight(a);
    while ((int)a.groups.size() > pending) {
        for (const coli_emu::AsyncCopy& c : a.groups.front()) coli_emu::land(c);
        a.groups.pop_front();
    }
}
