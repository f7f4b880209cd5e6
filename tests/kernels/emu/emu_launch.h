// emu_launch.h: one launch as a grid of blocks run one after another (memory faults caught and reported with the
// block and thread), and the call of a kernel with the arguments cuLaunchKernel would pass.
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
#pragma once

namespace coli_emu {

// Launch `thunk(params)` as a grid; 0 on success, 1 with coli_emu_error() set.
int launch(const char* symbol, void (*thunk)(void**), const unsigned* grid, const unsigned* block, void** params);

#if defined(COLI_EMU_RUNTIME)
static void on_fault(int, siginfo_t* info, void*) {
    g.fault_addr = info->si_addr;
    siglongjmp(g.fault_jump, 1);
}

int launch(const char* symbol, void (*thunk)(void**), const unsigned* grid, const unsigned* block,
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

#endif  // COLI_EMU_RUNTIME

// Call kernel F with the arguments cuLaunchKernel would pass: params[i] points at argument i.
template <class... A, size_t... I>
inline void call(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<A*>(params[I])...);
}

template <class... A>
constexpr size_t arity(void (*)(A...)) { return sizeof...(A); }

template <auto F>
void thunk(void** params) { call(F, params, std::make_index_sequence<arity(F)>{}); }

}  // namespace coli_emu
