// graphs.cpp: cuLaunchKernel (parameter values copied at record time, as a real graph does), stream capture into a
// graph, its instantiation (a snapshot) and its replay. fake_cuda.h describes the whole driver.
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

// ---- launches and graphs --------------------------------------------------------------------------------------------
// One launch of cuLaunchKernel or cuLaunchKernelEx (`api` names it in messages); pdl: the programmatic stream
// serialization attribute was set (recorded in the log line; the emulated launch runs after the one before it, as
// every launch here does).
static CUresult launch(const char* api, void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned shared, void* stream, void** params, void** extra, int pdl) {
    auto it = g_functions.find(f);
    if (it == g_functions.end()) {
        complain(api, "unknown function %p", f);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    Function* fn = it->second.get();
    if (extra) {
        complain(api, "`extra` launch arguments are not emulated; pass kernelParams");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!fn->params.empty() && !params) {
        complain(api, "%s takes %zu parameters; kernelParams is NULL", fn->name.c_str(),
                 fn->params.size());
        return CUDA_ERROR_INVALID_VALUE;
    }
    const unsigned long long threads = 1ull * bx * by * bz;
    if (!gx || !gy || !gz || !bx || !by || !bz || threads > 1024 || bz > 64 || gy > 65535 || gz > 65535) {
        complain(api, "%s: grid %ux%ux%u block %ux%ux%u out of range", fn->name.c_str(), gx, gy, gz,
                 bx, by, bz);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (shared > 49152) {
        complain(api, "%s: %u bytes of dynamic shared memory (limit 49152 without opt-in)",
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
    Stream* s = stream_of(stream, api, &bad);
    if (bad) return CUDA_ERROR_INVALID_HANDLE;
    log_line("%s %s grid=%u,%u,%u block=%u,%u,%u captured=%d%s", api, fn->name.c_str(), gx, gy, gz, bx, by, bz,
             int(s && s->capture), pdl ? " pdl=1" : "");
    return submit(std::move(n), stream, api);
}

API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void* stream, void** params, void** extra) {
    ENTER("cuLaunchKernel", true);
    if (CUresult r = need_context("cuLaunchKernel")) return r;
    return launch("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, shared, stream, params, extra, 0);
}

// cuLaunchKernelEx: CUlaunchConfig and CUlaunchAttribute as cuda.h (12.x) lays them out. Attributes: IGNORE (0) and
// PROGRAMMATIC_STREAM_SERIALIZATION (6, value.programmaticStreamSerializationAllowed, an int); others are refused.
API CUresult cuLaunchKernelEx(const CUlaunchConfig* config, void* f, void** params, void** extra) {
    ENTER("cuLaunchKernelEx", true);
    if (CUresult r = need_context("cuLaunchKernelEx")) return r;
    if (!config || (config->numAttrs && !config->attrs)) {
        complain("cuLaunchKernelEx", "config %p, attrs %p with numAttrs %u", (const void*)config,
                 config ? (const void*)config->attrs : nullptr, config ? config->numAttrs : 0u);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int pdl = 0;
    for (unsigned i = 0; i < config->numAttrs; ++i) {
        const CUlaunchAttribute& a = config->attrs[i];
        if (a.id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION_) {
            int allowed;
            std::memcpy(&allowed, a.value, sizeof allowed);
            pdl = allowed != 0;
        } else if (a.id != 0) {
            complain("cuLaunchKernelEx", "launch attribute %u is not emulated (only 6, programmatic stream "
                     "serialization)", a.id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    return launch("cuLaunchKernelEx", f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->sharedMemBytes, config->hStream, params, extra, pdl);
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
    s->capturing = std::this_thread::get_id();
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
