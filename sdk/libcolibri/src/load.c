/* load.c: the steps of colibri_init after the bundle checks (colibri.c lists them): each shape's buffers and
 * launch plan, the device, the image choice, the modules, the weight upload and every allocation. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "context.h"

int cb_cu_fail(colibri_ctx *c, const char *call, CUresult r) {
    char buf[32];
    return cb_fail(&c->err, r == CUDA_ERROR_OUT_OF_MEMORY_ ? COLIBRI_ERR_OUT_OF_MEMORY : COLIBRI_ERR_CUDA, "%s: %s",
                   call, cu_error_name(&c->cu, r, buf, sizeof buf));
}

static void format_version(int v, char *out, size_t n) { snprintf(out, n, "%d.%d", v / 1000, (v % 1000) / 10); }

static int parse_version(const char *text) {
    int major = 0, minor = 0;
    if (sscanf(text, "%d.%d", &major, &minor) < 1) return 0;
    return 1000 * major + 10 * minor;
}

/* ---- image selection (sdk/runtime/cuda_backend.py, select_image) ------------------------------------------- */
int cb_select_image(colibri_ctx *c, const cb_bundle *b, int dev_major, int dev_minor, int driver, int *kind) {
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

/* ---- the shapes and their launch plans ------------------------------------------------------------------------ */
static long find_buffer(const shape_plan *s, const char *name) {
    for (size_t i = 0; i < s->n_buffers; i++)
        if (s->buffers[i].name && strcmp(s->buffers[i].name, name) == 0) return (long)i;
    return -1;
}

static int int_in(const cJSON *v, long long lo, long long hi, long long *out) {
    if (!v || (v->type & 0xFF) != cJSON_Number || (v->type & CB_FLOAT_FLAG)) return 0;
    long long x = (long long)v->valuedouble;
    if (x < lo || x > hi) return 0;
    *out = x;
    return 1;
}

/* The context's shapes: the `shapes` entries but the last, then the largest from the top-level keys (a bundle
 * without `shapes` has only that one); each one's buffers and launch plan checked (the largest first, so a fault in
 * a top-level key is named as such), the buffer pool, then the largest against the last `shapes` entry. */
/* The least bytes a buffer needs at shape s, for the buffers whose size follows from the shape and the weights'
 * header alone (sdk/catalog.py device_buffers; T = batch * tokens, pairs = T * top_k): the kernels index them up to
 * that size, so a recorded size below it would let them write outside the allocation. The buffers sized by the
 * profile's kernel parameters (routing_partials, routing_counters, sorted_pairs, block_experts, down_counters) are
 * not checked here; the Python reader compares every buffer with the catalogue. -1: no rule for this name. */
static long long buffer_minimum(const char *name, const cb_header *h, long long shared, long long shared_inter,
                                long long batch, long long tokens, char *why, size_t why_len) {
    const long long T = batch * tokens, pairs = T * h->top_k;
    static const struct { const char *name; int what; } rules[] = {
        {"x0", 0}, {"x1", 0}, {"valid_tokens", 1}, {"topk_ids", 2}, {"topk_weights", 2}, {"act", 3},
        {"expert_counts", 4}, {"expert_offsets", 5}, {"pair_out", 6}, {"capacity_rank", 7},
        {"capacity_dropped", 8}, {"shared_act", 9}, {"shared_scale", 10}, {"pair_order", 11}};
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
        if (strcmp(name, rules[i].name)) continue;
        switch (rules[i].what) {
        case 0: snprintf(why, why_len, "tokens %lld x hidden %u float32", T, h->hidden_size); return T * h->hidden_size * 4;
        case 1: snprintf(why, why_len, "batch %lld int32", batch); return batch * 4;
        case 2: snprintf(why, why_len, "pairs %lld (tokens x top_k) x 4 bytes", pairs); return pairs * 4;
        case 3:
            snprintf(why, why_len, "pairs %lld x intermediate %u float32", pairs, h->intermediate_size);
            return pairs * h->intermediate_size * 4;
        case 4: snprintf(why, why_len, "experts %u int32", h->num_experts); return (long long)h->num_experts * 4;
        case 5: snprintf(why, why_len, "experts + 1 = %u int32", h->num_experts + 1); return ((long long)h->num_experts + 1) * 4;
        case 6: snprintf(why, why_len, "pairs %lld x hidden %u float32", pairs, h->hidden_size); return pairs * h->hidden_size * 4;
        case 7: snprintf(why, why_len, "2 x pairs %lld int32", pairs); return 2 * pairs * 4;
        case 8: snprintf(why, why_len, "layers %u int32", h->num_layers); return (long long)h->num_layers * 4;
        case 9:
            snprintf(why, why_len, "shared experts %lld x tokens %lld x shared intermediate %lld float32", shared, T,
                     shared_inter);
            return shared * T * shared_inter * 4;
        case 11: /* sdk/catalog.py pair_order_ints: nused, counts, offsets, used, the sorted pairs */
            snprintf(why, why_len, "1 + 3 x experts %u + pairs %lld int32", h->num_experts, pairs);
            return (1 + 3 * (long long)h->num_experts + pairs) * 4;
        default: snprintf(why, why_len, "tokens %lld float32", T); return T * 4;
        }
    }
    return -1;
}

static int check_buffer_minimums(colibri_ctx *c, const cb_bundle *b, const shape_plan *s) {
    const cJSON *weights = cJSON_GetObjectItemCaseSensitive(b->manifest, "weights");
    const cJSON *header = weights ? cJSON_GetObjectItemCaseSensitive(weights, "header") : NULL;
    long long shared = 0, shared_inter = 0; /* v2 fields (docs/format.md); a v1 header has none */
    if (header) {
        cb_json_int(header, "num_shared_experts", &shared);
        cb_json_int(header, "shared_intermediate_size", &shared_inter);
    }
    char why[160];
    for (size_t i = 0; i < s->n_buffers; i++) {
        const long long need = buffer_minimum(s->buffers[i].name, &b->header, shared, shared_inter, s->batch,
                                              s->tokens, why, sizeof why);
        if (need >= 0 && s->buffers[i].size < need)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sbuffers.%s is %lld bytes; allowed: at least "
                           "%lld (%s at batch %d x tokens %d, from the manifest's shape and weights.header as "
                           "sdk/catalog.py device_buffers sizes it)", s->where, s->buffers[i].name,
                           s->buffers[i].size, need, why, s->batch, s->tokens);
    }
    return COLIBRI_OK;
}

int cb_read_shapes(colibri_ctx *c, const cb_bundle *b) {
    const cJSON *entries = cJSON_GetObjectItemCaseSensitive(b->manifest, "shapes");
    const size_t n = entries ? (size_t)cJSON_GetArraySize(entries) : 1;
    c->shapes = calloc(n, sizeof *c->shapes);
    if (!c->shapes) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    c->n_shapes = n;
    size_t i = 0;
    for (const cJSON *e = entries ? entries->child : NULL; e && i + 1 < n; e = e->next, i++) {
        shape_plan *s = &c->shapes[i];
        long long batch, tokens;
        cb_json_int(e, "batch", &batch);
        cb_json_int(e, "tokens", &tokens);
        s->json = e;
        snprintf(s->where, sizeof s->where, "shapes[%zu].", i);
        s->batch = (int)batch;
        s->tokens = (int)tokens;
    }
    shape_plan *largest = &c->shapes[n - 1];
    largest->json = b->manifest;
    largest->batch = c->batch;
    largest->tokens = c->tokens;
    int rc;
    for (size_t k = 0; k < n; k++) {
        shape_plan *s = &c->shapes[(k + n - 1) % n]; /* the largest first */
        s->valid_buf = s->dropped_buf = -1;
        s->io_bytes = (size_t)s->batch * (size_t)s->tokens * (size_t)c->hidden * sizeof(float);
        if ((rc = cb_read_buffers(c, s)) || (rc = check_buffer_minimums(c, b, s)) || (rc = cb_walk_plan(c, b, s, 0)))
            return rc;
    }
    size_t total = 0;
    for (size_t k = 0; k < n; k++) total += c->shapes[k].n_buffers;
    c->pool = calloc(total ? total : 1, sizeof *c->pool);
    if (!c->pool) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    for (size_t k = 0; k < n; k++) /* one allocation per name, of the largest size any shape gives it */
        for (size_t j = 0; j < c->shapes[k].n_buffers; j++) {
            buffer *sb = &c->shapes[k].buffers[j];
            size_t p = 0;
            while (p < c->n_pool && strcmp(c->pool[p].name, sb->name)) p++;
            if (p == c->n_pool) {
                c->pool[p].name = sb->name;
                c->n_pool++;
            }
            if (sb->size > c->pool[p].size) c->pool[p].size = sb->size;
            sb->pool = p;
        }
    return cb_check_largest(b, &c->err);
}

/* A shape's buffers and io_buffers: sizes, names, the I/O buffers big enough for that shape. */
int cb_read_buffers(colibri_ctx *c, shape_plan *s) {
    char esc[128];
    const char *w = s->where;
    const cJSON *bufs = cJSON_GetObjectItemCaseSensitive(s->json, "buffers");
    const cJSON *io = cJSON_GetObjectItemCaseSensitive(s->json, "io_buffers");
    if (!cJSON_GetObjectItemCaseSensitive(s->json, "launch") || !bufs || !io)
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE,
                       "manifest.json: no launch plan, buffers or io_buffers; the C runtime needs a bundle built by "
                       "colibri-sdk with these keys: rebuild it (colibri-sdk build)");
    s->n_buffers = (size_t)cJSON_GetArraySize(bufs);
    s->buffers = calloc(s->n_buffers ? s->n_buffers : 1, sizeof *s->buffers);
    if (!s->buffers) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    size_t i = 0;
    for (const cJSON *e = bufs->child; e; e = e->next, i++) {
        long long size;
        if (!int_in(e, 0, MAX_BUFFER_BYTES, &size))
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sbuffers.%s is not a byte size; allowed: an "
                           "integer in 0..2^40", w, cb_escape(e->string, esc, sizeof esc));
        s->buffers[i].name = e->string;
        s->buffers[i].size = size;
    }
    const char *names[3] = {"input", "output", "valid_tokens"};
    long idx[3] = {-1, -1, -1};
    for (const cJSON *e = io->child; e; e = e->next) {
        int k = !strcmp(e->string, "input") ? 0 : !strcmp(e->string, "output") ? 1
              : !strcmp(e->string, "valid_tokens") ? 2 : -1;
        if (k < 0)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sio_buffers.%s; allowed keys: input, output, "
                           "valid_tokens", w, cb_escape(e->string, esc, sizeof esc));
        if (!cJSON_IsString(e) || (idx[k] = find_buffer(s, e->valuestring)) < 0)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sio_buffers.%s does not name a buffer; "
                           "allowed: a key of %sbuffers", w, names[k], w);
    }
    if (idx[0] < 0 || idx[1] < 0)
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sio_buffers needs input and output", w);
    for (int k = 0; k < 3; k++) {
        long long need = k < 2 ? (long long)s->io_bytes : 4LL * s->batch;
        if (idx[k] >= 0 && s->buffers[idx[k]].size < need)
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sio_buffers.%s is buffer %s of %lld bytes; "
                           "allowed: at least %lld (batch %d x tokens %d)", w, names[k], s->buffers[idx[k]].name,
                           s->buffers[idx[k]].size, need, s->batch, s->tokens);
    }
    s->in_buf = (size_t)idx[0];
    s->out_buf = (size_t)idx[1];
    s->valid_buf = idx[2];
    s->dropped_buf = find_buffer(s, "capacity_dropped"); /* sdk/catalog.py CAPACITY_DROPPED */
    if (s->dropped_buf >= 0 && (s->buffers[s->dropped_buf].size < 4 || s->buffers[s->dropped_buf].size % 4))
        return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %sbuffers.capacity_dropped is %lld bytes; allowed: "
                       "a positive multiple of 4 (one int32 per layer)", w, s->buffers[s->dropped_buf].size);
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

/* Walk a shape's plan: fill = 0 checks it and counts arguments; fill = 1 (after load) writes functions and values. */
int cb_walk_plan(colibri_ctx *c, const cb_bundle *b, shape_plan *s, int fill) {
    char esc[128];
    const char *w = s->where;
    const cJSON *plan = cJSON_GetObjectItemCaseSensitive(s->json, "launch");
    size_t li = 0, ai = 0;
    for (const cJSON *l = plan->child; l; l = l->next, li++) {
        const char *symbol = cJSON_IsObject(l) ? cb_json_str(l, "symbol") : NULL;
        launch tmp, *L = fill ? &s->launches[li] : &tmp;
        long long shared;
        if (!symbol || !dims3(cJSON_GetObjectItemCaseSensitive(l, "grid"), L->grid, 0x7FFFFFFF) ||
            !dims3(cJSON_GetObjectItemCaseSensitive(l, "block"), L->block, 1024) ||
            !int_in(cJSON_GetObjectItemCaseSensitive(l, "shared_bytes"), 0, 1 << 30, &shared) ||
            !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(l, "args")))
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu] needs symbol (str), grid and "
                           "block (3 positive integers), shared_bytes (integer >= 0) and args (list)", w, li);
        L->shared = (unsigned)shared;
        L->first_arg = ai;
        const cJSON *pdl = cJSON_GetObjectItemCaseSensitive(l, "pdl");
        if (pdl && !cJSON_IsBool(pdl))
            return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu].pdl; allowed: true or false "
                           "(programmatic dependent launch)", w, li);
        L->pdl = cJSON_IsTrue(pdl);
        if (fill && L->pdl && !c->cu.cuLaunchKernelEx)
            return cb_fail(&c->err, COLIBRI_ERR_NO_DRIVER, "manifest.json: %slaunch[%zu] uses programmatic dependent "
                           "launch; the CUDA driver has no cuLaunchKernelEx (a driver for CUDA >= 12.3 is needed)",
                           w, li);
        if (fill) {
            L->fn = NULL;
            for (size_t f = 0; f < s->n_functions; f++)
                if (strcmp(s->functions[f].symbol, symbol) == 0) L->fn = s->functions[f].fn;
            if (!L->fn)
                return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu] names %s; the %skernels do "
                               "not define it", w, li, cb_escape(symbol, esc, sizeof esc), *w ? w : "bundle's ");
        }
        size_t k = 0;
        for (const cJSON *a = cJSON_GetObjectItemCaseSensitive(l, "args")->child; a; a = a->next, k++, ai++) {
            const char *kind = cJSON_IsObject(a) ? cb_json_str(a, "kind") : NULL;
            uint64_t value = 0;
            long long x;
            if (kind && !strcmp(kind, "buffer")) {
                const char *name = cb_json_str(a, "name");
                long bi = name ? find_buffer(s, name) : -1;
                if (bi < 0)
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu].args[%zu] names buffer "
                                   "%s; allowed: a key of %sbuffers", w, li, k,
                                   name ? cb_escape(name, esc, sizeof esc) : "None", w);
                value = fill ? c->pool[s->buffers[bi].pool].ptr : 0;
            } else if (kind && !strcmp(kind, "weights")) {
                if (!int_in(cJSON_GetObjectItemCaseSensitive(a, "offset"), 0, (long long)b->header.data_size - 1, &x))
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu].args[%zu].offset; "
                                   "allowed: an integer in 0..%llu (the weight bytes)", w, li, k,
                                   (unsigned long long)b->header.data_size - 1);
                value = fill ? c->weights + (uint64_t)x : 0;
            } else if (kind && !strcmp(kind, "i32")) {
                if (!int_in(cJSON_GetObjectItemCaseSensitive(a, "value"), INT32_MIN, INT32_MAX, &x))
                    return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu].args[%zu].value; "
                                   "allowed: an int32", w, li, k);
                int32_t v32 = (int32_t)x;
                memcpy(&value, &v32, sizeof v32);
            } else if (!(kind && !strcmp(kind, "null"))) {
                return cb_fail(&c->err, COLIBRI_ERR_BUNDLE, "manifest.json: %slaunch[%zu].args[%zu] kind %s; allowed: "
                               "buffer, weights, null, i32", w, li, k, kind ? cb_escape(kind, esc, sizeof esc) : "None");
            }
            if (fill) {
                s->arg_values[ai] = value;
                s->arg_params[ai] = &s->arg_values[ai];
            }
        }
        L->nargs = k;
    }
    if (!fill) {
        s->n_launches = li;
        s->n_args = ai;
    }
    return COLIBRI_OK;
}

/* ---- device, modules, weights ------------------------------------------------------------------------------- */
int cb_open_device(colibri_ctx *c, int ordinal) {
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

int cb_load_modules(colibri_ctx *c, const cb_bundle *b, shape_plan *p) {
    const cJSON *kernels = cJSON_GetObjectItemCaseSensitive(p->json, "kernels");
    size_t n_symbols = 0, nk = (size_t)cJSON_GetArraySize(kernels);
    for (const cJSON *k = kernels->child; k; k = k->next)
        n_symbols += (size_t)cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(k, "symbols"));
    p->modules = calloc(nk ? nk : 1, sizeof *p->modules);
    p->functions = calloc(n_symbols ? n_symbols : 1, sizeof *p->functions);
    if (!p->modules || !p->functions) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    const char *kind = c->io.image_kind ? "ptx" : "cubin";
    for (const cJSON *k = kernels->child; k; k = k->next) {
        unsigned char *image;
        size_t size;
        int rc = cb_bundle_read(b, cb_json_str(k, kind), 1, &image, &size, &c->err); /* PTX: NUL-terminated */
        if (rc) return rc;
        CUresult r = c->cu.cuModuleLoadData(&p->modules[p->n_modules], image);
        free(image);
        if (r) {
            char call[160], esc[96];
            snprintf(call, sizeof call, "cuModuleLoadData(%s.%s)", cb_escape(cb_json_str(k, "name"), esc, sizeof esc), kind);
            return cb_cu_fail(c, call, r);
        }
        CUmodule mod = p->modules[p->n_modules++];
        for (const cJSON *s = cJSON_GetObjectItemCaseSensitive(k, "symbols")->child; s; s = s->next) {
            function *f = &p->functions[p->n_functions];
            f->symbol = strdup(s->valuestring);
            if (!f->symbol) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
            p->n_functions++;
            r = c->cu.cuModuleGetFunction(&f->fn, mod, s->valuestring);
            if (r) {
                char call[160], esc[96];
                snprintf(call, sizeof call, "cuModuleGetFunction(%s)", cb_escape(s->valuestring, esc, sizeof esc));
                return cb_cu_fail(c, call, r);
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
    return r ? cb_cu_fail(c, call, r) : COLIBRI_OK;
}

int cb_upload_weights(colibri_ctx *c, const cb_bundle *b) {
    const size_t size = (size_t)b->header.data_size;
    CU(c, cuMemAlloc, &c->weights, size + CB_WEIGHTS_TAIL);
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

int cb_alloc_memory(colibri_ctx *c) {
    for (size_t i = 0; i < c->n_pool; i++) {
        size_t size = (size_t)c->pool[i].size;
        CU(c, cuMemAlloc, &c->pool[i].ptr, size ? size : 1);
        /* int32 counters (sdk/catalog.py COUNTERS_SUFFIX): zero once; the kernels that count leave them zero, so
           shapes sharing the buffer each find zeros */
        const size_t n = strlen(c->pool[i].name), k = strlen("_counters");
        if (n >= k && strcmp(c->pool[i].name + n - k, "_counters") == 0)
            CU(c, cuMemsetD32, c->pool[i].ptr, 0u, size / 4);
    }
    CU(c, cuMemHostAlloc, (void **)&c->in_host, c->io_bytes, 0);
    CU(c, cuMemHostAlloc, (void **)&c->out_host, c->io_bytes, 0);
    CU(c, cuMemHostAlloc, (void **)&c->lengths_host, 4 * (size_t)c->batch, 0);
    memset(c->in_host, 0, c->io_bytes);
    memset(c->out_host, 0, c->io_bytes);
    for (int i = 0; i < c->batch; i++) c->lengths_host[i] = c->tokens;
    long long dropped = 0;
    for (size_t k = 0; k < c->n_shapes; k++) {
        const shape_plan *s = &c->shapes[k];
        if (s->dropped_buf >= 0 && s->buffers[s->dropped_buf].size > dropped) dropped = s->buffers[s->dropped_buf].size;
    }
    if (dropped) CU(c, cuMemHostAlloc, (void **)&c->dropped_host, (size_t)dropped, 0);
    c->out_lengths = calloc((size_t)c->batch, sizeof *c->out_lengths);
    if (!c->out_lengths) return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    for (size_t k = 0; k < c->n_shapes; k++) {
        shape_plan *s = &c->shapes[k];
        s->launches = calloc(s->n_launches ? s->n_launches : 1, sizeof *s->launches);
        s->arg_values = calloc(s->n_args ? s->n_args : 1, sizeof *s->arg_values);
        s->arg_params = calloc(s->n_args ? s->n_args : 1, sizeof *s->arg_params);
        if (!s->launches || !s->arg_values || !s->arg_params)
            return cb_fail(&c->err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    }
    return COLIBRI_OK;
}
