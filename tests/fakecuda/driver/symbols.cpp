// symbols.cpp: cuGetProcAddress (every implemented name at the CUDA versions of its ABI; any other name
// CUDA_ERROR_NOT_FOUND), cuGetExportTable, and the test hooks tests reach with ctypes. fake_cuda.h describes the whole
// driver.
#include <cstdlib>
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

API CUresult cuGetExportTable(const void** table, const void* id) {
    (void)id;
    if (table) *table = nullptr;
    complain("cuGetExportTable", "not emulated (the CUDA runtime library cannot run on the fake driver)");
    return CUDA_ERROR_NOT_SUPPORTED;
}
// ---- symbol lookup --------------------------------------------------------------------------------------------------
namespace {
struct Proc {
    const char* name;
    void* fn;
    int min_version;  // the ABI implemented here is the one cuGetProcAddress gives from this CUDA version on
    int max_version;  // ... up to (excluded) this one; 0: no limit
};
const Proc kProcs[] = {
    {"cuGetErrorName", (void*)cuGetErrorName, 0, 0},
    {"cuGetErrorString", (void*)cuGetErrorString, 0, 0},
    {"cuInit", (void*)cuInit, 0, 0},
    {"cuDriverGetVersion", (void*)cuDriverGetVersion, 0, 0},
    {"cuDeviceGet", (void*)cuDeviceGet, 0, 0},
    {"cuDeviceGetCount", (void*)cuDeviceGetCount, 0, 0},
    {"cuDeviceGetName", (void*)cuDeviceGetName, 0, 0},
    {"cuDeviceTotalMem", (void*)cuDeviceTotalMem_v2, 3020, 0},
    {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute, 0, 0},
    {"cuDevicePrimaryCtxRetain", (void*)cuDevicePrimaryCtxRetain, 0, 0},
    {"cuDevicePrimaryCtxRelease", (void*)cuDevicePrimaryCtxRelease_v2, 11000, 0},
    {"cuCtxCreate", (void*)cuCtxCreate_v2, 3020, 11040},
    {"cuCtxDestroy", (void*)cuCtxDestroy_v2, 4000, 0},
    {"cuCtxSetCurrent", (void*)cuCtxSetCurrent, 0, 0},
    {"cuCtxGetCurrent", (void*)cuCtxGetCurrent, 0, 0},
    {"cuCtxGetDevice", (void*)cuCtxGetDevice, 0, 0},
    {"cuCtxSynchronize", (void*)cuCtxSynchronize, 0, 0},
    {"cuMemAlloc", (void*)cuMemAlloc_v2, 3020, 0},
    {"cuMemFree", (void*)cuMemFree_v2, 3020, 0},
    {"cuMemGetInfo", (void*)cuMemGetInfo_v2, 3020, 0},
    {"cuMemHostAlloc", (void*)cuMemHostAlloc, 0, 0},
    {"cuMemAllocHost", (void*)cuMemAllocHost_v2, 3020, 0},
    {"cuMemFreeHost", (void*)cuMemFreeHost, 0, 0},
    {"cuMemcpyHtoD", (void*)cuMemcpyHtoD_v2, 3020, 0},
    {"cuMemcpyDtoH", (void*)cuMemcpyDtoH_v2, 3020, 0},
    {"cuMemcpyDtoD", (void*)cuMemcpyDtoD_v2, 3020, 0},
    {"cuMemcpyHtoDAsync", (void*)cuMemcpyHtoDAsync_v2, 3020, 0},
    {"cuMemcpyDtoHAsync", (void*)cuMemcpyDtoHAsync_v2, 3020, 0},
    {"cuMemcpyDtoDAsync", (void*)cuMemcpyDtoDAsync_v2, 3020, 0},
    {"cuMemsetD8", (void*)cuMemsetD8_v2, 3020, 0},
    {"cuMemsetD32", (void*)cuMemsetD32_v2, 3020, 0},
    {"cuMemsetD8Async", (void*)cuMemsetD8Async, 0, 0},
    {"cuMemsetD32Async", (void*)cuMemsetD32Async, 0, 0},
    {"cuModuleLoadData", (void*)cuModuleLoadData, 0, 0},
    {"cuModuleUnload", (void*)cuModuleUnload, 0, 0},
    {"cuModuleGetFunction", (void*)cuModuleGetFunction, 0, 0},
    {"cuStreamCreate", (void*)cuStreamCreate, 0, 0},
    {"cuStreamDestroy", (void*)cuStreamDestroy_v2, 4000, 0},
    {"cuStreamSynchronize", (void*)cuStreamSynchronize, 0, 0},
    {"cuStreamIsCapturing", (void*)cuStreamIsCapturing, 0, 0},
    {"cuStreamBeginCapture", (void*)cuStreamBeginCapture_v2, 10010, 0},
    {"cuStreamEndCapture", (void*)cuStreamEndCapture, 0, 0},
    {"cuEventCreate", (void*)cuEventCreate, 0, 0},
    {"cuEventDestroy", (void*)cuEventDestroy_v2, 4000, 0},
    {"cuEventRecord", (void*)cuEventRecord, 0, 0},
    {"cuEventSynchronize", (void*)cuEventSynchronize, 0, 0},
    {"cuEventElapsedTime", (void*)cuEventElapsedTime, 0, 0},
    {"cuLaunchKernel", (void*)cuLaunchKernel, 0, 0},
    {"cuLaunchKernelEx", (void*)cuLaunchKernelEx, 0, 0},
    {"cuGraphInstantiateWithFlags", (void*)cuGraphInstantiateWithFlags, 0, 0},
    {"cuGraphLaunch", (void*)cuGraphLaunch, 0, 0},
    {"cuGraphExecDestroy", (void*)cuGraphExecDestroy, 0, 0},
    {"cuGraphDestroy", (void*)cuGraphDestroy, 0, 0},
    {"cuGetProcAddress", (void*)cuGetProcAddress_v2, 12000, 0},
};
}  // namespace

API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, int* status) {
    std::lock_guard<std::recursive_mutex> lock(M);
    (void)flags;  // per-thread default stream variants behave the same here: every stream runs in order
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = nullptr;
    for (const auto& p : kProcs) {
        if (std::strcmp(p.name, symbol) != 0) continue;
        if (version < p.min_version || (p.max_version && version >= p.max_version)) {
            if (std::getenv("COLIBRI_FAKE_CUDA_VERBOSE"))
                complain("cuGetProcAddress", "%s at CUDA version %d: that ABI variant is not emulated", symbol,
                         version);
            break;
        }
        *pfn = p.fn;
        if (status) *status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
        return CUDA_SUCCESS;
    }
    if (std::getenv("COLIBRI_FAKE_CUDA_VERBOSE")) complain("cuGetProcAddress", "%s is not emulated", symbol);
    if (status) *status = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    return CUDA_ERROR_NOT_FOUND;
}

// The pre-12.0 form (no status argument).
API CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}

// ---- test hooks (not part of the CUDA API; tests reach them with ctypes.CDLL("libcuda.so.1")) -----------------------
// The kernel emulation library bound to the modules loaded from now on (NULL: back to COLIBRI_FAKE_CUDA_KERNELS).
API void colibri_fake_cuda_set_kernels(const char* path) {
    std::lock_guard<std::recursive_mutex> lock(M);
    g_kernels_override = path ? path : "";
}

// What is alive, for leak checks: "device=N host=N modules=N functions=N streams=N events=N graphs=N execs=N
// primary_refs=N" (device and host: live allocations).
API const char* colibri_fake_cuda_live() {
    std::lock_guard<std::recursive_mutex> lock(M);
    static char buf[256];
    size_t device = 0, host = 0;
    for (const auto& [start, a] : g_allocs) (a.device ? device : host) += 1;
    std::snprintf(buf, sizeof buf, "device=%zu host=%zu modules=%zu functions=%zu streams=%zu events=%zu graphs=%zu "
                  "execs=%zu primary_refs=%d", device, host, g_modules.size(), g_functions.size(), g_streams.size(),
                  g_events.size(), g_graphs.size(), g_execs.size(), g_primary_refs);
    return buf;
}

// Replace the failures to inject (the COLIBRI_FAKE_CUDA_FAIL syntax; "" for none); call counts start again.
API void colibri_fake_cuda_fail(const char* spec) {
    std::lock_guard<std::recursive_mutex> lock(M);
    load_settings();
    parse_injections(spec ? spec : "");
}
