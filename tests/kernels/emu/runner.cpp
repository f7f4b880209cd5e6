// runner.cpp: the entry points of the emulation library besides the kernels (tests/kernels/emulator.py builds
// one library per set of compile-time constants: this file plus one unit per kernel source, each unit
// `#include "cuda_shim.h"`, `#include "<source>.cu"` and COLI_EMU_EXPORT(symbol) for each entry point).
#include "cuda_shim.h"

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
