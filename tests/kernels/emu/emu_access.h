// emu_access.h: the access model of global loads: each warp-level load instruction's 32-byte sectors and requested
// bytes, summed per address class (coli_emu_access_enable, bench/kernel_access.py).
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
#pragma once

namespace coli_emu {

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
extern Access acc_model;

// One global load of `bytes` at p by the current thread, from the site that called (noinline: the return address
// is the load site, __ldg being inlined into the kernel).
void record_load(const void* p, uint32_t bytes);
// One warp-level instruction per pending entry: sectors touched, the distinct bytes its lanes asked for.
void flush_accesses();

#if defined(COLI_EMU_RUNTIME)
Access acc_model;

static int access_class(uintptr_t a) {
    for (const AccessRegion& r : acc_model.regions)
        if (a >= r.lo && a < r.hi) return r.cls;
    return kClasses - 1;
}

void note_load(uint32_t bytes);  // smem_model.h

// The site is this call's return address: __ldg is inlined, so each load site in a kernel calls from its own place.
__attribute__((noinline)) void record_load(const void* p, uint32_t bytes) {
    const uintptr_t site = uintptr_t(__builtin_return_address(0));
    note_load(bytes);
    const uint64_t who = (uint64_t(site) << 11) ^ uint64_t(g.current);
    const uint32_t occurrence = acc_model.seen[who]++;
    acc_model.pending[InstrKey{site, uint32_t(g.current / 32), occurrence}].emplace_back(uintptr_t(p), bytes);
}

void note_global_request(uintptr_t site, size_t lanes, unsigned long long bytes);  // smem_model.h

void flush_accesses() {
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

#endif  // COLI_EMU_RUNTIME

}  // namespace coli_emu
