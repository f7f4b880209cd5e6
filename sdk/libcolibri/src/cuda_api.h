/* cuda_api.h: the CUDA driver API functions libcolibri calls, resolved from libcuda.so.1 with dlopen/dlsym at run
 * time (no CUDA toolkit, runtime or nvcc needed to build or run). Types and enum values are the driver API's
 * (cuda.h of CUDA 12); the versioned symbol names (_v2) are those the driver exports for that ABI. */
#ifndef COLIBRI_CUDA_API_H
#define COLIBRI_CUDA_API_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

enum {
    CUDA_SUCCESS_ = 0,
    CUDA_ERROR_OUT_OF_MEMORY_ = 2,
    CU_DEVICE_ATTRIBUTE_INTEGRATED_ = 18,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR_ = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR_ = 76,
    CU_STREAM_NON_BLOCKING_ = 1,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL_ = 1,
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION_ = 6,
};

/* cuLaunchKernelEx's configuration, laid out as cuda.h (CUDA 12) has it: the attribute value is a 64-byte union whose
 * first int is programmaticStreamSerializationAllowed. */
typedef struct cu_launch_attribute {
    unsigned id;
    char pad[4];
    union {
        char bytes[64];
        int programmatic_stream_serialization_allowed;
    } value;
} cu_launch_attribute;
typedef struct cu_launch_config {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    CUstream stream;
    cu_launch_attribute *attrs;
    unsigned num_attrs;
} cu_launch_config;

typedef struct cu_api {
    void *lib;
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
    CUresult (*cuMemFreeHost)(void *);
    CUresult (*cuMemsetD32)(CUdeviceptr, unsigned, size_t);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleUnload)(CUmodule);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuStreamCreate)(CUstream *, unsigned);
    CUresult (*cuStreamDestroy)(CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void **, void **);
    /* optional (CUDA >= 11.8 drivers): resolved when present, needed only by a plan with "pdl" launches */
    CUresult (*cuLaunchKernelEx)(const cu_launch_config *, CUfunction, void **, void **);
    CUresult (*cuStreamBeginCapture)(CUstream, int);
    CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
    CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
    CUresult (*cuGraphExecDestroy)(CUgraphExec);
    CUresult (*cuGraphDestroy)(CUgraph);
} cu_api;

/* dlopen `library` (NULL: "libcuda.so.1") and resolve every function; 0 or COLIBRI_ERR_NO_DRIVER with a message. */
struct cb_err;
int cu_api_load(cu_api *cu, const char *library, struct cb_err *err);
void cu_api_unload(cu_api *cu);
/* "CUDA_ERROR_INVALID_VALUE", or "CUresult N". */
const char *cu_error_name(const cu_api *cu, CUresult r, char *buf, size_t n);

#endif
