// settings.cpp: the fake driver's error names, its settings (COLIBRI_FAKE_CUDA_*, read at cuInit), its call log
// and failure injection (COLIBRI_FAKE_CUDA_FAIL). fake_cuda.h describes the whole driver.
#include <cstdarg>
#include <cstdlib>
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

namespace fake {

// ---- error names ---------------------------------------------------------------------------------------------------
namespace {
const ErrorName kErrors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
}  // namespace

const ErrorName* find_error(int code) {
    for (const auto& e : kErrors)
        if (e.code == code) return &e;
    return nullptr;
}

int error_code(const char* name) {
    for (const auto& e : kErrors)
        if (std::strcmp(e.name, name) == 0) return e.code;
    return -1;
}

// ---- settings, log, failure injection ----------------------------------------------------------------------------
Settings S;
std::recursive_mutex M;  // one call at a time (cuda-bindings releases the GIL)
FILE* g_log = nullptr;
bool g_initialized = false;
CUresult g_sticky = CUDA_SUCCESS;  // a kernel fault poisons the context, as on a GPU

namespace {
struct Injection {
    std::string call;
    long nth;  // 0: every call
    int code;
    long seen = 0;
};
std::vector<Injection> g_inject;
}  // namespace

void complain(const char* call, const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "fake libcuda: %s: %s\n", call, buf);
    std::fflush(stderr);
    if (g_log) {
        std::fprintf(g_log, "! %s: %s\n", call, buf);
        std::fflush(g_log);
    }
}

void log_line(const char* fmt, ...) {
    if (!g_log) return;
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(g_log, fmt, ap);
    va_end(ap);
    std::fputc('\n', g_log);
    std::fflush(g_log);
}

const char* env(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return (v && *v) ? v : fallback;
}

void parse_injections(std::string spec) {
    g_inject.clear();
    size_t pos = 0;
    while (pos < spec.size()) {
        size_t end = spec.find(',', pos);
        if (end == std::string::npos) end = spec.size();
        std::string item = spec.substr(pos, end - pos);
        pos = end + 1;
        size_t eq = item.find('=');
        if (eq == std::string::npos) {
            complain("COLIBRI_FAKE_CUDA_FAIL", "'%s' is not CALL[@N]=CUDA_ERROR_NAME", item.c_str());
            continue;
        }
        std::string call = item.substr(0, eq), err = item.substr(eq + 1);
        long nth = 0;
        size_t at = call.find('@');
        if (at != std::string::npos) {
            nth = std::atol(call.c_str() + at + 1);
            call.resize(at);
        }
        int code = error_code(err.c_str());
        if (code < 0) {
            complain("COLIBRI_FAKE_CUDA_FAIL", "unknown error name '%s'", err.c_str());
            continue;
        }
        g_inject.push_back({call, nth, code});
    }
}

namespace {
bool g_loaded = false;
}  // namespace

void load_settings() {
    if (g_loaded) return;
    g_loaded = true;
    S.driver = std::atoi(env("COLIBRI_FAKE_CUDA_DRIVER", "12090"));
    std::string cc = env("COLIBRI_FAKE_CUDA_CC", "8.7");
    S.cc_major = std::atoi(cc.c_str());
    size_t dot = cc.find('.');
    S.cc_minor = dot == std::string::npos ? 0 : std::atoi(cc.c_str() + dot + 1);
    S.integrated = std::atoi(env("COLIBRI_FAKE_CUDA_INTEGRATED", "0"));
    S.devices = std::atoi(env("COLIBRI_FAKE_CUDA_DEVICES", "1"));
    char name[128];
    std::snprintf(name, sizeof name, "Colibri Fake %s GPU (sm_%d%d)", S.integrated ? "Integrated" : "Discrete",
                  S.cc_major, S.cc_minor);
    S.name = env("COLIBRI_FAKE_CUDA_NAME", name);
    const char* path = std::getenv("COLIBRI_FAKE_CUDA_LOG");
    if (path && *path && !g_log) g_log = std::fopen(path, "a");
    parse_injections(env("COLIBRI_FAKE_CUDA_FAIL", ""));
}

// The injected failure of this call, or CUDA_SUCCESS.
CUresult injected(const char* call) {
    for (auto& inj : g_inject) {
        if (inj.call != call) continue;
        ++inj.seen;
        if (inj.nth == 0 || inj.nth == inj.seen) {
            complain(call, "injected failure %s (COLIBRI_FAKE_CUDA_FAIL)", find_error(inj.code)->name);
            invalidate_captures();  // as on a GPU, a call failing during stream capture invalidates the capture
            return inj.code;
        }
    }
    return CUDA_SUCCESS;
}

}  // namespace fake

// ---- error names ---------------------------------------------------------------------------------------------------
API CUresult cuGetErrorName(CUresult error, const char** pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const ErrorName* e = find_error(error);
    *pStr = e ? e->name : nullptr;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorString(CUresult error, const char** pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const ErrorName* e = find_error(error);
    *pStr = e ? e->text : nullptr;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
