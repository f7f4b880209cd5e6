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
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "colibri.h"
#include "cuda_api.h"
#include "internal.h"

#define UPLOAD_CHUNK ((size_t)64 << 20)
#define MAX_BUFFER_BYTES ((long long)1 << 40)

typedef struct buffer {
    const char *name; /* points into the manifest while loading, NULL afterwards */
    long long size;
    CUdeviceptr ptr;
} buffer;

typedef struct launch {
    CUfunction fn;
    unsigned grid[3], block[3], shared;
    size_t first_arg, nargs; /* into ctx->arg_values / ctx->arg_params */
} launch;

typedef struct function {
    char *symbol;
    CUfunction fn;
} function;

struct colibri_ctx {
    pthread_mutex_t lock;
    cb_err err;
    cu_api cu;
    uint32_t flags;
    int batch, tokens, hidden;
    size_t io_bytes;
    CUdevice dev;
    CUcontext cuctx;
    int ctx_retained;
    CUstream own_stream, stream;
    CUmodule *modules;
    size_t n_modules;
    function *functions;
    size_t n_functions;
    buffer *buffers;
    size_t n_buffers;
    CUdeviceptr weights;
    launch *launches;
    size_t n_launches;
    uint64_t *arg_values;
    void **arg_params;
    size_t n_args;
    size_t in_buf, out_buf;
    long valid_buf; /* -1: none */
    float *in_host, *out_host;
    int32_t *lengths_host; /* pinned: copied into valid_tokens by the graph */
    int32_t *out_lengths;  /* the lengths of the input the current output came from */
    CUdeviceptr bound_in, bound_out;
    CUgraph graph;
    CUgraphExec exec;
    int has_input, has_output, in_flight;
    colibri_io io;
};

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

static int cu_fail(colibri_ctx *c, const char *call, CUresult r) {
    char buf[32];
    return cb_fail(&c->err, r == CUDA_ERROR_OUT_OF_MEMORY_ ? COLIBRI_ERR_OUT_OF_MEMORY : COLIBRI_ERR_CUDA, "%s: %s",
                   call, cu_error_name(&c->cu, r, buf, sizeof buf));
}

#define CU(c, call, ...)                                          \
    do {                                                          \
        CUresult r_ = (c)->cu.call(__VA_ARGS__);                  \
        if (r_ != CUDA_SUCCESS_) return cu_fail((c), #call, r_);  \
    } while (0)

static void format_version(int v, char *out, size_t n) { snprintf(out, n, "%d.%d", v / 1000, (v % 1000) / 10); }

static int parse_version(const char *text) {
    int major = 0, minor = 0;
    if (sscanf(text, "%d.%d", &major, &minor) < 1) return 0;
    return 1000 * major + 10 * minor;
}

/* ---- image selection (sdk/runtime/cuda_backend.py, select_image) ------------------------------------------- */
static int select_image(colibri_ctx *c, const cb_bundle *b, int dev_major, int dev_minor, int driver, int *kind) {
    char names[128], have[16], need[16];
    snprintf(names, sizeof names, "the GPU is sm_%d%d, the bundle is built for sm_%d%d", dev_major, dev_minor,
             b->cc_major, b->cc_minor);
    format_version(driver, have, sizeof have);
    if (driver < b->min_driver) {
        format_version(b->min_driver, need, sizeof need);
        return cb_fail(&c->err, COLIBRI_ERR_UNSUPPORTED_DEVICE,
                       "the CUDA driver is %s; the bundle needs at least %s (manifest min_driver %d); %s", have, need,
                       b->min_driver, names);
    }
    if (dev_major == b->cc_major && dev_minor >= b->cc_minor) {
        *kind = 0;
        return COLIBRI_OK;
    }
    if (dev_major < b->cc_major || (dev_major == b->cc_major && dev_minor < b->cc_minor))
        return cb_fail(&c->err, COLIBRI_ERR_UNSUPPORTED_DEVICE,
                       "%s: its code cannot run on an older GPU; build the bundle with a profile for sm_%d%d or older",
                       names, dev_major, dev_minor);
    int needed = parse_version(b->nvrtc_version);
    if (needed < b->min_driver) needed = b->min_driver;
    if (driver < needed) {
        format_version(needed, need, sizeof need);
        return cb_fail(&c->err, COLIBRI_ERR_UNSUPPORTED_DEVICE,
                       "%s: the cubin needs compute capability %d.x, and JIT-compiling the PTX (NVRTC %s) needs a CUDA "
                       "driver >= %s, this one is %s", names, b->cc_major, b->nvrtc_version, need, have);
    }
    *kind = 1;
    return COLIBRI_OK;
}

/* ---- the launch plan ---------------------------------------------------------------------------------------- */
static long find_buffer(const colibri_ctx *c, const char *name) {
    for (size_t i = 0; i < c->n_buffers; i++)
        if (c->buffers[i].name && strcmp(c->buffers[i].name, name) == 0) return (long)i;
    return -1;
}

static int int_in(const cJSON *v, long long lo, long long hi, long long *out) {
    if (!v || (v->type & 0xFF) != cJSON_Number || (v->type & CB_FLOAT_FLAG)) return 0;
    long long x = (long long)v->valuedouble;
    if (x < lo || x > hi) return 0;
    *out = x;
    return 1;
}

/* buffers and io_buffers of the manifest: sizes, names, the I/O buffers big enough. */
static int read_buffers(colibri_ctx *c, const cb_bundle *b) {
    char esc[128];
    const cJSON *m = b->manifest;
    const cJSON *bufs = cJSON_GetObjectItemCaseSensitive(m, "buffers");
    const cJSON *io = cJSON_GetObjectItemCaseSensitive(m, "io_buffers");
    if (!cJSON_GetObjectItemCaseSensitive(m, "launch") || !bufs || !io)
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE,
                       "manifest.json: no launch plan, buffers or io_buffers; the C runtime needs a bundle built by "
                       "colibri-sdk with these keys: rebuild it (colibri-sdk build)");
    c->n_buffers = (size_t)cJSON_GetArraySize(bufs);
    c->buffers = calloc(c->n_buffers ? c->n_buffers : 1, sizeof *c->buffers);
    if (!c->buffers) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    size_t i = 0;
    for (const cJSON *e = bufs->child; e; e = e->next, i++) {
        long long size;
        if (!int_in(e, 0, MAX_BUFFER_BYTES, &size))
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: buffers.%s is not a byte size; allowed: an "
                           "integer in 0..2^40", cb_escape(e->string, esc, sizeof esc));
        c->buffers[i].name = e->string;
        c->buffers[i].size = size;
    }
    const char *names[3] = {"input", "output", "valid_tokens"};
    long idx[3] = {-1, -1, -1};
    for (const cJSON *e = io->child; e; e = e->next) {
        int k = !strcmp(e->string, "input") ? 0 : !strcmp(e->string, "output") ? 1
              : !strcmp(e->string, "valid_tokens") ? 2 : -1;
        if (k < 0)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: io_buffers.%s; allowed keys: input, output, "
                           "valid_tokens", cb_escape(e->string, esc, sizeof esc));
        if (!cJSON_IsString(e) || (idx[k] = find_buffer(c, e->valuestring)) < 0)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: io_buffers.%s does not name a buffer; "
                           "allowed: a key of buffers", names[k]);
    }
    if (idx[0] < 0 || idx[1] < 0)
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: io_buffers needs input and output");
    for (int k = 0; k < 3; k++) {
        long long need = k < 2 ? (long long)c->io_bytes : 4LL * c->batch;
        if (idx[k] >= 0 && c->buffers[idx[k]].size < need)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: io_buffers.%s is buffer %s of %lld bytes; "
                           "allowed: at least %lld", names[k], c->buffers[idx[k]].name, c->buffers[idx[k]].size, need);
    }
    c->in_buf = (size_t)idx[0];
    c->out_buf = (size_t)idx[1];
    c->valid_buf = idx[2];
    return COLIBRI_OK;
}

static int dims3(const cJSON *v, unsigned out[3], long long hi) {
    if (cJSON_GetArraySize(v) != 3 || !cJSON_IsArray(v)) return 0;
    int i = 0;
    for (const cJSON *e = v->child; e; e = e->next, i++) {
        long long x;
        if (!int_in(e, 1, hi, &x)) return 0;
        out[i] = (unsigned)x;
    }
    return 1;
}

/* Walk the plan: fill = 0 checks it and counts arguments; fill = 1 (after load) writes functions and values. */
static int walk_plan(colibri_ctx *c, const cb_bundle *b, int fill) {
    char esc[128];
    const cJSON *plan = cJSON_GetObjectItemCaseSensitive(b->manifest, "launch");
    size_t li = 0, ai = 0;
    for (const cJSON *l = plan->child; l; l = l->next, li++) {
        const char *symbol = cJSON_IsObject(l) ? cb_json_str(l, "symbol") : NULL;
        launch tmp, *L = fill ? &c->launches[li] : &tmp;
        long long shared;
        if (!symbol || !dims3(cJSON_GetObjectItemCaseSensitive(l, "grid"), L->grid, 0x7FFFFFFF) ||
            !dims3(cJSON_GetObjectItemCaseSensitive(l, "block"), L->block, 1024) ||
            !int_in(cJSON_GetObjectItemCaseSensitive(l, "shared_bytes"), 0, 1 << 30, &shared) ||
            !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(l, "args")))
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu] needs symbol (str), grid and block "
                           "(3 positive integers), shared_bytes (integer >= 0) and args (list)", li);
        L->shared = (unsigned)shared;
        L->first_arg = ai;
        if (fill) {
            L->fn = NULL;
            for (size_t f = 0; f < c->n_functions; f++)
                if (strcmp(c->functions[f].symbol, symbol) == 0) L->fn = c->functions[f].fn;
            if (!L->fn)
                return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu] names %s; the bundle's kernels "
                               "do not define it", li, cb_escape(symbol, esc, sizeof esc));
        }
        size_t k = 0;
        for (const cJSON *a = cJSON_GetObjectItemCaseSensitive(l, "args")->child; a; a = a->next, k++, ai++) {
            const char *kind = cJSON_IsObject(a) ? cb_json_str(a, "kind") : NULL;
            uint64_t value = 0;
            long long x;
            if (kind && !strcmp(kind, "buffer")) {
                const char *name = cb_json_str(a, "name");
                long bi = name ? find_buffer(c, name) : -1;
                if (bi < 0)
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu].args[%zu] names buffer %s; "
                                   "allowed: a key of buffers", li, k, name ? cb_escape(name, esc, sizeof esc) : "None");
                value = fill ? c->buffers[bi].ptr : 0;
            } else if (kind && !strcmp(kind, "weights")) {
                if (!int_in(cJSON_GetObjectItemCaseSensitive(a, "offset"), 0, (long long)b->header.data_size - 1, &x))
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu].args[%zu].offset; allowed: "
                                   "an integer in 0..%llu (the weight bytes)", li, k,
                                   (unsigned long long)b->header.data_size - 1);
                value = fill ? c->weights + (uint64_t)x : 0;
            } else if (kind && !strcmp(kind, "i32")) {
                if (!int_in(cJSON_GetObjectItemCaseSensitive(a, "value"), INT32_MIN, INT32_MAX, &x))
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu].args[%zu].value; allowed: "
                                   "an int32", li, k);
                int32_t v32 = (int32_t)x;
                memcpy(&value, &v32, sizeof v32);
            } else if (!(kind && !strcmp(kind, "null"))) {
                return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: launch[%zu].args[%zu] kind %s; allowed: "
                               "buffer, weights, null, i32", li, k, kind ? cb_escape(kind, esc, sizeof esc) : "None");
            }
            if (fill) {
                c->arg_values[ai] = value;
                c->arg_params[ai] = &c->arg_values[ai];
            }
        }
        L->nargs = k;
    }
    if (!fill) {
        c->n_launches = li;
        c->n_args = ai;
    }
    return COLIBRI_OK;
}

/* ---- device, modules, weights ------------------------------------------------------------------------------- */
static int open_device(colibri_ctx *c, int ordinal) {
    char buf[32];
    CUresult r = c->cu.cuInit(0);
    if (r) return cb_fail(&c->err, COLIBRI_ERR_NO_DRIVER, "cuInit: %s", cu_error_name(&c->cu, r, buf, sizeof buf));
    CU(c, cuDriverGetVersion, &c->io.driver_version);
    int count = 0;
    CU(c, cuDeviceGetCount, &count);
    if (ordinal < 0 || ordinal >= count)
        return cb_fail(&c->err, COLIBRI_ERR_NO_DRIVER, "CUDA device %d does not exist; allowed: 0..%d", ordinal, count - 1);
    CU(c, cuDeviceGet, &c->dev, ordinal);
    CU(c, cuDevicePrimaryCtxRetain, &c->cuctx, c->dev);
    c->ctx_retained = 1;
    CU(c, cuCtxSetCurrent, c->cuctx);
    CU(c, cuDeviceGetAttribute, &c->io.compute_capability[0], CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR_, c->dev);
    CU(c, cuDeviceGetAttribute, &c->io.compute_capability[1], CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR_, c->dev);
    CU(c, cuDeviceGetAttribute, &c->io.integrated, CU_DEVICE_ATTRIBUTE_INTEGRATED_, c->dev);
    CU(c, cuDeviceGetName, c->io.device_name, (int)sizeof c->io.device_name, c->dev);
    c->io.device_name[sizeof c->io.device_name - 1] = 0;
    CU(c, cuStreamCreate, &c->own_stream, CU_STREAM_NON_BLOCKING_);
    c->stream = c->own_stream;
    return COLIBRI_OK;
}

static int load_modules(colibri_ctx *c, const cb_bundle *b) {
    const cJSON *kernels = cJSON_GetObjectItemCaseSensitive(b->manifest, "kernels");
    size_t n_symbols = 0, nk = (size_t)cJSON_GetArraySize(kernels);
    for (const cJSON *k = kernels->child; k; k = k->next)
        n_symbols += (size_t)cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(k, "symbols"));
    c->modules = calloc(nk ? nk : 1, sizeof *c->modules);
    c->functions = calloc(n_symbols ? n_symbols : 1, sizeof *c->functions);
    if (!c->modules || !c->functions) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    const char *kind = c->io.image_kind ? "ptx" : "cubin";
    for (const cJSON *k = kernels->child; k; k = k->next) {
        unsigned char *image;
        size_t size;
        int rc = cb_bundle_read(b, cb_json_str(k, kind), 1, &image, &size, &c->err); /* PTX: NUL-terminated */
        if (rc) return rc;
        CUresult r = c->cu.cuModuleLoadData(&c->modules[c->n_modules], image);
        free(image);
        if (r) {
            char call[160], esc[96];
            snprintf(call, sizeof call, "cuModuleLoadData(%s.%s)", cb_escape(cb_json_str(k, "name"), esc, sizeof esc), kind);
            return cu_fail(c, call, r);
        }
        CUmodule mod = c->modules[c->n_modules++];
        for (const cJSON *s = cJSON_GetObjectItemCaseSensitive(k, "symbols")->child; s; s = s->next) {
            function *f = &c->functions[c->n_functions];
            f->symbol = strdup(s->valuestring);
            if (!f->symbol) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
            c->n_functions++;
            r = c->cu.cuModuleGetFunction(&f->fn, mod, s->valuestring);
            if (r) {
                char call[160], esc[96];
                snprintf(call, sizeof call, "cuModuleGetFunction(%s)", cb_escape(s->valuestring, esc, sizeof esc));
                return cu_fail(c, call, r);
            }
        }
    }
    return COLIBRI_OK;
}

static int upload_integrated(colibri_ctx *c, int fd, const unsigned char *map, size_t map_len, size_t size) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t dropped = 0;
    for (size_t off = 0; off < size; off += UPLOAD_CHUNK) {
        size_t n = size - off < UPLOAD_CHUNK ? size - off : UPLOAD_CHUNK;
        size_t start = CB_HEADER_SIZE + off;
        CU(c, cuMemcpyHtoD, c->weights + off, map + start, n);
        size_t end = off + n < size ? (start + n) / page * page : map_len;
        if (end > dropped) {
            madvise((void *)(map + dropped), end - dropped, MADV_DONTNEED);
            posix_fadvise(fd, (off_t)dropped, (off_t)(end - dropped), POSIX_FADV_DONTNEED);
            dropped = end;
        }
    }
    return COLIBRI_OK;
}

static int upload_staged(colibri_ctx *c, const unsigned char *map, size_t size) {
    size_t chunk = size < UPLOAD_CHUNK ? (size ? size : 1) : UPLOAD_CHUNK;
    void *stage[2] = {NULL, NULL};
    CUevent ev[2] = {NULL, NULL};
    CUresult r = 0;
    const char *call = "";
    for (int i = 0; i < 2 && !r; i++) {
        call = "cuMemHostAlloc";
        r = c->cu.cuMemHostAlloc(&stage[i], chunk, 0);
        if (!r) {
            call = "cuEventCreate";
            r = c->cu.cuEventCreate(&ev[i], 0);
        }
    }
    size_t i = 0;
    for (size_t off = 0; off < size && !r; off += chunk, i++) {
        size_t n = size - off < chunk ? size - off : chunk;
        if (i >= 2) {
            call = "cuEventSynchronize";
            if ((r = c->cu.cuEventSynchronize(ev[i % 2]))) break;
        }
        memcpy(stage[i % 2], map + CB_HEADER_SIZE + off, n);
        call = "cuMemcpyHtoDAsync";
        if ((r = c->cu.cuMemcpyHtoDAsync(c->weights + off, stage[i % 2], n, c->own_stream))) break;
        call = "cuEventRecord";
        r = c->cu.cuEventRecord(ev[i % 2], c->own_stream);
    }
    if (!r) {
        call = "cuStreamSynchronize";
        r = c->cu.cuStreamSynchronize(c->own_stream);
    } else {
        c->cu.cuStreamSynchronize(c->own_stream);
    }
    for (int k = 0; k < 2; k++) { /* the staging memory is not kept for the context's life */
        if (ev[k]) c->cu.cuEventDestroy(ev[k]);
        if (stage[k]) c->cu.cuMemFreeHost(stage[k]);
    }
    return r ? cu_fail(c, call, r) : COLIBRI_OK;
}

static int upload_weights(colibri_ctx *c, const cb_bundle *b) {
    const size_t size = (size_t)b->header.data_size;
    CU(c, cuMemAlloc, &c->weights, size ? size : 1);
    int fd;
    uint64_t file_size;
    int rc = cb_bundle_open_file(b, b->weights_file, &fd, &file_size, &c->err);
    if (rc) return rc;
    if (file_size != CB_HEADER_SIZE + size) {
        close(fd);
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "%s changed while loading", b->weights_file);
    }
    unsigned char *map = mmap(NULL, (size_t)file_size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        rc = cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "%s: mmap failed: %s", b->weights_file, strerror(errno));
        close(fd);
        return rc;
    }
    rc = c->io.integrated ? upload_integrated(c, fd, map, (size_t)file_size, size) : upload_staged(c, map, size);
    munmap(map, (size_t)file_size);
    close(fd);
    if (rc) return rc;
    CU(c, cuStreamSynchronize, c->own_stream);
    return COLIBRI_OK;
}

static int alloc_memory(colibri_ctx *c) {
    for (size_t i = 0; i < c->n_buffers; i++) {
        size_t size = (size_t)c->buffers[i].size;
        CU(c, cuMemAlloc, &c->buffers[i].ptr, size ? size : 1);
    }
    CU(c, cuMemHostAlloc, (void **)&c->in_host, c->io_bytes, 0);
    CU(c, cuMemHostAlloc, (void **)&c->out_host, c->io_bytes, 0);
    CU(c, cuMemHostAlloc, (void **)&c->lengths_host, 4 * (size_t)c->batch, 0);
    memset(c->in_host, 0, c->io_bytes);
    memset(c->out_host, 0, c->io_bytes);
    for (int i = 0; i < c->batch; i++) c->lengths_host[i] = c->tokens;
    c->out_lengths = calloc((size_t)c->batch, sizeof *c->out_lengths);
    c->launches = calloc(c->n_launches ? c->n_launches : 1, sizeof *c->launches);
    c->arg_values = calloc(c->n_args ? c->n_args : 1, sizeof *c->arg_values);
    c->arg_params = calloc(c->n_args ? c->n_args : 1, sizeof *c->arg_params);
    if (!c->out_lengths || !c->launches || !c->arg_values || !c->arg_params)
        return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    return COLIBRI_OK;
}

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
    if (r) return cu_fail(c, "cuStreamEndCapture", r);
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
    if ((rc = read_buffers(c, b)) || (rc = walk_plan(c, b, 0))) return rc;
    if ((rc = cu_api_load(&c->cu, cfg->driver_library, &c->err))) return rc;
    if ((rc = open_device(c, cfg->device))) return rc;
    if ((rc = select_image(c, b, c->io.compute_capability[0], c->io.compute_capability[1], c->io.driver_version,
                           &c->io.image_kind)))
        return rc;
    if ((rc = load_modules(c, b)) || (rc = upload_weights(c, b)) || (rc = alloc_memory(c))) return rc;
    if ((rc = walk_plan(c, b, 1))) return rc;
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
