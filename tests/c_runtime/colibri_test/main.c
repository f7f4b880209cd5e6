/* colibri_test: the C tests of libcolibri, one subcommand per case (tests/c_runtime/test_c_runtime.py runs them on
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
 * code under test. Exit status 0 = pass; a failure prints "FAIL: ..." on stderr.
 *
 * main.c: the command line; colibri_test.h lists the other files. */
#include "colibri_test.h"

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
