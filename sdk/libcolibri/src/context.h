/* context.h: the context and what the loading code (load.c) and the calls (colibri.c) share. Not installed. */
#ifndef COLIBRI_CONTEXT_H
#define COLIBRI_CONTEXT_H

#include <pthread.h>

#include "colibri.h"
#include "cuda_api.h"
#include "internal.h"

#define UPLOAD_CHUNK ((size_t)64 << 20)
#define MAX_BUFFER_BYTES ((long long)1 << 40)

/* A device scratch buffer. A shape's entries name a buffer of the context's pool (`pool`: one allocation per buffer
 * name, of the largest size any shape gives it), so the shapes share their scratch memory: safe because a context
 * runs one call at a time (every call waits for the previous one's stream first). */
typedef struct buffer {
    const char *name; /* points into the manifest while loading, NULL afterwards */
    long long size;
    CUdeviceptr ptr;
    size_t pool; /* a shape's buffer: its index in ctx->pool */
} buffer;

typedef struct launch {
    CUfunction fn;
    unsigned grid[3], block[3], shared;
    int pdl; /* the plan's "pdl": programmatic stream serialization after a launch of the same call */
    size_t first_arg, nargs; /* into the shape's arg_values / arg_params */
} launch;

typedef struct function {
    char *symbol;
    CUfunction fn;
} function;

/* One compiled shape (a `shapes` entry; the top-level keys for the largest): its kernels, buffers, launch plan and
 * graph. Index order = the manifest's `shapes` order, smallest first; the last is the largest. */
typedef struct shape_plan {
    const cJSON *json; /* the entry (or the manifest, for the largest) while loading, NULL afterwards */
    char where[32];    /* "" for the largest (the top-level keys), "shapes[i]." for the others: message prefix */
    int batch, tokens;
    size_t io_bytes; /* batch * tokens * hidden * 4 */
    CUmodule *modules;
    size_t n_modules;
    function *functions;
    size_t n_functions;
    buffer *buffers;
    size_t n_buffers;
    launch *launches;
    size_t n_launches;
    uint64_t *arg_values;
    void **arg_params;
    size_t n_args;
    size_t in_buf, out_buf;
    long valid_buf;   /* -1: none */
    long dropped_buf; /* the capacity_dropped buffer (expert capacity: int32 per layer); -1: none (dropless) */
    CUgraph graph;
    CUgraphExec exec;
    uint64_t calls; /* colibri_infer calls run at this shape */
} shape_plan;

/* The first word of a live context: set by colibri_init, cleared by colibri_free before the memory is released, and
 * checked by every call (cb_ctx_live), so a freed or foreign handle is refused instead of used (docs/c_runtime.md,
 * "Handles"). "colibri1" in ASCII: a word no zeroed or small-integer buffer holds. */
#define CB_CTX_MAGIC 0x31697262696c6f63ULL

struct colibri_ctx {
    uint64_t magic; /* CB_CTX_MAGIC while the context is live */
    pthread_mutex_t lock;
    cb_err err;
    cu_api cu;
    uint32_t flags;
    int batch, tokens, hidden; /* the largest shape */
    size_t io_bytes;           /* the largest shape's */
    CUdevice dev;
    CUcontext cuctx;
    int ctx_retained;
    CUstream own_stream, stream;
    shape_plan *shapes;
    size_t n_shapes;
    buffer *pool;
    size_t n_pool;
    CUdeviceptr weights;
    int32_t *dropped_host; /* pinned: its copy, read by colibri_dropped_pairs (the largest size of any shape) */
    float *in_host, *out_host; /* pinned, of the largest shape's size; a call at shape s uses the first s.io_bytes */
    int32_t *lengths_host;     /* pinned (largest batch): copied into valid_tokens by the graph */
    int32_t *out_lengths;      /* the lengths of the input the current output came from */
    size_t in_shape, out_shape; /* the shape the current input is staged for / the current output came from */
    int in_batch, in_tokens;    /* the current input's own (batch, tokens), at most its shape's */
    int out_batch, out_tokens;  /* the same for the current output */
    CUdeviceptr bound_in, bound_out;
    int has_input, has_output, in_flight;
    int staged_since_infer; /* a set_input / set_input_shape succeeded after the output's colibri_infer */
    colibri_io io;
};

int cb_cu_fail(colibri_ctx *c, const char *call, CUresult r);

/* The message of the last failed colibri_init (or call on a NULL context) of this thread (colibri.c). */
extern _Thread_local cb_err cb_tls_err;

/* 1 when c's first word is CB_CTX_MAGIC (a live context), else 0. Reads a word that may lie in freed memory (a
 * handle passed again after colibri_free): that one read is exempt from AddressSanitizer (colibri.c). */
int cb_ctx_live(const colibri_ctx *c);

/* Take the context's mutex, refusing a NULL context and one that is not live (freed, or not from colibri_init); each
 * public call on a context starts with it. */
#define ENTER(c, name)                                                                                      \
    if (!(c)) return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, name ": ctx is NULL; allowed: a context from colibri_init"); \
    if (!cb_ctx_live(c)) return cb_fail(&cb_tls_err, COLIBRI_ERR_INVALID_ARG, name ": ctx is not a live context (freed " \
                                        "by colibri_free, or not from colibri_init); allowed: a context from colibri_init"); \
    pthread_mutex_lock(&(c)->lock)

/* shapes.c: the index of the first shape (smallest first) with batch and tokens both at least the call's; -1 if none
 * (sdk/runtime/runtime.py Runtime._run_for). */
long cb_shape_for(const colibri_ctx *c, size_t batch, size_t tokens);

/* Check a driver call at its call site: on failure, return COLIBRI_ERR_CUDA (or _OUT_OF_MEMORY) naming the call. */
#define CU(c, call, ...)                                          \
    do {                                                          \
        CUresult r_ = (c)->cu.call(__VA_ARGS__);                  \
        if (r_ != CUDA_SUCCESS_) return cb_cu_fail((c), #call, r_);  \
    } while (0)

/* load.c: the steps of colibri_init, in order. */
int cb_read_shapes(colibri_ctx *c, const cb_bundle *b);
int cb_read_buffers(colibri_ctx *c, shape_plan *s);
int cb_walk_plan(colibri_ctx *c, const cb_bundle *b, shape_plan *s, int fill);
int cb_open_device(colibri_ctx *c, int ordinal);
int cb_select_image(colibri_ctx *c, const cb_bundle *b, int dev_major, int dev_minor, int driver, int *kind);
int cb_load_modules(colibri_ctx *c, const cb_bundle *b, shape_plan *s);
int cb_upload_weights(colibri_ctx *c, const cb_bundle *b);
int cb_alloc_memory(colibri_ctx *c);

#endif
