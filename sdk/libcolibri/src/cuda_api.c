/* cuda_api.c: libcuda.so.1 opened at run time (dlopen), every function resolved by its exported name. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "colibri.h"
#include "cuda_api.h"
#include "internal.h"

#define SYMBOL(field, name) {offsetof(cu_api, field), name}

static const struct {
    size_t offset;
    const char *name;
} symbols[] = {
    SYMBOL(cuInit, "cuInit"),
    SYMBOL(cuDriverGetVersion, "cuDriverGetVersion"),
    SYMBOL(cuDeviceGetCount, "cuDeviceGetCount"),
    SYMBOL(cuDeviceGet, "cuDeviceGet"),
    SYMBOL(cuDeviceGetName, "cuDeviceGetName"),
    SYMBOL(cuDeviceGetAttribute, "cuDeviceGetAttribute"),
    SYMBOL(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SYMBOL(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    SYMBOL(cuCtxSetCurrent, "cuCtxSetCurrent"),
    SYMBOL(cuGetErrorName, "cuGetErrorName"),
    SYMBOL(cuMemAlloc, "cuMemAlloc_v2"),
    SYMBOL(cuMemFree, "cuMemFree_v2"),
    SYMBOL(cuMemHostAlloc, "cuMemHostAlloc"),
    SYMBOL(cuMemFreeHost, "cuMemFreeHost"),
    SYMBOL(cuMemsetD32, "cuMemsetD32_v2"),
    SYMBOL(cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
    SYMBOL(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    SYMBOL(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    SYMBOL(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    SYMBOL(cuModuleLoadData, "cuModuleLoadData"),
    SYMBOL(cuModuleUnload, "cuModuleUnload"),
    SYMBOL(cuModuleGetFunction, "cuModuleGetFunction"),
    SYMBOL(cuStreamCreate, "cuStreamCreate"),
    SYMBOL(cuStreamDestroy, "cuStreamDestroy_v2"),
    SYMBOL(cuStreamSynchronize, "cuStreamSynchronize"),
    SYMBOL(cuEventCreate, "cuEventCreate"),
    SYMBOL(cuEventDestroy, "cuEventDestroy_v2"),
    SYMBOL(cuEventRecord, "cuEventRecord"),
    SYMBOL(cuEventSynchronize, "cuEventSynchronize"),
    SYMBOL(cuLaunchKernel, "cuLaunchKernel"),
    SYMBOL(cuStreamBeginCapture, "cuStreamBeginCapture_v2"),
    SYMBOL(cuStreamEndCapture, "cuStreamEndCapture"),
    SYMBOL(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags"),
    SYMBOL(cuGraphLaunch, "cuGraphLaunch"),
    SYMBOL(cuGraphExecDestroy, "cuGraphExecDestroy"),
    SYMBOL(cuGraphDestroy, "cuGraphDestroy"),
};

int cu_api_load(cu_api *cu, const char *library, cb_err *err) {
    char esc[256];
    memset(cu, 0, sizeof *cu);
    const char *name = library && *library ? library : "libcuda.so.1";
    cu->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!cu->lib) {
        const char *why = dlerror();
        /* dlerror() already starts with the library name ("libcuda.so.1: cannot open shared object file ..."). */
        if (why && strncmp(why, name, strlen(name)) == 0)
            return cb_fail(err, COLIBRI_ERR_NO_DRIVER, "no CUDA driver (%s)", cb_escape(why, esc, sizeof esc));
        return cb_fail(err, COLIBRI_ERR_NO_DRIVER, "no CUDA driver (%s: %s)", cb_escape(name, esc, 128),
                       why ? why : "dlopen failed");
    }
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        void *f = dlsym(cu->lib, symbols[i].name);
        if (!f) {
            int rc = cb_fail(err, COLIBRI_ERR_NO_DRIVER, "the CUDA driver %s has no %s; a driver for CUDA >= 11.4 is "
                             "needed", cb_escape(name, esc, 128), symbols[i].name);
            cu_api_unload(cu);
            return rc;
        }
        memcpy((char *)cu + symbols[i].offset, &f, sizeof f);
    }
    void *ex = dlsym(cu->lib, "cuLaunchKernelEx"); /* optional: a plan with "pdl" launches checks for it */
    memcpy(&cu->cuLaunchKernelEx, &ex, sizeof ex);
    return COLIBRI_OK;
}

/* The driver library stays loaded (as with the CUDA runtime and ctypes): unloading libcuda while the process runs
 * is not supported by the driver; dlopen of a loaded library only takes a reference. */
void cu_api_unload(cu_api *cu) { memset(cu, 0, sizeof *cu); }

const char *cu_error_name(const cu_api *cu, CUresult r, char *buf, size_t n) {
    const char *name = NULL;
    if (cu->cuGetErrorName && cu->cuGetErrorName(r, &name) == 0 && name) return name;
    snprintf(buf, n, "CUresult %d", r);
    return buf;
}
