// cuda_shim.h: the CUDA C subset of kernels/*.cu on the CPU, so that g++ compiles the unmodified kernel sources
// and tests/kernels/emulator.py runs a launch plan without a GPU.
//
// An emulation of the LOGIC only (indexing, tails, barriers, warp exchanges, atomics): it says nothing about GPU
// timing, the GPU memory model, occupancy or register use.
//
// Execution model: one launch runs its blocks one after another on the calling thread. The threads of a block are
// fibers (ucontext, switched with _setjmp/_longjmp) of that thread, switched only at the synchronisation points: __syncthreads, __syncwarp and the
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
//   - alignment: an 8- or 16-byte __ldg must be aligned to its size, both addresses of a 16-byte cp.async to 16
//     bytes (an error of the launch otherwise, as the GPU raises a misaligned-address fault); under the random
//     schedule a cp.async copy lands at a random synchronisation point of its thread between issue and the wait
//     that retires it (at the issue itself included), so a stage refilled before every thread is done with it, or
//     read before its wait, shows up as a wrong result;
//   - strict rules, each an error of the launch rather than a hang: a __syncthreads must be reached by every
//     thread of the block, a full-mask warp operation by all 32 lanes (a thread that exited before counts as
//     missing), and a state where no fiber can move is a deadlock. A segmentation fault inside a kernel is
//     reported with the block and thread instead of killing the process.
// Only the intrinsics the kernels use are defined; anything else fails to compile, which is the point.
//
// This header is the one the kernel units include. It holds the qualifiers and vector types, and includes its parts
// in order: emu_state.h (the launch state), emu_scheduler.h (fibers, barriers, warp exchanges), emu_access.h (the
// access model of global loads), smem_model.h (its shared-memory counters), emu_launch.h (a grid launch),
// emu_intrinsics.h (the CUDA intrinsics), emu_mma_cp_async.h (tensor cores and cp.async).
// Two halves: a kernel unit compiles the kernels, the intrinsics (inline, as small as they can be) and the entry
// points; everything they call (the scheduler, the launch, the access and shared-memory models, cp.async and mma)
// is declared here and defined under COLI_EMU_RUNTIME, which only runner.cpp sets: g++ compiles it once per
// library (and once for every library of the same flags, emulator.py `_objects`), not once per kernel unit.
// An include guard rather than #pragma once: the guard also holds when the header came from its precompiled form
// (emulator.py _shim_pch) and a unit includes it again.
#ifndef COLI_EMU_CUDA_SHIM_H
#define COLI_EMU_CUDA_SHIM_H

#include <csetjmp>
#include <setjmp.h>
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
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }

// Set by the scheduler before every switch into a fiber.
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#include "emu_state.h"
#include "emu_scheduler.h"
#include "emu_access.h"
#include "smem_model.h"
#include "emu_launch.h"
#include "emu_intrinsics.h"
#include "emu_mma_cp_async.h"

#endif  // COLI_EMU_CUDA_SHIM_H
