/* util.c: messages, a growable buffer, sha256 through OpenSSL's libcrypto (EVP). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "colibri.h"
#include "internal.h"

int cb_fail(cb_err *err, int status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->text, sizeof err->text, fmt, ap);
        va_end(ap);
    }
    return status;
}

const char *cb_escape(const char *text, char *out, size_t out_len) {
    size_t o = 0;
    if (!out_len) return "";
    if (!text) text = "(null)";
    for (const unsigned char *p = (const unsigned char *)text; *p && o + 5 < out_len; p++) {
        if (*p < 0x20 || *p == 0x7F || *p == '\\' || *p == '"')
            o += (size_t)snprintf(out + o, out_len - o, "\\x%02x", *p);
        else
            out[o++] = (char)*p;
    }
    out[o] = 0;
    return out;
}

int cb_buf_put(cb_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
    return 0;
}

void cb_buf_free(cb_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

struct cb_sha256 {
    EVP_MD_CTX *md;
};

cb_sha256 *cb_sha256_new(void) {
    cb_sha256 *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->md = EVP_MD_CTX_new();
    if (!h->md || EVP_DigestInit_ex(h->md, EVP_sha256(), NULL) != 1) {
        cb_sha256_free(h);
        return NULL;
    }
    return h;
}

int cb_sha256_update(cb_sha256 *h, const void *data, size_t n) {
    return EVP_DigestUpdate(h->md, data, n) == 1 ? 0 : -1;
}

int cb_sha256_hex(cb_sha256 *h, char hex[65]) {
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned n = 0;
    if (EVP_DigestFinal_ex(h->md, d, &n) != 1 || n != 32) return -1;
    for (unsigned i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
    return 0;
}

void cb_sha256_free(cb_sha256 *h) {
    if (!h) return;
    EVP_MD_CTX_free(h->md);
    free(h);
}

int cb_json_int(const cJSON *obj, const char *key, long long *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || (v->type & 0xFF) != cJSON_Number || (v->type & CB_FLOAT_FLAG)) return -1;
    *out = (long long)v->valuedouble;
    return 0;
}

const char *cb_json_str(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}
