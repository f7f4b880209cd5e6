/* colibri_test.c: the C tests of libcolibri, one subcommand per case (tests/c_runtime/test_c_runtime.py runs them on
 * the fake driver, tests/fakecuda/driver/, built with AddressSanitizer).
 *
 *   colibri_test run BUNDLE [eager] [noverify] [lengths] [calls=N]   self-test vectors end to end (N calls, default
 *                                                      5); prints one JSON line
 *   colibri_test errors BUNDLE                             every API status code from bad calls
 *   colibri_test init BUNDLE CODE [SUBSTRING]              colibri_init returns CODE (and its message holds SUBSTRING)
 *   colibri_test bind BUNDLE                               caller device pointers and a caller stream
 *   colibri_test handles BUNDLE                            get_output after a new input without infer; a freed
 *                                                          (double free, calls after free) and a foreign handle
 *   colibri_test threads BUNDLE                            two threads, each with its own context, and two threads
 *                                                          sharing one context (calls serialised by its mutex)
 *   colibri_test fuzz BUNDLE N SEED                        N single-byte changes / truncations of manifest.json:
 *                                                          each refused with COLIBRI_ERR_BUNDLE, never a crash
 *   colibri_test shapes BUNDLE DIR CALL...                 one call per CALL "BxT" or "BxT:L0,L1,..." (lengths) with
 *                                                          colibri_set_input_shape: input DIR/in_BxT.f32 (raw float32
 *                                                          (B, T, hidden)), output written to DIR/out_BxT.f32; "!BxT":
 *                                                          must be refused; prints the shapes, each call's shape and
 *                                                          the refusals as one JSON line
 *
 * Linked against the static library with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc, so the host allocations of
 * libcolibri (and of this program) between two points are counted: "no allocation per call" is checked, not assumed.
 * Expected values come from the bundle's self-test output (the reference engine at build time), never from the
 * code under test. Exit status 0 = pass; a failure prints "FAIL: ..." on stderr. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

/* ---- allocation counter -------------------------------------------------------------------------------------- */
void *__real_malloc(size_t);
void *__real_calloc(size_t, size_t);
void *__real_realloc(void *, size_t);
static long g_allocs;
void *__wrap_malloc(size_t n) { g_allocs++; return __real_malloc(n); }
void *__wrap_calloc(size_t a, size_t b) { g_allocs++; return __real_calloc(a, b); }
void *__wrap_realloc(void *p, size_t n) { g_allocs++; return __real_realloc(p, n); }

static int g_failures;
#define CHECK(cond, ...)                                          \
    do {                                                          \
        if (!(cond)) {                                            \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);  \
            fprintf(stderr, __VA_ARGS__);                         \
            fprintf(stderr, "\n");                                \
            g_failures++;                                         \
        }                                                         \
    } while (0)
#define EXPECT(call, code)                                                                                    \
    do {                                                                                                      \
        int got_ = (call);                                                                                    \
        CHECK(got_ == (code), "%s returned %s, expected %s (%s)", #call, colibri_status_name(got_),           \
              colibri_status_name(code), colibri_last_error(ctx));                                            \
    } while (0)

/* ---- .npy (float32, C order) --------------------------------------------------------------------------------- */
static float *load_npy(const char *path, size_t *count) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char magic[10];
    float *data = NULL;
    if (fread(magic, 1, 10, f) == 10 && memcmp(magic, "\x93NUMPY", 6) == 0) {
        size_t hlen = magic[6] == 1 ? (size_t)(magic[8] | magic[9] << 8) : 0;
        char header[4096];
        if (hlen && hlen < sizeof header && fread(header, 1, hlen, f) == hlen) {
            header[hlen] = 0;
            if (strstr(header, "'<f4'") && strstr(header, "'fortran_order': False")) {
                fseek(f, 0, SEEK_END);
                long end = ftell(f);
                *count = (size_t)(end - 10 - (long)hlen) / 4;
                fseek(f, 10 + (long)hlen, SEEK_SET);
                data = malloc(*count * 4);
                if (data && fread(data, 4, *count, f) != *count) {
                    free(data);
                    data = NULL;
                }
            }
        }
    }
    fclose(f);
    return data;
}

static float *selftest(const char *bundle, const char *which, size_t *count) {
    char path[4096];
    snprintf(path, sizeof path, "%s/selftest/%s.npy", bundle, which);
    float *d = load_npy(path, count);
    if (!d) fprintf(stderr, "FAIL: cannot read %s\n", path);
    return d;
}

/* rtol/atol of the bundle's dtype (docs/build.md, "Self-test vectors"). */
static void tolerances(const colibri_io *io, double *rtol, double *atol) {
    *rtol = *atol = strcmp(io->dtype, "fp16") == 0 ? 1e-2 : 1e-4;
}

static colibri_ctx *open_ctx(const char *bundle, uint32_t flags) {
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = bundle;
    cfg.flags = flags;
    colibri_ctx *ctx = NULL;
    int rc = colibri_init(&cfg, &ctx);
    if (rc != COLIBRI_OK) fprintf(stderr, "FAIL: colibri_init: %s: %s\n", colibri_status_name(rc), colibri_last_error(NULL));
    return ctx;
}

/* ---- run --------------------------------------------------------------------------------------------------------- */
static int cmd_run(const char *bundle, int argc, char **argv) {
    uint32_t flags = 0;
    int with_lengths = 0, calls = 5;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "eager")) flags |= COLIBRI_FLAG_EAGER;
        if (!strcmp(argv[i], "noverify")) flags |= COLIBRI_FLAG_NO_VERIFY;
        if (!strcmp(argv[i], "lengths")) with_lengths = 1;
        if (!strncmp(argv[i], "calls=", 6)) calls = atoi(argv[i] + 6);
    }
    if (calls < 1) calls = 1;
    colibri_ctx *ctx = open_ctx(bundle, flags);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    size_t nx = 0, ne = 0;
    float *x = selftest(bundle, "input", &nx), *expected = selftest(bundle, "output", &ne);
    const size_t n = (size_t)io.batch * io.tokens * io.hidden;
    CHECK(x && expected && nx == n && ne == n, "self-test vectors hold %zu/%zu values; the bundle's shape %zu", nx, ne, n);
    if (g_failures) return 1;
    float *y = malloc(io.output_bytes);
    int32_t *lengths = malloc(io.batch * sizeof *lengths);
    for (uint32_t b = 0; b < io.batch; b++) lengths[b] = with_lengths ? (int32_t)((io.tokens + 1) / 2 - (b % 2)) : (int32_t)io.tokens;
    if (with_lengths) /* what lies past a sequence's length must not matter */
        for (uint32_t b = 0; b < io.batch; b++)
            for (size_t i = (size_t)lengths[b] * io.hidden; i < (size_t)io.tokens * io.hidden; i++)
                x[b * io.tokens * io.hidden + i] = NAN;
    double rtol, atol, max_abs = 0;
    tolerances(&io, &rtol, &atol);
    long allocs_in_calls = 0;
    for (int call = 0; call < calls; call++) {
        long before = g_allocs;
        EXPECT(colibri_set_input(ctx, x, lengths, io.batch), COLIBRI_OK);
        EXPECT(colibri_infer(ctx), COLIBRI_OK);
        EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
        allocs_in_calls += g_allocs - before;
        size_t bad = 0;
        for (uint32_t b = 0; b < io.batch; b++)
            for (size_t i = 0; i < (size_t)io.tokens * io.hidden; i++) {
                size_t k = b * io.tokens * io.hidden + i;
                int valid = i < (size_t)lengths[b] * io.hidden;
                double want = valid ? expected[k] : 0.0, d = fabs((double)y[k] - want);
                if (!(d <= atol + rtol * fabs(want)) || (!valid && y[k] != 0.0f)) bad++;
                if (d > max_abs) max_abs = d;
            }
        CHECK(bad == 0, "call %d: %zu of %zu outputs differ from the reference (max abs err %g)", call, bad, n, max_abs);
    }
    CHECK(allocs_in_calls == 0, "%ld host allocations in %d set_input/infer/get_output calls; allowed: 0",
          allocs_in_calls, calls);
    printf("{\"passed\": %s, \"max_abs_err\": %.3g, \"image_kind\": \"%s\", \"integrated\": %d, \"launches\": %u, "
           "\"allocs_per_call\": %ld, \"calls\": %d, \"device\": \"%s\"}\n", g_failures ? "false" : "true", max_abs,
           io.image_kind ? "ptx" : "cubin", io.integrated, io.launches, allocs_in_calls / calls, calls, io.device_name);
    free(x);
    free(expected);
    free(y);
    free(lengths);
    colibri_free(ctx);
    return g_failures ? 1 : 0;
}

/* ---- errors ------------------------------------------------------------------------------------------------------ */
static int cmd_errors(const char *bundle) {
    colibri_ctx *ctx = NULL;
    CHECK(colibri_abi_version() == COLIBRI_ABI_VERSION, "abi %u", colibri_abi_version());
    CHECK(!strcmp(colibri_status_name(COLIBRI_ERR_INVALID_ARG), "COLIBRI_ERR_INVALID_ARG"), "status name");
    CHECK(!strcmp(colibri_status_name(42), "COLIBRI_ERR_UNKNOWN"), "unknown status name");
    CHECK(COLIBRI_OK == 0 && COLIBRI_ERR_INVALID_ARG == 1 && COLIBRI_ERR_BUNDLE == 2 && COLIBRI_ERR_NO_DRIVER == 3 &&
          COLIBRI_ERR_UNSUPPORTED_DEVICE == 4 && COLIBRI_ERR_CUDA == 5 && COLIBRI_ERR_OUT_OF_MEMORY == 6 &&
          COLIBRI_ERR_STATE == 7 && COLIBRI_ERR_ABI == 8 && COLIBRI_ERR_NONFINITE_OUTPUT == 9,
          "the status codes are stable integers");
    CHECK(!strcmp(colibri_status_name(COLIBRI_ERR_NONFINITE_OUTPUT), "COLIBRI_ERR_NONFINITE_OUTPUT"), "status name 9");
    CHECK(COLIBRI_ABI_MINOR >= 2u, "COLIBRI_ABI_MINOR %u: the non-finite output code is an addition", COLIBRI_ABI_MINOR);

    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = bundle;
    EXPECT(colibri_init(NULL, &ctx), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_init(&cfg, NULL), COLIBRI_ERR_INVALID_ARG);
    colibri_config bad = cfg;
    bad.struct_size = 8;
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_ABI);
    CHECK(strstr(colibri_last_error(NULL), "struct_size 8") != NULL, "ABI message: %s", colibri_last_error(NULL));
    bad = cfg;
    bad.abi_version = 99;
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_ABI);
    bad = cfg;
    bad.flags = 0x80;
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_INVALID_ARG);
    bad = cfg;
    bad.bundle_dir = NULL;
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_INVALID_ARG);
    bad = cfg;
    bad.bundle_dir = "/nonexistent/bundle";
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_BUNDLE);
    CHECK(strstr(colibri_last_error(NULL), "/nonexistent/bundle is not a bundle folder") != NULL, "%s",
          colibri_last_error(NULL));
    bad = cfg;
    bad.driver_library = "/nonexistent/libcuda.so.1";
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_NO_DRIVER);
    CHECK(strstr(colibri_last_error(NULL), "no CUDA driver (/nonexistent/libcuda.so.1: cannot open") != NULL, "%s",
          colibri_last_error(NULL));
    CHECK(strstr(colibri_last_error(NULL), "libcuda.so.1: /nonexistent") == NULL, "library named once: %s",
          colibri_last_error(NULL));
    bad = cfg;
    bad.device = 3;
    EXPECT(colibri_init(&bad, &ctx), COLIBRI_ERR_NO_DRIVER);
    CHECK(strstr(colibri_last_error(NULL), "CUDA device 3 does not exist; allowed: 0..0") != NULL, "%s",
          colibri_last_error(NULL));
    CHECK(ctx == NULL, "a failed init leaves ctx NULL");

    /* NULL context: every call refuses it */
    EXPECT(colibri_infer(NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_set_input(NULL, NULL, NULL, 1), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_get_output(NULL, NULL, 0), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_bind(NULL, 0, 0), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_set_stream(NULL, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_io_info(NULL, NULL), COLIBRI_ERR_INVALID_ARG);
    colibri_free(NULL);

    EXPECT(colibri_init(&cfg, &ctx), COLIBRI_OK);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    const size_t n = (size_t)io.batch * io.tokens * io.hidden;
    CHECK(io.input_bytes == n * 4 && io.output_bytes == n * 4, "io bytes %zu %zu", io.input_bytes, io.output_bytes);
    float *x = calloc(n, 4), *y = calloc(n, 4);
    int32_t *len = calloc(io.batch + 1, 4);
    for (uint32_t b = 0; b < io.batch; b++) len[b] = (int32_t)io.tokens;

    EXPECT(colibri_infer(ctx), COLIBRI_ERR_STATE); /* no input yet */
    CHECK(strstr(colibri_last_error(ctx), "no input yet") != NULL, "%s", colibri_last_error(ctx));
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_STATE);
    EXPECT(colibri_set_input(ctx, NULL, len, io.batch), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_set_input(ctx, x, len, io.batch + 1), COLIBRI_ERR_INVALID_ARG);
    char want[128];
    snprintf(want, sizeof want, "n = %u; allowed: %u (the bundle's batch)", io.batch + 1, io.batch);
    CHECK(strstr(colibri_last_error(ctx), want) != NULL, "%s", colibri_last_error(ctx));
    EXPECT(colibri_set_input(ctx, x, len, 0), COLIBRI_ERR_INVALID_ARG);
    len[0] = (int32_t)io.tokens + 1;
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_ERR_INVALID_ARG);
    snprintf(want, sizeof want, "input_lengths[0] = %u; allowed: 0..%u", io.tokens + 1, io.tokens);
    CHECK(strstr(colibri_last_error(ctx), want) != NULL, "%s", colibri_last_error(ctx));
    len[0] = -1;
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_ERR_INVALID_ARG);
    len[0] = (int32_t)io.tokens;
    x[io.hidden + 1] = INFINITY; /* token 1 */
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_ERR_INVALID_ARG);
    CHECK(strstr(colibri_last_error(ctx), "non-finite value (NaN or Inf) at (batch 0, token 1, 1)") != NULL, "%s",
          colibri_last_error(ctx));
    EXPECT(colibri_infer(ctx), COLIBRI_ERR_STATE); /* a refused input is no input */
    len[0] = 1;                                     /* ... but past the length it is ignored */
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_OK);
    x[io.hidden + 1] = 0.0f;
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, NULL, io.output_bytes), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes - 4), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes + 4), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK); /* the same input again */
    EXPECT(colibri_set_stream(ctx, NULL), COLIBRI_OK);
    colibri_free(ctx);
    free(x);
    free(y);
    free(len);
    printf("{\"passed\": %s}\n", g_failures ? "false" : "true");
    return g_failures ? 1 : 0;
}

/* ---- nonfinite: a finite input that overflows inside a layer ----------------------------------------------------- */
static void json_string(const char *s);

static int cmd_nonfinite(const char *bundle) {
    colibri_ctx *ctx = open_ctx(bundle, 0);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    size_t nx = 0;
    float *x = selftest(bundle, "input", &nx);
    const size_t n = (size_t)io.batch * io.tokens * io.hidden;
    CHECK(x && nx == n && io.tokens >= 2, "self-test input of %zu values, tokens %u", nx, io.tokens);
    if (g_failures) return 1;
    float *y = malloc(io.output_bytes);
    for (size_t i = 0; i < io.hidden; i++) x[io.hidden + i] = 1e19f; /* batch 0, token 1: finite, overflows float32 */
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_NONFINITE_OUTPUT);
    char message[1024];
    snprintf(message, sizeof message, "%s", colibri_last_error(ctx));
    int filled = 0; /* y holds the output as computed: non-finite at the bad token, finite elsewhere */
    for (size_t i = 0; i < io.hidden; i++) filled |= !isfinite(y[io.hidden + i]);
    CHECK(filled, "y was not filled with the computed (non-finite) values");
    for (size_t i = 0; i < io.hidden; i++) CHECK(isfinite(y[i]), "token 0 column %zu: %g", i, (double)y[i]);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_ERR_NONFINITE_OUTPUT); /* asked again: the same */
    int32_t *len = malloc(io.batch * sizeof *len);
    for (uint32_t b = 0; b < io.batch; b++) len[b] = (int32_t)io.tokens;
    len[0] = 1; /* token 1 of batch 0 is padding now: its input is ignored and its output is zero */
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    for (size_t i = 0; i < io.hidden; i++) x[io.hidden + i] = NAN; /* NaN at the padding position: never read */
    EXPECT(colibri_set_input(ctx, x, len, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    for (size_t i = 0; i < io.hidden; i++)
        CHECK(y[io.hidden + i] == 0.0f, "padding column %zu: %g", i, (double)y[io.hidden + i]);
    for (int twice = 0; twice < 2; twice++) { /* a host buffer one float short: refused, y not written */
        memset(y, 0x7f, io.output_bytes);
        EXPECT(colibri_get_output(ctx, y, io.output_bytes - 4), COLIBRI_ERR_INVALID_ARG);
        CHECK(strstr(colibri_last_error(ctx), "colibri_get_output: y_bytes = ") == colibri_last_error(ctx) &&
              !strchr(colibri_last_error(ctx), '\n'), "%s", colibri_last_error(ctx));
        CHECK(((const unsigned char *)y)[0] == 0x7f && ((const unsigned char *)y)[io.output_bytes - 1] == 0x7f,
              "a refused get_output wrote y");
    }
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK); /* the output is still there */
    for (size_t i = 0; i < io.hidden; i++) x[io.hidden + i] = 0.5f;
    EXPECT(colibri_set_input(ctx, x, NULL, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK); /* a finite output again */
    printf("{\"passed\": %s, \"message\": ", g_failures ? "false" : "true");
    json_string(message);
    printf("}\n");
    free(x);
    free(y);
    free(len);
    colibri_free(ctx);
    return g_failures ? 1 : 0;
}

/* ---- init -------------------------------------------------------------------------------------------------------- */
static int cmd_init(const char *bundle, int code, const char *substring) {
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = bundle;
    colibri_ctx *ctx = NULL;
    int rc = colibri_init(&cfg, &ctx);
    const char *msg = colibri_last_error(NULL);
    printf("{\"status\": \"%s\", \"code\": %d}\n", colibri_status_name(rc), rc);
    fprintf(stderr, "message: %s\n", rc ? msg : "");
    CHECK(rc == code, "colibri_init returned %s, expected %s: %s", colibri_status_name(rc), colibri_status_name(code), msg);
    if (substring) CHECK(strstr(msg, substring) != NULL, "message \"%s\" lacks \"%s\"", msg, substring);
    CHECK(rc != 0 || ctx != NULL, "success without a context");
    CHECK(!strchr(msg, '\n'), "a message is one line");
    colibri_free(ctx);
    return g_failures ? 1 : 0;
}

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

static int cmd_handles(const char *bundle) {
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

static int cmd_bind(const char *bundle) {
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

static int cmd_threads(const char *bundle) {
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

/* ---- fuzz: mutated manifests ------------------------------------------------------------------------------------ */
static int cmd_fuzz(const char *bundle, int n, unsigned seed) {
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.json", bundle);
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *orig = malloc((size_t)size), *mut = malloc((size_t)size);
    if (fread(orig, 1, (size_t)size, f) != (size_t)size) return 1;
    fclose(f);
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = bundle;
    cfg.flags = COLIBRI_FLAG_NO_VERIFY;
    int refused = 0;
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        long at = (long)((seed >> 8) % (unsigned long)size), len = size;
        memcpy(mut, orig, (size_t)size);
        if (i % 4 == 3) {
            len = at; /* truncated */
        } else {
            unsigned char v;
            do {
                seed = seed * 1103515245u + 12345u;
                v = (unsigned char)(seed >> 16);
            } while (v == orig[at]);
            mut[at] = v;
        }
        f = fopen(path, "wb");
        fwrite(mut, 1, (size_t)len, f);
        fclose(f);
        colibri_ctx *ctx = NULL;
        int rc = colibri_init(&cfg, &ctx);
        CHECK(rc == COLIBRI_ERR_BUNDLE, "mutation %d (byte %ld%s) gave %s: %s", i, at, len < size ? ", truncated" : "",
              colibri_status_name(rc), colibri_last_error(NULL));
        refused += rc == COLIBRI_ERR_BUNDLE;
        colibri_free(ctx);
    }
    f = fopen(path, "wb");
    fwrite(orig, 1, (size_t)size, f);
    fclose(f);
    free(orig);
    free(mut);
    printf("{\"passed\": %s, \"refused\": %d, \"mutations\": %d}\n", g_failures ? "false" : "true", refused, n);
    return g_failures ? 1 : 0;
}

/* ---- dropped: expert capacity ------------------------------------------------------------------------------------ */
/* The self-test input with the given lengths (one per sequence); the output (float32, raw) into OUT_PATH, and the
 * dropped pairs (colibri_dropped_pairs) printed. The caller compares both with the reference engine. */
static int cmd_dropped(const char *bundle, const char *out_path, int argc, char **argv) {
    colibri_ctx *ctx = open_ctx(bundle, 0);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    int64_t pairs = -1;
    EXPECT(colibri_dropped_pairs(ctx, &pairs), COLIBRI_ERR_STATE); /* before any call */
    EXPECT(colibri_dropped_pairs(ctx, NULL), COLIBRI_ERR_INVALID_ARG);
    size_t nx = 0;
    float *x = selftest(bundle, "input", &nx);
    float *y = malloc(io.output_bytes);
    int32_t *lengths = malloc(io.batch * sizeof *lengths);
    for (uint32_t b = 0; b < io.batch; b++) lengths[b] = (int)b < argc ? atoi(argv[b]) : (int32_t)io.tokens;
    CHECK(x && nx == (size_t)io.batch * io.tokens * io.hidden, "self-test input of %zu values", nx);
    if (g_failures) return 1;
    EXPECT(colibri_set_input(ctx, x, lengths, io.batch), COLIBRI_OK);
    EXPECT(colibri_infer(ctx), COLIBRI_OK);
    EXPECT(colibri_get_output(ctx, y, io.output_bytes), COLIBRI_OK);
    EXPECT(colibri_dropped_pairs(ctx, &pairs), COLIBRI_OK);
    FILE *f = fopen(out_path, "wb");
    CHECK(f && fwrite(y, 1, io.output_bytes, f) == io.output_bytes, "cannot write %s", out_path);
    if (f) fclose(f);
    printf("{\"passed\": %s, \"dropped\": %lld}\n", g_failures ? "false" : "true", (long long)pairs);
    free(x);
    free(y);
    free(lengths);
    colibri_free(ctx);
    return g_failures ? 1 : 0;
}

/* ---- shapes: one call per argument at the smallest shape that holds it --------------------------------------- */
static void json_string(const char *text) {
    putchar('"');
    for (const char *p = text; *p; p++) {
        if ((unsigned char)*p < 0x20) {
            printf("\\u%04x", (unsigned char)*p);
            continue;
        }
        if (*p == '"' || *p == '\\') putchar('\\');
        putchar(*p);
    }
    putchar('"');
}

static float *read_raw(const char *path, size_t count) {
    FILE *f = fopen(path, "rb");
    float *data = f ? malloc(count * sizeof *data) : NULL;
    if (data && fread(data, sizeof *data, count, f) != count) {
        free(data);
        data = NULL;
    }
    if (f) fclose(f);
    if (!data) fprintf(stderr, "FAIL: cannot read %zu float32 from %s\n", count, path);
    return data;
}

static int cmd_shapes(const char *bundle, const char *dir, int argc, char **argv) {
    colibri_ctx *ctx = open_ctx(bundle, 0);
    if (!ctx) return 1;
    colibri_io io;
    EXPECT(colibri_io_info(ctx, &io), COLIBRI_OK);
    uint32_t n_shapes = 0, last = 0;
    EXPECT(colibri_shape_count(ctx, &n_shapes), COLIBRI_OK);
    EXPECT(colibri_last_shape(ctx, &last), COLIBRI_ERR_STATE); /* before any call */
    EXPECT(colibri_last_shape(ctx, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_count(ctx, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_at(ctx, 0, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_for(ctx, 1, 1, NULL), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_for(ctx, 0, 1, &last), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_set_input_shape(ctx, NULL, NULL, 1, 1), COLIBRI_ERR_INVALID_ARG);
    EXPECT(colibri_shape_count(NULL, &n_shapes), COLIBRI_ERR_INVALID_ARG);
    char chosen[4096] = "", refused[8192] = "";
    size_t nc = 0, nr = 0;
    long allocs = 0;
    for (int a = 0; a < argc; a++) {
        const int refuse = argv[a][0] == '!';
        const char *spec = argv[a] + refuse;
        unsigned b = 0, t = 0;
        int used = 0;
        if (sscanf(spec, "%ux%u%n", &b, &t, &used) < 2) {
            fprintf(stderr, "FAIL: call %s is not BxT\n", argv[a]);
            return 1;
        }
        int32_t lengths[64];
        const int with_lengths = spec[used] == ':';
        if (with_lengths) { /* "L0,L1,...": one per sequence */
            const char *p = spec + used + 1;
            for (unsigned i = 0; i < b && i < 64; i++) {
                char *end;
                lengths[i] = (int32_t)strtol(p, &end, 10);
                p = *end == ',' ? end + 1 : end;
            }
        }
        const size_t count = (size_t)b * t * io.hidden;
        if (refuse) {
            float one = 0.0f;
            EXPECT(colibri_set_input_shape(ctx, &one, NULL, b, t), COLIBRI_ERR_INVALID_ARG);
            nr += (size_t)snprintf(refused + nr, sizeof refused - nr, "%s", nr ? "\x1f" : "");
            nr += (size_t)snprintf(refused + nr, sizeof refused - nr, "%s", colibri_last_error(ctx));
            continue;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/in_%ux%u.f32", dir, b, t);
        float *x = read_raw(path, count), *y = malloc(count * sizeof *y);
        if (!x || !y) return 1;
        const long before = g_allocs;
        EXPECT(colibri_set_input_shape(ctx, x, with_lengths ? lengths : NULL, b, t), COLIBRI_OK);
        EXPECT(colibri_infer(ctx), COLIBRI_OK);
        EXPECT(colibri_get_output(ctx, y, count * sizeof *y), COLIBRI_OK);
        EXPECT(colibri_last_shape(ctx, &last), COLIBRI_OK);
        allocs += g_allocs - before;
        uint32_t expect_index = 99;
        EXPECT(colibri_shape_for(ctx, b, t, &expect_index), COLIBRI_OK);
        CHECK(expect_index == last, "call %s: colibri_shape_for says %u, the call ran at %u", spec, expect_index, last);
        nc += (size_t)snprintf(chosen + nc, sizeof chosen - nc, "%s%u", nc ? ", " : "", last);
        snprintf(path, sizeof path, "%s/out_%ux%u.f32", dir, b, t);
        FILE *f = fopen(path, "wb");
        CHECK(f && fwrite(y, sizeof *y, count, f) == count, "cannot write %s", path);
        if (f) fclose(f);
        free(x);
        free(y);
    }
    printf("{\"passed\": %s, \"allocs\": %ld, \"chosen\": [%s], \"shapes\": [", g_failures ? "false" : "true",
           allocs, chosen);
    for (uint32_t i = 0; i < n_shapes; i++) {
        colibri_shape sh;
        EXPECT(colibri_shape_at(ctx, i, &sh), COLIBRI_OK);
        printf("%s{\"batch\": %u, \"tokens\": %u, \"calls\": %llu, \"launches\": %u, \"input_bytes\": %zu}",
               i ? ", " : "", sh.batch, sh.tokens, (unsigned long long)sh.calls, sh.launches, sh.input_bytes);
    }
    colibri_shape sh;
    EXPECT(colibri_shape_at(ctx, n_shapes, &sh), COLIBRI_ERR_INVALID_ARG);
    printf("], \"largest\": [%u, %u], \"refused\": ", io.batch, io.tokens);
    json_string(refused);
    printf("}\n");
    colibri_free(ctx);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: colibri_test run|errors|nonfinite|init|bind|threads|fuzz|dropped|shapes BUNDLE ...\n");
        return 2;
    }
    const char *cmd = argv[1], *bundle = argv[2];
    if (!strcmp(cmd, "run")) return cmd_run(bundle, argc - 3, argv + 3);
    if (!strcmp(cmd, "errors")) return cmd_errors(bundle);
    if (!strcmp(cmd, "nonfinite")) return cmd_nonfinite(bundle);
    if (!strcmp(cmd, "init") && argc >= 4) return cmd_init(bundle, atoi(argv[3]), argc >= 5 ? argv[4] : NULL);
    if (!strcmp(cmd, "bind")) return cmd_bind(bundle);
    if (!strcmp(cmd, "handles")) return cmd_handles(bundle);
    if (!strcmp(cmd, "dropped") && argc >= 4) return cmd_dropped(bundle, argv[3], argc - 4, argv + 4);
    if (!strcmp(cmd, "threads")) return cmd_threads(bundle);
    if (!strcmp(cmd, "shapes") && argc >= 4) return cmd_shapes(bundle, argv[3], argc - 4, argv + 4);
    if (!strcmp(cmd, "fuzz") && argc >= 5) return cmd_fuzz(bundle, atoi(argv[3]), (unsigned)strtoul(argv[4], NULL, 10));
    fprintf(stderr, "unknown subcommand %s\n", cmd);
    return 2;
}
