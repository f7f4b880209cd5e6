// memory.cpp: "device memory" as host memory (256-byte aligned, canary bytes around every allocation, checked at
// every synchronisation and free), pinned host memory, and the copy and memset calls. fake_cuda.h describes the whole
// driver.
#include <cstdlib>
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

namespace fake {

constexpr size_t kAlign = 256;  // cuMemAlloc's alignment
constexpr size_t kGuard = 256;  // canary bytes before and after every device allocation
constexpr unsigned char kCanary = 0xA5;

std::map<uintptr_t, Allocation> g_allocs;  // by start address
namespace {
size_t g_device_bytes = 0;
}  // namespace

// The live allocation holding [p, p+n), or nullptr.
Allocation* find_alloc(uintptr_t p, size_t n, uintptr_t* base) {
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    if (p < it->first || p + n > it->first + it->second.size || p + n < p) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

bool guards_intact(uintptr_t start, const Allocation& a) {
    if (!a.device) return true;
    const unsigned char* before = reinterpret_cast<const unsigned char*>(start) - kGuard;
    const unsigned char* after = reinterpret_cast<const unsigned char*>(start) + a.size;
    for (size_t i = 0; i < kGuard; ++i)
        if (before[i] != kCanary || after[i] != kCanary) return false;
    return true;
}

// Every device allocation's canaries intact; else the context is poisoned with CUDA_ERROR_ILLEGAL_ADDRESS.
CUresult check_guards(const char* call) {
    for (const auto& [start, a] : g_allocs) {
        if (!guards_intact(start, a)) {
            complain(call, "a write outside the device allocation at %p (%zu bytes)", (void*)start, a.size);
            g_sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
        }
    }
    return g_sticky;
}

namespace {
void* alloc_aligned(size_t size, bool device, uintptr_t* start) {
    const size_t total = size + 2 * kGuard + kAlign;
    auto* raw = static_cast<unsigned char*>(std::malloc(total));
    if (!raw) return nullptr;
    uintptr_t s = (reinterpret_cast<uintptr_t>(raw) + kGuard + kAlign - 1) / kAlign * kAlign;
    std::memset(raw, kCanary, total);
    std::memset(reinterpret_cast<void*>(s), 0, size);
    g_allocs[s] = {raw, size, device};
    *start = s;
    return raw;
}
}  // namespace

CUresult device_range(const char* call, CUdeviceptr p, size_t n) {
    Allocation* a = find_alloc(p, n ? n : 1);
    if (!a || !a->device) {
        complain(call, "device range [0x%llx, +%zu) is not inside one live cuMemAlloc allocation", p, n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

bool is_pinned(const void* p, size_t n) {
    Allocation* a = find_alloc(reinterpret_cast<uintptr_t>(p), n ? n : 1);
    return a && !a->device;
}

}  // namespace fake

// ---- memory ---------------------------------------------------------------------------------------------------------
API CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
    ENTER("cuMemAlloc", true);
    if (CUresult r = need_context("cuMemAlloc")) return r;
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t start;
    if (!alloc_aligned(bytes, true, &start)) return CUDA_ERROR_OUT_OF_MEMORY;
    g_device_bytes += bytes;
    *dptr = start;
    log_line("cuMemAlloc bytes=%zu ptr=0x%llx", bytes, (unsigned long long)start);
    return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr p) {
    ENTER("cuMemFree", true);
    if (CUresult r = need_context("cuMemFree")) return r;
    auto it = g_allocs.find(p);
    if (it == g_allocs.end() || !it->second.device) {
        complain("cuMemFree", "0x%llx is not the start of a live cuMemAlloc allocation", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult r = guards_intact(it->first, it->second) ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r) complain("cuMemFree", "a write outside the device allocation at 0x%llx", p);
    g_device_bytes -= it->second.size;
    std::free(it->second.raw);
    g_allocs.erase(it);
    log_line("cuMemFree ptr=0x%llx", p);
    return r;
}

API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    ENTER("cuMemGetInfo", true);
    if (CUresult r = need_context("cuMemGetInfo")) return r;
    *total = size_t(16) << 30;
    *free_bytes = *total - g_device_bytes;
    return CUDA_SUCCESS;
}

static CUresult host_alloc(const char* call, void** pp, size_t bytes, unsigned flags) {
    if (CUresult r = need_context(call)) return r;
    if (!pp || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t start;
    if (!alloc_aligned(bytes, false, &start)) return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = reinterpret_cast<void*>(start);
    log_line("%s bytes=%zu flags=%u ptr=%p", call, bytes, flags, *pp);
    return CUDA_SUCCESS;
}

API CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int flags) {
    ENTER("cuMemHostAlloc", true);
    return host_alloc("cuMemHostAlloc", pp, bytes, flags);
}

API CUresult cuMemAllocHost_v2(void** pp, size_t bytes) {
    ENTER("cuMemAllocHost", true);
    return host_alloc("cuMemAllocHost", pp, bytes, 0);
}

API CUresult cuMemFreeHost(void* p) {
    ENTER("cuMemFreeHost", true);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end() || it->second.device) {
        complain("cuMemFreeHost", "%p is not the start of a live cuMemHostAlloc allocation", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::free(it->second.raw);
    g_allocs.erase(it);
    log_line("cuMemFreeHost ptr=%p", p);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    ENTER("cuMemcpyHtoD", true);
    return copy_node("cuMemcpyHtoD", dst, reinterpret_cast<uintptr_t>(src), n, nullptr, true, false, false);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoH", true);
    return copy_node("cuMemcpyDtoH", reinterpret_cast<uintptr_t>(dst), src, n, nullptr, false, true, false);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoD", true);
    return copy_node("cuMemcpyDtoD", dst, src, n, nullptr, true, true, false);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* stream) {
    ENTER("cuMemcpyHtoDAsync", true);
    return copy_node("cuMemcpyHtoDAsync", dst, reinterpret_cast<uintptr_t>(src), n, stream, true, false, true);
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* stream) {
    ENTER("cuMemcpyDtoHAsync", true);
    return copy_node("cuMemcpyDtoHAsync", reinterpret_cast<uintptr_t>(dst), src, n, stream, false, true, true);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* stream) {
    ENTER("cuMemcpyDtoDAsync", true);
    return copy_node("cuMemcpyDtoDAsync", dst, src, n, stream, true, true, true);
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    ENTER("cuMemsetD8", true);
    return memset_node("cuMemsetD8", dst, v, n, 1, nullptr, false);
}
API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n) {
    ENTER("cuMemsetD32", true);
    return memset_node("cuMemsetD32", dst, v, n, 4, nullptr, false);
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* stream) {
    ENTER("cuMemsetD8Async", true);
    return memset_node("cuMemsetD8Async", dst, v, n, 1, stream, true);
}
API CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, void* stream) {
    ENTER("cuMemsetD32Async", true);
    return memset_node("cuMemsetD32Async", dst, v, n, 4, stream, true);
}
