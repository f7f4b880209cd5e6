// runner.cpp: the entry points of the emulation library besides the kernels (tests/kernels/emulator.py builds
// one library per set of compile-time constants: this file plus one unit per kernel source, each unit
// `#include "cuda_shim.h"`, `#include "<source>.cu"` and COLI_EMU_EXPORT(symbol) for each entry point).
#include <dlfcn.h>

#define COLI_EMU_RUNTIME 1  // this unit holds the shim's definitions (cuda_shim.h, "Two halves")
#include "cuda_shim.h"

#ifndef COLI_EMU_SMEM_MODEL
#define COLI_EMU_SMEM_MODEL 0
#endif

#define COLI_EMU_API extern "C" __attribute__((visibility("default")))

// The error of the last failed launch ("" after a successful one).
COLI_EMU_API const char* coli_emu_error() { return coli_emu::g.error; }

// Schedule of the following launches: 0 threads and blocks in increasing order, 1 decreasing, 2 a pseudo-random
// order per scheduling round seeded by `seed`.
COLI_EMU_API void coli_emu_set_schedule(int mode, unsigned long long seed) {
    coli_emu::g.mode = mode;
    coli_emu::g.rng = seed ? seed : 0x9E3779B97F4A7C15ull;
}

// The fp16 → fp32 conversion the kernels use under emulation, bits to bits (no float crosses the ABI, so a
// signalling NaN stays as it is), for a test against NumPy.
COLI_EMU_API void coli_emu_half_to_float(const unsigned short* in, unsigned int* out, unsigned long long n) {
    for (unsigned long long i = 0; i < n; ++i) {
        const float f = coli_emu::half_bits_to_float(in[i]);
        std::memcpy(&out[i], &f, 4);
    }
}

// ---- access model (cuda_shim.h): loads through __ldg, per address class -------------------------------------------
// Register [lo, lo + size) as address class `cls` (0..kClasses-2); a negative size clears every region.
COLI_EMU_API void coli_emu_access_region(unsigned long long lo, long long size, int cls) {
    if (size < 0) {
        coli_emu::acc_model.regions.clear();
        return;
    }
    coli_emu::acc_model.regions.push_back({uintptr_t(lo), uintptr_t(lo + size), cls});
}

// Turn recording on (1) or off (0) for the following launches.
COLI_EMU_API void coli_emu_access_enable(int on) { coli_emu::acc_model.on = on != 0; }

// Copy the totals since the last read into out[kClasses][4] (instructions, sectors, min_sectors, bytes), then reset.
COLI_EMU_API int coli_emu_access_read(unsigned long long* out) {
    for (int c = 0; c < coli_emu::kClasses; ++c) {
        const coli_emu::AccessStats& s = coli_emu::acc_model.stats[c];
        out[4 * c] = s.instructions;
        out[4 * c + 1] = s.sectors;
        out[4 * c + 2] = s.min_sectors;
        out[4 * c + 3] = s.bytes;
        coli_emu::acc_model.stats[c] = {};
    }
    return coli_emu::kClasses;
}

// ---- shared memory, lanes and bytes in flight (emu/smem_model.h; recorded with the access model on) --------------
// Per access site since the last read, rows of 7: site (offset in this library: addr2line gives its source line),
// kind (0 shared load, 1 shared store, 2 global load), warp-level requests, wavefronts, ideal wavefronts, active
// lanes summed over requests, distinct bytes. Writes at most max_rows rows, returns the number of sites (then
// resets, whatever the count).
COLI_EMU_API long long coli_emu_model_sites(unsigned long long* out, long long max_rows) {
    Dl_info info{};
    dladdr(reinterpret_cast<void*>(&coli_emu_model_sites), &info);
    const uintptr_t base = uintptr_t(info.dli_fbase);
    long long n = 0;
    for (const auto& [key, s] : coli_emu::smem.sites) {
        if (n < max_rows) {
            unsigned long long* row = out + 7 * n;
            row[0] = (key >> 4) - base;
            row[1] = s.kind;
            row[2] = s.requests;
            row[3] = s.wavefronts;
            row[4] = s.ideal;
            row[5] = s.lanes;
            row[6] = s.bytes;
        }
        ++n;
    }
    coli_emu::smem.sites.clear();
    return n;
}

// Bytes-in-flight batches since the last read (then reset): out[6] = __ldg batches, their bytes, their bytes
// squared; cp.async batches, bytes, bytes squared (a batch: the bytes one thread has outstanding at a use point).
COLI_EMU_API void coli_emu_model_inflight(unsigned long long* out) {
    coli_emu::SmemModel& m = coli_emu::smem;
    const unsigned long long v[6] = {m.batches, m.batch_bytes, m.batch_bytes_sq, m.async_batches, m.async_bytes,
                                     m.async_bytes_sq};
    for (int i = 0; i < 6; ++i) out[i] = v[i];
    m.batches = m.batch_bytes = m.batch_bytes_sq = m.async_batches = m.async_bytes = m.async_bytes_sq = 0;
    for (unsigned long long& o : m.outstanding) o = 0;
}

// Register [offset, offset + size) of this library's image as `__shared__` storage (smem_model.h SmemModel::extra);
// a negative size clears the list. 0, or 1 when the list is full.
COLI_EMU_API int coli_emu_model_shared_region(unsigned long long offset, long long size) {
    coli_emu::SmemModel& m = coli_emu::smem;
    if (size < 0) {
        m.extra_n = 0;
        return 0;
    }
    if (m.extra_n == m.kExtra) return 1;
    Dl_info info{};
    dladdr(reinterpret_cast<void*>(&coli_emu_model_shared_region), &info);
    const uintptr_t lo = uintptr_t(info.dli_fbase) + uintptr_t(offset);
    m.extra_lo[m.extra_n] = lo;
    m.extra_hi[m.extra_n++] = lo + uintptr_t(size);
    return 0;
}

// Block sampling of the following launches with the access model on: only blocks whose linear index is a
// multiple of `stride` run (1: every block). Returns the blocks run since the last call, then resets that count.
COLI_EMU_API long long coli_emu_model_sample(long long stride) {
    const long long ran = coli_emu::acc_model.blocks_run;
    coli_emu::acc_model.sample = stride < 1 ? 1 : stride;
    coli_emu::acc_model.blocks_run = 0;
    return ran;
}

// 1 when this library records shared-memory accesses (built with COLI_EMU_SMEM_MODEL), else 0.
COLI_EMU_API int coli_emu_model_shared() { return COLI_EMU_SMEM_MODEL; }

#if COLI_EMU_SMEM_MODEL
// The calls g++ -fsanitize=thread puts before every memory access of the kernel code (no ThreadSanitizer runtime
// is linked: these are the only definitions). The return address is the access site.
#define COLI_TSAN_HOOK(name, bytes, write)                                                                       \
    COLI_EMU_API __attribute__((no_sanitize_thread)) void name(void* p) {                                       \
        coli_emu::on_access(uintptr_t(p), bytes, write, uintptr_t(__builtin_return_address(0)));                \
    }
COLI_TSAN_HOOK(__tsan_read1, 1, false)
COLI_TSAN_HOOK(__tsan_read2, 2, false)
COLI_TSAN_HOOK(__tsan_read4, 4, false)
COLI_TSAN_HOOK(__tsan_read8, 8, false)
COLI_TSAN_HOOK(__tsan_read16, 16, false)
COLI_TSAN_HOOK(__tsan_write1, 1, true)
COLI_TSAN_HOOK(__tsan_write2, 2, true)
COLI_TSAN_HOOK(__tsan_write4, 4, true)
COLI_TSAN_HOOK(__tsan_write8, 8, true)
COLI_TSAN_HOOK(__tsan_write16, 16, true)
COLI_TSAN_HOOK(__tsan_unaligned_read2, 2, false)
COLI_TSAN_HOOK(__tsan_unaligned_read4, 4, false)
COLI_TSAN_HOOK(__tsan_unaligned_read8, 8, false)
COLI_TSAN_HOOK(__tsan_unaligned_read16, 16, false)
COLI_TSAN_HOOK(__tsan_unaligned_write2, 2, true)
COLI_TSAN_HOOK(__tsan_unaligned_write4, 4, true)
COLI_TSAN_HOOK(__tsan_unaligned_write8, 8, true)
COLI_TSAN_HOOK(__tsan_unaligned_write16, 16, true)
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_init() {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_func_entry(void*) {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_func_exit() {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_vptr_update(void*, void*) {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_vptr_read(void*) {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_read_range(void*, unsigned long) {}
COLI_EMU_API __attribute__((no_sanitize_thread)) void __tsan_write_range(void*, unsigned long) {}
#endif
