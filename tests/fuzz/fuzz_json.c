/* libFuzzer target for the server's JSON reader (tools/json.c, docs/cli.md "serve"): build with
 * -DEKV_BUILD_FUZZ=ON (clang). Any crash or sanitizer report is a bug, and so is a document the
 * reader accepts that does not survive a round trip: every accepted tree is written back with the
 * writer the server answers with (sb_json_str for strings and keys), read again, and must be the
 * same tree (strings valid UTF-8 byte for byte, numbers bit for bit). */
#include "json.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Writes v as JSON text; 0 when a number is not finite (such a tree has no exact text). */
static int write_value(sbuf *b, const json_value *v) {
    switch (v->type) {
    case JSON_NULL: sb_puts(b, "null"); return 1;
    case JSON_BOOL: sb_puts(b, v->boolean ? "true" : "false"); return 1;
    case JSON_NUMBER:
        if (!isfinite(v->number)) return 0;
        if (v->is_int)
            sb_printf(b, "%lld", (long long)v->integer);
        else { /* a fraction or exponent keeps it a non-integer when read again ("-0" is not) */
            char t[40];
            snprintf(t, sizeof t, "%.17g", v->number);
            sb_puts(b, t);
            if (!strpbrk(t, ".eE")) sb_puts(b, ".0");
        }
        return 1;
    case JSON_STRING: sb_json_str(b, v->str, v->len); return 1;
    default: break;
    }
    const int obj = v->type == JSON_OBJECT;
    sb_puts(b, obj ? "{" : "[");
    for (size_t i = 0; i < v->n; i++) {
        if (i) sb_puts(b, ",");
        if (obj) {
            sb_json_str(b, v->kids[i].key, v->kids[i].key_len);
            sb_puts(b, ":");
        }
        if (!write_value(b, &v->kids[i])) return 0;
    }
    sb_puts(b, obj ? "}" : "]");
    return 1;
}

static int same(const json_value *a, const json_value *b) {
    if (a->type != b->type || a->n != b->n || a->key_len != b->key_len) return 0;
    if (a->key && (!b->key || memcmp(a->key, b->key, a->key_len))) return 0;
    switch (a->type) {
    case JSON_BOOL: return a->boolean == b->boolean;
    case JSON_NUMBER:
        return a->is_int == b->is_int &&
               (a->is_int ? a->integer == b->integer : memcmp(&a->number, &b->number, 8) == 0);
    case JSON_STRING: return a->len == b->len && !memcmp(a->str, b->str, a->len);
    default: break;
    }
    for (size_t i = 0; i < a->n; i++)
        if (!same(&a->kids[i], &b->kids[i])) return 0;
    return 1;
}

static void check_strings(const json_value *v) {
    if (v->type == JSON_STRING)
        for (size_t i = 0; i < v->len;) {
            const size_t n = json_utf8_len((const unsigned char *)v->str + i, v->len - i);
            if (!n) __builtin_trap(); /* an accepted string that is not UTF-8 */
            i += n;
        }
    for (size_t i = 0; i < v->n; i++) check_strings(&v->kids[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_value v, w;
    char err[256];
    memset(&v, 0, sizeof v);
    memset(&w, 0, sizeof w);
    if (json_parse((const char *)data, size, &v, err, sizeof err) == 0) {
        check_strings(&v);
        sbuf b = {0};
        if (write_value(&b, &v) && !b.oom) {
            if (json_parse(b.p, b.len, &w, err, sizeof err) != 0) {
                fprintf(stderr, "written text refused: %s\n%.*s\n", err, (int)b.len, b.p);
                __builtin_trap();
            }
            if (!same(&v, &w)) __builtin_trap();
        }
        sb_free(&b);
    }
    json_free(&v);
    json_free(&w);
    return 0;
}
