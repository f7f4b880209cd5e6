// fake_cuda.h: a fake CUDA driver (libcuda.so.1) on the CPU, for testing the CUDA backend without a GPU.
//
// It implements the driver API functions the runtime uses (sdk/runtime/cuda_backend.py through cuda-bindings, and
// the ctypes probe of sdk/runtime/driver.py), with the ABI of the real library:
//   - cuda-bindings 12.x/13.x dlopen "libcuda.so.1" (cuda.pathfinder: system search, so LD_LIBRARY_PATH), dlsym
//     `cuGetProcAddress_v2`, and resolve every driver function through it with (name, CUDA version, flags, status);
//     names implemented here resolve to the function of that version's ABI (cuMemAlloc at 3020 → cuMemAlloc_v2,
//     cuStreamBeginCapture at 10010 → _v2, ...), every other name to CUDA_ERROR_NOT_FOUND, and calling such a
//     function raises FunctionNotFoundError in cuda-bindings;
//   - "device memory" is host memory: 256-byte aligned, with canary bytes around every allocation, checked at every
//     synchronisation and free (a write out of bounds is CUDA_ERROR_ILLEGAL_ADDRESS); copies and memsets must stay
//     inside one live allocation;
//   - modules: cuModuleLoadData takes a cubin (ELF, EM_CUDA; the SM in e_flags must be runnable on the fake device:
//     same major, minor <= the device's) or PTX text (its .target must not be newer than the device and its
//     .version not newer than the driver's PTX ISA). The parameter sizes of each entry come from the image (cubin:
//     EIATTR_KPARAM_INFO of .nv.info.<name>; PTX: the .entry signature). The code itself cannot run: each module is
//     bound to the kernel emulation library of tests/kernels/emulator.py (path in COLIBRI_FAKE_CUDA_KERNELS, or set
//     by colibri_fake_cuda_set_kernels), and cuModuleGetFunction(name) is its `coli_emu_launch_<name>`;
//   - streams are in order and run synchronously; cuStreamBeginCapture records copies, memsets and launches (kernel
//     parameter VALUES copied at record time, as a real graph does) instead of running them; cuGraphLaunch replays
//     the instantiated copy. Synchronising a capturing stream invalidates the capture.
//   - an event keeps the host time at which its record ran; cuEventElapsedTime is the emulation's CPU time;
// Settings (environment, read at cuInit): COLIBRI_FAKE_CUDA_DRIVER (cuDriverGetVersion, default 12090),
// COLIBRI_FAKE_CUDA_CC ("8.7"), COLIBRI_FAKE_CUDA_INTEGRATED ("0"/"1"), COLIBRI_FAKE_CUDA_DEVICES (1),
// COLIBRI_FAKE_CUDA_FAIL ("cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY" fails every call, "cuMemAlloc@3=..." the 3rd only;
// comma-separated), COLIBRI_FAKE_CUDA_KERNEL_MAP (emulation library per module image, see mapped_kernels),
// COLIBRI_FAKE_CUDA_LOG (a file: one line per call, for tests), COLIBRI_FAKE_CUDA_VERBOSE (name
// every unresolved cuGetProcAddress lookup on stderr).
// Every error the fake itself detects is also printed on stderr as "fake libcuda: <call>: <why>".
//
// The driver is the .cpp files of this folder, compiled together into one libcuda.so.1 (g++ -shared; every
// builder globs driver/*.cpp): settings.cpp (error names, settings, log, failure injection), context.cpp (cuInit,
// devices, contexts), memory.cpp (device and pinned memory, copies, memsets), modules.cpp (cubin/PTX images bound to
// the kernel emulation library), streams.cpp (the work nodes, streams, events), graphs.cpp (launches, stream
// capture, CUDA Graphs), symbols.cpp (cuGetProcAddress and the test hooks). This header holds what they share: the
// driver's types, its state (namespace fake, hidden: -fvisibility=hidden) and the driver API they define.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_UNKNOWN = 999,
};

namespace fake {

// ---- error names (settings.cpp) --------------------------------------------------------------------------------
struct ErrorName {
    int code;
    const char* name;
    const char* text;
};
const ErrorName* find_error(int code);
int error_code(const char* name);

// ---- settings, log, failure injection (settings.cpp) -----------------------------------------------------------
struct Settings {
    int driver = 12090;
    int cc_major = 8, cc_minor = 7;
    int integrated = 0;
    int devices = 1;
    std::string name;
};
extern Settings S;
extern std::recursive_mutex M;  // one call at a time (cuda-bindings releases the GIL)
extern FILE* g_log;
extern bool g_initialized;
extern CUresult g_sticky;  // a kernel fault poisons the context, as on a GPU

void complain(const char* call, const char* fmt, ...);
void log_line(const char* fmt, ...);
const char* env(const char* name, const char* fallback);
void parse_injections(std::string spec);
void load_settings();
// The injected failure of this call, or CUDA_SUCCESS.
CUresult injected(const char* call);

#define ENTER_NO_INJECTION(call)                                           \
    std::lock_guard<std::recursive_mutex> lock_(M);                        \
    if (!g_initialized) {                                                  \
        complain(call, "called before cuInit");                            \
        return CUDA_ERROR_NOT_INITIALIZED;                                 \
    }

// Entry of every implemented call (the lock is taken by the caller's scope).
#define ENTER(call, needs_init)                                            \
    std::lock_guard<std::recursive_mutex> lock_(M);                        \
    if ((needs_init) && !g_initialized) {                                  \
        complain(call, "called before cuInit");                            \
        return CUDA_ERROR_NOT_INITIALIZED;                                 \
    }                                                                      \
    if (CUresult inj_ = injected(call); inj_ != CUDA_SUCCESS) return inj_;

// ---- memory (memory.cpp) ---------------------------------------------------------------------------------------
struct Allocation {
    unsigned char* raw;
    size_t size;
    bool device;  // false: pinned host memory (cuMemHostAlloc)
};
extern std::map<uintptr_t, Allocation> g_allocs;  // by start address

// The live allocation holding [p, p+n), or nullptr.
Allocation* find_alloc(uintptr_t p, size_t n, uintptr_t* base = nullptr);
bool guards_intact(uintptr_t start, const Allocation& a);
// Every device allocation's canaries intact; else the context is poisoned with CUDA_ERROR_ILLEGAL_ADDRESS.
CUresult check_guards(const char* call);
CUresult device_range(const char* call, CUdeviceptr p, size_t n);
bool is_pinned(const void* p, size_t n);

// ---- modules and functions (modules.cpp) -----------------------------------------------------------------------
struct KernelLib {
    std::string path;
    void* handle;
    const char* (*error)();
};
extern std::string g_kernels_override;

typedef int (*Launcher)(const unsigned*, const unsigned*, void**);

struct Param {
    size_t offset, size;
};
struct Entry {
    std::vector<Param> params;
};
struct Module {
    std::string kind;  // "cubin" or "ptx"
    int sm;            // cubin SM or PTX target
    std::map<std::string, Entry> entries;
    KernelLib* lib;
};
struct Function {
    Module* module;
    std::string name;
    Launcher launch;
    std::vector<Param> params;
    size_t param_bytes;
};
extern std::map<void*, std::unique_ptr<Module>> g_modules;
extern std::map<void*, std::unique_ptr<Function>> g_functions;

// ---- contexts (context.cpp) ------------------------------------------------------------------------------------
struct Context {
    int device;
};
extern Context g_primary;
extern int g_primary_refs;
extern thread_local Context* t_current;
CUresult need_context(const char* call);

// ---- streams, graphs (streams.cpp) -----------------------------------------------------------------------------
struct Node {
    enum Kind { copy, memset8, memset32, kernel, event } kind;
    explicit Node(Kind k) : kind(k) {}
    uintptr_t dst = 0, src = 0;
    size_t bytes = 0;  // copy: bytes; memset: count of elements
    unsigned value = 0;
    Function* fn = nullptr;
    unsigned grid[3] = {}, block[3] = {};
    std::vector<unsigned char> args;  // kernel parameter values, copied at record time
    void* recorded = nullptr;         // event: the cuEventRecord handle
};
struct Graph {
    std::vector<Node> nodes;
};
struct GraphExec {
    std::vector<Node> nodes;
};
struct Stream {
    Graph* capture = nullptr;
    int invalidated = 0;
    int mode = 0;                   // CUstreamCaptureMode: 0 global, 1 thread-local, 2 relaxed
    std::thread::id capturing;      // the thread that began the capture
};
struct Event {
    double ms = -1;  // steady-clock time (ms) when its record node last ran; -1: never recorded
};
extern std::map<void*, std::unique_ptr<Stream>> g_streams;
extern std::map<void*, std::unique_ptr<Event>> g_events;
extern std::map<void*, std::unique_ptr<Graph>> g_graphs;
extern std::map<void*, std::unique_ptr<GraphExec>> g_execs;

bool is_default_stream(void* s);
// The stream object of a handle (nullptr for the default streams); *bad set when the handle is unknown.
Stream* stream_of(void* h, const char* call, bool* bad);
void invalidate_captures();
bool any_capture();
// A synchronous call while a capture is active invalidates it (thread-local and global capture modes).
CUresult refuse_during_capture(const char* call);
CUresult run_node(const Node& n);
// Run a node on `stream` now, or record it when the stream is capturing.
CUresult submit(Node n, void* stream, const char* call);
CUresult copy_node(const char* call, uintptr_t dst, uintptr_t src, size_t n, void* stream, bool dst_dev, bool src_dev,
                   bool async);
CUresult memset_node(const char* call, CUdeviceptr dst, unsigned value, size_t count, int elem, void* stream,
                     bool async);

}  // namespace fake

// ---- the driver API (each defined in the file of its section; symbols.cpp lists them for cuGetProcAddress) ------
API CUresult cuGetErrorName(CUresult error, const char** pStr);
API CUresult cuGetErrorString(CUresult error, const char** pStr);
API CUresult cuInit(unsigned int flags);
API CUresult cuDriverGetVersion(int* version);
API CUresult cuDeviceGetCount(int* count);
API CUresult cuDeviceGet(CUdevice* device, int ordinal);
API CUresult cuDeviceGetName(char* name, int len, CUdevice dev);
API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev);
API CUresult cuDeviceGetAttribute(int* pi, int attrib, CUdevice dev);
API CUresult cuDevicePrimaryCtxRetain(void** pctx, CUdevice dev);
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
API CUresult cuCtxCreate_v2(void** pctx, unsigned int flags, CUdevice dev);
API CUresult cuCtxDestroy_v2(void* ctx);
API CUresult cuCtxSetCurrent(void* ctx);
API CUresult cuCtxGetCurrent(void** pctx);
API CUresult cuCtxGetDevice(CUdevice* dev);
API CUresult cuCtxSynchronize();
API CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes);
API CUresult cuMemFree_v2(CUdeviceptr p);
API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total);
API CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int flags);
API CUresult cuMemAllocHost_v2(void** pp, size_t bytes);
API CUresult cuMemFreeHost(void* p);
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n);
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n);
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* stream);
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* stream);
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* stream);
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n);
API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n);
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* stream);
API CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, void* stream);
API CUresult cuModuleLoadData(void** pmod, const void* image);
API CUresult cuModuleUnload(void* hmod);
API CUresult cuModuleGetFunction(void** pfn, void* hmod, const char* name);
API CUresult cuStreamCreate(void** ph, unsigned int flags);
API CUresult cuStreamDestroy_v2(void* h);
API CUresult cuStreamSynchronize(void* h);
API CUresult cuStreamIsCapturing(void* h, int* status);
API CUresult cuEventCreate(void** ph, unsigned int flags);
API CUresult cuEventDestroy_v2(void* h);
API CUresult cuEventRecord(void* ev, void* stream);
API CUresult cuEventElapsedTime(float* ms, void* start, void* end);
API CUresult cuEventSynchronize(void* ev);
API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void* stream, void** params, void** extra);
// cuLaunchKernelEx's structures, laid out as cuda.h (12.x) has them (the attribute value is a 64-byte union).
enum { CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION_ = 6 };
struct CUlaunchAttribute {
    unsigned id;
    char pad[4];
    char value[64];
};
struct CUlaunchConfig {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void* hStream;
    CUlaunchAttribute* attrs;
    unsigned numAttrs;
};
API CUresult cuLaunchKernelEx(const CUlaunchConfig* config, void* f, void** params, void** extra);
API CUresult cuStreamBeginCapture_v2(void* h, int mode);
API CUresult cuStreamEndCapture(void* h, void** graph);
API CUresult cuGraphInstantiateWithFlags(void** pexec, void* graph, unsigned long long flags);
API CUresult cuGraphLaunch(void* exec, void* stream);
API CUresult cuGraphExecDestroy(void* exec);
API CUresult cuGraphDestroy(void* graph);
API CUresult cuGetExportTable(const void** table, const void* id);
API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, int* status);
API CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags);
API void colibri_fake_cuda_set_kernels(const char* path);
API const char* colibri_fake_cuda_live();
API void colibri_fake_cuda_fail(const char* spec);
