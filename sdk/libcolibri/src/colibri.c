/* colibri.c: the runtime — a checked bundle on a GPU through the CUDA driver API (docs/c_runtime.md).
 *
 * colibri_init, in order (the same steps as sdk/runtime/cuda_backend.py):
 *   1. the bundle is opened and checked (bundle.c), and its launch plan, buffers and io_buffers validated;
 *   2. libcuda.so.1 is opened (dlopen), cuInit, the device, its primary context, a non-blocking stream;
 *   3. cubin or PTX chosen (select_image: same major and >= minor runs the cubin; a newer GPU JIT-compiles the PTX
 *      when the driver is at least as new as the NVRTC that wrote it), each kernel module loaded;
 *   4. the weights (the .colibri data after the header, mmap'ed) uploaded once in 64 MiB chunks: directly from the
 *      mapping on an integrated GPU, dropping each chunk's pages afterwards (madvise MADV_DONTNEED, posix_fadvise
 *      POSIX_FADV_DONTNEED) so the weights are not resident twice; through two pinned staging buffers otherwise;
 *   5. every buffer of the manifest allocated, pinned input/output (and lengths) allocated, every launch's
 *      kernelParams array built;
 *   6. the forward pass (lengths copy when io_buffers has valid_tokens, input copy, every launch, output copy)
 *      captured once into a CUDA Graph and instantiated.
 * Per call: set_input copies into pinned memory, infer is one cuGraphLaunch (+ one cuStreamSynchronize on the
 * context's own stream), get_output copies out. Nothing is allocated after colibri_init. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"

static _Thread_local cb_err tls_err;

/* ---- small helpers ----------------------------------------------------------------------------------------- */
uint32_t colibri_abi_version(void) { return COLIBRI_ABI_VERSION; }

const char *colibri_status_name(int status) {
    static const char *names[] = {"COLIBRI_OK", "COLIBRI_ERR_INVALID_ARG", "COLIBRI_ERR_BUNDLE",
                                  "COLIBRI_ERR_NO_DRIVER", "COLIBRI_ERR_UNSUPPORTED_DEVICE", "COLIBRI_ERR_CUDA",
                                  "COLIBRI_ERR_OUT_OF_MEMORY", "COLIBRI_ERR_STATE", "COLIBRI_ERR_ABI"};
    if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "COLIBRI_ERR_UNKNOWN";
    return names[status];
}

const char *colibri_last_error(const colibri_ctx *ctx) { return ctx ? ctx->err.text : tls_err.text; }

/* ---- the forward pass ---------------------------------------------------------------------------------------- */
static int enqueue(colibri_ctx *c, CUstream s) {
    if (c->valid_buf >= 0)
        CU(c, cuMemcpyHtoDAsync, c->buffers[c->valid_buf].ptr, c->lengths_host, 4 * (size_t)c->batch, s);
    if (c->bound_in)
        CU(c, cuMemcpyDtoDAsync, c->buffers[c->in_buf].ptr, c->bound_in, c->io_bytes, s);
    else
        CU(c, cuMemcpyHtoDAsync, c->buffers[c->in_buf].ptr, c->in_host, c->io_bytes, s);
    for (size_t i = 0; i < c->n_launches; i++) {
        const launch *L = &c->launches[i];
        CU(c, cuLaunchKernel, L->fn, L->grid[0], L->grid[1], L->grid[2], L->block[0], L->block[1], L->block[2],
           L->shared, s, L->nargs ? &c->arg_params[L->first_arg] : NULL, NULL);
    }
    if (c->bound_out)
        CU(c, cuMemcpyDtoDAsync, c->bound_out, c->buffers[c->out_buf].ptr, c->io_bytes, s);
    else
        CU(c, cuMemcpyDtoHAsync, c->out_host, c->buffers[c->out_buf].ptr, c->io_bytes, s);
    return COLIBRI_OK;
}

static void drop_graph(colibri_ctx *c) {
    if (c->exec) c->cu.cuGraphExecDestroy(c->exec);
    if (c->graph) c->cu.cuGraphDestroy(c->graph);
    c->exec = NULL;
    c->graph = NULL;
}

static int capture(colibri_ctx *c) {
    drop_graph(c);
    if (c->flags & COLIBRI_FLAG_EAGER) return COLIBRI_OK;
    CU(c, cuStreamBeginCapture, c->own_stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL_);
    int rc = enqueue(c, c->own_stream);
    CUgraph g = NULL;
    CUresult r = c->cu.cuStreamEndCapture(c->own_stream, &g);
    if (rc) { /* the first error is the one to report */
        if (g) c->cu.cuGraphDestroy(g);
        return rc;
    }
    if (r) return cb_cu_fail(c, "cuStreamEndCapture", r);
    c->graph = g;
    CU(c, cuGraphInstantiateWithFlags, &c->exec, c->graph, 0);
    return COLIBRI_OK;
}

static int wait_stream(colibri_ctx *c) {
    if (!c->in_flight) return COLIBRI_OK;
    c->in_flight = 0;
    CU(c, cuStreamSynchronize, c->stream);
    return COLIBRI_OK;
}

/* ---- public calls --------------------------------------------------------------------------------------------- */
static void release(colibri_ctx *c) {
    if (c->cu.lib) {
        if (c->cuctx) c->cu.cuCtxSetCurrent(c->cuctx);
        if (c->in_flight) c->cu.cuStreamSynchronize(c->stream);
        if (c->own_stream) c->cu.cuStreamSynchronize(c->own_stream);
        drop_graph(c);
        for (size_t i = 0; i < c->n_buffers; i++)
            if (c->buffers[i].ptr) c->cu.cuMemFree(c->buffers[i].ptr);
        if (c->weights) c->cu.cuMemFree(c->weights);
        if (c->in_host) c->cu.cuMemFreeHost(c->in_host);
        if (c->out_host) c->cu.cuMemFreeHost(c->out_host);
        if (c->lengths_host) c->cu.cuMemFreeHost(c->lengths_host);
        if (c->dropped_host) c->cu.cuMemFreeHost(c->dropped_host);
        for (size_t i = 0; i < c->n_modules; i++) c->cu.cuModuleUnload(c->modules[i]);
        if (c->own_stream) c->cu.cuStreamDestroy(c->own_stream);
        if (c->ctx_retained) c->cu.cuDevicePrimaryCtxRelease(c->dev);
        cu_api_unload(&c->cu);
    }
    for (size_t i = 0; i < c->n_functions; i++) free(c->functions[i].symbol);
    free(c->functions);
    free(c->modules);
    free(c->buffers);
    free(c->launches);
    free(c->arg_values);
    free(c->arg_params);
    free(c->out_lengths);
}

static int init_steps(colibri_ctx *c, const colibri_config *cfg, cb_bundle *b) {
    int rc = cb_bundle_open(b, cfg->bundle_dir, !(cfg->flags & COLIBRI_FLAG_NO_VERIFY), &c->err);
    if (rc) return rc;
    c->batch = b->batch;
    c->tokens = b->tokens;
    c->hidden = b->header.hidden_size;
    c->io_bytes = (size_t)c->batch * (size_t)c->tokens * (size_t)c->hidden * sizeof(float);
    if ((rc = cb_read_buffers(c, b)) || (rc = cb_walk_plan(c, b, 0))) return rc;
    if ((rc = cu_api_load(&c->cu, cfg->driver_library, &c->err))) return rc;
    if ((rc = cb_open_device(c, cfg->device))) return rc;
    if ((rc = cb_select_image(c, b, c->io.compute_capability[0], c->io.compute_capability[1], c->io.driver_version,
                           &c->io.image_kind)))
        return rc;
    if ((rc = cb_load_modules(c, b)) || (rc = cb_upload_weights(c, b)) || (rc = cb_alloc_memory(c))) return rc;
    if ((rc = cb_walk_plan(c, b, 1))) return rc;
    if ((rc = capture(c))) return rc;
    colibri_io *io = &c->io;
    io->batch = (uint32_t)c->batch;
    io->tokens = (uint32_t)c->tokens;
    io->hidden = (uint32_t)c->hidden;
    io->input_bytes = io->output_bytes = c->io_bytes;
    io->launches = (uint32_t)c->n_launches;
    snprintf(io->arch, sizeof io->arch, "%s", b->arch);
    snprintf(io->dtype, sizeof io->dtype, "%s", b->dtype);
    for (size_t i = 0; i < c->n_buffers; i++) c->buffers[i].name = NULL; /* they pointed into the manifest */
    return COLIBRI_OK;
}

int colibri_init(const colibri_config *cfg, colibri_ctx **out) {
    if (out) *out = NULL;
    if (!cfg || !out)
        return cb_fail(&tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_init: config and ctx must not be NULL");
    if (cfg->struct_size != sizeof(colibri_config) || cfg->abi_version != COLIBRI_ABI_VERSION)
        return cb_fail(&tls_err, COLIBRI_ERR_ABI,
                       "colibri_init: config.struct_size %u / abi_version %u; this library has %zu / %u (initialise "
                       "the config with COLIBRI_CONFIG_INIT and rebuild against this colibri.h)",
                       cfg->struct_size, cfg->abi_version, sizeof(colibri_config), COLIBRI_ABI_VERSION);
    const uint32_t known = COLIBRI_FLAG_NO_VERIFY | COLIBRI_FLAG_EAGER;
    if (cfg->flags & ~known)
        return cb_fail(&tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_init: config.flags 0x%x; allowed: bits 0x%x",
                       cfg->flags, known);
    colibri_ctx *c = calloc(1, sizeof *c);
    if (!c) return cb_fail(&tls_err, COLIBRI_ERR_OUT_OF_MEMORY, "colibri_init: out of memory");
    c->valid_buf = -1;
    c->dropped_buf = -1;
    c->flags = cfg->flags;
    cb_bundle b;
    int rc = init_steps(c, cfg, &b);
    cb_bundle_close(&b);
    if (rc) {
        tls_err = c->err;
        release(c);
        free(c);
        return rc;
    }
    pthread_mutex_init(&c->lock, NULL);
    tls_err.text[0] = 0;
    *out = c;
    return COLIBRI_OK;
}

int colibri_io_info(const colibri_ctx *c, colibri_io *info) {
    if (!c || !info) return cb_fail(&tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_io_info: ctx and info must not be NULL");
    *info = c->io;
    return COLIBRI_OK;
}

#define ENTER(c, name)                                                                                      \
    if (!(c)) return cb_fail(&tls_err, COLIBRI_ERR_INVALID_ARG, name ": ctx is NULL; allowed: a context from colibri_init"); \
    pthread_mutex_lock(&(c)->lock)

static int set_input_locked(colibri_ctx *c, const float *x, const int32_t *lengths, size_t n) {
    if (!x) return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_set_input: x is NULL");
    if (n != (size_t)c->batch)
        return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_set_input: n = %zu; allowed: %d (the bundle's batch)",
                       n, c->batch);
    if (lengths)
        for (size_t b = 0; b < n; b++)
            if (lengths[b] < 0 || lengths[b] > c->tokens)
                return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG,
                               "colibri_set_input: input_lengths[%zu] = %d; allowed: 0..%d (the bundle's tokens)", b,
                               (int)lengths[b], c->tokens);
    if (c->bound_in)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_set_input: the input is bound to device memory "
                                                   "(colibri_bind); write it there");
    int rc = wait_stream(c); /* the previous call's input copy may still read the pinned buffer */
    if (rc) return rc;
    const size_t row = (size_t)c->hidden, per_seq = (size_t)c->tokens * row;
    c->has_input = 0;
    for (size_t b = 0; b < n; b++) {
        const int len = lengths ? lengths[b] : c->tokens;
        float *dst = c->in_host + b * per_seq;
        const float *src = x + b * per_seq;
        memcpy(dst, src, (size_t)len * row * sizeof(float));
        memset(dst + (size_t)len * row, 0, (per_seq - (size_t)len * row) * sizeof(float));
        const uint32_t *bits = (const uint32_t *)dst;
        for (size_t i = 0; i < (size_t)len * row; i++)
            if ((bits[i] & 0x7F800000u) == 0x7F800000u)
                return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG,
                               "colibri_set_input: a non-finite value (NaN or Inf) at (batch %zu, token %zu, %zu); all "
                               "values at valid positions must be finite", b, i / row, i % row);
        c->lengths_host[b] = len;
    }
    c->has_input = 1;
    return COLIBRI_OK;
}

int colibri_set_input(colibri_ctx *c, const float *x, const int32_t *lengths, size_t n) {
    ENTER(c, "colibri_set_input");
    int rc = set_input_locked(c, x, lengths, n);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int infer_locked(colibri_ctx *c) {
    if (!c->has_input && !c->bound_in)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_infer: no input yet; call colibri_set_input first");
    int rc = wait_stream(c);
    if (rc) return rc;
    c->has_output = 0;
    CU(c, cuCtxSetCurrent, c->cuctx);
    if (c->flags & COLIBRI_FLAG_EAGER) {
        if ((rc = enqueue(c, c->stream))) return rc;
    } else {
        CU(c, cuGraphLaunch, c->exec, c->stream);
    }
    memcpy(c->out_lengths, c->lengths_host, (size_t)c->batch * sizeof *c->out_lengths);
    if (c->stream == c->own_stream) {
        CU(c, cuStreamSynchronize, c->stream);
    } else {
        c->in_flight = 1;
    }
    c->has_output = 1;
    return COLIBRI_OK;
}

int colibri_infer(colibri_ctx *c) {
    ENTER(c, "colibri_infer");
    int rc = infer_locked(c);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int get_output_locked(colibri_ctx *c, float *y, size_t y_bytes) {
    if (!y) return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_get_output: y is NULL");
    if (y_bytes != c->io_bytes)
        return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_get_output: y_bytes = %zu; allowed: %zu (float32 "
                       "(%d, %d, %d))", y_bytes, c->io_bytes, c->batch, c->tokens, c->hidden);
    if (c->bound_out)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_get_output: the output is bound to device memory "
                                                   "(colibri_bind); read it there");
    if (!c->has_output)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_get_output: no output yet; call colibri_infer first");
    int rc = wait_stream(c);
    if (rc) {
        c->has_output = 0;
        return rc;
    }
    const size_t row = (size_t)c->hidden, per_seq = (size_t)c->tokens * row;
    for (int b = 0; b < c->batch; b++) {
        const size_t valid = (size_t)c->out_lengths[b] * row;
        memcpy(y + b * per_seq, c->out_host + b * per_seq, valid * sizeof(float));
        memset(y + b * per_seq + valid, 0, (per_seq - valid) * sizeof(float));
    }
    return COLIBRI_OK;
}

int colibri_get_output(colibri_ctx *c, float *y, size_t y_bytes) {
    ENTER(c, "colibri_get_output");
    int rc = get_output_locked(c, y, y_bytes);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int bind_locked(colibri_ctx *c, uint64_t in, uint64_t out) {
    int rc = wait_stream(c);
    if (rc) return rc;
    CU(c, cuCtxSetCurrent, c->cuctx);
    c->bound_in = (CUdeviceptr)in;
    c->bound_out = (CUdeviceptr)out;
    if (in)
        for (int b = 0; b < c->batch; b++) c->lengths_host[b] = c->tokens; /* device input: every position valid */
    c->has_output = 0;
    rc = capture(c);
    if (rc) { /* keep a usable context: back to the pinned buffers */
        c->bound_in = c->bound_out = 0;
        char saved[CB_ERR_LEN];
        memcpy(saved, c->err.text, sizeof saved);
        if (capture(c) != COLIBRI_OK) c->has_input = 0;
        memcpy(c->err.text, saved, sizeof saved);
    }
    return rc;
}

int colibri_bind(colibri_ctx *c, uint64_t device_input, uint64_t device_output) {
    ENTER(c, "colibri_bind");
    int rc = bind_locked(c, device_input, device_output);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int dropped_locked(colibri_ctx *c, int64_t *pairs) {
    if (!pairs) return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_dropped_pairs: pairs is NULL");
    if (!c->has_output)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_dropped_pairs: no call yet; call colibri_infer first");
    *pairs = 0;
    if (c->dropped_buf < 0) return COLIBRI_OK; /* dropless */
    int rc = wait_stream(c);
    if (rc) return rc;
    const buffer *d = &c->buffers[c->dropped_buf];
    CU(c, cuCtxSetCurrent, c->cuctx);
    CU(c, cuMemcpyDtoHAsync, c->dropped_host, d->ptr, (size_t)d->size, c->stream);
    CU(c, cuStreamSynchronize, c->stream);
    for (long long l = 0; l < d->size / 4; l++) *pairs += c->dropped_host[l];
    return COLIBRI_OK;
}

int colibri_dropped_pairs(colibri_ctx *c, int64_t *pairs) {
    ENTER(c, "colibri_dropped_pairs");
    int rc = dropped_locked(c, pairs);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int colibri_set_stream(colibri_ctx *c, void *stream) {
    ENTER(c, "colibri_set_stream");
    int rc = wait_stream(c);
    if (!rc) c->stream = stream ? (CUstream)stream : c->own_stream;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

void colibri_free(colibri_ctx *c) {
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    release(c);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_destroy(&c->lock);
    free(c);
}
