// modules.cpp: cuModuleLoadData of a cubin (ELF, EM_CUDA) or PTX text, each entry's parameter layout read from the
// image, and each module bound to a kernel emulation library (tests/kernels/emulator.py) whose
// coli_emu_launch_<name> is cuModuleGetFunction(name). fake_cuda.h describes the whole driver.
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

namespace fake {

std::string g_kernels_override;
std::map<void*, std::unique_ptr<Module>> g_modules;
std::map<void*, std::unique_ptr<Function>> g_functions;

namespace {
std::map<std::string, KernelLib*> g_libs;

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

}  // namespace

}  // namespace fake

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
