/* shapes.c: colibri_test fuzz (mutated manifests), dropped (expert capacity) and shapes (one call per input shape). */
#include "colibri_test.h"

/* ---- fuzz: mutated manifests ------------------------------------------------------------------------------------ */
int cmd_fuzz(const char *bundle, int n, unsigned seed) {
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
int cmd_dropped(const char *bundle, const char *out_path, int argc, char **argv) {
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
int cmd_shapes(const char *bundle, const char *dir, int argc, char **argv) {
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
