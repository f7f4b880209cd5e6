/* colibri.c: the runtime — a checked bundle on a GPU through the CUDA driver API (docs/c_runtime.md).
 *
 * colibri_init, in order (the same steps as sdk/runtime/cuda_backend.py):
 *   1. the bundle is opened and checked (bundle.c), and each compiled shape's launch plan, buffers and io_buffers
 *      validated (the manifest's `shapes`, smallest first; a bundle without it has one shape);
 *   2. libcuda.so.1 is opened (dlopen), cuInit, the device, its primary context, a non-blocking stream;
 *   3. cubin or PTX chosen (select_image: same major and >= minor runs the cubin; a newer GPU JIT-compiles the PTX
 *      when the driver is at least as new as the NVRTC that wrote it), each shape's kernel modules loaded;
 *   4. the weights (the .colibri data after the header, mmap'ed) uploaded once in 64 MiB chunks: directly from the
 *      mapping on an integrated GPU, dropping each chunk's pages afterwards (madvise MADV_DONTNEED, posix_fadvise
 *      POSIX_FADV_DONTNEED) so the weights are not resident twice; through two pinned staging buffers otherwise;
 *   5. every buffer name of any shape allocated once, of the largest size a shape gives it (the shapes share them:
 *      one call at a time per context), pinned input/output (and lengths) of the largest shape's size, every
 *      launch's kernelParams array built;
 *   6. per shape, the forward pass (lengths copy when io_buffers has valid_tokens, input copy, every launch, output
 *      copy) captured once into a CUDA Graph and instantiated.
 * Per call: set_input copies into pinned memory at the smallest shape that holds the call (the first of `shapes`
 * with batch and tokens both at least the call's, as sdk/runtime/runtime.py Runtime.shape_for), infer is one
 * cuGraphLaunch of that shape's graph (+ one cuStreamSynchronize on the context's own stream), get_output copies the
 * call's part out. Nothing is allocated after colibri_init. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"

_Thread_local cb_err cb_tls_err;

/* ---- small helpers ----------------------------------------------------------------------------------------- */
uint32_t colibri_abi_version(void) { return COLIBRI_ABI_VERSION; }

const char *colibri_status_name(int status) {
    static const char *names[] = {"COLIBRI_OK", "COLIBRI_ERR_INVALID_ARG", "COLIBRI_ERR_BUNDLE",
                                  "COLIBRI_ERR_NO_DRIVER", "COLIBRI_ERR_UNSUPPORTED_DEVICE", "COLIBRI_ERR_CUDA",
                                  "COLIBRI_ERR_OUT_OF_MEMORY", "COLIBRI_ERR_STATE", "COLIBRI_ERR_ABI",
                                  "COLIBRI_ERR_NONFINITE_OUTPUT"};
    if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "COLIBRI_ERR_UNKNOWN";
    return names[status];
}

/* No AddressSanitizer instrumentation for this one read: a handle passed again after colibri_free points at freed
 * memory, and reading its first word is how the call learns that (colibri_free cleared it). What the check cannot
 * see is documented in docs/c_runtime.md, "Handles". */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CB_NO_ASAN __attribute__((no_sanitize("address")))
#endif
#endif
#if !defined(CB_NO_ASAN) && defined(__SANITIZE_ADDRESS__)
#define CB_NO_ASAN __attribute__((no_sanitize_address))
#endif
#ifndef CB_NO_ASAN
#define CB_NO_ASAN
#endif

CB_NO_ASAN int cb_ctx_live(const colibri_ctx *c) { return *(const volatile uint64_t *)&c->magic == CB_CTX_MAGIC; }

/* A handle that is not live gets the message of the call that refused it (this thread's), never its own memory. */
const char *colibri_last_error(const colibri_ctx *ctx) {
    return ctx && cb_ctx_live(ctx) ? ctx->err.text : cb_tls_err.text;
}

/* ---- the forward pass ---------------------------------------------------------------------------------------- */
static shape_plan *largest(colibri_ctx *c) { return &c->shapes[c->n_shapes - 1]; }

static int enqueue(colibri_ctx *c, const shape_plan *p, CUstream s) {
    const CUdeviceptr in = c->pool[p->buffers[p->in_buf].pool].ptr, out = c->pool[p->buffers[p->out_buf].pool].ptr;
    const int bound = p == largest(c); /* caller device memory holds the largest shape only */
    if (p->valid_buf >= 0)
        CU(c, cuMemcpyHtoDAsync, c->pool[p->buffers[p->valid_buf].pool].ptr, c->lengths_host, 4 * (size_t)p->batch, s);
    if (bound && c->bound_in)
        CU(c, cuMemcpyDtoDAsync, in, c->bound_in, p->io_bytes, s);
    else
        CU(c, cuMemcpyHtoDAsync, in, c->in_host, p->io_bytes, s);
    for (size_t i = 0; i < p->n_launches; i++) {
        const launch *L = &p->launches[i];
        void **params = L->nargs ? &p->arg_params[L->first_arg] : NULL;
        if (L->pdl && i > 0) { /* the first follows the input copy: no programmatic edge */
            cu_launch_attribute attr = {.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION_};
            attr.value.programmatic_stream_serialization_allowed = 1;
            const cu_launch_config cfg = {L->grid[0], L->grid[1], L->grid[2], L->block[0], L->block[1], L->block[2],
                                          L->shared, s, &attr, 1};
            CU(c, cuLaunchKernelEx, &cfg, L->fn, params, NULL);
        } else {
            CU(c, cuLaunchKernel, L->fn, L->grid[0], L->grid[1], L->grid[2], L->block[0], L->block[1], L->block[2],
               L->shared, s, params, NULL);
        }
    }
    if (bound && c->bound_out)
        CU(c, cuMemcpyDtoDAsync, c->bound_out, out, p->io_bytes, s);
    else
        CU(c, cuMemcpyDtoHAsync, c->out_host, out, p->io_bytes, s);
    return COLIBRI_OK;
}

static void drop_graph(colibri_ctx *c, shape_plan *p) {
    if (p->exec) c->cu.cuGraphExecDestroy(p->exec);
    if (p->graph) c->cu.cuGraphDestroy(p->graph);
    p->exec = NULL;
    p->graph = NULL;
}

static int capture(colibri_ctx *c, shape_plan *p) {
    drop_graph(c, p);
    if (c->flags & COLIBRI_FLAG_EAGER) return COLIBRI_OK;
    CU(c, cuStreamBeginCapture, c->own_stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL_);
    int rc = enqueue(c, p, c->own_stream);
    CUgraph g = NULL;
    CUresult r = c->cu.cuStreamEndCapture(c->own_stream, &g);
    if (rc) { /* the first error is the one to report */
        if (g) c->cu.cuGraphDestroy(g);
        return rc;
    }
    if (r) return cb_cu_fail(c, "cuStreamEndCapture", r);
    p->graph = g;
    CU(c, cuGraphInstantiateWithFlags, &p->exec, p->graph, 0);
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
        for (size_t k = 0; k < c->n_shapes; k++) drop_graph(c, &c->shapes[k]);
        for (size_t i = 0; i < c->n_pool; i++)
            if (c->pool[i].ptr) c->cu.cuMemFree(c->pool[i].ptr);
        if (c->weights) c->cu.cuMemFree(c->weights);
        if (c->in_host) c->cu.cuMemFreeHost(c->in_host);
        if (c->out_host) c->cu.cuMemFreeHost(c->out_host);
        if (c->lengths_host) c->cu.cuMemFreeHost(c->lengths_host);
        if (c->dropped_host) c->cu.cuMemFreeHost(c->dropped_host);
        for (size_t k = 0; k < c->n_shapes; k++)
            for (size_t i = 0; i < c->shapes[k].n_modules; i++) c->cu.cuModuleUnload(c->shapes[k].modules[i]);
        if (c->own_stream) c->cu.cuStreamDestroy(c->own_stream);
        if (c->ctx_retained) c->cu.cuDevicePrimaryCtxRelease(c->dev);
        cu_api_unload(&c->cu);
    }
    for (size_t k = 0; k < c->n_shapes; k++) {
        shape_plan *p = &c->shapes[k];
        for (size_t i = 0; i < p->n_functions; i++) free(p->functions[i].symbol);
        free(p->functions);
        free(p->modules);
        free(p->buffers);
        free(p->launches);
        free(p->arg_values);
        free(p->arg_params);
    }
    free(c->shapes);
    free(c->pool);
    free(c->out_lengths);
}

static int init_steps(colibri_ctx *c, const colibri_config *cfg, cb_bundle *b) {
    int rc = cb_bundle_open(b, cfg->bundle_dir, !(cfg->flags & COLIBRI_FLAG_NO_VERIFY), &c->err);
    if (rc) return rc;
    c->batch = b->batch;
    c->tokens = b->tokens;
    c->hidden = b->header.hidden_size;
    c->io_bytes = (size_t)c->batch * (size_t)c->tokens * (size_t)c->hidden * sizeof(float);
    if ((rc = cb_read_shapes(c, b))) return rc;
    if ((rc = cu_api_load(&c->cu, cfg->driver_library, &c->err))) return rc;
    if ((rc = cb_open_device(c, cfg->device))) return rc;
    if ((rc = cb_select_image(c, b, c->io.compute_capability[0], c->io.compute_capability[1], c->io.driver_version,
                           &c->io.image_kind)))
        return rc;
    for (size_t k = 0; k < c->n_shapes; k++)
        if ((rc = cb_load_modules(c, b, &c->shapes[k]))) return rc;
    if ((rc = cb_upload_weights(c, b)) || (rc = cb_alloc_memory(c))) return rc;
    for (size_t k = 0; k < c->n_shapes; k++)
        if ((rc = cb_walk_plan(c, b, &c->shapes[k], 1)) || (rc = capture(c, &c->shapes[k]))) return rc;
    colibri_io *io = &c->io;
    io->batch = (uint32_t)c->batch;
    io->tokens = (uint32_t)c->tokens;
    io->hidden = (uint32_t)c->hidden;
    io->input_bytes = io->output_bytes = c->io_bytes;
    io->launches = (uint32_t)largest(c)->n_launches;
    snprintf(io->arch, sizeof io->arch, "%s", b->arch);
    snprintf(io->dtype, sizeof io->dtype, "%s", b->dtype);
    for (size_t k = 0; k < c->n_shapes; k++) { /* they pointed into the manifest */
        c->shapes[k].json = NULL;
        for (size_t i = 0; i < c->shapes[k].n_buffers; i++) c->shapes[k].buffers[i].name = NULL;
    }
    for (size_t i = 0; i < c->n_pool; i++) c->pool[i].name = NULL;
    c->in_shape = c->out_shape = c->n_shapes - 1;
    c->in_batch = c->out_batch = c->batch;
    c->in_tokens = c->out_tokens = c->tokens;
    return COLIBRI_OK;
}

int colibri_init(const colibri_config *cfg, colibri_ctx **out) {
    if (out) *out = NULL;
    if (!cfg || !out)
        return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_init: config and ctx must not be NULL");
    if (cfg->struct_size != sizeof(colibri_config) || cfg->abi_version != COLIBRI_ABI_VERSION)
        return cb_fail(&cb_tls_err, COLIBRI_ERR_ABI,
                       "colibri_init: config.struct_size %u / abi_version %u; this library has %zu / %u (initialise "
                       "the config with COLIBRI_CONFIG_INIT and rebuild against this colibri.h)",
                       cfg->struct_size, cfg->abi_version, sizeof(colibri_config), COLIBRI_ABI_VERSION);
    const uint32_t known = COLIBRI_FLAG_NO_VERIFY | COLIBRI_FLAG_EAGER;
    if (cfg->flags & ~known)
        return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_init: config.flags 0x%x; allowed: bits 0x%x",
                       cfg->flags, known);
    colibri_ctx *c = calloc(1, sizeof *c);
    if (!c) return cb_fail(&cb_tls_err, COLIBRI_ERR_OUT_OF_MEMORY, "colibri_init: out of memory");
    c->flags = cfg->flags;
    cb_bundle b;
    int rc = init_steps(c, cfg, &b);
    cb_bundle_close(&b);
    if (rc) {
        cb_tls_err = c->err;
        release(c);
        free(c);
        return rc;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->magic = CB_CTX_MAGIC;
    cb_tls_err.text[0] = 0;
    *out = c;
    return COLIBRI_OK;
}

int colibri_io_info(const colibri_ctx *c, colibri_io *info) {
    if (!c || !info) return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_io_info: ctx and info must not be NULL");
    if (!cb_ctx_live(c))
        return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_io_info: ctx is not a live context (freed by "
                       "colibri_free, or not from colibri_init); allowed: a context from colibri_init");
    *info = c->io;
    return COLIBRI_OK;
}


/* Stage x (batch, tokens, hidden) into the pinned input at shape k (its (batch, tokens) corner; zeros elsewhere), and
 * the valid lengths: lengths[b] (or tokens) for the call's sequences, 0 for the padding ones (Runtime._valid_counts). */
static int stage(colibri_ctx *c, const char *call, size_t k, const float *x, const int32_t *lengths, size_t batch,
                 size_t tokens) {
    if (lengths)
        for (size_t b = 0; b < batch; b++)
            if (lengths[b] < 0 || (size_t)lengths[b] > tokens)
                return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG,
                               "%s: input_lengths[%zu] = %d; allowed: 0..%zu (the input's tokens)", call, b,
                               (int)lengths[b], tokens);
    if (c->bound_in)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "%s: the input is bound to device memory (colibri_bind); write it "
                       "there", call);
    int rc = wait_stream(c); /* the previous call's input copy may still read the pinned buffer */
    if (rc) return rc;
    const shape_plan *p = &c->shapes[k];
    const size_t row = (size_t)c->hidden, per_seq = (size_t)p->tokens * row, src_seq = tokens * row;
    c->has_input = 0;
    for (size_t b = 0; b < (size_t)p->batch; b++) {
        const size_t len = b >= batch ? 0 : lengths ? (size_t)lengths[b] : tokens;
        float *dst = c->in_host + b * per_seq;
        if (len) memcpy(dst, x + b * src_seq, len * row * sizeof(float));
        memset(dst + len * row, 0, (per_seq - len * row) * sizeof(float));
        const uint32_t *bits = (const uint32_t *)dst;
        for (size_t i = 0; i < len * row; i++)
            if ((bits[i] & 0x7F800000u) == 0x7F800000u)
                return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG,
                               "%s: a non-finite value (NaN or Inf) at (batch %zu, token %zu, %zu); all values at "
                               "valid positions must be finite", call, b, i / row, i % row);
        c->lengths_host[b] = (int32_t)len;
    }
    c->in_shape = k;
    c->in_batch = (int)batch;
    c->in_tokens = (int)tokens;
    c->has_input = 1;
    c->staged_since_infer = 1; /* the output held is the previous input's */
    return COLIBRI_OK;
}

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
    return stage(c, "colibri_set_input", c->n_shapes - 1, x, lengths, n, (size_t)c->tokens);
}

int colibri_set_input(colibri_ctx *c, const float *x, const int32_t *lengths, size_t n) {
    ENTER(c, "colibri_set_input");
    int rc = set_input_locked(c, x, lengths, n);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int set_input_shape_locked(colibri_ctx *c, const float *x, const int32_t *lengths, size_t batch,
                                  size_t tokens) {
    static const char call[] = "colibri_set_input_shape";
    if (!x) return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "%s: x is NULL", call);
    if (batch < 1 || tokens < 1)
        return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "%s: batch %zu x tokens %zu; allowed: 1 or more each", call,
                       batch, tokens);
    const long k = cb_shape_for(c, batch, tokens);
    if (k < 0)
        return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "%s: input batch %zu x tokens %zu is larger than every compiled "
                       "shape; the largest is batch %d x tokens %d (build with a larger shape.batch / shape.tokens)",
                       call, batch, tokens, c->batch, c->tokens);
    if (c->bound_out)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "%s: the output is bound to device memory (colibri_bind), which "
                       "holds the largest shape; use colibri_set_input", call);
    return stage(c, call, (size_t)k, x, lengths, batch, tokens);
}

int colibri_set_input_shape(colibri_ctx *c, const float *x, const int32_t *lengths, size_t batch, size_t tokens) {
    ENTER(c, "colibri_set_input_shape");
    int rc = set_input_shape_locked(c, x, lengths, batch, tokens);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static int infer_locked(colibri_ctx *c) {
    if (!c->has_input && !c->bound_in)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_infer: no input yet; call colibri_set_input first");
    int rc = wait_stream(c);
    if (rc) return rc;
    c->has_output = 0;
    shape_plan *p = &c->shapes[c->in_shape];
    CU(c, cuCtxSetCurrent, c->cuctx);
    if (c->flags & COLIBRI_FLAG_EAGER) {
        if ((rc = enqueue(c, p, c->stream))) return rc;
    } else {
        CU(c, cuGraphLaunch, p->exec, c->stream);
    }
    memcpy(c->out_lengths, c->lengths_host, (size_t)p->batch * sizeof *c->out_lengths);
    c->out_shape = c->in_shape;
    c->out_batch = c->in_batch;
    c->out_tokens = c->in_tokens;
    p->calls++;
    c->staged_since_infer = 0;
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
    /* before the size check: that size is the previous input's, not the one the caller just set */
    if (c->staged_since_infer)
        return cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_get_output: a new input was set since the last "
                       "colibri_infer, and the output held is the previous input's; call colibri_infer first");
    const size_t row = (size_t)c->hidden, tokens = (size_t)c->out_tokens;
    const size_t want = (size_t)c->out_batch * tokens * row * sizeof(float);
    if (y_bytes != want)
        return cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_get_output: y_bytes = %zu; allowed: %zu (float32 "
                       "(%d, %d, %d))", y_bytes, want, c->out_batch, c->out_tokens, c->hidden);
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
    const size_t per_seq = (size_t)c->shapes[c->out_shape].tokens * row; /* the shape's layout in out_host */
    size_t bad = 0, first_b = 0, first_t = 0;
    for (int b = 0; b < c->out_batch; b++) {
        const size_t valid = (size_t)c->out_lengths[b] * row;
        memcpy(y + b * tokens * row, c->out_host + b * per_seq, valid * sizeof(float));
        memset(y + b * tokens * row + valid, 0, (tokens * row - valid) * sizeof(float));
        /* NaN/Inf at a valid position (exponent bits all ones), counted per position as the Python runtime's
         * NonFiniteOutputError does (sdk/runtime/runtime.py _nonfinite_output) */
        const uint32_t *bits = (const uint32_t *)(y + b * tokens * row);
        for (size_t t = 0; t < (size_t)c->out_lengths[b]; t++)
            for (size_t i = 0; i < row; i++)
                if ((bits[t * row + i] & 0x7F800000u) == 0x7F800000u) {
                    if (!bad++) first_b = (size_t)b, first_t = t;
                    break;
                }
    }
    if (bad)
        return cb_fail(&c->err, COLIBRI_ERR_NONFINITE_OUTPUT, "colibri_get_output: the output is non-finite (NaN or "
                       "Inf) at %zu valid position%s, first at (batch %zu, token %zu), from %s: a value overflowed the "
                       "float type inside a layer (float32's largest is 3.4e38), or a kernel result is wrong; y holds "
                       "the output as computed", bad, bad == 1 ? "" : "s", first_b, first_t,
                       c->bound_in ? "a device input (not checked on the host)" : "a finite input");
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
    if (in || (out && c->in_shape != c->n_shapes - 1)) { /* bound memory holds the largest shape */
        for (int b = 0; b < c->batch; b++) c->lengths_host[b] = c->tokens; /* device input: every position valid */
        c->in_shape = c->n_shapes - 1;
        c->in_batch = c->batch;
        c->in_tokens = c->tokens;
        c->has_input = 0; /* a pinned input staged before is not the largest shape's with these lengths any more */
    }
    c->has_output = 0;
    rc = capture(c, largest(c));
    if (rc) { /* keep a usable context: back to the pinned buffers */
        c->bound_in = c->bound_out = 0;
        char saved[CB_ERR_LEN];
        memcpy(saved, c->err.text, sizeof saved);
        if (capture(c, largest(c)) != COLIBRI_OK) c->has_input = 0;
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
    const shape_plan *p = &c->shapes[c->out_shape];
    if (p->dropped_buf < 0) return COLIBRI_OK; /* dropless */
    int rc = wait_stream(c);
    if (rc) return rc;
    const buffer *d = &p->buffers[p->dropped_buf];
    CU(c, cuCtxSetCurrent, c->cuctx);
    CU(c, cuMemcpyDtoHAsync, c->dropped_host, c->pool[d->pool].ptr, (size_t)d->size, c->stream);
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
    if (!cb_ctx_live(c)) { /* freed before, or never a context: nothing of it is touched */
        cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, "colibri_free: ctx is not a live context (freed by colibri_free, "
                "or not from colibri_init); nothing freed");
        return;
    }
    pthread_mutex_lock(&c->lock);
    c->magic = 0; /* from here on every call refuses this handle */
    release(c);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_destroy(&c->lock);
    free(c);
}
