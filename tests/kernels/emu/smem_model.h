// smem_model.h: the access model's shared-memory, lane and bytes-in-flight counters (included by cuda_shim.h).
//
// Compiled in only with COLI_EMU_SMEM_MODEL 1 (tests/kernels/emulator.py build_model_library), a library whose
// kernel units g++ builds with -fsanitize=thread at compile time only: every memory access of the kernel code then
// calls __tsan_read<N>/__tsan_write<N>(address) (runner.cpp defines them; no ThreadSanitizer runtime is linked), and
// the ones that fall in the `coli_shared` section (the `__shared__` variables) are recorded here while the access
// model is on (coli_emu_access_enable). The ordinary library has none of this: its kernels run as before.
//
// Model (docs/kernels.md "Shared memory, lanes and bytes in flight"):
//   - a lane's consecutive accesses in program order, same direction and element size (4 or 8 bytes), contiguous,
//     starting aligned to the merged width, are one access of up to 16 bytes (ptxas' LDS.64/LDS.128 and STS
//     vectors of adjacent aligned elements); sub-word accesses stay as they are;
//   - the k-th execution of one access site by each lane of a warp, between two __syncthreads, is one warp-level
//     request; its wavefronts: the warp is split in phases of 32 lanes (accesses up to 4 bytes), 16 (8 bytes) or 8
//     (16 bytes); in each phase with an active lane, the largest number of distinct 4-byte words asked for in one
//     of the 32 banks (bank = word index mod 32; the same word read by several lanes is one broadcast); summed
//     over phases. Ideal: ceil(distinct bytes / 128), at least 1;
//   - active lanes: the lanes taking part in a request (shared or global);
//   - bytes in flight: a lane's global loads (__ldg, __ldcg) are outstanding from their issue to the lane's next
//     shared-memory access or warp exchange (the point where the value is first consumed, as a model); the bytes
//     outstanding there are one batch. cp.async copies are outstanding until the wait that retires them: the
//     batch is the bytes of every copy the thread has in flight at that wait.
#pragma once

namespace coli_emu {

enum SiteKind : uint32_t { kSharedLoad = 0, kSharedStore = 1, kGlobalLoad = 2 };

struct SiteStats {
    uint32_t kind;
    unsigned long long requests, wavefronts, ideal, lanes, bytes;
};

struct LaneAccess {
    uint32_t lane;
    uintptr_t addr;
    uint32_t bytes;
};

struct SmemRun {  // a lane's open run of contiguous accesses (merged into one vector access when it closes)
    uintptr_t addr = 0, site = 0;
    uint32_t bytes = 0, elem = 0;
    bool write = false;
};

struct SmemModel {
    std::unordered_map<uintptr_t, SiteStats> sites;  // key: site << 4 | piece (see close_run)
    std::unordered_map<uint64_t, uint32_t> seen;
    std::unordered_map<InstrKey, std::vector<LaneAccess>, InstrKeyHash> pending;
    SmemRun run[kMaxThreads];
    // bytes in flight: per thread, __ldg bytes outstanding; totals of the batches (count, bytes, bytes squared)
    unsigned long long outstanding[kMaxThreads] = {};
    unsigned long long batches = 0, batch_bytes = 0, batch_bytes_sq = 0;
    unsigned long long async_batches = 0, async_bytes = 0, async_bytes_sq = 0;
    bool in_copy = false;  // the load being recorded is a cp.async copy's
    // `__shared__` variables outside the coli_shared section: g++ ignores the section attribute of a static in a
    // function template instance (common.cuh tc_tile_rows' TcShared), so the library's loader registers them by
    // symbol (emulator.ModelLibrary)
    // (plain arrays: is_shared runs inside every access hook and must call no instrumented code)
    static constexpr int kExtra = 256;
    uintptr_t extra_lo[kExtra] = {}, extra_hi[kExtra] = {};
    int extra_n = 0;
};
extern SmemModel smem;

#if defined(COLI_EMU_RUNTIME)
SmemModel smem;

COLI_EMU_NOSAN static void add_batch(unsigned long long b, bool async) {
    if (async) {
        ++smem.async_batches;
        smem.async_bytes += b;
        smem.async_bytes_sq += b * b;
    } else {
        ++smem.batches;
        smem.batch_bytes += b;
        smem.batch_bytes_sq += b * b;
    }
}

// The loads of thread t are consumed here (a shared-memory access or warp exchange).
COLI_EMU_NOSAN static void consume_loads(int t) {
    if (smem.outstanding[t]) {
        add_batch(smem.outstanding[t], false);
        smem.outstanding[t] = 0;
    }
}

COLI_EMU_NOSAN static void emit_shared(int t, uintptr_t key, uintptr_t addr, uint32_t bytes, bool write) {
    const uint64_t who = (uint64_t(key) << 11) ^ uint64_t(t);
    const uint32_t occurrence = smem.seen[who]++;
    smem.pending[InstrKey{key, uint32_t(t / 32), occurrence}].push_back({uint32_t(t % 32), addr, bytes});
    SiteStats& s = smem.sites[key];
    s.kind = write ? kSharedStore : kSharedLoad;
}

// Close thread t's open run: aligned pieces of 16, 8 or 4 bytes (or the element size), one request site each.
COLI_EMU_NOSAN static void close_run(int t) {
    SmemRun& r = smem.run[t];
    if (!r.bytes) return;
    uintptr_t a = r.addr;
    uint32_t left = r.bytes, piece = 0;
    while (left) {
        uint32_t w = 16;
        while (w > r.elem && (w > left || a % w)) w >>= 1;
        emit_shared(t, (r.site << 4) | piece, a, w, r.write);
        a += w;
        left -= w;
        ++piece;
    }
    r.bytes = 0;
}

COLI_EMU_NOSAN static bool is_shared(uintptr_t a) {
    if (a >= uintptr_t(__start_coli_shared) && a < uintptr_t(__stop_coli_shared)) return true;
    for (int i = 0; i < smem.extra_n; ++i)
        if (a >= smem.extra_lo[i] && a < smem.extra_hi[i]) return true;
    return false;
}

// One access of the kernel code (from the instrumentation hooks): shared ones are merged into runs and recorded.
COLI_EMU_NOSAN void on_access(uintptr_t a, uint32_t size, bool write, uintptr_t site) {
    if (!acc_model.on || !is_shared(a)) return;
    const int t = g.current;
    consume_loads(t);
    SmemRun& r = smem.run[t];
    const uint32_t merged = r.bytes + size;
    const uint32_t width = merged <= 4 ? 4 : merged <= 8 ? 8 : 16;
    if (r.bytes && r.write == write && r.elem == size && (size == 4 || size == 8) && a == r.addr + r.bytes &&
        merged <= 16 && r.addr % width == 0) {
        r.bytes = merged;
        return;
    }
    close_run(t);
    r = SmemRun{a, site, size, size, write};
    if (size == 16 || size < 4) close_run(t);  // a whole vector, or a sub-word access: never merged
}

// Wavefronts of one warp-level request (see the model above).
COLI_EMU_NOSAN static unsigned long long wavefronts(const std::vector<LaneAccess>& lanes, unsigned long long* distinct_bytes) {
    uint32_t width = 0;
    for (const LaneAccess& l : lanes) width = std::max(width, l.bytes);
    const uint32_t phase = width >= 16 ? 8 : width >= 8 ? 16 : 32;
    unsigned long long total = 0;
    std::vector<uintptr_t> words;
    for (uint32_t p0 = 0; p0 < 32; p0 += phase) {
        words.clear();
        for (const LaneAccess& l : lanes)
            if (l.lane >= p0 && l.lane < p0 + phase)
                for (uintptr_t w = l.addr >> 2; w <= (l.addr + l.bytes - 1) >> 2; ++w) words.push_back(w);
        if (words.empty()) continue;
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        unsigned per_bank[32] = {};
        unsigned worst = 0;
        for (uintptr_t w : words) worst = std::max(worst, ++per_bank[w % 32]);
        total += worst;
    }
    // distinct bytes: the union of the lanes' ranges
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (const LaneAccess& l : lanes) ranges.emplace_back(l.addr, l.addr + l.bytes);
    std::sort(ranges.begin(), ranges.end());
    unsigned long long bytes = 0;
    uintptr_t covered = 0;
    for (const auto& [lo, hi] : ranges) {
        const uintptr_t from = lo > covered ? lo : covered;
        if (hi > from) bytes += hi - from;
        if (hi > covered) covered = hi;
    }
    *distinct_bytes = bytes;
    return total;
}

// Turn the pending shared requests into per-site totals; called where no lane can still add to them (every thread
// at a __syncthreads, or the block's end).
COLI_EMU_NOSAN static void flush_shared() {
    for (auto& [key, lanes] : smem.pending) {
        unsigned long long bytes = 0;
        const unsigned long long wf = wavefronts(lanes, &bytes);
        SiteStats& s = smem.sites[key.site];
        s.requests += 1;
        s.wavefronts += wf;
        s.ideal += bytes ? (bytes + 127) / 128 : 1;
        s.lanes += lanes.size();
        s.bytes += bytes;
    }
    smem.pending.clear();
    smem.seen.clear();
}

// A global load of `lanes` lanes at `site` (flush_accesses), for the active-lane counts.
COLI_EMU_NOSAN static void add_global_request(uintptr_t site, size_t lanes, unsigned long long bytes) {
    SiteStats& s = smem.sites[site << 4];
    s.kind = kGlobalLoad;
    s.requests += 1;
    s.lanes += lanes;
    s.bytes += bytes;
}

// ---- the shim's hooks (synchronisation points, loads, copies); nothing happens while the access model is off --------
COLI_EMU_NOSAN void model_arrive(bool consume) {
    if (!acc_model.on) return;
    close_run(g.current);
    if (consume) consume_loads(g.current);
}

COLI_EMU_NOSAN void model_block_release() {
    if (acc_model.on) flush_shared();
}

COLI_EMU_NOSAN void note_load(uint32_t bytes) {
    if (!smem.in_copy) smem.outstanding[g.current] += bytes;
}

COLI_EMU_NOSAN void note_global_request(uintptr_t site, size_t lanes, unsigned long long bytes) {
    add_global_request(site, lanes, bytes);
}

// At a cp.async wait: the bytes of every copy the thread has in flight are one batch.
COLI_EMU_NOSAN void note_copies_in_flight(const AsyncCopies& a) {
    if (!acc_model.on) return;
    size_t copies = a.open.size();
    for (const std::vector<AsyncCopy>& group : a.groups) copies += group.size();
    if (copies) add_batch(16ull * copies, true);
}

#endif  // COLI_EMU_RUNTIME

}  // namespace coli_emu
