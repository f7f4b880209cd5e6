/* bundle_manifest.c: the manifest's schema, with the rules of the Python bundle reader (sdk/bundle/reader.py and
 * sdk/bundle/manifest.py): every required key with its JSON type, no unknown key; paths relative, normalised,
 * inside the bundle, without control characters; files sorted and unique; kernel entries (symbols, images listed
 * as files, resources), the weights header record, the `shapes` entries (each a listed self-test, smallest first,
 * the last the top-level shape) and what only this runtime needs: the launch plan, buffers and io_buffers.
 * The checks of the files themselves (open without following links, sizes, sha256, the weights header, NaN/Inf)
 * are in bundle.c, which calls cb_check_schema once the manifest is parsed and found canonical. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "internal.h"

enum { T_INT, T_NUM, T_STR, T_LIST, T_DICT };
static const char *type_names[] = {"int", "int or float", "str", "list", "dict"};

static int is_type(const cJSON *v, int t) {
    if (!v) return 0;
    switch (t) {
        case T_INT: return (v->type & 0xFF) == cJSON_Number && !(v->type & CB_FLOAT_FLAG);
        case T_NUM: return (v->type & 0xFF) == cJSON_Number;
        case T_STR: return cJSON_IsString(v);
        case T_LIST: return cJSON_IsArray(v);
        case T_DICT: return cJSON_IsObject(v);
    }
    return 0;
}

static int expect(const cJSON *obj, const char *key, int t, const char *where, cb_err *err) {
    const cJSON *v = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    if (is_type(v, t)) return COLIBRI_OK;
    char *shown = v ? cJSON_PrintUnformatted(v) : NULL;
    char esc[160];
    int rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: %s%s = %s; allowed: %s", where, key,
                     shown ? cb_escape(shown, esc, sizeof esc) : "None", type_names[t]);
    free(shown);
    return rc;
}

static const char *REQUIRED[] = {"schema_version", "sdk_version", "arch", "compute_capability", "nvrtc_version",
                                 "min_driver", "dtype", "shape", "aggregation", "profile", "weights", "kernels",
                                 "selftest", "files", DIGEST_KEY};
static const int REQUIRED_T[] = {T_INT, T_STR, T_STR, T_LIST, T_STR, T_INT, T_STR, T_DICT, T_STR, T_DICT, T_DICT,
                                 T_LIST, T_DICT, T_LIST, T_STR};
static const char *OPTIONAL[] = {"launch", "buffers", "io_buffers", "shapes"};
static const int OPTIONAL_T[] = {T_LIST, T_DICT, T_DICT, T_LIST};
const char *const cb_header_fields[CB_HEADER_FIELDS] = {"num_layers", "num_experts", "top_k", "hidden_size",
                                                        "intermediate_size", "dtype", "routing", "composition"};
static const char *RESOURCE_KEYS[] = {"registers", "shared_bytes", "stack_bytes", "spill_store_bytes",
                                      "spill_load_bytes"};
#define N(a) (sizeof(a) / sizeof((a)[0]))

static int in_list(const char *s, const char **list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, list[i]) == 0) return 1;
    return 0;
}

static int check_files(const cJSON *files, cb_err *err) {
    char where[64];
    int i = 0;
    const char *prev = NULL;
    for (const cJSON *e = files->child; e; e = e->next, i++) {
        snprintf(where, sizeof where, "files[%d]", i);
        if (!cJSON_IsObject(e))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: %s is not an object; allowed: dict", where);
        snprintf(where, sizeof where, "files[%d].", i);
        int rc = expect(e, "path", T_STR, where, err);
        if (!rc) rc = expect(e, "sha256", T_STR, where, err);
        if (!rc) rc = expect(e, "size", T_INT, where, err);
        if (rc) return rc;
        const char *path = cb_json_str(e, "path");
        snprintf(where, sizeof where, "files[%d].path", i);
        if ((rc = cb_check_relative(path, where, err))) return rc;
        long long size;
        cb_json_int(e, "size", &size);
        if (size < 0)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: files[%d].size = %lld; allowed: >= 0", i, size);
        if (prev && strcmp(prev, path) >= 0)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: files must be sorted by path without duplicates");
        if (strcmp(path, MANIFEST) == 0)
            return cb_fail(err, COLIBRI_ERR_BUNDLE,
                           "manifest.json: files lists manifest.json; it covers every file except the manifest itself");
        prev = path;
    }
    return COLIBRI_OK;
}

const cJSON *cb_listed(const cJSON *files, const char *path) {
    for (const cJSON *e = files->child; e; e = e->next)
        if (strcmp(cb_json_str(e, "path"), path) == 0) return e;
    return NULL;
}

static int check_kernels(const cJSON *kernels, const cJSON *files, cb_err *err) {
    char where[96], esc[256];
    int i = 0;
    static const char *keys[] = {"name", "source", "symbols", "cubin", "ptx", "defines", "resources"};
    static const int types[] = {T_STR, T_STR, T_LIST, T_STR, T_STR, T_DICT, T_DICT};
    for (const cJSON *k = kernels->child; k; k = k->next, i++) {
        if (!cJSON_IsObject(k))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: kernels[%d] is not an object; allowed: dict", i);
        snprintf(where, sizeof where, "kernels[%d].", i);
        for (size_t j = 0; j < N(keys); j++) {
            int rc = expect(k, keys[j], types[j], where, err);
            if (rc) return rc;
        }
        for (const char **kind = (const char *[]){"cubin", "ptx", NULL}; *kind; kind++) {
            const char *p = cb_json_str(k, *kind);
            snprintf(where, sizeof where, "kernels[%d].%s", i, *kind);
            int rc = cb_check_relative(p, where, err);
            if (rc) return rc;
            if (!cb_listed(files, p))
                return cb_fail(err, COLIBRI_ERR_BUNDLE,
                               "manifest.json: kernels[%d].%s = \"%s\" is not a listed file; allowed: a path in files",
                               i, *kind, cb_escape(p, esc, sizeof esc));
        }
        for (const cJSON *s = cJSON_GetObjectItemCaseSensitive(k, "symbols")->child; s; s = s->next)
            if (!cJSON_IsString(s))
                return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: kernels[%d].symbols holds a non-string", i);
        for (const cJSON *r = cJSON_GetObjectItemCaseSensitive(k, "resources")->child; r; r = r->next) {
            snprintf(where, sizeof where, "kernels[%d].resources.", i);
            if (!cJSON_IsObject(r))
                return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: %s%s is not an object; allowed: dict", where,
                               cb_escape(r->string, esc, 64));
            snprintf(where, sizeof where, "kernels[%d].resources.%s.", i, cb_escape(r->string, esc, 64));
            for (size_t j = 0; j < N(RESOURCE_KEYS); j++) {
                int rc = expect(r, RESOURCE_KEYS[j], T_INT, where, err);
                if (rc) return rc;
            }
        }
    }
    return COLIBRI_OK;
}

/* `shapes` (docs/build.md, "Several shapes"): each entry an object with integer batch and tokens in range, a kernels
 * list (checked as the top-level one: relative, listed images) and a selftest with relative paths; the entries
 * strictly increasing in (batch*tokens, batch, tokens) and the last one the largest in batch and in tokens, as
 * colibri_sdk.bundle.manifest._check_shapes. That the last equals the top-level keys is cb_check_largest, run after
 * the launch plans are read (load.c), so a fault in a top-level plan is named by its own rule first. */
static void shape_dims(const cJSON *e, long long *batch, long long *tokens);

/* Strictly increasing in (batch*tokens, batch, tokens); the last the largest in both (the Python reader's words). */
static int check_shape_order(const cJSON *shapes, cb_err *err) {
    long long pb = 0, pt = 0, lb, lt;
    int sorted = 1, i = 0;
    const int n = cJSON_GetArraySize(shapes);
    shape_dims(cJSON_GetArrayItem(shapes, n - 1), &lb, &lt);
    for (const cJSON *e = shapes->child; e; e = e->next, i++) {
        long long b, t;
        shape_dims(e, &b, &t);
        if (i && !(b * t > pb * pt || (b * t == pb * pt && (b > pb || (b == pb && t > pt))))) sorted = 0;
        pb = b;
        pt = t;
    }
    if (!sorted) {
        char got[64 * 32] = "";
        size_t len = 0;
        i = 0;
        for (const cJSON *e = shapes->child; e && len < sizeof got; e = e->next, i++) {
            long long b, t;
            shape_dims(e, &b, &t);
            len += (size_t)snprintf(got + len, sizeof got - len, "%s(%lld, %lld)", i ? ", " : "", b, t);
        }
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes must be sorted smallest first (by batch*tokens, "
                       "batch, tokens) without duplicates; got [%s]", got);
    }
    i = 0;
    for (const cJSON *e = shapes->child; e && e->next; e = e->next, i++) {
        long long b, t;
        shape_dims(e, &b, &t);
        if (b > lb || t > lt)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes[%d] is batch %lld x tokens %lld, beyond the "
                           "largest (last) shape batch %lld x tokens %lld; allowed: the last shape has the largest "
                           "batch and the largest tokens", i, b, t, lb, lt);
    }
    return COLIBRI_OK;
}

#define MAX_SHAPES 64 /* colibri_sdk.bundle.manifest.MAX_SHAPES: shape.batch and shape.tokens of 8 values each */
static int check_shapes(const cJSON *shapes, const cJSON *files, cb_err *err) {
    char where[64];
    int i = 0, rc;
    static const char *keys[] = {"batch", "tokens", "kernels", "launch", "buffers", "io_buffers", "selftest"};
    static const int types[] = {T_INT, T_INT, T_LIST, T_LIST, T_DICT, T_DICT, T_DICT};
    if (!shapes) return COLIBRI_OK;
    const int count = cJSON_GetArraySize(shapes);
    if (count < 1)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes is empty; allowed: 1..%d entries", MAX_SHAPES);
    if (count > MAX_SHAPES)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes has %d entries; allowed: 1..%d", count,
                       MAX_SHAPES);
    for (const cJSON *e = shapes->child; e; e = e->next, i++) {
        if (!cJSON_IsObject(e))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes[%d] is not an object; allowed: dict", i);
        snprintf(where, sizeof where, "shapes[%d].", i);
        for (size_t j = 0; j < N(keys); j++)
            if ((rc = expect(e, keys[j], types[j], where, err))) return rc;
        for (const cJSON *c = e->child; c; c = c->next)
            if (!in_list(c->string, keys, N(keys)))
                return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes[%d]: unknown key '%s'", i,
                               cb_escape(c->string, where, sizeof where));
        long long batch, tokens;
        cb_json_int(e, "batch", &batch);
        cb_json_int(e, "tokens", &tokens);
        if (batch < 1 || tokens < 1 || batch > MAX_TOKENS || tokens > MAX_TOKENS || batch * tokens > MAX_TOKENS)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes[%d] batch %lld x tokens %lld; allowed: "
                           "1..%d each, product at most %d", i, batch, tokens, MAX_TOKENS, MAX_TOKENS);
        if ((rc = check_kernels(cJSON_GetObjectItemCaseSensitive(e, "kernels"), files, err))) return rc;
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(e, "selftest");
        snprintf(where, sizeof where, "shapes[%d].selftest.", i);
        if ((rc = expect(st, "input", T_STR, where, err)) || (rc = expect(st, "output", T_STR, where, err))) return rc;
        if ((rc = cb_check_relative(cb_json_str(st, "input"), "shapes[].selftest.input", err))) return rc;
        if ((rc = cb_check_relative(cb_json_str(st, "output"), "shapes[].selftest.output", err))) return rc;
    }
    return check_shape_order(shapes, err);
}

/* The sizes (batch, tokens) of entry i of `shapes` (already checked to be integers). */
static void shape_dims(const cJSON *e, long long *batch, long long *tokens) {
    cb_json_int(e, "batch", batch);
    cb_json_int(e, "tokens", tokens);
}

int cb_check_largest(const cb_bundle *b, cb_err *err) {
    const cJSON *m = b->manifest, *shapes = cJSON_GetObjectItemCaseSensitive(m, "shapes");
    if (!shapes) return COLIBRI_OK;
    const int n = cJSON_GetArraySize(shapes);
    const cJSON *last = cJSON_GetArrayItem(shapes, n - 1), *shape = cJSON_GetObjectItemCaseSensitive(m, "shape");
    static const char *keys[] = {"batch", "tokens", "kernels", "launch", "buffers", "io_buffers", "selftest"};
    for (size_t i = 0; i < N(keys); i++) {
        const int dim = i < 2;
        const cJSON *top = cJSON_GetObjectItemCaseSensitive(dim ? shape : m, keys[i]);
        if (!top || !cJSON_Compare(cJSON_GetObjectItemCaseSensitive(last, keys[i]), top, 1))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shapes[%d].%s differs from the top-level %s%s; "
                           "allowed: the last (largest) shape is the top-level one", n - 1, keys[i],
                           dim ? "shape." : "", keys[i]);
    }
    return COLIBRI_OK;
}

int cb_check_schema(cb_bundle *b, cb_err *err) {
    const cJSON *m = b->manifest;
    char esc[256];
    if (!cJSON_IsObject(m))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: top level is not an object; allowed: a JSON object");
    long long version = -1;
    if (cb_json_int(m, "schema_version", &version) || version != 1)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: schema_version = %lld; this runtime reads schema_version 1",
                       version);
    for (size_t i = 0; i < N(REQUIRED); i++) {
        if (!cJSON_GetObjectItemCaseSensitive(m, REQUIRED[i]))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: missing key '%s'", REQUIRED[i]);
        int rc = expect(m, REQUIRED[i], REQUIRED_T[i], "", err);
        if (rc) return rc;
    }
    for (size_t i = 0; i < N(OPTIONAL); i++)
        if (cJSON_GetObjectItemCaseSensitive(m, OPTIONAL[i])) {
            int rc = expect(m, OPTIONAL[i], OPTIONAL_T[i], "", err);
            if (rc) return rc;
        }
    for (const cJSON *c = m->child; c; c = c->next)
        if (!in_list(c->string, REQUIRED, N(REQUIRED)) && !in_list(c->string, OPTIONAL, N(OPTIONAL)))
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: unknown key '%s'", cb_escape(c->string, esc, 128));
    const char *dtype = cb_json_str(m, "dtype"), *agg = cb_json_str(m, "aggregation");
    if (strcmp(dtype, "fp16") && strcmp(dtype, "fp32"))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: dtype = '%s'; allowed: ('fp16', 'fp32')",
                       cb_escape(dtype, esc, 64));
    if (strcmp(agg, "ordered") && strcmp(agg, "atomic"))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: aggregation = '%s'; allowed: ('ordered', 'atomic')",
                       cb_escape(agg, esc, 64));
    const cJSON *cc = cJSON_GetObjectItemCaseSensitive(m, "compute_capability");
    if (cJSON_GetArraySize(cc) != 2 || !is_type(cc->child, T_INT) || !is_type(cc->child->next, T_INT))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: compute_capability; allowed: [major, minor] integers");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(m, "shape");
    long long dims[2];
    const char *dim_names[] = {"batch", "tokens"};
    for (int i = 0; i < 2; i++) {
        int rc = expect(shape, dim_names[i], T_INT, "shape.", err);
        if (rc) return rc;
        cb_json_int(shape, dim_names[i], &dims[i]);
        if (dims[i] < 1 || dims[i] > MAX_TOKENS)
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shape.%s = %lld; allowed: 1..%d", dim_names[i],
                           dims[i], MAX_TOKENS);
    }
    if (dims[0] * dims[1] > MAX_TOKENS)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: shape batch*tokens = %lld; allowed: at most %d",
                       dims[0] * dims[1], MAX_TOKENS);
    const cJSON *w = cJSON_GetObjectItemCaseSensitive(m, "weights");
    int rc = expect(w, "file", T_STR, "weights.", err);
    if (!rc) rc = expect(w, "header", T_DICT, "weights.", err);
    if (!rc) rc = cb_check_relative(cb_json_str(w, "file"), "weights.file", err);
    if (rc) return rc;
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(w, "header");
    for (size_t i = 0; i < CB_HEADER_FIELDS; i++)
        if ((rc = expect(h, cb_header_fields[i], T_INT, "weights.header.", err))) return rc;
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(m, "files");
    if ((rc = check_files(files, err))) return rc;
    if (!cb_listed(files, cb_json_str(w, "file")))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: weights.file = \"%s\" is not a listed file",
                       cb_escape(cb_json_str(w, "file"), esc, sizeof esc));
    if ((rc = check_kernels(cJSON_GetObjectItemCaseSensitive(m, "kernels"), files, err))) return rc;
    if ((rc = check_shapes(cJSON_GetObjectItemCaseSensitive(m, "shapes"), files, err))) return rc;
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(m, "selftest");
    static const char *st_keys[] = {"input", "output", "rtol", "atol"};
    static const int st_types[] = {T_STR, T_STR, T_NUM, T_NUM};
    for (size_t i = 0; i < N(st_keys); i++)
        if ((rc = expect(st, st_keys[i], st_types[i], "selftest.", err))) return rc;
    if ((rc = cb_check_relative(cb_json_str(st, "input"), "selftest.input", err))) return rc;
    if ((rc = cb_check_relative(cb_json_str(st, "output"), "selftest.output", err))) return rc;

    b->batch = (int)dims[0];
    b->tokens = (int)dims[1];
    b->cc_major = (int)cc->child->valuedouble;
    b->cc_minor = (int)cc->child->next->valuedouble;
    long long md;
    cb_json_int(m, "min_driver", &md);
    b->min_driver = (int)md;
    snprintf(b->arch, sizeof b->arch, "%s", cb_json_str(m, "arch"));
    snprintf(b->dtype, sizeof b->dtype, "%s", dtype);
    snprintf(b->nvrtc_version, sizeof b->nvrtc_version, "%s", cb_json_str(m, "nvrtc_version"));
    b->weights_file = cb_json_str(w, "file");
    return COLIBRI_OK;
}
