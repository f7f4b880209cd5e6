/* bundle.c: open and check a bundle folder with the rules of the Python bundle reader (sdk/bundle/reader.py):
 *   - manifest.json and every listed file are opened component by component without following symlinks
 *     (O_NOFOLLOW), must be regular files inside the folder, and are refused before a byte is read otherwise;
 *   - the manifest is strict JSON (cJSON: no NaN/Infinity), without duplicate keys, byte for byte its own canonical
 *     form, and its manifest_sha256 is the sha256 of the canonical form without that key;
 *   - the schema: every key, its JSON type and range, no unknown key; paths relative, normalised, inside the
 *     bundle, without control characters; files sorted and unique; kernel images and the weights listed files;
 *   - every listed file has its recorded size and (verify) sha256; (verify) no unlisted file and no finite-only
 *     violation (NaN/Inf) in the weights;
 *   - the weights' 64-byte .colibri header (v1 or v2, docs/format.md) equals the manifest's weights.header; a v2
 *     file's size follows from its block layout, and only its float blocks are scanned for NaN/Inf.
 * Plus what only this runtime needs: a launch plan, buffers and io_buffers (written by the build).
 * The schema checks are in bundle_manifest.c (cb_check_schema); this file holds the paths, the files and the open. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "colibri.h"
#include "internal.h"

#define MAX_MANIFEST_BYTES (64u * 1024u * 1024u)
#define CHUNK (1u << 20)
#define MAX_SCAN_DEPTH 32

/* ---- paths ------------------------------------------------------------------------------------------------- */
/* Python's check_relative plus the control-character rule: non-empty, relative, no "." / ".." / empty component,
 * no backslash, no byte below 0x20 or 0x7F. */
int cb_check_relative(const char *path, const char *what, cb_err *err) {
    char esc[256];
    if (!path || !*path)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: %s: path \"\"; allowed: a non-empty relative POSIX path", what);
    for (const unsigned char *p = (const unsigned char *)path; *p; p++)
        if (*p < 0x20 || *p == 0x7F)
            return cb_fail(err, COLIBRI_ERR_BUNDLE,
                           "manifest.json: %s: path \"%s\" holds a control character; allowed: printable characters",
                           what, cb_escape(path, esc, sizeof esc));
    int bad = path[0] == '/' || strchr(path, '\\') != NULL;
    const char *s = path;
    while (!bad) {
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.')) bad = 1;
        if (!e) break;
        s = e + 1;
    }
    if (bad)
        return cb_fail(err, COLIBRI_ERR_BUNDLE,
                       "manifest.json: %s: path \"%s\"; allowed: a normalised relative path inside the bundle", what,
                       cb_escape(path, esc, sizeof esc));
    return COLIBRI_OK;
}

static int open_nofollow(int root_fd, const char *rel, int *fd_out, struct stat *st, cb_err *err) {
    char esc[256], part[256];
    int dir = root_fd, fd = -1;
    const char *s = rel;
    for (;;) {
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n >= sizeof part) {
            if (dir != root_fd) close(dir);
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: a path component is longer than %zu bytes",
                           cb_escape(rel, esc, sizeof esc), sizeof part - 1);
        }
        memcpy(part, s, n);
        part[n] = 0;
        int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (e ? O_DIRECTORY : O_NONBLOCK);
        fd = openat(dir, part, flags);
        int saved = errno;
        if (dir != root_fd) close(dir);
        if (fd < 0) {
            if (saved == ELOOP || saved == ENOTDIR || saved == EMLINK)
                return cb_fail(err, COLIBRI_ERR_BUNDLE,
                               "%s: a symlink (or a folder on its path is not a folder); a bundle is read only "
                               "through regular files inside its folder", cb_escape(rel, esc, sizeof esc));
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot open: %s", cb_escape(rel, esc, sizeof esc),
                           strerror(saved));
        }
        if (!e) break;
        dir = fd;
        s = e + 1;
    }
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: not a regular file; a bundle holds regular files only",
                       cb_escape(rel, esc, sizeof esc));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    *fd_out = fd;
    return COLIBRI_OK;
}

int cb_bundle_open_file(const cb_bundle *b, const char *rel, int *fd, uint64_t *size, cb_err *err) {
    struct stat st;
    int rc = open_nofollow(b->root_fd, rel, fd, &st, err);
    if (!rc && size) *size = (uint64_t)st.st_size;
    return rc;
}

static int read_all(int fd, unsigned char *dst, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, dst + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        done += (size_t)r;
    }
    return 0;
}

int cb_bundle_read(const cb_bundle *b, const char *rel, size_t extra, unsigned char **data, size_t *size,
                   cb_err *err) {
    char esc[256];
    int fd;
    uint64_t n;
    int rc = cb_bundle_open_file(b, rel, &fd, &n, err);
    if (rc) return rc;
    unsigned char *buf = malloc((size_t)n + extra + 1);
    if (!buf) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "%s: out of memory reading %llu bytes",
                       cb_escape(rel, esc, sizeof esc), (unsigned long long)n);
    }
    if (read_all(fd, buf, (size_t)n) != 0) {
        close(fd);
        free(buf);
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot read: %s", cb_escape(rel, esc, sizeof esc),
                       errno ? strerror(errno) : "the file is shorter than its size");
    }
    close(fd);
    memset(buf + n, 0, extra + 1);
    *data = buf;
    *size = (size_t)n;
    return COLIBRI_OK;
}

/* ---- files ----------------------------------------------------------------------------------------------------- */
/* NaN/Inf in the weight data (after the header), fp16 or fp32 little-endian. `offset`: file offset of data[0]. */
static int nonfinite(const unsigned char *data, size_t n, uint64_t offset, int itemsize) {
    size_t start = offset < CB_HEADER_SIZE ? (size_t)(CB_HEADER_SIZE - offset) : 0;
    if (itemsize == 2) {
        for (size_t i = start; i + 1 < n; i += 2)
            if (((data[i] | (data[i + 1] << 8)) & 0x7C00) == 0x7C00) return 1;
    } else {
        for (size_t i = start; i + 3 < n; i += 4)
            if (((data[i + 2] | (data[i + 3] << 8)) & 0x7F80) == 0x7F80) return 1;
    }
    return 0;
}

/* ---- the v2 layout (docs/format.md, v2 "Blocks" and "Sizes"; colibri_sdk.format.HeaderV2.blocks) ---------------- */
/* The u16 fields at header offsets 22..50, in order (the manifest's weights.header keys of a v2 file). */
static const char *V2_FIELDS[] = {"quant", "group_size", "zero_points", "norm_topk", "n_group", "topk_group",
                                  "group_score", "router_bias", "correction_bias", "num_shared_experts",
                                  "shared_intermediate_size", "shared_gate", "expert_bias", "activation",
                                  "num_model_layers"};
enum { V2_QUANT, V2_GROUP, V2_ZEROS, V2_NORM, V2_NGROUP, V2_TOPKGROUP, V2_GSCORE, V2_RBIAS, V2_CBIAS, V2_SHARED,
       V2_SHARED_I, V2_SHARED_GATE, V2_EBIAS, V2_ACT, V2_MODEL_LAYERS, V2_N };
#define MAX_FLOAT_RANGES 32

typedef struct v2_layout {
    uint64_t file_size;
    int n;                                   /* float blocks (matrices of quant 0, scales, router, biases, gate) */
    uint64_t lo[MAX_FLOAT_RANGES], hi[MAX_FLOAT_RANGES];
    int itemsize[MAX_FLOAT_RANGES];
} v2_layout;

static uint64_t align64(uint64_t x) { return (x + 63) / 64 * 64; }

static void v2_add(v2_layout *out, uint64_t *offset, uint64_t nbytes, int float_itemsize) {
    *offset = align64(*offset);
    if (float_itemsize && out->n < MAX_FLOAT_RANGES) {
        out->lo[out->n] = *offset;
        out->hi[out->n] = *offset + nbytes;
        out->itemsize[out->n++] = float_itemsize;
    }
    *offset += nbytes;
}

/* gate, up (rows, cols) and down (cols, rows) of `count` experts per layer, each with its scale and zero blocks. */
static void v2_matrices(v2_layout *out, uint64_t *offset, const uint64_t *v, uint64_t L, uint64_t count,
                        uint64_t inter, uint64_t hidden, int s) {
    const uint64_t shapes[3][2] = {{inter, hidden}, {inter, hidden}, {hidden, inter}};
    for (int m = 0; m < 3; m++) {
        const uint64_t rows = shapes[m][0], cols = shapes[m][1];
        const uint64_t row_bytes = v[V2_QUANT] == 0 ? cols * s : v[V2_QUANT] == 1 ? cols : (cols + 1) / 2;
        const uint64_t groups = v[V2_GROUP] == 0 ? 1 : (cols + v[V2_GROUP] - 1) / v[V2_GROUP];
        v2_add(out, offset, L * count * rows * row_bytes, v[V2_QUANT] == 0 ? s : 0);
        if (v[V2_QUANT]) v2_add(out, offset, L * count * rows * groups * s, s);
        if (v[V2_ZEROS]) v2_add(out, offset, L * count * rows * groups, 0);
    }
}

/* The blocks of a v2 file from its sizes (L, E, H, I, dtype) and V2_FIELDS values. */
static void v2_layout_of(uint64_t L, uint64_t E, uint64_t H, uint64_t I, uint64_t dtype, const uint64_t *v,
                         v2_layout *out) {
    const int s = dtype == 1 ? 2 : 4;
    uint64_t offset = align64(64 + 2 * L);
    out->n = 0;
    v2_matrices(out, &offset, v, L, E, I, H, s);
    v2_add(out, &offset, L * H * E * 4, 4); /* router */
    if (v[V2_RBIAS]) v2_add(out, &offset, L * E * 4, 4);
    if (v[V2_CBIAS]) v2_add(out, &offset, L * E * 4, 4);
    if (v[V2_EBIAS]) {
        v2_add(out, &offset, L * E * I * 4, 4);
        v2_add(out, &offset, L * E * I * 4, 4);
        v2_add(out, &offset, L * E * H * 4, 4);
    }
    if (v[V2_SHARED]) v2_matrices(out, &offset, v, L, v[V2_SHARED], v[V2_SHARED_I], H, s);
    if (v[V2_SHARED_GATE]) v2_add(out, &offset, L * H * 4, 4);
    out->file_size = offset;
}

/* The v2 layout of the manifest's weights.header (0: a v1 header, or fields missing). */
static int manifest_v2_layout(const cb_bundle *b, v2_layout *out) {
    const cJSON *mh = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(b->manifest, "weights"), "header");
    long long version, x;
    if (cb_json_int(mh, "version", &version) != 0 || version != 0x0200) return 0;
    uint64_t v[V2_N], sizes[5];
    static const char *size_keys[] = {"num_layers", "num_experts", "hidden_size", "intermediate_size", "dtype"};
    for (int i = 0; i < 5; i++) {
        if (cb_json_int(mh, size_keys[i], &x) != 0 || x < 0 || x > 65535) return 0;
        sizes[i] = (uint64_t)x;
    }
    for (int i = 0; i < V2_N; i++) {
        if (cb_json_int(mh, V2_FIELDS[i], &x) != 0 || x < 0 || x > 65535) return 0;
        v[i] = (uint64_t)x;
    }
    v2_layout_of(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], v, out);
    return 1;
}

/* NaN/Inf in the float blocks of a v2 file: data[0] at file offset `offset`. */
static int nonfinite_v2(const unsigned char *data, size_t n, uint64_t offset, const v2_layout *layout) {
    for (int r = 0; r < layout->n; r++) {
        uint64_t a = layout->lo[r] > offset ? layout->lo[r] : offset, e = offset + n;
        uint64_t z = layout->hi[r] < e ? layout->hi[r] : e;
        const int size = layout->itemsize[r];
        if (a >= z) continue;
        a += (size - (a - layout->lo[r]) % size) % size; /* the first whole element of the block in the chunk */
        for (uint64_t i = a - offset; i + size <= z - offset; i += size) {
            const unsigned char *p = data + i;
            if (size == 2 ? ((p[0] | (p[1] << 8)) & 0x7C00) == 0x7C00 : ((p[2] | (p[3] << 8)) & 0x7F80) == 0x7F80)
                return 1;
        }
    }
    return 0;
}

static int verify_file(cb_bundle *b, const cJSON *entry, int verify, unsigned char *chunk, cb_err *err) {
    char esc[256], hex[65];
    const char *rel = cb_json_str(entry, "path");
    long long want;
    cb_json_int(entry, "size", &want);
    int fd;
    uint64_t size;
    int rc = cb_bundle_open_file(b, rel, &fd, &size, err);
    if (rc) return rc;
    if ((long long)size != want) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: %llu bytes; the manifest records %lld",
                       cb_escape(rel, esc, sizeof esc), (unsigned long long)size, want);
    }
    if (!verify) {
        close(fd);
        return COLIBRI_OK;
    }
    const int weights = strcmp(rel, b->weights_file) == 0;
    const int itemsize = strcmp(b->dtype, "fp16") == 0 ? 2 : 4;
    v2_layout layout; /* a v2 file: only its float blocks are scanned (int8/int4 codes look like any float) */
    const int v2 = weights && manifest_v2_layout(b, &layout);
    cb_sha256 *h = cb_sha256_new();
    if (!h) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "sha256: cannot create a digest context");
    }
    int bad_value = 0;
    for (uint64_t off = 0; off < size;) {
        size_t n = size - off < CHUNK ? (size_t)(size - off) : CHUNK;
        if (read_all(fd, chunk, n) != 0) {
            rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot read: %s", cb_escape(rel, esc, sizeof esc),
                         errno ? strerror(errno) : "shorter than its size");
            break;
        }
        cb_sha256_update(h, chunk, n);
        if (weights && !bad_value)
            bad_value = v2 ? nonfinite_v2(chunk, n, off, &layout) : nonfinite(chunk, n, off, itemsize);
        off += n;
    }
    close(fd);
    if (!rc && cb_sha256_hex(h, hex) != 0) rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "sha256 failed");
    cb_sha256_free(h);
    if (rc) return rc;
    if (strcmp(hex, cb_json_str(entry, "sha256")) != 0)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: sha256 %s differs from the manifest's %s",
                       cb_escape(rel, esc, sizeof esc), hex, cb_escape(cb_json_str(entry, "sha256"), esc + 128, 80));
    if (bad_value)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: the weights hold NaN or Inf values; allowed: finite weights",
                       cb_escape(rel, esc, sizeof esc));
    return COLIBRI_OK;
}

/* Every entry under the folder must be a listed regular file, a real folder, or manifest.json at the top. */
static int scan_unlisted(cb_bundle *b, int dir_fd, const char *prefix, int depth, cb_err *err) {
    char esc[256], rel[1024];
    if (depth > MAX_SCAN_DEPTH)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: folders nested deeper than %d", cb_escape(prefix, esc, sizeof esc),
                       MAX_SCAN_DEPTH);
    int fd = dup(dir_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot list the folder: %s", *prefix ? prefix : ".", strerror(errno));
    }
    rewinddir(d);
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(b->manifest, "files");
    int rc = COLIBRI_OK;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(rel, sizeof rel, "%s%s", prefix, e->d_name);
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot stat: %s", cb_escape(rel, esc, sizeof esc), strerror(errno));
        } else if (S_ISLNK(st.st_mode)) {
            rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: a symlink; a bundle holds regular files and folders only",
                         cb_escape(rel, esc, sizeof esc));
        } else if (S_ISDIR(st.st_mode)) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub < 0) {
                rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: cannot open the folder: %s", cb_escape(rel, esc, sizeof esc),
                             strerror(errno));
            } else {
                char sub_prefix[sizeof rel + 2];
                snprintf(sub_prefix, sizeof sub_prefix, "%s/", rel);
                rc = scan_unlisted(b, sub, sub_prefix, depth + 1, err);
                close(sub);
            }
        } else if (!(depth == 0 && strcmp(rel, MANIFEST) == 0) && !cb_listed(files, rel)) {
            rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: not listed in the manifest; a bundle holds only the files it lists",
                         cb_escape(rel, esc, sizeof esc));
        }
    }
    closedir(d);
    return rc;
}

/* ---- the weights header ---------------------------------------------------------------------------------------- */
static uint16_t u16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static int read_header(cb_bundle *b, cb_err *err) {
    char esc[256];
    const char *rel = b->weights_file;
    int fd;
    uint64_t size;
    int rc = cb_bundle_open_file(b, rel, &fd, &size, err);
    if (rc) return rc;
    unsigned char raw[CB_HEADER_SIZE];
    int short_read = size < CB_HEADER_SIZE || read_all(fd, raw, CB_HEADER_SIZE) != 0;
    close(fd);
    cb_escape(rel, esc, sizeof esc);
    if (short_read)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: %llu bytes; a .colibri file starts with a 64-byte header", esc,
                       (unsigned long long)size);
    if (memcmp(raw, "COLI", 4) != 0)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: bad magic; expected b'COLI'", esc);
    cb_header *h = &b->header;
    h->version = u16(raw + 4);
    h->num_layers = u16(raw + 6);
    h->num_experts = u16(raw + 8);
    h->top_k = u16(raw + 10);
    h->hidden_size = u16(raw + 12);
    h->intermediate_size = u16(raw + 14);
    h->dtype = u16(raw + 16);
    h->routing = u16(raw + 18);
    h->composition = u16(raw + 20);
    const int v2 = h->version == 0x0200;
    if (h->version != 0x0100 && !v2)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: unsupported version 0x%04x; this runtime reads 0x0100 and 0x0200",
                       esc, h->version);
    for (int i = 22; i < CB_HEADER_SIZE && !v2; i++)
        if (raw[i])
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: reserved byte %d is 0x%02x; allowed: 0", esc, i, raw[i]);
    if (!h->num_layers || !h->num_experts || !h->top_k || !h->hidden_size || !h->intermediate_size ||
        h->top_k > h->num_experts || h->dtype > 1 || h->routing > (v2 ? 2 : 1) || h->composition > 1)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: the header holds a size of zero, top_k > num_experts or an "
                                                "unknown dtype/routing/composition code", esc);
    const uint16_t values[] = {h->num_layers, h->num_experts, h->top_k, h->hidden_size, h->intermediate_size,
                               h->dtype, h->routing, h->composition};
    const cJSON *mh = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(b->manifest, "weights"), "header");
    for (size_t i = 0; i < CB_HEADER_FIELDS; i++) {
        long long recorded;
        cb_json_int(mh, cb_header_fields[i], &recorded);
        if (recorded != values[i])
            return cb_fail(err, COLIBRI_ERR_BUNDLE,
                           "%s: header %s = %u, but the manifest's weights.header.%s = %lld; the weights do not belong "
                           "to this manifest", esc, cb_header_fields[i], values[i], cb_header_fields[i], recorded);
    }
    long long recorded_version;
    if (cb_json_int(mh, "version", &recorded_version) == 0 && recorded_version != h->version)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: header version = %u, but the manifest's weights.header.version = %lld",
                       esc, h->version, recorded_version);
    const uint64_t itemsize = h->dtype == 1 ? 2 : 4, L = h->num_layers, E = h->num_experts, H = h->hidden_size,
                   I = h->intermediate_size;
    h->data_size = (L * E * 3 * I * H + L * H * E) * itemsize;
    if (v2) { /* every v2 field as the manifest records it, then the block layout gives the size */
        uint64_t v[V2_N];
        for (int i = 0; i < V2_N; i++) {
            long long recorded;
            v[i] = u16(raw + 22 + 2 * i);
            if (cb_json_int(mh, V2_FIELDS[i], &recorded) != 0 || recorded != (long long)v[i])
                return cb_fail(err, COLIBRI_ERR_BUNDLE,
                               "%s: header %s = %u, but the manifest's weights.header does not record it so; the "
                               "weights do not belong to this manifest", esc, V2_FIELDS[i], (unsigned)v[i]);
        }
        if (v[V2_QUANT] > 2 || v[V2_MODEL_LAYERS] < L)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: quant code %u or num_model_layers %u; allowed: 0..2 and "
                           ">= num_layers", esc, (unsigned)v[V2_QUANT], (unsigned)v[V2_MODEL_LAYERS]);
        v2_layout layout;
        v2_layout_of(L, E, H, I, h->dtype, v, &layout);
        h->data_size = layout.file_size - CB_HEADER_SIZE;
    }
    if (size != CB_HEADER_SIZE + h->data_size)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: %llu bytes; its header describes %llu", esc,
                       (unsigned long long)size, (unsigned long long)(CB_HEADER_SIZE + h->data_size));
    /* v1 weights are converted to the profile's dtype; a v2 file is copied as it is (its own storage) */
    if (!v2 && (h->dtype == 1) != (strcmp(b->dtype, "fp16") == 0))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s: weights dtype code %u; the manifest's dtype is %s", esc, h->dtype,
                       b->dtype);
    return COLIBRI_OK;
}

/* ---- open ------------------------------------------------------------------------------------------------------ */
static int read_manifest(cb_bundle *b, cb_err *err) {
    int fd;
    struct stat st;
    int rc = open_nofollow(b->root_fd, MANIFEST, &fd, &st, err);
    if (rc) return rc;
    if ((uint64_t)st.st_size > MAX_MANIFEST_BYTES) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: %lld bytes; allowed: at most %u", (long long)st.st_size,
                       MAX_MANIFEST_BYTES);
    }
    b->raw_len = (size_t)st.st_size;
    b->raw = malloc(b->raw_len + 1);
    if (!b->raw) {
        close(fd);
        return cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "manifest.json: out of memory");
    }
    int bad = read_all(fd, (unsigned char *)b->raw, b->raw_len);
    close(fd);
    if (bad) return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: cannot read the manifest");
    b->raw[b->raw_len] = 0;
    const char *end = NULL;
    b->manifest = cJSON_ParseWithLengthOpts(b->raw, b->raw_len, &end, 0);
    if (!b->manifest)
        return cb_fail(err, COLIBRI_ERR_BUNDLE,
                       "manifest.json: not valid JSON (at byte %ld); the file was changed or truncated",
                       (long)((cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() : b->raw) - b->raw));
    return COLIBRI_OK;
}

static int check_canonical(cb_bundle *b, cb_err *err) {
    cb_buf out = {0};
    int rc = cb_canonical(b->manifest, &out, b->raw, b->raw_len, NULL, err);
    if (!rc && cb_buf_put(&out, "\n", 1) != 0) rc = cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    if (!rc && (out.len != b->raw_len || memcmp(out.data, b->raw, out.len) != 0))
        rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: not in canonical form (sorted keys, 2-space indent, "
                                              "trailing newline); the file was edited after the build");
    cb_buf_free(&out);
    if (rc) return rc;
    if (!cJSON_IsObject(b->manifest))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: top level is not an object; allowed: a JSON object");
    const char *recorded = cb_json_str(b->manifest, DIGEST_KEY);
    if (!recorded) return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: missing key '%s'", DIGEST_KEY);
    rc = cb_canonical(b->manifest, &out, NULL, 0, DIGEST_KEY, err);
    if (!rc && cb_buf_put(&out, "\n", 1) != 0) rc = cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
    char hex[65] = {0};
    if (!rc) {
        cb_sha256 *h = cb_sha256_new();
        if (!h || cb_sha256_update(h, out.data, out.len) || cb_sha256_hex(h, hex))
            rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "sha256 failed");
        cb_sha256_free(h);
    }
    cb_buf_free(&out);
    if (rc) return rc;
    char esc[96];
    if (strcmp(hex, recorded) != 0)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: content sha256 %s differs from the recorded "
                       "manifest_sha256 %s; the manifest was changed after the build", hex,
                       cb_escape(recorded, esc, sizeof esc));
    return COLIBRI_OK;
}

int cb_bundle_open(cb_bundle *b, const char *dir, int verify, cb_err *err) {
    char esc[256];
    memset(b, 0, sizeof *b);
    b->root_fd = -1;
    if (!dir || !*dir) return cb_fail(err, COLIBRI_ERR_INVALID_ARG, "config.bundle_dir is NULL or empty; allowed: a bundle folder");
    b->root_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (b->root_fd < 0)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "%s is not a bundle folder (%s)", cb_escape(dir, esc, sizeof esc),
                       strerror(errno));
    int rc = read_manifest(b, err);
    if (!rc) rc = check_canonical(b, err);
    if (!rc) rc = cb_check_schema(b, err);
    if (!rc) {
        unsigned char *chunk = verify ? malloc(CHUNK) : NULL;
        if (verify && !chunk) rc = cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory");
        for (const cJSON *e = cJSON_GetObjectItemCaseSensitive(b->manifest, "files")->child; e && !rc; e = e->next)
            rc = verify_file(b, e, verify, chunk, err);
        free(chunk);
    }
    if (!rc && verify) rc = scan_unlisted(b, b->root_fd, "", 0, err);
    if (!rc) rc = read_header(b, err);
    if (rc) cb_bundle_close(b);
    return rc;
}

void cb_bundle_close(cb_bundle *b) {
    if (b->root_fd >= 0) close(b->root_fd);
    b->root_fd = -1;
    cJSON_Delete(b->manifest);
    b->manifest = NULL;
    free(b->raw);
    b->raw = NULL;
}
