/* handles.c: colibri_test handles (stale outputs, freed and foreign handles), bind (caller device memory and a caller
 * stream) and threads (a context per thread, and one context shared by two). */
#include "colibri_test.h"

/* ---- handles: a stale output after a new input; freed and foreign handles ---------------------------------------- */
#define NOT_LIVE "ctx is not a live context (freed by colibri_free, or not from colibri_init)"

/* Every call on a handle that is not live: COLIBRI_ERR_INVALID_ARG naming the call, and nothing of it touched. */
static void refuse_handle(colibri_ctx *ctx, float *x, float *y, size_t n_bytes, size_t batch) {
    colibri_io io;
    uint32_t u;
    int64_t pairs;
    EXPECT(colibri_set_input(ctx, x, NULL, batch), COLIBRI_ERR_INVALID_ARG);
    CHECK(strstr(colibri_last_error(NULL), "colibri_set_input: " NOT_LIVE) != NULL, "%s", colibri_last_error(NULL));
    CHECK(!strcmp(colibri_last_error(ctx), colibri_last_error(NULL)), "the handle's message is the thread's: %s",
          colibri_last_error(ctx));
    EXPECT(colibri_set_input_shape(ctx, x, NULL, 1, 1), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_infer(ctx), COLIBRI_ERR_INVALID_ARG);
    CHECK(strstr(colibri_last_error(NULL), "colibri_infer: " NOT_LIVE) != NULL, "%s", colibri_last_error(NULL));
    EXPECT(colibri_get_output(ctx, y, n_bytes), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_bind(ctx, 0, 0), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_set_stream(ctx, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_dropped_pairs(ctx, &pairs), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_count(ctx, &u), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_for(ctx, 1, 1, &u), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_last_shape(ctx, &u), COLIBRI_ERR_INVALID_ARG);
    colibri_free(ctx); /* does nothing */
    CHECK(strstr(colibri_last_error(NULL), "colibri_free: " NOT_LIVE "; nothing freed") != NULL, "%s",
          colibri_last_error(NULL));
}

int cmd_handles(const char *bundle) {
    colibri_ctx *ctx = open_ctx(bundle, 0);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    const size_t n = (size_t)io.batch * io.tokens * io.hidden;
    float *x = calloc(n, 4), *y = calloc(n, 4);
    for (size_t i = 0; i < n; i++) x[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;

    /* the output belongs to the input of the last infer: a new input makes it stale until the next infer */
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK); /* read twice: the same call's output */
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_STATE);
    CHECK(strstr(colibri_last_error(ctx), "colibri_get_output: a new input was set since the last colibri_infer, "
                                          "and the output held is the previous input's; call colibri_infer first"),
          "%s", colibri_last_error(ctx));
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    EXPECT(colibri_set_input_shape(ctx, x, NULL, 1, 1), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_STATE);
    EXPECT(colibri_get_output(ctx, y, (size_t)io.hidden * 4), COLIBRI_ERR_STATE);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, (size_t)io.hidden * 4), COLIBRI_OK);
    x[0] = NAN; /* a refused input stages nothing: the output of the last infer is still current */
    EXPECT(colibri_set_input_shape(ctx, x, NULL, 1, 1), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_get_output(ctx, y, (size_t)io.hidden * 4), COLIBRI_OK);
    x[0] = 0.0f;

    /* foreign handles: a zeroed and a filled buffer larger than any context, never from colibri_init */
    unsigned char *foreign = calloc(1, 1 << 16);
    refuse_handle((colibri_ctx *)foreign, x, y, io.output_bytes, io.batch);
    memset(foreign, 0xAB, 1 << 16);
    refuse_handle((colibri_ctx *)foreign, x, y, io.output_bytes, io.batch);
    free(foreign); /* colibri_free did not free it: under ASan a second free would be reported here */

    /* a freed handle: a double colibri_free and every call after it */
    colibri_free(ctx);
    refuse_handle(ctx, x, y, io.output_bytes, io.batch);
    free(x);
    free(y);
    printf("{\"passed\": %s}\n", g_failures ? "false" : "true");
    return g_failures ? 1 : 0;
}

/* ---- bind: caller device memory and a caller stream --------------------------------------------------------- */
typedef int (*cu_alloc_t)(unsigned long long *, size_t);
typedef int (*cu_free_t)(unsigned long long);
typedef int (*cu_htod_t)(unsigned long long, const void *, size_t);
typedef int (*cu_dtoh_t)(void *, unsigned long long, size_t);
typedef int (*cu_stream_create_t)(void **, unsigned);
typedef int (*cu_stream_t)(void *);

int cmd_bind(const char *bundle) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen libcuda.so.1");
    if (!lib) return 1;
    cu_alloc_t mem_alloc = (cu_alloc_t)dlsym(lib, "cuMemAlloc_v2");
    cu_free_t mem_free = (cu_free_t)dlsym(lib, "cuMemFree_v2");
    cu_htod_t htod = (cu_htod_t)dlsym(lib, "cuMemcpyHtoD_v2");
    cu_dtoh_t dtoh = (cu_dtoh_t)dlsym(lib, "cuMemcpyDtoH_v2");
    cu_stream_create_t stream_create = (cu_stream_create_t)dlsym(lib, "cuStreamCreate");
    cu_stream_t stream_sync = (cu_stream_t)dlsym(lib, "cuStreamSynchronize");
    cu_stream_t stream_destroy = (cu_stream_t)dlsym(lib, "cuStreamDestroy_v2");
    colibri_ctx *ctx = open_ctx(bundle, COLIBRI_FLAG_NO_VERIFY); /* makes the primary context current */
    if (!ctx) return 1;
    colibri_io io;
    colibri_io_info(ctx, &io);
    size_t nx = 0, ne = 0;
    float *x = selftest(bundle, "input", &nx), *expected = selftest(bundle, "output", &ne), *y = malloc(io.output_bytes);
    unsigned long long din = 0, dout = 0;
    void *stream = NULL;
    CHECK(mem_alloc(&din, io.input_bytes) == 0 && mem_alloc(&dout, io.output_bytes) == 0, "cuMemAlloc");
    CHECK(stream_create(&stream, 1) == 0, "cuStreamCreate");
    CHECK(htod(din, x, io.input_bytes) == 0, "cuMemcpyHtoD");
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK); /* staged before the bind: dropped by it */
    EXPECT(colibri_bind(ctx, din, dout), COLIBRI_OK);
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_ERR_STATE);
    EXPECT(colibri_set_stream(ctx, stream), COLIBRI_OK);
    long before = g_allocs;
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    CHECK(g_allocs == before, "bound infer allocated");
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_STATE);
    CHECK(stream_sync(stream) == 0, "cuStreamSynchronize");
    CHECK(dtoh(y, dout, io.output_bytes) == 0, "cuMemcpyDtoH");
    double rtol, atol;
    tolerances(&io, &rtol, &atol);
    size_t bad = 0;
    for (size_t i = 0; i < ne; i++)
        if (!(fabs((double)y[i] - expected[i]) <= atol + rtol * fabs(expected[i]))) bad++;
    CHECK(bad == 0, "bound output: %zu of %zu values differ from the reference", bad, ne);
    /* unbind: back to the pinned buffers, on the caller's stream (get_output waits for it) */
    EXPECT(colibri_bind(ctx, 0, 0), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_ERR_STATE); /* no pinned input staged since the bind */
    CHECK(!strcmp(colibri_last_error(ctx), "colibri_infer: no input yet; call colibri_set_input first"), "%s",
          colibri_last_error(ctx));
    memset(y, 0, io.output_bytes);
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    bad = 0;
    for (size_t i = 0; i < ne; i++)
        if (!(fabs((double)y[i] - expected[i]) <= atol + rtol * fabs(expected[i]))) bad++;
    CHECK(bad == 0, "unbound output on the caller stream: %zu of %zu values differ", bad, ne);
    EXPECT(colibri_set_stream(ctx, NULL), COLIBRI_OK);
    colibri_free(ctx);
    stream_destroy(stream);
    mem_free(din);
    mem_free(dout);
    free(x);
    free(expected);
    free(y);
    dlclose(lib);
    printf("{\"passed\": %s}\n", g_failures ? "false" : "true");
    return g_failures ? 1 : 0;
}

/* ---- threads ------------------------------------------------------------------------------------------------------ */
typedef struct worker {
    const char *bundle;
    colibri_ctx *shared; /* NULL: open an own context */
    const float *x, *expected;
    size_t n;
    int calls, bad, failed_calls;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    colibri_ctx *ctx = w->shared ? w->shared : open_ctx(w->bundle, COLIBRI_FLAG_NO_VERIFY);
    if (!ctx) {
        w->failed_calls++;
        return NULL;
    }
    colibri_io io;
    colibri_io_info(ctx, &io);
    float *y = malloc(io.output_bytes);
    double rtol, atol;
    tolerances(&io, &rtol, &atol);
    for (int c = 0; c < w->calls; c++) {
        /* on a shared context the three calls may interleave with the other thread's: the output is then the other
           thread's input's, which is the same input here, so the values must still match */
        if (colibri_set_input(ctx, w->x, NULL, io.batch) || colibri_infer(ctx) ||
            colibri_get_output(ctx, y, io.output_bytes)) {
            w->failed_calls++;
            continue;
        }
        for (size_t i = 0; i < w->n; i++)
            if (!(fabs((double)y[i] - w->expected[i]) <= atol + rtol * fabs(w->expected[i]))) w->bad++;
    }
    free(y);
    if (!w->shared) colibri_free(ctx);
    return NULL;
}

int cmd_threads(const char *bundle) {
    size_t nx = 0, ne = 0;
    float *x = selftest(bundle, "input", &nx), *expected = selftest(bundle, "output", &ne);
    if (!x || !expected) return 1;
    for (int round = 0; round < 2; round++) {
        colibri_ctx *shared = round ? open_ctx(bundle, COLIBRI_FLAG_NO_VERIFY) : NULL;
        worker w[2];
        pthread_t t[2];
        for (int i = 0; i < 2; i++) {
            w[i] = (worker){bundle, shared, x, expected, ne, 2, 0, 0};
            pthread_create(&t[i], NULL, work, &w[i]);
        }
        for (int i = 0; i < 2; i++) {
            pthread_join(t[i], NULL);
            CHECK(w[i].failed_calls == 0 && w[i].bad == 0, "%s context, thread %d: %d failed calls, %d wrong values",
                  round ? "shared" : "own", i, w[i].failed_calls, w[i].bad);
        }
        colibri_free(shared);
    }
    free(x);
    free(expected);
    printf("{\"passed\": %s}\n", g_failures ? "false" : "true");
    return g_failures ? 1 : 0;
}
