/* context.h: the context and what the loading code (load.c) and the calls (colibri.c) share. Not installed. */
#ifndef COLIBRI_CONTEXT_H
#define COLIBRI_CONTEXT_H

#include <pthread.h>

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
    long dropped_buf; /* the capacity_dropped buffer (expert capacity: int32 per layer); -1: none (dropless) */
    int32_t *dropped_host; /* pinned: its copy, read by colibri_dropped_pairs */
    float *in_host, *out_host;
    int32_t *lengths_host; /* pinned: copied into valid_tokens by the graph */
    int32_t *out_lengths;  /* the lengths of the input the current output came from */
    CUdeviceptr bound_in, bound_out;
    CUgraph graph;
    CUgraphExec exec;
    int has_input, has_output, in_flight;
    colibri_io io;
};

int cb_cu_fail(colibri_ctx *c, const char *call, CUresult r);

/* Check a driver call at its call site: on failure, return COLIBRI_ERR_CUDA (or _OUT_OF_MEMORY) naming the call. */
#define CU(c, call, ...)                                          \
    do {                                                          \
        CUresult r_ = (c)->cu.call(__VA_ARGS__);                  \
        if (r_ != CUDA_SUCCESS_) return cb_cu_fail((c), #call, r_);  \
    } while (0)

/* load.c: the steps of colibri_init, in order. */
int cb_read_buffers(colibri_ctx *c, const cb_bundle *b);
int cb_walk_plan(colibri_ctx *c, const cb_bundle *b, int fill);
int cb_open_device(colibri_ctx *c, int ordinal);
int cb_select_image(colibri_ctx *c, const cb_bundle *b, int dev_major, int dev_minor, int driver, int *kind);
int cb_load_modules(colibri_ctx *c, const cb_bundle *b);
int cb_upload_weights(colibri_ctx *c, const cb_bundle *b);
int cb_alloc_memory(colibri_ctx *c);

#endif
