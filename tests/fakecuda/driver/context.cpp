// context.cpp: cuInit, the driver version, the fake devices (COLIBRI_FAKE_CUDA_CC, _INTEGRATED, _DEVICES) and their
// contexts (the primary one and cuCtxCreate's). fake_cuda.h describes the whole driver.

#include "fake_cuda.h"

using namespace fake;

namespace fake {

Context g_primary{0};
int g_primary_refs = 0;
thread_local Context* t_current = nullptr;
namespace {
std::map<void*, std::unique_ptr<Context>> g_contexts;
}  // namespace

CUresult need_context(const char* call) {
    if (!t_current) {
        complain(call, "no current context (cuCtxSetCurrent / cuDevicePrimaryCtxRetain first)");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    return CUDA_SUCCESS;
}

}  // namespace fake

API CUresult cuInit(unsigned int flags) {
    std::lock_guard<std::recursive_mutex> lock(M);
    load_settings();
    log_line("cuInit flags=%u", flags);
    if (CUresult r = injected("cuInit")) return r;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (S.devices < 1) return CUDA_ERROR_NO_DEVICE;
    g_initialized = true;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int* version) {
    std::lock_guard<std::recursive_mutex> lock(M);
    load_settings();
    if (CUresult r = injected("cuDriverGetVersion")) return r;
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = S.driver;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int* count) {
    ENTER("cuDeviceGetCount", true);
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = S.devices;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    ENTER("cuDeviceGet", true);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName", true);
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(name, size_t(len), "%s", S.name.c_str());
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem", true);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = size_t(16) << 30;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int* pi, int attrib, CUdevice dev) {
    ENTER("cuDeviceGetAttribute", true);
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    int v;
    switch (attrib) {
        case 75: v = S.cc_major; break;           // COMPUTE_CAPABILITY_MAJOR
        case 76: v = S.cc_minor; break;           // COMPUTE_CAPABILITY_MINOR
        case 18: v = S.integrated; break;         // INTEGRATED
        case 1: v = 1024; break;                  // MAX_THREADS_PER_BLOCK
        case 2: case 3: v = 1024; break;          // MAX_BLOCK_DIM_X, _Y
        case 4: v = 64; break;                    // MAX_BLOCK_DIM_Z
        case 5: v = 2147483647; break;            // MAX_GRID_DIM_X
        case 6: case 7: v = 65535; break;         // MAX_GRID_DIM_Y, _Z
        case 8: v = 49152; break;                 // MAX_SHARED_MEMORY_PER_BLOCK
        case 97: v = 166912; break;               // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        case 81: v = 167936; break;               // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        case 10: v = 32; break;                   // WARP_SIZE
        case 16: v = S.integrated ? 16 : 132; break;  // MULTIPROCESSOR_COUNT
        case 19: case 41: v = 1; break;           // CAN_MAP_HOST_MEMORY, UNIFIED_ADDRESSING
        case 39: v = 2048; break;                 // MAX_THREADS_PER_MULTIPROCESSOR
        case 12: v = 65536; break;                // MAX_REGISTERS_PER_BLOCK
        case 9: v = 65536; break;                 // TOTAL_CONSTANT_MEMORY
        default:
            complain("cuDeviceGetAttribute", "attribute %d is not emulated", attrib);
            return CUDA_ERROR_NOT_SUPPORTED;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(void** pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain", true);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    ++g_primary_refs;
    *pctx = &g_primary;
    log_line("cuDevicePrimaryCtxRetain refs=%d", g_primary_refs);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease", true);
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    if (g_primary_refs <= 0) {
        complain("cuDevicePrimaryCtxRelease", "the primary context is not retained");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    --g_primary_refs;
    log_line("cuDevicePrimaryCtxRelease refs=%d", g_primary_refs);
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(void** pctx, unsigned int flags, CUdevice dev) {
    ENTER("cuCtxCreate", true);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.devices) return CUDA_ERROR_INVALID_DEVICE;
    auto ctx = std::make_unique<Context>(Context{dev});
    *pctx = ctx.get();
    t_current = ctx.get();
    g_contexts[ctx.get()] = std::move(ctx);
    (void)flags;
    return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy_v2(void* ctx) {
    ENTER("cuCtxDestroy", true);
    auto it = g_contexts.find(ctx);
    if (it == g_contexts.end()) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_current == ctx) t_current = nullptr;
    g_contexts.erase(it);
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(void* ctx) {
    ENTER("cuCtxSetCurrent", true);
    if (ctx && ctx != &g_primary && !g_contexts.count(ctx)) {
        complain("cuCtxSetCurrent", "unknown context %p", ctx);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (ctx == &g_primary && g_primary_refs <= 0) {
        complain("cuCtxSetCurrent", "the primary context was released");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    t_current = static_cast<Context*>(ctx);
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(void** pctx) {
    ENTER("cuCtxGetCurrent", true);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_current;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice* dev) {
    ENTER("cuCtxGetDevice", true);
    if (CUresult r = need_context("cuCtxGetDevice")) return r;
    *dev = t_current->device;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize() {
    ENTER("cuCtxSynchronize", true);
    if (CUresult r = need_context("cuCtxSynchronize")) return r;
    if (any_capture())
        if (CUresult r = refuse_during_capture("cuCtxSynchronize")) return r;
    return check_guards("cuCtxSynchronize");
}
