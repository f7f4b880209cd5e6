// emu_scheduler.h: the threading and barrier model: __syncthreads and warp barriers (full mask only, every thread
// or lane required), warp exchanges, the order of fibers and blocks per schedule, deadlock detection, and
// running one block to completion.
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
#pragma once

namespace coli_emu {

// __syncthreads: every thread of the block meets here.
void block_barrier();
// All lanes of the calling warp meet here; returns the generation at arrival (its parity picks exchange slots).
unsigned warp_barrier(unsigned mask);
// Run one block to completion; false on an error (g.error says which).
bool run_block();

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

#if defined(COLI_EMU_RUNTIME)
static int warp_size_of(int warp) {
    const int rest = g.nthreads - warp * 32;
    return rest < 32 ? rest : 32;
}

void block_barrier() {
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
unsigned warp_barrier(unsigned mask) {
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

extern "C" char __start_coli_shared[] __attribute__((weak));
extern "C" char __stop_coli_shared[] __attribute__((weak));

COLI_EMU_NOSAN static void poison_shared() {
    for (char* p = __start_coli_shared; p + 4 <= __stop_coli_shared; p += 4) std::memcpy(p, &kSharedPoison, 4);
}

// A fiber's life: the current block's kernel, then a wait for the next block, as often as blocks run.
static void fiber_main() {
    for (;;) {
        g.thunk(g.params);
        model_arrive(true);
        Fiber& f = g.fibers[g.current];
        f.wait = Wait::done;
        --g.alive;
        ++g.events;
        ++g.exited[g.current / 32];
        f.ready = true;
        yield();
    }
}

// Switch to fiber t until it yields.
static void resume(int t) {
    Fiber& f = g.fibers[t];
    if (_setjmp(g.sched)) return;
    if (!f.live) {  // never started, or left inside a kernel by a failed launch: a fresh fiber on its stack
        f.live = true;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g.stacks + size_t(t) * kStackBytes;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;  // fiber_main never returns
        makecontext(&f.ctx, fiber_main, 0);
        setcontext(&f.ctx);
    }
    _longjmp(f.at, 1);
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

static void describe_deadlock() {
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
bool run_block() {
    const int n = g.nthreads;
    g.alive = n;
    g.block_arrived = 0;
    const int warps = (n + 31) / 32;
    for (int w = 0; w < warps; ++w) g.warp_arrived[w] = g.exited[w] = 0;
    for (int t = 0; t < n; ++t) async_copies[t] = AsyncCopies{};  // copies never waited for die with their block
    poison_shared();
    for (int t = 0; t < n; ++t) {
        Fiber& f = g.fibers[t];
        f.live = f.live && f.ready;  // one still inside a kernel (a failed launch) starts afresh
        f.ready = false;
        f.wait = Wait::none;
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
            resume(t);
            if (g.failed) return false;
        }
        if (g.alive > 0 && g.events == before) {
            describe_deadlock();
            return false;
        }
    }
    return true;
}

#endif  // COLI_EMU_RUNTIME

}  // namespace coli_emu
