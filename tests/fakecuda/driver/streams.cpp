// streams.cpp: the work nodes (copies, memsets, kernels, event records), run at once on an in-order stream or
// recorded while it captures; the stream and event calls. fake_cuda.h describes the whole driver.
#include <chrono>
#include <cstring>

#include "fake_cuda.h"

using namespace fake;

namespace fake {

std::map<void*, std::unique_ptr<Stream>> g_streams;
std::map<void*, std::unique_ptr<Event>> g_events;
std::map<void*, std::unique_ptr<Graph>> g_graphs;
std::map<void*, std::unique_ptr<GraphExec>> g_execs;

bool is_default_stream(void* s) {
    return s == nullptr || s == reinterpret_cast<void*>(1) || s == reinterpret_cast<void*>(2);
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

// A synchronous call while a capture is active invalidates it, as CUstreamCaptureMode says: a global capture refuses
// the call from any thread, a thread-local one only from the thread that began it, a relaxed one never (CUDA Driver
// API, cuThreadExchangeStreamCaptureMode).
CUresult refuse_during_capture(const char* call) {
    bool refused = false;
    const std::thread::id self = std::this_thread::get_id();
    for (auto& [h, s] : g_streams) {
        if (s->capture && (s->mode == 0 || (s->mode == 1 && s->capturing == self))) {
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

namespace {
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
}  // namespace

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

namespace {
// A synchronous copy or memset runs now (refused while a stream captures); an asynchronous one goes to `stream`.
CUresult run_or_submit(Node node, void* stream, const char* call, bool async) {
    if (!async) {
        if (any_capture())
            if (CUresult r = refuse_during_capture(call)) return r;
        return run_node(node);
    }
    return submit(std::move(node), stream, call);
}
}  // namespace

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
    return run_or_submit(std::move(node), stream, call, async);
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
    return run_or_submit(std::move(node), stream, call, async);
}

}  // namespace fake

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
