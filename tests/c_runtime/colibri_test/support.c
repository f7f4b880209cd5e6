/* support.c: colibri_test's host-allocation counter (the -Wl,--wrap targets), its failure count, reading .npy and raw
 * float32 files, opening a context, and JSON strings. */
#include "colibri_test.h"

/* ---- allocation counter -------------------------------------------------------------------------------------- */
void *__real_malloc(size_t);
void *__real_calloc(size_t, size_t);
void *__real_realloc(void *, size_t);
long g_allocs;
void *__wrap_malloc(size_t n) { g_allocs++; return __real_malloc(n); }
void *__wrap_calloc(size_t a, size_t b) { g_allocs++; return __real_calloc(a, b); }
void *__wrap_realloc(void *p, size_t n) { g_allocs++; return __real_realloc(p, n); }

int g_failures;

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

float *selftest(const char *bundle, const char *which, size_t *count) {
    char path[4096];
    snprintf(path, sizeof path, "%s/selftest/%s.npy", bundle, which);
    float *d = load_npy(path, count);
    if (!d) fprintf(stderr, "FAIL: cannot read %s\n", path);
    return d;
}

/* rtol/atol of the bundle's dtype (docs/build.md, "Self-test vectors"). */
void tolerances(const colibri_io *io, double *rtol, double *atol) {
    *rtol = *atol = strcmp(io->dtype, "fp16") == 0 ? 1e-2 : 1e-4;
}

colibri_ctx *open_ctx(const char *bundle, uint32_t flags) {
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = bundle;
    cfg.flags = flags;
    colibri_ctx *ctx = NULL;
    int rc = colibri_init(&cfg, &ctx);
    if (rc != COLIBRI_OK) fprintf(stderr, "FAIL: colibri_init: %s: %s\n", colibri_status_name(rc), colibri_last_error(NULL));
    return ctx;
}

/* ---- JSON strings, raw float32 files ------------------------------------------------------------------------- */
void json_string(const char *text) {
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

float *read_raw(const char *path, size_t count) {
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
