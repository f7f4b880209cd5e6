/* calls.c: colibri_test run (self-test vectors end to end), errors (every status code from bad calls), nonfinite (a
 * finite input that overflows inside a layer) and init (colibri_init's refusals). */
#include "colibri_test.h"

/* ---- run --------------------------------------------------------------------------------------------------------- */
int cmd_run(const char *bundle, int argc, char **argv) {
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
int cmd_errors(const char *bundle) {
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
int cmd_nonfinite(const char *bundle) {
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
int cmd_init(const char *bundle, int code, const char *substring) {
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
