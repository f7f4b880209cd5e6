/* colibri_test.h: what the files of colibri_test share (main.c describes the program): the failure count and
 * its CHECK / EXPECT macros, the host-allocation counter, reading the bundle's self-test vectors, and one entry per
 * subcommand. support.c holds the helpers; calls.c (run, errors, nonfinite, init), handles.c (handles, bind, threads)
 * and shapes.c (fuzz, dropped, shapes) the checks; main.c the command line. */
#ifndef COLIBRI_TEST_H
#define COLIBRI_TEST_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

/* ---- allocation counter and failures (support.c) --------------------------------------------------------------- */
extern long g_allocs; /* host allocations so far (malloc, calloc, realloc: -Wl,--wrap) */
extern int g_failures;
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


/* ---- helpers (support.c) ----------------------------------------------------------------------------------------- */
/* The bundle's selftest/WHICH.npy (float32), its element count in *count; NULL (and a FAIL line) when unreadable. */
float *selftest(const char *bundle, const char *which, size_t *count);
/* rtol/atol of the bundle's dtype (docs/build.md, "Self-test vectors"). */
void tolerances(const colibri_io *io, double *rtol, double *atol);
/* colibri_init of BUNDLE with FLAGS; NULL (and a FAIL line) when it fails. */
colibri_ctx *open_ctx(const char *bundle, uint32_t flags);
/* TEXT on stdout as a JSON string (quotes, backslashes and control characters escaped). */
void json_string(const char *text);
/* COUNT float32 from the raw file PATH (malloc'd); NULL (and a FAIL line) when it cannot be read. */
float *read_raw(const char *path, size_t count);

/* ---- the subcommands (calls.c, handles.c, shapes.c) -------------------------------------------------------------- */
int cmd_run(const char *bundle, int argc, char **argv);
int cmd_errors(const char *bundle);
int cmd_nonfinite(const char *bundle);
int cmd_init(const char *bundle, int code, const char *substring);
int cmd_handles(const char *bundle);
int cmd_bind(const char *bundle);
int cmd_threads(const char *bundle);
int cmd_fuzz(const char *bundle, int n, unsigned seed);
int cmd_dropped(const char *bundle, const char *out_path, int argc, char **argv);
int cmd_shapes(const char *bundle, const char *dir, int argc, char **argv);

#endif
