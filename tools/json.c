/* The server's strict JSON reader and the writer's escaping (tools/json.h). Written here, no
 * third-party code: the server parses untrusted request bodies, so every rule is checked and
 * every failure says what was wrong and where. */
#include "json.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const unsigned char *s, *p, *end;
    int depth;
    size_t values;
    char *err;
    size_t errlen;
} parser;

static int fail(parser *ps, const char *what) {
    if (ps->err && !ps->err[0])
        snprintf(ps->err, ps->errlen, "%s at byte %zu", what, (size_t)(ps->p - ps->s));
    return -1;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

size_t json_utf8_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    const unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t k;
    unsigned lo = 0x80, hi = 0xBF; /* the second byte's range (RFC 3629 table) */
    if (c >= 0xC2 && c <= 0xDF)
        k = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        k = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        k = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F; /* nothing past U+10FFFF */
    } else
        return 0;
    if (n < k || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return k;
}

static int hex4(parser *ps, unsigned *out) {
    if (ps->end - ps->p < 4) return fail(ps, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        const unsigned char c = *ps->p++;
        const int d = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
        if (d < 0) return fail(ps, "bad hex digit in \\u escape");
        v = v * 16 + (unsigned)d;
    }
    *out = v;
    return 0;
}

static void put_utf8(sbuf *b, unsigned cp) {
    char t[4];
    size_t n;
    if (cp < 0x80)
        t[0] = (char)cp, n = 1;
    else if (cp < 0x800)
        t[0] = (char)(0xC0 | cp >> 6), t[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        t[0] = (char)(0xE0 | cp >> 12), t[1] = (char)(0x80 | (cp >> 6 & 63)),
        t[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        t[0] = (char)(0xF0 | cp >> 18), t[1] = (char)(0x80 | (cp >> 12 & 63)),
        t[2] = (char)(0x80 | (cp >> 6 & 63)), t[3] = (char)(0x80 | (cp & 63)), n = 4;
    sb_put(b, t, n);
}

/* A \u escape (the backslash and 'u' read): one code point, a surrogate pair joined. */
static int unicode_escape(parser *ps, sbuf *b) {
    unsigned cp, lo = 0;
    if (hex4(ps, &cp)) return -1;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(ps, "lone low surrogate in \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u')
            return fail(ps, "high surrogate \\u escape without its low half");
        ps->p += 2;
        if (hex4(ps, &lo)) return -1;
        if (lo < 0xDC00 || lo > 0xDFFF)
            return fail(ps, "high surrogate \\u escape without its low half");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    put_utf8(b, cp);
    return 0;
}

/* A string (the opening quote read) into out/len, NUL-terminated. */
static int parse_string(parser *ps, char **out, size_t *len) {
    sbuf b = {0};
    for (;;) {
        if (ps->p >= ps->end) {
            sb_free(&b);
            return fail(ps, "unterminated string");
        }
        const unsigned char c = *ps->p;
        if (c == '"') {
            ps->p++;
            break;
        }
        int bad = 0;
        if (c < 0x20)
            bad = fail(ps, "raw control character in a string");
        else if (c == '\\') {
            ps->p++;
            const unsigned char e = ps->p < ps->end ? *ps->p++ : 0;
            const char *simple = e ? strchr("\"\\/bfnrt", e) : NULL;
            if (e == 'u')
                bad = unicode_escape(ps, &b);
            else if (simple)
                sb_put(&b, &"\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"], 1);
            else
                bad = fail(ps, "bad escape in a string");
        } else {
            const size_t k = json_utf8_len(ps->p, (size_t)(ps->end - ps->p));
            if (!k)
                bad = fail(ps, "invalid UTF-8 in a string");
            else {
                sb_put(&b, (const char *)ps->p, k);
                ps->p += k;
            }
        }
        if (bad) {
            sb_free(&b);
            return -1;
        }
    }
    sb_put(&b, "", 1); /* the terminating NUL */
    if (b.oom) {
        sb_free(&b);
        return fail(ps, "out of memory");
    }
    *out = b.p;
    *len = b.len - 1;
    return 0;
}

static int parse_number(parser *ps, json_value *v) {
    const unsigned char *p = ps->p, *start = p, *e = ps->end;
    int is_int = 1;
    if (p < e && *p == '-') p++;
    if (p < e && *p == '0')
        p++;
    else if (p < e && *p >= '1' && *p <= '9')
        while (p < e && *p >= '0' && *p <= '9') p++;
    else
        return fail(ps, "bad number");
    if (p < e && *p == '.') {
        is_int = 0;
        if (++p >= e || *p < '0' || *p > '9') return fail(ps, "bad number: no digit after '.'");
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        if (++p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || *p < '0' || *p > '9') return fail(ps, "bad number: no digit in the exponent");
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    char buf[64];
    const size_t n = (size_t)(p - start);
    if (n >= sizeof buf) { /* too long to be a value any field takes: kept as not finite */
        v->number = start[0] == '-' ? -HUGE_VAL : HUGE_VAL;
    } else {
        memcpy(buf, start, n);
        buf[n] = 0;
        v->number = strtod(buf, NULL);
        errno = 0;
        long long i = is_int ? strtoll(buf, NULL, 10) : 0;
        v->is_int = is_int && errno != ERANGE;
        v->integer = v->is_int ? (int64_t)i : 0;
    }
    v->type = JSON_NUMBER;
    ps->p = p;
    return 0;
}

static int parse_value(parser *ps, json_value *v);

static int add_kid(parser *ps, json_value *v, size_t *cap) {
    if (v->n == *cap) {
        const size_t nc = *cap ? 2 * *cap : 4;
        json_value *k = realloc(v->kids, nc * sizeof *k);
        if (!k) return fail(ps, "out of memory");
        v->kids = k;
        *cap = nc;
    }
    memset(&v->kids[v->n++], 0, sizeof *v->kids);
    return 0;
}

/* An object member's key (the opening quote read), not a repeat of an earlier one. */
static int member_key(parser *ps, json_value *v, json_value *kid) {
    char *key;
    size_t klen;
    if (parse_string(ps, &key, &klen)) return -1;
    kid->key = key;
    kid->key_len = klen;
    for (size_t i = 0; i + 1 < v->n; i++)
        if (v->kids[i].key_len == klen && !memcmp(v->kids[i].key, key, klen))
            return fail(ps, "duplicate key in an object");
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != ':') return fail(ps, "expected ':' after a key");
    ps->p++;
    return 0;
}

/* An array or object (the opening bracket read). */
static int parse_container(parser *ps, json_value *v, int object) {
    const char close = object ? '}' : ']';
    size_t cap = 0;
    v->type = object ? JSON_OBJECT : JSON_ARRAY;
    if (++ps->depth > JSON_MAX_DEPTH) return fail(ps, "nested too deep");
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        ps->depth--;
        return 0;
    }
    for (;;) {
        if (object && v->n == JSON_MAX_MEMBERS) return fail(ps, "too many members in an object");
        if (add_kid(ps, v, &cap)) return -1;
        json_value *kid = &v->kids[v->n - 1];
        skip_ws(ps);
        if (object) {
            if (ps->p >= ps->end || *ps->p != '"') return fail(ps, "expected a string key");
            ps->p++;
            if (member_key(ps, v, kid)) return -1;
        }
        if (parse_value(ps, kid)) return -1;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            ps->depth--;
            return 0;
        }
        return fail(ps, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int literal(parser *ps, const char *word) {
    const size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n))
        return fail(ps, "unexpected token");
    ps->p += n;
    return 0;
}

static int parse_value(parser *ps, json_value *v) {
    if (++ps->values > JSON_MAX_VALUES) return fail(ps, "too many values");
    skip_ws(ps);
    if (ps->p >= ps->end) return fail(ps, "unexpected end of input");
    switch (*ps->p) {
    case '{': ps->p++; return parse_container(ps, v, 1);
    case '[': ps->p++; return parse_container(ps, v, 0);
    case '"':
        ps->p++;
        v->type = JSON_STRING;
        return parse_string(ps, &v->str, &v->len);
    case 't':
        v->type = JSON_BOOL;
        v->boolean = 1;
        return literal(ps, "true");
    case 'f': v->type = JSON_BOOL; return literal(ps, "false");
    case 'n': v->type = JSON_NULL; return literal(ps, "null");
    default: return parse_number(ps, v);
    }
}

int json_parse(const char *text, size_t len, json_value *out, char *err, size_t errlen) {
    parser ps = {(const unsigned char *)text,
                 (const unsigned char *)text,
                 (const unsigned char *)text + len,
                 0,
                 0,
                 err,
                 errlen};
    memset(out, 0, sizeof *out);
    if (err && errlen) err[0] = 0;
    if (parse_value(&ps, out)) return -1;
    skip_ws(&ps);
    if (ps.p != ps.end) return fail(&ps, "trailing characters after the JSON value");
    return 0;
}

void json_free(json_value *v) {
    if (!v) return;
    for (size_t i = 0; i < v->n; i++) json_free(&v->kids[i]);
    free(v->kids);
    free(v->str);
    free((char *)v->key);
    memset(v, 0, sizeof *v);
}

const json_value *json_get(const json_value *obj, const char *key) {
    if (!obj || obj->type != JSON_OBJECT) return NULL;
    const size_t n = strlen(key);
    for (size_t i = 0; i < obj->n; i++)
        if (obj->kids[i].key_len == n && !memcmp(obj->kids[i].key, key, n)) return &obj->kids[i];
    return NULL;
}

const char *json_type_name(json_type t) {
    static const char *names[] = {"null",     "a boolean", "a number",
                                  "a string", "an array",  "an object"};
    return names[t];
}

void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

void sb_printf(sbuf *b, const char *fmt, ...) {
    char t[1024];
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(t, sizeof t, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof t)
        b->oom = 1; /* the callers format short fields only: a longer one is a bug */
    else
        sb_put(b, t, (size_t)n);
}

void sb_json_str(sbuf *b, const char *s, size_t n) {
    sb_put(b, "\"", 1);
    size_t run = 0; /* bytes copied as they are, flushed before each escape */
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            run++;
            continue;
        }
        sb_put(b, s + i - run, run);
        run = 0;
        char e[8];
        const char *named = c == '"'    ? "\\\""
                            : c == '\\' ? "\\\\"
                            : c == '\n' ? "\\n"
                            : c == '\r' ? "\\r"
                            : c == '\t' ? "\\t"
                                        : NULL;
        if (!named) snprintf(e, sizeof e, "\\u%04x", c);
        sb_puts(b, named ? named : e);
    }
    sb_put(b, s + n - run, run);
    sb_put(b, "\"", 1);
}

void sb_free(sbuf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}
