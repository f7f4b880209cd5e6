// emu_state.h: the state of one emulated launch: the block's fibers and what they wait for, the schedule's
// pseudo-random numbers, the launch's first error, and each thread's cp.async copies in flight.
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
// What a kernel unit calls is declared here; the definitions under COLI_EMU_RUNTIME are compiled once per
// library, in runner.cpp (cuda_shim.h, "Two halves").
#pragma once

namespace coli_emu {


constexpr int kMaxThreads = 1024;
constexpr int kWarps = kMaxThreads / 32;
constexpr size_t kStackBytes = 256 << 10;
constexpr uint32_t kSharedPoison = 0x7FC0BAD0u;  // a float32 NaN; as an int32 a large positive value

enum class Wait { none, block, warp, done };

// A thread's fiber: made once (makecontext) and then switched with _setjmp/_longjmp, which keep the signal mask
// as it is (swapcontext saves and restores it with a system call at every switch). A fiber whose kernel returned
// waits at the top of its loop for the next block (emu_scheduler.h fiber_main); one left inside a kernel (a failed
// launch) is made afresh.
struct Fiber {
    ucontext_t ctx;
    jmp_buf at;  // where it yielded
    bool live;   // `at` is valid: resumed, it goes on from there
    bool ready;  // its kernel returned: it waits at the end of fiber_main's loop, to run the next block's
    Wait wait;
    unsigned gen;  // the barrier generation it waits to see change
};

struct State {
    Fiber fibers[kMaxThreads];
    char* stacks = nullptr;
    jmp_buf sched;  // the scheduler, where a fiber yields to
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

// Access-model hooks of the synchronisation points (defined with the access model, smem_model.h).
void model_arrive(bool consume);
void model_block_release();

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
extern AsyncCopies async_copies[kMaxThreads];

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
void yield();

// Record the first error, then park the fiber for good; the scheduler ends the launch.
[[noreturn]] void fail(const char* what);

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

// Under the random schedule, at a synchronisation point of the current thread, each of its copies in flight lands
// with probability 1/2 (the rest stay in flight; their groups keep their order for the waits).
void land_some_copies();

#if defined(COLI_EMU_RUNTIME)
AsyncCopies async_copies[kMaxThreads];

void yield() {
    if (!_setjmp(g.fibers[g.current].at)) _longjmp(g.sched, 1);
}

// Record the first error, then park the fiber for good; the scheduler ends the launch.
[[noreturn]] void fail(const char* what) {
    if (!g.failed) {
        g.failed = true;
        std::snprintf(g.error, sizeof g.error, "%s: block (%u, %u, %u) thread %d: %s", g.symbol, blockIdx.x,
                      blockIdx.y, blockIdx.z, g.current, what);
    }
    for (;;) yield();
}

// A cp.async copy lands: its 16 bytes are written to shared memory (not a request of the kernel's own).
COLI_EMU_NOSAN inline void land(const AsyncCopy& c) { std::memcpy(c.dst, c.bytes, 16); }

void land_some_copies() {
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

#endif  // COLI_EMU_RUNTIME

}  // namespace coli_emu
