/* c_runtime_bench.c: host time per call of libcolibri (set_input + infer + get_output) on one bundle.
 *   c_runtime_bench BUNDLE [CALLS [B T MODE]]   prints one JSON line: median, p90, p99 and mean in microseconds
 * Without B T: calls of the largest shape (colibri_set_input). With B T (a call of B sequences of T tokens):
 *   MODE "shape": colibri_set_input_shape, which runs the smallest compiled shape that holds the call;
 *   MODE "padded": what a program did while the runtime ran only the largest shape: the call zero-padded to the
 *   largest shape with input_lengths (T for the first B sequences, 0 for the others), colibri_set_input.
 * bench/c_runtime_bench.py runs it next to the Python runtime, both on the fake driver with no-op kernels. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int calls = argc > 2 ? atoi(argv[2]) : 2000;
    if (calls < 10) calls = 10;
    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = argv[1];
    cfg.flags = COLIBRI_FLAG_NO_VERIFY;
    colibri_ctx *ctx;
    if (colibri_init(&cfg, &ctx) != COLIBRI_OK) {
        fprintf(stderr, "%s\n", colibri_last_error(NULL));
        return 1;
    }
    colibri_io io;
    colibri_io_info(ctx, &io);
    const size_t b = argc > 4 ? (size_t)atoi(argv[3]) : io.batch, tk = argc > 4 ? (size_t)atoi(argv[4]) : io.tokens;
    const int shaped = argc > 5 && !strcmp(argv[5], "shape");
    const size_t out_bytes = shaped ? b * tk * io.hidden * 4 : io.output_bytes;
    float *x = calloc(1, io.input_bytes), *y = malloc(io.output_bytes);
    int32_t *lengths = calloc(io.batch, sizeof *lengths);
    double *t = malloc(calls * sizeof *t), sum = 0;
    for (size_t i = 0; i < io.input_bytes / 4; i++) x[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < io.batch; i++) lengths[i] = i < b ? (int32_t)tk : 0;
    const int32_t *lens = argc > 4 && !shaped ? lengths : NULL;
    for (int i = -50; i < calls; i++) { /* 50 warm-up calls, then the timed ones */
        double t0 = now_us();
        int rc = shaped ? colibri_set_input_shape(ctx, x, NULL, b, tk) : colibri_set_input(ctx, x, lens, io.batch);
        if (!rc) rc = colibri_infer(ctx);
        if (!rc) rc = colibri_get_output(ctx, y, out_bytes);
        if (rc) {
            fprintf(stderr, "%s\n", colibri_last_error(ctx));
            return 1;
        }
        if (i < 0) continue;
        t[i] = now_us() - t0;
        sum += t[i];
    }
    qsort(t, calls, sizeof *t, cmp);
    printf("{\"calls\": %d, \"median_us\": %.2f, \"p90_us\": %.2f, \"p99_us\": %.2f, \"mean_us\": %.2f}\n", calls,
           t[calls / 2], t[calls * 9 / 10], t[calls * 99 / 100], sum / calls);
    colibri_free(ctx);
    free(x);
    free(y);
    free(t);
    free(lengths);
    return 0;
}
