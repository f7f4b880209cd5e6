// fake_cuda.cpp: a fake CUDA driver (libcuda.so.1) on the CPU, for testing the CUDA backend without a GPU.
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
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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

namespace {

// ---- error names ---------------------------------------------------------------------------------------------------
struct ErrorName {
    int code;
    const char* name;
    const char* text;
};
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
struct Settings {
    int driver = 12090;
    int cc_major = 8, cc_minor = 7;
    int integrated = 0;
    int devices = 1;
    std::string name;
};
Settings S;
std::recursive_mutex M;  // one call at a time (cuda-bindings releases the GIL)
FILE* g_log = nullptr;
bool g_initialized = false;
CUresult g_sticky = CUDA_SUCCESS;  // a kernel fault poisons the context, as on a GPU

struct Injection {
    std::string call;
    long nth;  // 0: every call
    int code;
    long seen = 0;
};
std::vector<Injection> g_inject;

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

bool g_loaded = false;

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

void invalidate_captures();

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

// ---- memory ---------------------------------------------------------------------------------------------------------
constexpr size_t kAlign = 256;  // cuMemAlloc's alignment
constexpr size_t kGuard = 256;  // canary bytes before and after every device allocation
constexpr unsigned char kCanary = 0xA5;

struct Allocation {
    unsigned char* raw;
    size_t size;
    bool device;  // false: pinned host memory (cuMemHostAlloc)
};
std::map<uintptr_t, Allocation> g_allocs;  // by start address
size_t g_device_bytes = 0;

// The live allocation holding [p, p+n), or nullptr.
Allocation* find_alloc(uintptr_t p, size_t n, uintptr_t* base = nullptr) {
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

// ---- modules and functions ---------------------------------------------------------------------------------------
struct KernelLib {
    std::string path;
    void* handle;
    const char* (*error)();
};
std::map<std::string, KernelLib*> g_libs;
std::string g_kernels_override;

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

// The bytes of a module image: a cubin's ELF extent (section and program headers and the file-backed sections), a
// PTX text's length.
size_t image_bytes(const unsigned char* img, bool cubin) {
    if (!cubin) return std::strlen(reinterpret_cast<const char*>(img));
    uint64_t shoff, phoff, end;
    uint16_t phentsize, phnum, shentsize, shnum;
    std::memcpy(&phoff, img + 0x20, 8);
    std::memcpy(&shoff, img + 0x28, 8);
    std::memcpy(&phentsize, img + 0x36, 2);
    std::memcpy(&phnum, img + 0x38, 2);
    std::memcpy(&shentsize, img + 0x3A, 2);
    std::memcpy(&shnum, img + 0x3C, 2);
    end = std::max<uint64_t>(shoff + uint64_t(shnum) * shentsize, phoff + uint64_t(phnum) * phentsize);
    for (int i = 0; i < shnum; ++i) {
        const unsigned char* sh = img + shoff + size_t(i) * shentsize;
        uint32_t type;
        uint64_t off, size;
        std::memcpy(&type, sh + 4, 4);
        std::memcpy(&off, sh + 24, 8);
        std::memcpy(&size, sh + 32, 8);
        if (type != 8) end = std::max(end, off + size);  // SHT_NOBITS occupies no file bytes
    }
    for (int i = 0; i < phnum; ++i) {
        const unsigned char* ph = img + phoff + size_t(i) * phentsize;
        uint64_t off, size;
        std::memcpy(&off, ph + 8, 8);
        std::memcpy(&size, ph + 32, 8);
        end = std::max(end, off + size);
    }
    return size_t(end);
}

// COLIBRI_FAKE_CUDA_KERNEL_MAP: a file of lines "<FNV-1a 64 of the image, 16 hex digits> <emulation library>", so
// the modules of a bundle's several shapes (each compiled with its own -D constants) each run on the emulation built
// with their constants even when one program loads them all (libcolibri). "" when unset or not listed.
std::string mapped_kernels(const unsigned char* img, bool cubin) {
    std::string map = env("COLIBRI_FAKE_CUDA_KERNEL_MAP", "");
    if (map.empty()) return "";
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0, n = image_bytes(img, cubin); i < n; ++i) h = (h ^ img[i]) * 0x100000001b3ull;
    char key[17];
    std::snprintf(key, sizeof key, "%016llx", static_cast<unsigned long long>(h));
    FILE* f = std::fopen(map.c_str(), "r");
    if (!f) return "";
    char line[4096];
    std::string found;
    while (found.empty() && std::fgets(line, sizeof line, f)) {
        std::string text(line);
        while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
        if (text.size() > 17 && text.compare(0, 16, key) == 0 && text[16] == ' ') found = text.substr(17);
    }
    std::fclose(f);
    return found;
}

KernelLib* kernel_lib(const char* call, const std::string& mapped = "") {
    std::string path = !mapped.empty()                 ? mapped
                       : g_kernels_override.empty()    ? env("COLIBRI_FAKE_CUDA_KERNELS", "")
                                                       : g_kernels_override;
    if (path.empty()) {
        complain(call, "no kernel emulation library: set COLIBRI_FAKE_CUDA_KERNELS to a library built by "
                       "tests/kernels/emulator.py");
        return nullptr;
    }
    auto it = g_libs.find(path);
    if (it != g_libs.end()) return it->second;
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        complain(call, "cannot load the kernel emulation library: %s", dlerror());
        return nullptr;
    }
    auto* lib = new KernelLib{path, h, reinterpret_cast<const char* (*)()>(dlsym(h, "coli_emu_error"))};
    g_libs[path] = lib;
    return lib;
}

// PTX ISA version each driver understands (CUDA release notes); a driver JIT-compiles PTX up to its own ISA.
int max_ptx_isa(int driver) {  // 10 * major + minor
    const int table[][2] = {{13000, 90}, {12090, 88}, {12080, 87}, {12070, 86}, {12050, 85}, {12040, 84},
                            {12030, 83}, {12020, 82}, {12010, 81}, {12000, 80}, {11080, 78}};
    for (const auto& row : table)
        if (driver >= row[0]) return row[1];
    return 70;
}

CUresult parse_cubin(const unsigned char* img, Module* m) {
    if (img[4] != 2 || img[5] != 1) return CUDA_ERROR_INVALID_IMAGE;
    uint16_t machine;
    std::memcpy(&machine, img + 18, 2);
    if (machine != 190) return CUDA_ERROR_INVALID_IMAGE;
    uint32_t flags;
    std::memcpy(&flags, img + 48, 4);
    m->sm = img[7] == 0x41 ? int((flags >> 8) & 0xff) : int(flags & 0xff);
    uint64_t shoff;
    uint16_t shentsize, shnum, shstrndx;
    std::memcpy(&shoff, img + 0x28, 8);
    std::memcpy(&shentsize, img + 0x3A, 2);
    std::memcpy(&shnum, img + 0x3C, 2);
    std::memcpy(&shstrndx, img + 0x3E, 2);
    auto section = [&](int i, uint32_t* name, uint64_t* off, uint64_t* size) {
        const unsigned char* s = img + shoff + size_t(i) * shentsize;
        std::memcpy(name, s, 4);
        std::memcpy(off, s + 24, 8);
        std::memcpy(size, s + 32, 8);
    };
    uint32_t n;
    uint64_t stroff, strsize;
    section(shstrndx, &n, &stroff, &strsize);
    for (int i = 0; i < shnum; ++i) {
        uint64_t off, size;
        section(i, &n, &off, &size);
        const char* name = reinterpret_cast<const char*>(img + stroff + n);
        if (std::strncmp(name, ".nv.info.", 9) != 0) continue;
        Entry e;
        // Attributes: u8 format, u8 attribute, then by format 0x04: u16 size + that many bytes; 0x01-0x03: 2 bytes
        // (value or padding). EIATTR_KPARAM_INFO (0x17): u32 index, u16 ordinal, u16 offset, u32 whose
        // bits 18..31 are the size (measured on NVRTC 12.9 cubins; the format is not documented by NVIDIA).
        const unsigned char* p = img + off;
        const unsigned char* end = p + size;
        while (p + 2 <= end) {
            const int fmt = p[0], attr = p[1];
            if (fmt == 4) {
                uint16_t len;
                std::memcpy(&len, p + 2, 2);
                if (attr == 0x17 && len >= 12) {
                    uint16_t ordinal, offset;
                    uint32_t bits;
                    std::memcpy(&ordinal, p + 8, 2);
                    std::memcpy(&offset, p + 10, 2);
                    std::memcpy(&bits, p + 12, 4);
                    if (e.params.size() <= ordinal) e.params.resize(ordinal + 1);
                    e.params[ordinal] = {offset, (bits >> 18) & 0x3fff};
                }
                p += 4 + len;
            } else {
                p += 4;
            }
        }
        m->entries[name + 9] = e;
    }
    return CUDA_SUCCESS;
}

size_t ptx_type_size(const std::string& t) {
    if (t.size() < 3) return 0;
    return size_t(std::atoi(t.c_str() + 2)) / 8;  // .u64 .f32 .b8 ...
}

CUresult parse_ptx(const char* text, Module* m, int* isa) {
    const char* v = std::strstr(text, ".version ");
    const char* t = std::strstr(text, ".target sm_");
    if (!v || !t) return CUDA_ERROR_INVALID_PTX;
    int major = 0, minor = 0;
    std::sscanf(v + 9, "%d.%d", &major, &minor);
    *isa = 10 * major + minor;
    m->sm = std::atoi(t + 11);
    for (const char* p = std::strstr(text, ".entry "); p; p = std::strstr(p + 1, ".entry ")) {
        const char* name = p + 7;
        const char* open = std::strchr(name, '(');
        if (!open) return CUDA_ERROR_INVALID_PTX;
        std::string sym(name, open - name);
        while (!sym.empty() && (sym.back() == ' ' || sym.back() == '\n' || sym.back() == '\t')) sym.pop_back();
        const char* close = std::strchr(open, ')');
        if (!close) return CUDA_ERROR_INVALID_PTX;
        Entry e;
        size_t offset = 0;
        std::string sig(open + 1, close - open - 1);
        // Each parameter: ".param .u64 name" or ".param .align A .b8 name[N]" (optionally ".ptr ..." qualifiers).
        for (size_t q = sig.find(".param"); q != std::string::npos; q = sig.find(".param", q + 1)) {
            size_t stop = sig.find(',', q);
            std::string decl = sig.substr(q, stop == std::string::npos ? std::string::npos : stop - q);
            size_t align = 0, size = 0;
            size_t a = decl.find(".align ");
            if (a != std::string::npos) align = std::strtoul(decl.c_str() + a + 7, nullptr, 10);
            for (const char* ty : {".u", ".s", ".b", ".f"}) {
                size_t k = decl.find(ty, 6);
                while (k != std::string::npos && !(k + 2 < decl.size() && decl[k + 2] >= '0' && decl[k + 2] <= '9'))
                    k = decl.find(ty, k + 1);
                if (k != std::string::npos) {
                    size_t end = decl.find_first_of(" \t\n", k);
                    size = ptx_type_size(decl.substr(k, end - k));
                    break;
                }
            }
            size_t br = decl.find('[');
            if (br != std::string::npos) size *= std::strtoul(decl.c_str() + br + 1, nullptr, 10);
            if (size == 0) return CUDA_ERROR_INVALID_PTX;
            if (!align) align = size;
            offset = (offset + align - 1) / align * align;
            e.params.push_back({offset, size});
            offset += size;
        }
        m->entries[sym] = e;
    }
    return CUDA_SUCCESS;
}

// ---- streams, graphs ------------------------------------------------------------------------------------------------
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
    int mode = 0;
};
struct Event {
    double ms = -1;  // steady-clock time (ms) when its record node last ran; -1: never recorded
};
struct Context {
    int device;
};

Context g_primary{0};
int g_primary_refs = 0;
thread_local Context* t_current = nullptr;
std::map<void*, std::unique_ptr<Stream>> g_streams;
std::map<void*, std::unique_ptr<Event>> g_events;
std::map<void*, std::unique_ptr<Graph>> g_graphs;
std::map<void*, std::unique_ptr<GraphExec>> g_execs;
std::map<void*, std::unique_ptr<Module>> g_modules;
std::map<void*, std::unique_ptr<Function>> g_functions;
std::map<void*, std::unique_ptr<Context>> g_contexts;

bool is_default_stream(void* s) {
    return s == nullptr || s == reinterpret_cast<void*>(1) || s == reinterpret_cast<void*>(2);
}

CUresult need_context(const char* call) {
    if (!t_current) {
        complain(call, "no current context (cuCtxSetCurrent / cuDevicePrimaryCtxRetain first)");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    return CUDA_SUCCESS;
}

// The stream object of a handle (nullptr for the default streams); *bad set when the handle is unknown.
Stream* stream_of(void* h, const char* call, bool* bad) {
    *bad = false;
    if (is_default_stream(h)) return nullptr;
    auto it = g_streams.find(h);
    if (it == g_streams.end()) {
        complain(call, "unknown stream handle %p", h);
        *bad = true;
        return nullptr;
    }
    return it->second.get();
}

void invalidate_captures() {
    for (auto& [h, s] : g_streams)
        if (s->capture) s->invalidated = 1;
}

bool any_capture() {
    for (const auto& [h, s] : g_streams)
        if (s->capture) return true;
    return false;
}

// A synchronous call while a capture is active invalidates it (thread-local and global capture modes).
CUresult refuse_during_capture(const char* call) {
    bool refused = false;
    for (auto& [h, s] : g_streams) {
        if (s->capture && s->mode != 2) {
            s->invalidated = 1;
            refused = true;
        }
    }
    if (refused) {
        complain(call, "a synchronous call during stream capture; the capture is invalidated");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return CUDA_SUCCESS;
}

CUresult run_kernel(const Node& n) {
    if (g_sticky) return g_sticky;
    const Function* f = n.fn;
    std::vector<void*> ptrs(f->params.size());
    for (size_t i = 0; i < f->params.size(); ++i)
        ptrs[i] = const_cast<unsigned char*>(n.args.data()) + f->params[i].offset;
    // An 8-byte argument is a pointer for these kernels: it must point into a live allocation.
    for (size_t i = 0; i < f->params.size(); ++i) {
        if (f->params[i].size != 8) continue;
        uint64_t v;
        std::memcpy(&v, ptrs[i], 8);
        if (v && !find_alloc(v, 1)) {
            complain("cuLaunchKernel", "%s argument %zu = 0x%llx points into no live allocation", f->name.c_str(), i,
                     (unsigned long long)v);
            g_sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
            return g_sticky;
        }
    }
    if (f->launch(n.grid, n.block, ptrs.data()) != 0) {
        complain("cuLaunchKernel", "%s failed in the emulator: %s", f->name.c_str(),
                 f->module->lib->error ? f->module->lib->error() : "?");
        g_sticky = CUDA_ERROR_LAUNCH_FAILED;
        return g_sticky;
    }
    return CUDA_SUCCESS;
}

CUresult run_node(const Node& n) {
    if (g_sticky) return g_sticky;
    switch (n.kind) {
        case Node::copy:
            std::memmove(reinterpret_cast<void*>(n.dst), reinterpret_cast<const void*>(n.src), n.bytes);
            return CUDA_SUCCESS;
        case Node::memset8:
            std::memset(reinterpret_cast<void*>(n.dst), int(n.value & 0xff), n.bytes);
            return CUDA_SUCCESS;
        case Node::memset32: {
            auto* p = reinterpret_cast<uint32_t*>(n.dst);
            for (size_t i = 0; i < n.bytes; ++i) p[i] = n.value;
            return CUDA_SUCCESS;
        }
        case Node::kernel:
            return run_kernel(n);
        case Node::event: {
            auto it = g_events.find(n.recorded);
            if (it != g_events.end())
                it->second->ms = std::chrono::duration<double, std::milli>(
                                     std::chrono::steady_clock::now().time_since_epoch()).count();
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_UNKNOWN;
}

// Run a node on `stream` now, or record it when the stream is capturing.
CUresult submit(Node n, void* stream, const char* call) {
    bool bad;
    Stream* s = stream_of(stream, call, &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    if (s && s->capture) {
        if (s->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        s->capture->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    if (is_default_stream(stream) && any_capture()) {
        if (CUresult r = refuse_during_capture(call)) return r;
    }
    return run_node(n);
}

CUresult copy_node(const char* call, uintptr_t dst, uintptr_t src, size_t n, void* stream, bool dst_dev, bool src_dev,
                   bool async) {
    if (CUresult r = need_context(call)) return r;
    if (g_sticky) return g_sticky;
    if (dst_dev)
        if (CUresult r = device_range(call, dst, n)) return r;
    if (src_dev)
        if (CUresult r = device_range(call, src, n)) return r;
    if ((!dst_dev && !dst) || (!src_dev && !src)) {
        complain(call, "null host pointer");
        return CUDA_ERROR_INVALID_VALUE;
    }
    const void* host = reinterpret_cast<const void*>(dst_dev ? src : dst);
    bool bad;
    Stream* s = stream_of(stream, call, &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    log_line("%s bytes=%zu pinned=%d captured=%d", call, n, (dst_dev && src_dev) ? 1 : int(is_pinned(host, n)),
             int(s && s->capture));
    Node node{Node::copy};
    node.dst = dst;
    node.src = src;
    node.bytes = n;
    if (!async) {
        if (any_capture())
            if (CUresult r = refuse_during_capture(call)) return r;
        return run_node(node);
    }
    return submit(std::move(node), stream, call);
}

CUresult memset_node(const char* call, CUdeviceptr dst, unsigned value, size_t count, int elem, void* stream,
                     bool async) {
    if (CUresult r = need_context(call)) return r;
    if (g_sticky) return g_sticky;
    if (CUresult r = device_range(call, dst, count * elem)) return r;
    if (elem == 4 && dst % 4) {
        complain(call, "pointer 0x%llx is not 4-byte aligned", dst);
        return CUDA_ERROR_INVALID_VALUE;
    }
    log_line("%s count=%zu value=0x%x", call, count, value);
    Node node{elem == 4 ? Node::memset32 : Node::memset8};
    node.dst = dst;
    node.bytes = count;
    node.value = value;
    if (!async) {
        if (any_capture())
            if (CUresult r = refuse_during_capture(call)) return r;
        return run_node(node);
    }
    return submit(std::move(node), stream, call);
}

}  // namespace

// =====================================================================================================================
// The driver API
// =====================================================================================================================

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

// ---- modules --------------------------------------------------------------------------------------------------------
API CUresult cuModuleLoadData(void** pmod, const void* image) {
    ENTER("cuModuleLoadData", true);
    if (CUresult r = need_context("cuModuleLoadData")) return r;
    if (!pmod || !image) return CUDA_ERROR_INVALID_VALUE;
    const auto* img = static_cast<const unsigned char*>(image);
    auto m = std::make_unique<Module>();
    const int dev_sm = 10 * S.cc_major + S.cc_minor;
    if (std::memcmp(img, "\x7f" "ELF", 4) == 0) {
        m->kind = "cubin";
        if (CUresult r = parse_cubin(img, m.get())) {
            complain("cuModuleLoadData", "not a 64-bit CUDA ELF (EM_CUDA)");
            return r;
        }
        if (m->sm / 10 != S.cc_major || m->sm % 10 > S.cc_minor) {
            complain("cuModuleLoadData", "cubin for sm_%d cannot run on this sm_%d device", m->sm, dev_sm);
            return CUDA_ERROR_NO_BINARY_FOR_GPU;
        }
    } else {
        uint32_t magic;
        std::memcpy(&magic, img, 4);
        if (magic == 0xBA55ED50u || magic == 0x466243B1u) {
            complain("cuModuleLoadData", "fatbin images are not emulated");
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        m->kind = "ptx";
        int isa = 0;
        if (CUresult r = parse_ptx(static_cast<const char*>(image), m.get(), &isa)) {
            complain("cuModuleLoadData", "neither a cubin (ELF) nor PTX text with .version and .target");
            return r == CUDA_ERROR_INVALID_PTX ? CUDA_ERROR_INVALID_IMAGE : r;
        }
        if (isa > max_ptx_isa(S.driver)) {
            complain("cuModuleLoadData", "PTX ISA %d.%d is newer than this driver (%d) understands (%d.%d)", isa / 10,
                     isa % 10, S.driver, max_ptx_isa(S.driver) / 10, max_ptx_isa(S.driver) % 10);
            return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
        }
        if (m->sm > dev_sm) {
            complain("cuModuleLoadData", "PTX for sm_%d cannot be JIT-compiled for this older sm_%d device", m->sm,
                     dev_sm);
            return CUDA_ERROR_NO_BINARY_FOR_GPU;
        }
    }
    m->lib = kernel_lib("cuModuleLoadData", mapped_kernels(img, m->kind == "cubin"));
    if (!m->lib) return CUDA_ERROR_NOT_SUPPORTED;
    std::string names;
    for (const auto& [name, e] : m->entries) names += (names.empty() ? "" : ",") + name;
    log_line("cuModuleLoadData kind=%s sm=%d entries=%s", m->kind.c_str(), m->sm, names.c_str());
    *pmod = m.get();
    g_modules[m.get()] = std::move(m);
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(void* hmod) {
    ENTER("cuModuleUnload", true);
    auto it = g_modules.find(hmod);
    if (it == g_modules.end()) {
        complain("cuModuleUnload", "unknown module %p", hmod);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (auto f = g_functions.begin(); f != g_functions.end();)
        f = f->second->module == hmod ? g_functions.erase(f) : std::next(f);
    g_modules.erase(it);
    log_line("cuModuleUnload");
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(void** pfn, void* hmod, const char* name) {
    ENTER("cuModuleGetFunction", true);
    if (!pfn || !name) return CUDA_ERROR_INVALID_VALUE;
    auto it = g_modules.find(hmod);
    if (it == g_modules.end()) {
        complain("cuModuleGetFunction", "unknown module %p", hmod);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    Module* m = it->second.get();
    auto e = m->entries.find(name);
    if (e == m->entries.end()) {
        complain("cuModuleGetFunction", "the %s image has no entry '%s'", m->kind.c_str(), name);
        return CUDA_ERROR_NOT_FOUND;
    }
    std::string symbol = std::string("coli_emu_launch_") + name;
    auto launch = reinterpret_cast<Launcher>(dlsym(m->lib->handle, symbol.c_str()));
    if (!launch) {
        complain("cuModuleGetFunction", "the kernel emulation library %s has no %s", m->lib->path.c_str(),
                 symbol.c_str());
        return CUDA_ERROR_NOT_FOUND;
    }
    auto f = std::make_unique<Function>();
    f->module = m;
    f->name = name;
    f->launch = launch;
    f->params = e->second.params;
    f->param_bytes = 0;
    for (const auto& p : f->params) f->param_bytes = std::max(f->param_bytes, p.offset + p.size);
    log_line("cuModuleGetFunction %s params=%zu", name, f->params.size());
    *pfn = f.get();
    g_functions[f.get()] = std::move(f);
    return CUDA_SUCCESS;
}

// ---- streams and events -------------------------------------------------------------------------------------------
API CUresult cuStreamCreate(void** ph, unsigned int flags) {
    ENTER("cuStreamCreate", true);
    if (CUresult r = need_context("cuStreamCreate")) return r;
    if (!ph || flags > 1) return CUDA_ERROR_INVALID_VALUE;
    auto s = std::make_unique<Stream>();
    *ph = s.get();
    g_streams[s.get()] = std::move(s);
    log_line("cuStreamCreate flags=%u", flags);
    return CUDA_SUCCESS;
}

API CUresult cuStreamDestroy_v2(void* h) {
    ENTER("cuStreamDestroy", true);
    auto it = g_streams.find(h);
    if (it == g_streams.end()) {
        complain("cuStreamDestroy", "unknown stream %p", h);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (it->second->capture) {
        complain("cuStreamDestroy", "the stream is capturing");
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    g_streams.erase(it);
    log_line("cuStreamDestroy");
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(void* h) {
    ENTER("cuStreamSynchronize", true);
    if (CUresult r = need_context("cuStreamSynchronize")) return r;
    bool bad;
    Stream* s = stream_of(h, "cuStreamSynchronize", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    if (s && s->capture) {
        s->invalidated = 1;
        complain("cuStreamSynchronize", "the stream is capturing; the capture is invalidated");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    log_line("cuStreamSynchronize stream=%p", h);  // the stream, so tests can see which calls were in flight
    return check_guards("cuStreamSynchronize");
}

API CUresult cuStreamIsCapturing(void* h, int* status) {
    ENTER("cuStreamIsCapturing", true);
    bool bad;
    Stream* s = stream_of(h, "cuStreamIsCapturing", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    *status = (s && s->capture) ? (s->invalidated ? 2 : 1) : 0;
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(void** ph, unsigned int flags) {
    ENTER("cuEventCreate", true);
    if (CUresult r = need_context("cuEventCreate")) return r;
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    auto e = std::make_unique<Event>();
    *ph = e.get();
    g_events[e.get()] = std::move(e);
    (void)flags;
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(void* h) {
    ENTER("cuEventDestroy", true);
    if (!g_events.erase(h)) {
        complain("cuEventDestroy", "unknown event %p", h);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(void* ev, void* stream) {
    ENTER("cuEventRecord", true);
    if (!g_events.count(ev)) {
        complain("cuEventRecord", "unknown event %p", ev);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    Node n{Node::event};
    n.recorded = ev;
    return submit(std::move(n), stream, "cuEventRecord");
}

// Milliseconds between two completed records (host time of the emulation: a CPU time, not a GPU time).
API CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    ENTER("cuEventElapsedTime", true);
    auto a = g_events.find(start), b = g_events.find(end);
    if (!ms || a == g_events.end() || b == g_events.end()) {
        complain("cuEventElapsedTime", "unknown event");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (a->second->ms < 0 || b->second->ms < 0) {
        complain("cuEventElapsedTime", "an event that was never recorded");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *ms = float(b->second->ms - a->second->ms);
    return CUDA_SUCCESS;
}

API CUresult cuEventSynchronize(void* ev) {
    ENTER("cuEventSynchronize", true);
    if (!g_events.count(ev)) {
        complain("cuEventSynchronize", "unknown event %p", ev);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    log_line("cuEventSynchronize");
    return check_guards("cuEventSynchronize");
}

// ---- launches and graphs --------------------------------------------------------------------------------------------
API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void* stream, void** params, void** extra) {
    ENTER("cuLaunchKernel", true);
    if (CUresult r = need_context("cuLaunchKernel")) return r;
    auto it = g_functions.find(f);
    if (it == g_functions.end()) {
        complain("cuLaunchKernel", "unknown function %p", f);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    Function* fn = it->second.get();
    if (extra) {
        complain("cuLaunchKernel", "`extra` launch arguments are not emulated; pass kernelParams");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!fn->params.empty() && !params) {
        complain("cuLaunchKernel", "%s takes %zu parameters; kernelParams is NULL", fn->name.c_str(),
                 fn->params.size());
        return CUDA_ERROR_INVALID_VALUE;
    }
    const unsigned long long threads = 1ull * bx * by * bz;
    if (!gx || !gy || !gz || !bx || !by || !bz || threads > 1024 || bz > 64 || gy > 65535 || gz > 65535) {
        complain("cuLaunchKernel", "%s: grid %ux%ux%u block %ux%ux%u out of range", fn->name.c_str(), gx, gy, gz,
                 bx, by, bz);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (shared > 49152) {
        complain("cuLaunchKernel", "%s: %u bytes of dynamic shared memory (limit 49152 without opt-in)",
                 fn->name.c_str(), shared);
        return CUDA_ERROR_INVALID_VALUE;
    }
    Node n{Node::kernel};
    n.fn = fn;
    n.grid[0] = gx, n.grid[1] = gy, n.grid[2] = gz;
    n.block[0] = bx, n.block[1] = by, n.block[2] = bz;
    n.args.assign(fn->param_bytes, 0);
    for (size_t i = 0; i < fn->params.size(); ++i)
        std::memcpy(n.args.data() + fn->params[i].offset, params[i], fn->params[i].size);
    bool bad;
    Stream* s = stream_of(stream, "cuLaunchKernel", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    log_line("cuLaunchKernel %s grid=%u,%u,%u block=%u,%u,%u captured=%d", fn->name.c_str(), gx, gy, gz, bx, by, bz,
             int(s && s->capture));
    return submit(std::move(n), stream, "cuLaunchKernel");
}

API CUresult cuStreamBeginCapture_v2(void* h, int mode) {
    ENTER("cuStreamBeginCapture", true);
    if (CUresult r = need_context("cuStreamBeginCapture")) return r;
    if (is_default_stream(h)) {
        complain("cuStreamBeginCapture", "the legacy default stream cannot be captured");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    bool bad;
    Stream* s = stream_of(h, "cuStreamBeginCapture", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    if (s->capture) {
        complain("cuStreamBeginCapture", "the stream is already capturing");
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    auto g = std::make_unique<Graph>();
    s->capture = g.get();
    s->invalidated = 0;
    s->mode = mode;
    g_graphs[g.get()] = std::move(g);
    log_line("cuStreamBeginCapture mode=%d", mode);
    return CUDA_SUCCESS;
}

API CUresult cuStreamEndCapture(void* h, void** graph) {
    ENTER_NO_INJECTION("cuStreamEndCapture");
    bool bad;
    Stream* s = stream_of(h, "cuStreamEndCapture", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    if (!s || !s->capture) {
        complain("cuStreamEndCapture", "the stream is not capturing");
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    Graph* g = s->capture;
    s->capture = nullptr;  // the capture ends, also when the call fails
    const CUresult failed = injected("cuStreamEndCapture");
    if (failed || s->invalidated) {
        const CUresult r = failed ? failed : CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        s->invalidated = 0;
        g_graphs.erase(g);
        if (graph) *graph = nullptr;
        return r;
    }
    if (graph) *graph = g;
    log_line("cuStreamEndCapture nodes=%zu", g->nodes.size());
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(void** pexec, void* graph, unsigned long long flags) {
    ENTER("cuGraphInstantiate", true);
    auto it = g_graphs.find(graph);
    if (it == g_graphs.end()) {
        complain("cuGraphInstantiate", "unknown graph %p", graph);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (!pexec || flags > 15) return CUDA_ERROR_INVALID_VALUE;
    auto e = std::make_unique<GraphExec>();
    e->nodes = it->second->nodes;  // an executable graph is a snapshot
    *pexec = e.get();
    log_line("cuGraphInstantiate nodes=%zu", e->nodes.size());
    g_execs[e.get()] = std::move(e);
    return CUDA_SUCCESS;
}

API CUresult cuGraphLaunch(void* exec, void* stream) {
    ENTER("cuGraphLaunch", true);
    if (CUresult r = need_context("cuGraphLaunch")) return r;
    auto it = g_execs.find(exec);
    if (it == g_execs.end()) {
        complain("cuGraphLaunch", "unknown executable graph %p", exec);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    bool bad;
    Stream* s = stream_of(stream, "cuGraphLaunch", &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    if (s && s->capture) {
        complain("cuGraphLaunch", "launching a graph into a capturing stream is not emulated");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    log_line("cuGraphLaunch nodes=%zu stream=%p", it->second->nodes.size(), stream);
    for (const Node& n : it->second->nodes)
        if (CUresult r = run_node(n)) return r;
    return CUDA_SUCCESS;
}

API CUresult cuGraphExecDestroy(void* exec) {
    ENTER("cuGraphExecDestroy", true);
    if (!g_execs.erase(exec)) {
        complain("cuGraphExecDestroy", "unknown executable graph %p", exec);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    log_line("cuGraphExecDestroy");
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(void* graph) {
    ENTER("cuGraphDestroy", true);
    for (const auto& [h, s] : g_streams)
        if (s->capture == graph) return CUDA_ERROR_ILLEGAL_STATE;
    if (!g_graphs.erase(graph)) {
        complain("cuGraphDestroy", "unknown graph %p", graph);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    log_line("cuGraphDestroy");
    return CUDA_SUCCESS;
}

API CUresult cuGetExportTable(const void** table, const void* id) {
    (void)id;
    if (table) *table = nullptr;
    complain("cuGetExportTable", "not emulated (the CUDA runtime library cannot run on the fake driver)");
    return CUDA_ERROR_NOT_SUPPORTED;
}

// ---- symbol lookup --------------------------------------------------------------------------------------------------
API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, int* status);

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
