/* internal.h: what the parts of libcolibri share (not installed). */
#ifndef COLIBRI_INTERNAL_H
#define COLIBRI_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "cJSON.h"

#define CB_ERR_LEN 640

/* A message buffer: every failing function writes one line here and returns a COLIBRI_ERR_* code. */
typedef struct cb_err {
    char text[CB_ERR_LEN];
} cb_err;

int cb_fail(cb_err *err, int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* `text` with control characters, quotes and backslashes escaped (\xNN), cut to fit `out`. */
const char *cb_escape(const char *text, char *out, size_t out_len);

/* ---- growable byte buffer (load time only) ---------------------------------------------------------------- */
typedef struct cb_buf {
    char *data;
    size_t len, cap;
} cb_buf;
int cb_buf_put(cb_buf *b, const char *s, size_t n); /* 0 or -1 (out of memory) */
void cb_buf_free(cb_buf *b);

/* ---- sha256 (OpenSSL libcrypto) --------------------------------------------------------------------------- */
typedef struct cb_sha256 cb_sha256;
cb_sha256 *cb_sha256_new(void);
int cb_sha256_update(cb_sha256 *h, const void *data, size_t n);
int cb_sha256_hex(cb_sha256 *h, char hex[65]); /* finalises */
void cb_sha256_free(cb_sha256 *h);

/* ---- canonical JSON (json_canon.c) ------------------------------------------------------------------------ */
/* A number item printed as a float by the canonical form (the manifest spelled it with '.', 'e' or 'E'). */
#define CB_FLOAT_FLAG (1 << 12)
/* Print `item` as Python's json.dumps(sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) does (without
 * the trailing newline). With `raw` (the parsed text), each number's int/float spelling is taken from `raw` at the
 * same offset and recorded in CB_FLOAT_FLAG; without it, from the flag. `skip_key`: a top-level key to leave out.
 * Refuses duplicate keys, non-finite numbers and strings that are not UTF-8. */
int cb_canonical(cJSON *item, cb_buf *out, const char *raw, size_t raw_len, const char *skip_key, cb_err *err);

/* ---- the bundle (bundle.c) -------------------------------------------------------------------------------- */
typedef struct cb_header {
    uint16_t version, num_layers, num_experts, top_k, hidden_size, intermediate_size, dtype, routing, composition;
    uint64_t data_size; /* bytes after the 64-byte header */
} cb_header;

typedef struct cb_bundle {
    int root_fd;
    char *raw;
    size_t raw_len;
    cJSON *manifest;
    const char *weights_file;
    cb_header header;
    int batch, tokens;
    int cc_major, cc_minor, min_driver;
    char arch[16], dtype[8], nvrtc_version[16];
} cb_bundle;

#define MANIFEST "manifest.json"
#define DIGEST_KEY "manifest_sha256" /* the manifest key holding its own digest */
#define MAX_TOKENS 65536                /* the most batch, tokens and batch x tokens of a shape */
#define CB_HEADER_SIZE 64
/* bytes allocated after the weights: the GEMV's aligned 16-byte windows may read up to 15 bytes past the data
   (sdk/catalog.py WEIGHTS_TAIL_BYTES) */
#define CB_WEIGHTS_TAIL 16

/* Open and check a bundle folder (docs/c_runtime.md, "Refusals"); verify: sha256 of every file + unlisted scan. */
int cb_bundle_open(cb_bundle *b, const char *dir, int verify, cb_err *err);
void cb_bundle_close(cb_bundle *b);
/* The last `shapes` entry equals the top-level shape, kernels, launch, buffers, io_buffers and selftest (none: OK). */
int cb_check_largest(const cb_bundle *b, cb_err *err);
/* bundle_manifest.c: the manifest's schema (keys, types, ranges, paths, kernels, shapes, launch plan); the entry
 * of `files` whose path is `path` (NULL if none); the weights header fields a manifest records, in header order. */
int cb_check_schema(cb_bundle *b, cb_err *err);
const cJSON *cb_listed(const cJSON *files, const char *path);
#define CB_HEADER_FIELDS 8
extern const char *const cb_header_fields[CB_HEADER_FIELDS];
/* bundle.c: 0, or COLIBRI_ERR_BUNDLE naming `what` when `path` is not a normalised relative path inside the bundle. */
int cb_check_relative(const char *path, const char *what, cb_err *err);
/* Open a file listed in the manifest: every component without following symlinks, a regular file. */
int cb_bundle_open_file(const cb_bundle *b, const char *rel, int *fd, uint64_t *size, cb_err *err);
/* Read a whole listed file into malloc'ed memory; `extra` zero bytes are appended (PTX wants a NUL). */
int cb_bundle_read(const cb_bundle *b, const char *rel, size_t extra, unsigned char **data, size_t *size, cb_err *err);

/* JSON access helpers: an int member (integral number, not a float literal), a string member. */
int cb_json_int(const cJSON *obj, const char *key, long long *out);
const char *cb_json_str(const cJSON *obj, const char *key);

#endif
