// emu_mma_cp_async.h: the tensor-core mma and the asynchronous 16-byte copies of common.cuh (mma_m16n8k16,
// cp_async16, cp_async_commit, cp_async_wait), in plain C++.
// Part of cuda_shim.h, which includes its parts in order (each uses the ones before it); not for use on its own.
#pragma once

// ---- tensor cores and asynchronous copies (common.cuh mma_m16n8k16, cp_async16) ----------------------------------
// mma: every lane deposits its fragments, the warp meets, each lane computes its four D entries from the whole A
// and B (fp16 → float exactly, products summed in k order 0..15 in float, then + C: the GPU's internal order and
// precision are not specified, so results may differ in the last bits), the warp meets again before the slots are
// reused.
namespace coli_emu {
void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]);
// The copy of 16 bytes `v` to shared `dst`, issued by the current thread (common.cuh cp_async16).
void issue_copy(void* dst, const uint4& v);
// The current thread's copies since its last commit become one group (cp_async_commit).
void commit_copies();
// The current thread's oldest groups land until at most `pending` remain (cp_async_wait).
void wait_copies(int pending);

#if defined(COLI_EMU_RUNTIME)
static uint32_t mma_a[kWarps][32][4], mma_b[kWarps][32][2];

// Every half as a float (half_bits_to_float), made when the library loads (a namespace-scope initialiser: no
// guard variable, whose atomics the shared-memory model's instrumentation would want a runtime for).
static float half_table[1 << 16];
[[maybe_unused]] static const bool half_table_made = [] {
    for (uint32_t h = 0; h < (1u << 16); ++h) half_table[h] = half_bits_to_float(uint16_t(h));
    return true;
}();
static float mma_half(uint32_t word, int high) { return half_table[high ? word >> 16 : word & 0xffffu]; }

void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
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


void issue_copy(void* dst, const uint4& v) {
    AsyncCopy c{dst, {}};
    std::memcpy(c.bytes, &v, 16);
    if (g.mode >= 2 && next_random() % 4 == 0) {  // lands at once
        land(c);
        return;
    }
    async_copies[g.current].open.push_back(c);
}

void commit_copies() {
    AsyncCopies& a = async_copies[g.current];
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}

void wait_copies(int pending) {
    AsyncCopies& a = async_copies[g.current];
    note_copies_in_flight(a);
    while ((int)a.groups.size() > pending) {
        for (const AsyncCopy& c : a.groups.front()) land(c);
        a.groups.pop_front();
    }
}
#endif  // COLI_EMU_RUNTIME

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
    coli_emu::issue_copy(dst, v);
}
inline void coli_emu_cp_async_commit() { coli_emu::commit_copies(); }
// Retire the oldest committed groups until at most `pending` remain (copies not yet committed stay in flight).
inline void coli_emu_cp_async_wait(int pending) { coli_emu::wait_copies(pending); }
