/* qc_loop.c: a camera-style loop that embeds libcolibri (sdk/libcolibri, docs/c_runtime.md).
 *
 * Each frame's token features (float32 (batch, tokens, hidden), what a pipeline's pre-processing stage produces:
 * the jetson_qc example's conv stem gives 16 tokens x 64 per frame) go through the bundle's MoE layers, paced at a
 * fixed frame rate with a per-frame deadline; one JSON line per frame on stdout, a summary on stderr.
 *
 *   qc_loop BUNDLE [--fps 5] [--frames N] [--source synthetic|stdin] [--budget-ms 50]
 *
 *   --source synthetic   deterministic features (a stand-in for a camera and the stem; default)
 *   --source stdin       raw little-endian float32 frames of batch*tokens*hidden values each, e.g. from a capture
 *                        and pre-processing process; ends at end of input
 *
 * All buffers are allocated before the loop; the loop itself allocates nothing. Build (after libcolibri):
 *   cc -O2 examples/jetson_qc/c/qc_loop.c -I sdk/libcolibri/include -L build/libcolibri -lcolibri -lm -o qc_loop
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig; g_stop = 1; }

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void sleep_until(double t_ms) {
    double left = t_ms - now_ms();
    if (left <= 0) return;
    struct timespec ts = {(time_t)(left / 1e3), (long)(fmod(left, 1e3) * 1e6)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !g_stop) {
    }
}

/* Frame i's features: a smooth deterministic pattern with a per-frame "defect" bump (xorshift, no libc rand). */
static void synthetic_frame(float *x, size_t n, size_t hidden, unsigned frame) {
    unsigned s = 2463534242u ^ (frame * 2654435761u);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 17, s ^= s << 5;
        x[i] = 0.5f * sinf(0.1f * (float)(i % hidden) + 0.3f * (float)frame) + ((float)(s & 0xFFFF) / 65536.0f - 0.5f);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: qc_loop BUNDLE [--fps F] [--frames N] [--source synthetic|stdin] [--budget-ms B]\n");
        return 2;
    }
    double fps = 5.0, budget_ms = 50.0;
    long frames = 20;
    const char *source = "synthetic";
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--fps")) fps = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--frames")) frames = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--source")) source = argv[i + 1];
        else if (!strcmp(argv[i], "--budget-ms")) budget_ms = atof(argv[i + 1]);
        else {
            fprintf(stderr, "qc_loop: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!(fps > 0) || frames < 1 || (strcmp(source, "synthetic") && strcmp(source, "stdin"))) {
        fprintf(stderr, "qc_loop: --fps must be > 0, --frames >= 1, --source synthetic or stdin\n");
        return 2;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);

    colibri_config cfg = COLIBRI_CONFIG_INIT;
    cfg.bundle_dir = argv[1];
    colibri_ctx *ctx = NULL;
    int rc = colibri_init(&cfg, &ctx);
    if (rc != COLIBRI_OK) {
        fprintf(stderr, "qc_loop: error: %s (%s)\n", colibri_last_error(NULL), colibri_status_name(rc));
        return 1;
    }
    colibri_io io;
    colibri_io_info(ctx, &io);
    fprintf(stderr, "qc_loop: %s on %s (%s, %s), input (%u, %u, %u) float32\n", argv[1], io.device_name,
            io.image_kind ? "PTX" : "cubin", io.arch, io.batch, io.tokens, io.hidden);
    const size_t n = io.input_bytes / sizeof(float);
    float *x = malloc(io.input_bytes), *y = malloc(io.output_bytes);
    double *lat = malloc((size_t)frames * sizeof *lat);
    if (!x || !y || !lat) {
        fprintf(stderr, "qc_loop: out of memory\n");
        return 1;
    }
    long done = 0, late = 0;
    const double period = 1e3 / fps, start = now_ms();
    for (long f = 0; f < frames && !g_stop; f++) {
        sleep_until(start + f * period);
        if (!strcmp(source, "stdin")) {
            if (fread(x, sizeof(float), n, stdin) != n) break;
        } else {
            synthetic_frame(x, n, io.hidden, (unsigned)f);
        }
        const double t0 = now_ms();
        rc = colibri_set_input(ctx, x, NULL, io.batch);
        if (rc == COLIBRI_OK) rc = colibri_infer(ctx);
        if (rc == COLIBRI_OK) rc = colibri_get_output(ctx, y, io.output_bytes);
        const double ms = now_ms() - t0;
        if (rc != COLIBRI_OK) { /* a bad frame is reported and skipped; a driver failure ends the loop */
            printf("{\"frame\": %ld, \"error\": \"%s\"}\n", f, colibri_status_name(rc));
            fprintf(stderr, "qc_loop: frame %ld: %s\n", f, colibri_last_error(ctx));
            if (rc == COLIBRI_ERR_INVALID_ARG) continue;
            break;
        }
        double energy = 0; /* a score from the MoE output: its mean square (the Python example's head goes here) */
        for (size_t i = 0; i < n; i++) energy += (double)y[i] * y[i];
        energy /= (double)n;
        lat[done++] = ms;
        late += ms > budget_ms;
        printf("{\"frame\": %ld, \"latency_ms\": %.3f, \"score\": %.6f, \"late\": %s}\n", f, ms, energy,
               ms > budget_ms ? "true" : "false");
        fflush(stdout);
    }
    if (done) {
        qsort(lat, (size_t)done, sizeof *lat, cmp_double);
        fprintf(stderr, "qc_loop: %ld frames, latency p50 %.3f ms, p99 %.3f ms, %ld over the %.1f ms budget\n", done,
                lat[done / 2], lat[(size_t)((done - 1) * 0.99)], late, budget_ms);
    }
    free(x);
    free(y);
    free(lat);
    colibri_free(ctx);
    return rc == COLIBRI_OK || rc == COLIBRI_ERR_INVALID_ARG ? 0 : 1;
}
