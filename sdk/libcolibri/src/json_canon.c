/* json_canon.c: the canonical JSON of a manifest, byte for byte as the Python bundle reader writes it:
 * json.dumps(data, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) (sdk/bundle/reader.py,
 * canonical_json). Floats are printed as Python's repr: the shortest digits that read back to the same double,
 * fixed notation for decimal exponents -4..15, else d.ddde+XX (Python's float_repr_style "short"). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "internal.h"

#define MAX_DEPTH 64

static int put(cb_buf *out, const char *s, size_t n, cb_err *err) {
    if (cb_buf_put(out, s, n) != 0) return cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory printing the manifest");
    return COLIBRI_OK;
}

static int put_indent(cb_buf *out, int depth, cb_err *err) {
    static const char spaces[] = "                                                                ";
    int n = 2 * depth;
    while (n > 0) {
        int k = n < 64 ? n : 64;
        if (put(out, spaces, (size_t)k, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
        n -= k;
    }
    return COLIBRI_OK;
}

/* Decode one UTF-8 sequence; returns its length or 0 when invalid (overlong, surrogate, > U+10FFFF). */
static int utf8_decode(const unsigned char *s, unsigned *cp) {
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    int n = (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (!n) return 0;
    unsigned v = s[0] & (0x7F >> n);
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    static const unsigned min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return n;
}

static int put_string(cb_buf *out, const char *s, cb_err *err) {
    char tmp[16];
    if (put(out, "\"", 1, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned cp;
        int n = utf8_decode(p, &cp);
        if (!n) return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: a string is not valid UTF-8");
        p += n;
        const char *esc = NULL;
        switch (cp) {
            case '"': esc = "\\\""; break;
            case '\\': esc = "\\\\"; break;
            case '\n': esc = "\\n"; break;
            case '\r': esc = "\\r"; break;
            case '\t': esc = "\\t"; break;
            case '\b': esc = "\\b"; break;
            case '\f': esc = "\\f"; break;
            default: break;
        }
        if (esc) {
            if (put(out, esc, strlen(esc), err)) return COLIBRI_ERR_OUT_OF_MEMORY;
        } else if (cp >= 0x20 && cp < 0x7F) {
            char c = (char)cp;
            if (put(out, &c, 1, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
        } else if (cp < 0x10000) {
            snprintf(tmp, sizeof tmp, "\\u%04x", cp);
            if (put(out, tmp, 6, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
        } else {
            unsigned v = cp - 0x10000;
            snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
            if (put(out, tmp, 12, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
        }
    }
    return put(out, "\"", 1, err);
}

/* Python's repr(float) for a finite double. */
static void float_repr(double v, char *out, size_t out_len) {
    if (v == 0.0) {
        snprintf(out, out_len, "%s", signbit(v) ? "-0.0" : "0.0");
        return;
    }
    char buf[48];
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, v);
        if (strtod(buf, NULL) == v) break;
    }
    /* buf: [-]d[.ddd]e[+-]XX */
    const char *s = buf;
    int neg = *s == '-';
    if (neg) s++;
    char digits[24];
    int nd = 0;
    for (; *s && *s != 'e'; s++)
        if (*s >= '0' && *s <= '9' && nd < 23) digits[nd++] = *s;
    digits[nd] = 0;
    int exp10 = atoi(s + 1);
    while (nd > 1 && digits[nd - 1] == '0') digits[--nd] = 0;
    char *o = out;
    size_t left = out_len;
#define EMIT(...)                                                   \
    do {                                                            \
        int w_ = snprintf(o, left, __VA_ARGS__);                    \
        if (w_ < 0 || (size_t)w_ >= left) return;                   \
        o += w_;                                                    \
        left -= (size_t)w_;                                         \
    } while (0)
    if (neg) EMIT("-");
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 >= 0) {
            for (int i = 0; i <= exp10; i++) EMIT("%c", i < nd ? digits[i] : '0');
            EMIT(".");
            if (nd > exp10 + 1)
                EMIT("%s", digits + exp10 + 1);
            else
                EMIT("0");
        } else {
            EMIT("0.");
            for (int i = 0; i < -exp10 - 1; i++) EMIT("0");
            EMIT("%s", digits);
        }
    } else {
        EMIT("%c", digits[0]);
        if (nd > 1) EMIT(".%s", digits + 1);
        EMIT("e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
#undef EMIT
}

static int put_number(cJSON *item, cb_buf *out, const char *raw, size_t raw_len, cb_err *err) {
    double v = item->valuedouble;
    if (!isfinite(v))
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: a number is out of range (NaN or Infinity); "
                                                "allowed: finite JSON numbers");
    if (raw) {
        int is_float = 0;
        for (size_t i = out->len; i < raw_len; i++) {
            char c = raw[i];
            if (c == '.' || c == 'e' || c == 'E') is_float = 1;
            else if (!(c == '-' || c == '+' || (c >= '0' && c <= '9'))) break;
        }
        if (is_float) item->type |= CB_FLOAT_FLAG;
    }
    char text[64];
    if (item->type & CB_FLOAT_FLAG) {
        float_repr(v, text, sizeof text);
    } else {
        if (v != floor(v) || fabs(v) > 9007199254740992.0)
            return cb_fail(err, COLIBRI_ERR_BUNDLE,
                           "manifest.json: integer %.17g is not exact in 53 bits; allowed: |n| <= 2^53", v);
        snprintf(text, sizeof text, "%lld", (long long)v);
    }
    return put(out, text, strlen(text), err);
}

static int by_key(const void *a, const void *b) {
    const cJSON *x = *(const cJSON *const *)a, *y = *(const cJSON *const *)b;
    return strcmp(x->string, y->string);
}

static int canon(cJSON *item, int depth, cb_buf *out, const char *raw, size_t raw_len, const char *skip_key,
                 cb_err *err) {
    char esc[96];
    if (depth > MAX_DEPTH)
        return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: nested deeper than %d levels", MAX_DEPTH);
    switch (item->type & 0xFF) {
        case cJSON_NULL: return put(out, "null", 4, err);
        case cJSON_True: return put(out, "true", 4, err);
        case cJSON_False: return put(out, "false", 5, err);
        case cJSON_Number: return put_number(item, out, raw, raw_len, err);
        case cJSON_String: return put_string(out, item->valuestring, err);
        case cJSON_Array: {
            if (!item->child) return put(out, "[]", 2, err);
            if (put(out, "[\n", 2, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
            for (cJSON *c = item->child; c; c = c->next) {
                int rc = put_indent(out, depth + 1, err);
                if (!rc) rc = canon(c, depth + 1, out, raw, raw_len, NULL, err);
                if (!rc && c->next) rc = put(out, ",\n", 2, err);
                if (rc) return rc;
            }
            if (put(out, "\n", 1, err) || put_indent(out, depth, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
            return put(out, "]", 1, err);
        }
        case cJSON_Object: {
            size_t n = 0;
            for (cJSON *c = item->child; c; c = c->next)
                if (!(skip_key && strcmp(c->string, skip_key) == 0)) n++;
            if (!n) return put(out, "{}", 2, err);
            cJSON **kids = malloc(n * sizeof *kids);
            if (!kids) return cb_fail(err, COLIBRI_ERR_OUT_OF_MEMORY, "out of memory printing the manifest");
            size_t k = 0;
            for (cJSON *c = item->child; c; c = c->next)
                if (!(skip_key && strcmp(c->string, skip_key) == 0)) kids[k++] = c;
            qsort(kids, n, sizeof *kids, by_key);
            int rc = put(out, "{\n", 2, err);
            for (size_t i = 0; i < n && !rc; i++) {
                if (i && strcmp(kids[i - 1]->string, kids[i]->string) == 0) {
                    rc = cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: duplicate key \"%s\"; allowed: each key once",
                                 cb_escape(kids[i]->string, esc, sizeof esc));
                    break;
                }
                rc = put_indent(out, depth + 1, err);
                if (!rc) rc = put_string(out, kids[i]->string, err);
                if (!rc) rc = put(out, ": ", 2, err);
                if (!rc) rc = canon(kids[i], depth + 1, out, raw, raw_len, NULL, err);
                if (!rc && i + 1 < n) rc = put(out, ",\n", 2, err);
            }
            free(kids);
            if (rc) return rc;
            if (put(out, "\n", 1, err) || put_indent(out, depth, err)) return COLIBRI_ERR_OUT_OF_MEMORY;
            return put(out, "}", 1, err);
        }
        default:
            return cb_fail(err, COLIBRI_ERR_BUNDLE, "manifest.json: an unknown JSON value type");
    }
}

int cb_canonical(cJSON *item, cb_buf *out, const char *raw, size_t raw_len, const char *skip_key, cb_err *err) {
    return canon(item, 0, out, raw, raw_len, skip_key, err);
}
