/* colibri.h: the C runtime of colibri-sdk (libcolibri). Loads a bundle folder written by `colibri-sdk build`
 * (docs/build.md), checks it exactly as the Python bundle reader does, and runs its launch plan on a GPU through
 * the CUDA driver API, captured once in a CUDA Graph and replayed per call. docs/c_runtime.md is the guide.
 *
 *     colibri_config cfg = COLIBRI_CONFIG_INIT;
 *     cfg.bundle_dir = "bundles/orin";
 *     colibri_ctx *ctx;
 *     if (colibri_init(&cfg, &ctx) != COLIBRI_OK) { fprintf(stderr, "%s\n", colibri_last_error(NULL)); ... }
 *     colibri_io io;  colibri_io_info(ctx, &io);                   // the largest shape, byte sizes
 *     colibri_set_input(ctx, x, lengths, io.batch);                // x: float32 (batch, tokens, hidden)
 *     colibri_infer(ctx);                                          // one cuGraphLaunch + one synchronisation
 *     colibri_get_output(ctx, y, io.output_bytes);                 // y: float32 (batch, tokens, hidden)
 *     colibri_free(ctx);
 *
 * Status codes are stable integers (they never change meaning; new ones are only added). Every call returns one;
 * `colibri_last_error` gives the one-line message of the last failure (what was wrong, the value seen, what is
 * allowed).
 *
 * Threads: a context may be used from any thread, one call at a time: each call takes the context's mutex, so
 * concurrent calls on one context are serialised and never corrupt it, but a set_input / infer / get_output
 * sequence is three calls — a caller that shares a context between threads must hold its own lock around the
 * sequence. Different contexts are independent (each has its own stream, buffers and graph) and may run
 * concurrently. `colibri_free` must not race with other calls on the same context. colibri_init,
 * colibri_abi_version and colibri_status_name are thread-safe; colibri_last_error(NULL) is per thread.
 *
 * Handles: `ctx` is invalid after colibri_free(ctx): do not pass it again. A call given a freed handle, or a pointer
 * that never came from colibri_init, returns COLIBRI_ERR_INVALID_ARG ("ctx is not a live context") and touches
 * nothing else, and colibri_free of one does nothing: the context's first word is a magic value that colibri_free
 * clears. This is a safety net, not a guarantee: once the allocator has given the freed memory to someone else
 * (another colibri_init may get the same address), the old handle may look live or name that other context.
 *
 * Memory: everything is allocated by colibri_init (device buffers, pinned input/output, the graph); no call after it
 * allocates host or device memory, except colibri_bind, which re-captures the graph.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define COLIBRI_API __attribute__((visibility("default")))
#else
#define COLIBRI_API
#endif

/* Bumped when a struct layout or a call's meaning changes incompatibly. */
#define COLIBRI_ABI_VERSION 1u
/* Bumped when calls, structs or status codes are only added (a program built against a lower minor links and runs
 * unchanged): 1 = the compiled shapes (colibri_set_input_shape, colibri_shape_count / _at / _for,
 * colibri_last_shape); 2 = COLIBRI_ERR_NONFINITE_OUTPUT (colibri_get_output checks the output). */
#define COLIBRI_ABI_MINOR 2u

/* Status codes: stable integers. */
enum {
    COLIBRI_OK = 0,
    COLIBRI_ERR_INVALID_ARG = 1,        /* NULL pointer, n != batch, a length outside 0..tokens, a wrong byte size,
                                           a non-finite value at a valid input position, an unknown flag */
    COLIBRI_ERR_BUNDLE = 2,             /* the bundle is refused: missing or unreadable file, symlink, schema,
                                           non-canonical or tampered manifest, size or sha256 mismatch, unlisted
                                           file, weights header differing from the manifest's */
    COLIBRI_ERR_NO_DRIVER = 3,          /* libcuda.so.1 cannot be opened, lacks a needed function, cuInit failed,
                                           or no such device */
    COLIBRI_ERR_UNSUPPORTED_DEVICE = 4, /* the GPU or driver cannot run the bundle's cubin or PTX */
    COLIBRI_ERR_CUDA = 5,               /* a CUDA driver call failed (the message names the call and the error) */
    COLIBRI_ERR_OUT_OF_MEMORY = 6,      /* host or device allocation failed */
    COLIBRI_ERR_STATE = 7,              /* call out of order: infer before any input, get_output before infer,
                                           get_output while the output is bound to a device pointer */
    COLIBRI_ERR_ABI = 8,                /* config.struct_size or config.abi_version differs from this library's */
    COLIBRI_ERR_NONFINITE_OUTPUT = 9    /* colibri_get_output: NaN/Inf at a valid output position (minor 2) */
};

/* config.flags */
#define COLIBRI_FLAG_NO_VERIFY 1u /* skip the sha256 of every file and the unlisted-file scan (the schema, the
                                     manifest's canonical form and digest, sizes and symlink refusals still apply);
                                     for a bundle already checked with `colibri-sdk verify` */
#define COLIBRI_FLAG_EAGER 2u     /* launch the plan kernel by kernel on each call instead of replaying the graph */

typedef struct colibri_config {
    uint32_t struct_size;       /* sizeof(colibri_config) */
    uint32_t abi_version;       /* COLIBRI_ABI_VERSION */
    const char *bundle_dir;     /* the bundle folder */
    int device;                 /* CUDA device ordinal */
    uint32_t flags;             /* COLIBRI_FLAG_* */
    const char *driver_library; /* NULL: "libcuda.so.1" (dlopen's search path) */
} colibri_config;

#define COLIBRI_CONFIG_INIT {sizeof(colibri_config), COLIBRI_ABI_VERSION, NULL, 0, 0u, NULL}

typedef struct colibri_io {
    uint32_t batch, tokens, hidden; /* the bundle's largest compiled shape (the only one of a single-shape bundle):
                                       colibri_set_input's x and the output are float32 (batch, tokens, hidden) */
    size_t input_bytes;             /* batch * tokens * hidden * 4 */
    size_t output_bytes;            /* the same */
    uint32_t launches;              /* kernel launches per call (the manifest's launch plan) */
    int image_kind;                 /* 0: cubin, 1: PTX (JIT) */
    int integrated;                 /* CU_DEVICE_ATTRIBUTE_INTEGRATED of the device (1 on Jetson) */
    int compute_capability[2];      /* the device's (major, minor) */
    int driver_version;             /* cuDriverGetVersion: 1000 * major + 10 * minor */
    char arch[16];                  /* the bundle's arch, e.g. "sm_87" */
    char dtype[8];                  /* the bundle's float type: "fp16" | "fp32" (the manifest's dtype: activations,
                                       scales; int8/int4 weight storage is weights.header.quant, docs/format.md) */
    char device_name[64];
} colibri_io;

/* One compiled shape of the bundle (the manifest's `shapes`, docs/build.md "Several shapes"). */
typedef struct colibri_shape {
    uint32_t batch, tokens; /* the shape: a call of at most batch sequences of at most tokens tokens runs here */
    uint32_t launches;      /* kernel launches per call at this shape */
    size_t input_bytes;     /* batch * tokens * hidden * 4: the padded input (and output) of a call at this shape */
    uint64_t calls;         /* colibri_infer calls run at this shape so far (the Python runtime's shapes_chosen) */
} colibri_shape;

typedef struct colibri_ctx colibri_ctx;

/* COLIBRI_ABI_VERSION of the library that is linked (compare with the header's). */
COLIBRI_API uint32_t colibri_abi_version(void);

/* "COLIBRI_OK", "COLIBRI_ERR_INVALID_ARG", ...; "COLIBRI_ERR_UNKNOWN" for any other value. */
COLIBRI_API const char *colibri_status_name(int status);

/* Open and check the bundle, open the device, load the kernels, upload the weights, allocate every buffer and
 * capture the graph. On failure *ctx is NULL and colibri_last_error(NULL) says why (in the calling thread). */
COLIBRI_API int colibri_init(const colibri_config *config, colibri_ctx **ctx);

/* Shapes, byte sizes and what was chosen at load. */
COLIBRI_API int colibri_io_info(const colibri_ctx *ctx, colibri_io *info);

/* Copy one input of the largest shape into the pinned input buffer; the call runs at the largest shape (for a call
 * of its own size at the smallest shape that holds it: colibri_set_input_shape).
 *   x: float32, C-contiguous (n, tokens, hidden) at the largest shape's tokens (colibri_io) and hidden.
 *   input_lengths: NULL (every position valid) or n int32 lengths, each 0..tokens: positions at or past a
 *     sequence's length are ignored (copied as zeros) and are zero in the output.
 *   n: must equal the largest shape's batch.
 * COLIBRI_ERR_INVALID_ARG: NULL x, n != batch, a length outside 0..tokens, or NaN/Inf at a valid position.
 * COLIBRI_ERR_STATE: the input is bound to a device pointer (colibri_bind). */
COLIBRI_API int colibri_set_input(colibri_ctx *ctx, const float *x, const int32_t *input_lengths, size_t n);

/* Copy one input of its own size into pinned memory, at the smallest compiled shape that holds it: the first of the
 * bundle's shapes (smallest first: by batch*tokens, then batch, then tokens) with batch and tokens both at least the
 * call's, as the Python runtime's Runtime.shape_for. The input is padded with zeros to that shape (padding positions
 * are not valid tokens); colibri_infer runs that shape's graph and colibri_get_output returns the call's part.
 *   x: float32, C-contiguous (batch, tokens, hidden).
 *   input_lengths: NULL (every position valid) or batch int32 lengths, each 0..tokens.
 * COLIBRI_ERR_INVALID_ARG: NULL x, batch or tokens 0, a call larger than the largest shape ("input batch B x tokens T
 * is larger than every compiled shape; the largest is ..."), a length outside 0..tokens, NaN/Inf at a valid
 * position. COLIBRI_ERR_STATE: the input or the output is bound to device memory (colibri_bind: it holds the largest
 * shape; use colibri_set_input). */
COLIBRI_API int colibri_set_input_shape(colibri_ctx *ctx, const float *x, const int32_t *input_lengths, size_t batch,
                                        size_t tokens);

/* Run the bundle on the current input: one cuGraphLaunch (or the eager launches). On the context's own stream it
 * waits for the result; on a stream given by colibri_set_stream it returns once the work is enqueued. */
COLIBRI_API int colibri_infer(colibri_ctx *ctx);

/* Copy the output of the last infer into y: float32 (batch, tokens, hidden) of that call's input (output_bytes after
 * colibri_set_input; batch * tokens * hidden * 4 after colibri_set_input_shape); y_bytes must equal it.
 * Waits for the stream first. COLIBRI_ERR_STATE before any infer, while the output is bound, or after a
 * colibri_set_input / colibri_set_input_shape that succeeded since the last infer (the output held is then the
 * previous input's: call colibri_infer first).
 * COLIBRI_ERR_NONFINITE_OUTPUT: NaN or Inf at a valid position (e.g. a finite input near 1e19 overflowing float32
 * inside an expert; the Python runtime's NonFiniteOutputError): y is still filled, the message names how many
 * positions and the first (batch, token). Positions past a sequence's length are zeros and not checked. */
COLIBRI_API int colibri_get_output(colibri_ctx *ctx, float *y, size_t y_bytes);

/* Use caller device memory for the input and/or the output (CUdeviceptr values; 0 keeps the pinned host buffer):
 * the graph then copies device to device, and set_input / get_output are refused for the bound side. Each must
 * hold input_bytes / output_bytes and stay valid while bound. Re-captures the graph (allocates); call it once.
 * Binding an input (or an output while the staged input is at a smaller shape) drops the pinned input staged
 * before: colibri_infer after unbinding is COLIBRI_ERR_STATE until the next set_input. */
COLIBRI_API int colibri_bind(colibri_ctx *ctx, uint64_t device_input, uint64_t device_output);

/* Run on a caller's CUstream (created in the device's primary context); NULL returns to the context's own stream.
 * On a caller's stream colibri_infer does not wait: synchronise the stream, or call colibri_get_output. */
COLIBRI_API int colibri_set_stream(colibri_ctx *ctx, void *cuda_stream);

/* Expert capacity: the (token, expert) pairs dropped by the last colibri_infer, summed over the layers (the bundle's
 * capacity_dropped buffer, one int32 per layer written by colibri_capacity on every call); 0 for a dropless bundle.
 * Waits for the stream. COLIBRI_ERR_INVALID_ARG: pairs NULL. COLIBRI_ERR_STATE: before any colibri_infer. */
COLIBRI_API int colibri_dropped_pairs(colibri_ctx *ctx, int64_t *pairs);

/* The compiled shapes: *count of them (1 for a bundle of one shape), and shape `index` (0 .. count-1, smallest
 * first; the last is colibri_io_info's). COLIBRI_ERR_INVALID_ARG: NULL pointer, index out of range. */
COLIBRI_API int colibri_shape_count(colibri_ctx *ctx, uint32_t *count);
COLIBRI_API int colibri_shape_at(colibri_ctx *ctx, uint32_t index, colibri_shape *shape);

/* The index of the shape a call of (batch, tokens) runs at (colibri_set_input_shape's choice). COLIBRI_ERR_INVALID_ARG:
 * NULL index, batch or tokens 0, or a call larger than the largest shape. */
COLIBRI_API int colibri_shape_for(colibri_ctx *ctx, size_t batch, size_t tokens, uint32_t *index);

/* The index of the shape the last colibri_infer ran at. COLIBRI_ERR_STATE: no output yet. */
COLIBRI_API int colibri_last_shape(colibri_ctx *ctx, uint32_t *index);

/* The one-line message of the last failed call on ctx, or, with ctx NULL (or a handle that is not live), of the last
 * failed colibri_init or call refused for its handle in this thread. "" when there was none. Valid until the next call on ctx (or in this thread). */
COLIBRI_API const char *colibri_last_error(const colibri_ctx *ctx);

/* Free everything (graph, buffers, modules, stream, pinned memory, the context reference). NULL is a no-op; so is a
 * handle that is not live (freed before, or not from colibri_init; colibri_last_error(NULL) then says so). ctx is
 * invalid afterwards. */
COLIBRI_API void colibri_free(colibri_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_H */
