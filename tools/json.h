/* A small strict JSON reader and writer for the CLI's server (tools/serve*.c; docs/cli.md,
 * "serve"). The reader takes RFC 8259 text only: no trailing commas, comments, NaN, leading
 * zeros or duplicate keys; strings must be valid UTF-8 (no overlong forms, surrogates or code
 * points past U+10FFFF, no lone \u surrogates) and raw control characters are refused. Depth,
 * values and object members are limited, so a hostile body costs bounded time and memory. */
#ifndef EKV_TOOLS_JSON_H
#define EKV_TOOLS_JSON_H
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json_value json_value;
struct json_value {
    json_type type;
    const char *key; /* an object member's key (NUL-terminated, key_len bytes), else NULL */
    size_t key_len;
    int boolean;
    double number;
    int is_int; /* a number written as an integer that fits int64 (integer set) */
    int64_t integer;
    char *str; /* a string's bytes (NUL-terminated; may hold NUL: use len) */
    size_t len;
    json_value *kids; /* array elements or object members, n of them */
    size_t n;
};

enum { JSON_MAX_DEPTH = 32, JSON_MAX_VALUES = 65536, JSON_MAX_MEMBERS = 256 };

/* Parses text[0..len) into *out. Returns 0, or -1 with a message in err[errlen] that says what
 * and at which byte. The tree is freed with json_free (also after a failure: safe). */
int json_parse(const char *text, size_t len, json_value *out, char *err, size_t errlen);
void json_free(json_value *v);
/* The member of an object by key, or NULL (NULL for a non-object too). */
const json_value *json_get(const json_value *obj, const char *key);
const char *json_type_name(json_type t);
/* Length of the valid UTF-8 sequence at s[0..n), or 0 if the bytes there are not one. */
size_t json_utf8_len(const unsigned char *s, size_t n);

/* A growing output buffer: appends never fail visibly; oom is set instead, and the text is
 * then not to be sent. */
typedef struct {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;
void sb_put(sbuf *b, const char *s, size_t n);
void sb_puts(sbuf *b, const char *s);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s[0..n) (valid UTF-8) as a quoted JSON string: '"', '\\' and control characters escaped. */
void sb_json_str(sbuf *b, const char *s, size_t n);
void sb_free(sbuf *b);
#endif
