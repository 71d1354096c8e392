/*
 * safetensors reader (see entmaxkv.h). Untrusted input: every length, offset and nesting
 * level is checked before it is used; nothing is read outside the buffer.
 */
#include "../core/internal.h"
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

enum { MAX_DEPTH = 32, MAX_DIMS = 8 };
static const int64_t MAX_HEADER = (int64_t)100 << 20;

struct ekv_safetensors {
    unsigned char *buf; /* the whole file */
    int64_t len;
    int64_t ntensors;
    ekv_tensor_info *t;
    char *strings; /* names, dtype names, metadata keys and values, NUL-terminated */
    int64_t nmeta;
    const char **meta; /* [2*nmeta]: key, value, key, value, ... (pointers into strings) */
};

/* ---- a small strict JSON reader over the header ---- */
typedef struct {
    const char *s, *end, *start;
    char err[200];
} jp;

/* Keeps the first error (the innermost, most precise one). */
static int jfail(jp *p, const char *msg) {
    if (!p->err[0])
        snprintf(p->err, sizeof p->err, "%s at header byte %lld", msg,
                 (long long)(p->s - p->start));
    return -1;
}

static void ws(jp *p) {
    while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r'))
        p->s++;
}

/* Reads a JSON string into out (capacity cap, NUL-terminated). Decodes escapes, \u to UTF-8. */
static int jstring(jp *p, char *out, size_t cap, size_t *outlen) {
    ws(p);
    if (p->s >= p->end || *p->s != '"') return jfail(p, "expected a string");
    p->s++;
    size_t n = 0;
    while (p->s < p->end && *p->s != '"') {
        unsigned c = (unsigned char)*p->s++;
        if (c < 0x20) return jfail(p, "control character in a string");
        if (c == '\\') {
            if (p->s >= p->end) return jfail(p, "truncated escape");
            char e = *p->s++;
            unsigned cp;
            switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u': {
                if (p->end - p->s < 4) return jfail(p, "truncated \\u escape");
                cp = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *p->s++;
                    cp <<= 4;
                    if (h >= '0' && h <= '9')
                        cp |= (unsigned)(h - '0');
                    else if (h >= 'a' && h <= 'f')
                        cp |= (unsigned)(h - 'a' + 10);
                    else if (h >= 'A' && h <= 'F')
                        cp |= (unsigned)(h - 'A' + 10);
                    else
                        return jfail(p, "bad \\u escape");
                }
                break;
            }
            default: return jfail(p, "bad escape");
            }
            /* encode as UTF-8 (surrogates are kept as-is, 3 bytes: names only need to match) */
            unsigned char u[3];
            size_t k = 0;
            if (cp < 0x80)
                u[k++] = (unsigned char)cp;
            else if (cp < 0x800) {
                u[k++] = (unsigned char)(0xC0 | (cp >> 6));
                u[k++] = (unsigned char)(0x80 | (cp & 0x3F));
            } else {
                u[k++] = (unsigned char)(0xE0 | (cp >> 12));
                u[k++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                u[k++] = (unsigned char)(0x80 | (cp & 0x3F));
            }
            for (size_t i = 0; i < k; i++) {
                if (out && n + 1 < cap) out[n] = (char)u[i];
                n++;
            }
        } else {
            if (out && n + 1 < cap) out[n] = (char)c;
            n++;
        }
    }
    if (p->s >= p->end) return jfail(p, "unterminated string");
    p->s++;
    if (out) {
        if (n + 1 > cap) return jfail(p, "string too long");
        out[n] = 0;
    }
    if (outlen) *outlen = n;
    return 0;
}

/* A non-negative integer that fits int64 (shapes and offsets). */
static int jint(jp *p, int64_t *v) {
    ws(p);
    if (p->s >= p->end || *p->s < '0' || *p->s > '9')
        return jfail(p, "expected a non-negative integer");
    int64_t x = 0;
    if (*p->s == '0' && p->s + 1 < p->end && p->s[1] >= '0' && p->s[1] <= '9')
        return jfail(p, "leading zero");
    while (p->s < p->end && *p->s >= '0' && *p->s <= '9') {
        if (x > (INT64_MAX - 9) / 10) return jfail(p, "integer overflows int64");
        x = x * 10 + (*p->s++ - '0');
    }
    if (p->s < p->end && (*p->s == '.' || *p->s == 'e' || *p->s == 'E'))
        return jfail(p, "expected an integer");
    *v = x;
    return 0;
}

static int jskip(jp *p, int depth);

static int jexpect(jp *p, char c, const char *what) {
    ws(p);
    if (p->s >= p->end || *p->s != c) return jfail(p, what);
    p->s++;
    return 0;
}

/* Skips any JSON value (for __metadata__ and unknown fields). */
static int jskip(jp *p, int depth) {
    if (depth > MAX_DEPTH) return jfail(p, "JSON nested too deeply");
    ws(p);
    if (p->s >= p->end) return jfail(p, "truncated JSON");
    char c = *p->s;
    if (c == '"') return jstring(p, NULL, 0, NULL);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        p->s++;
        ws(p);
        if (p->s < p->end && *p->s == close) {
            p->s++;
            return 0;
        }
        for (;;) {
            if (c == '{') {
                if (jstring(p, NULL, 0, NULL) || jexpect(p, ':', "expected ':'")) return -1;
            }
            if (jskip(p, depth + 1)) return -1;
            ws(p);
            if (p->s < p->end && *p->s == ',') {
                p->s++;
                continue;
            }
            return jexpect(p, close, "expected ',' or a closing bracket");
        }
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        const char *st = p->s;
        if (*p->s == '-') p->s++;
        while (p->s < p->end && ((*p->s >= '0' && *p->s <= '9') || *p->s == '.' || *p->s == 'e' ||
                                 *p->s == 'E' || *p->s == '+' || *p->s == '-'))
            p->s++;
        return p->s > st ? 0 : jfail(p, "bad number");
    }
    static const char *lits[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(lits[i]);
        if ((size_t)(p->end - p->s) >= n && !memcmp(p->s, lits[i], n)) {
            p->s += n;
            return 0;
        }
    }
    return jfail(p, "unexpected character");
}

static int dtype_info(const char *name, int64_t *size, int32_t *edt) {
    static const struct {
        const char *n;
        int64_t sz;
        int32_t dt;
    } t[] = {{"F64", 8, -1},
             {"F32", 4, EKV_DTYPE_F32},
             {"F16", 2, EKV_DTYPE_F16},
             {"BF16", 2, EKV_DTYPE_BF16},
             {"I64", 8, -1},
             {"I32", 4, -1},
             {"I16", 2, -1},
             {"I8", 1, -1},
             {"U64", 8, -1},
             {"U32", 4, -1},
             {"U16", 2, -1},
             {"U8", 1, -1},
             {"BOOL", 1, -1},
             {"F8_E4M3", 1, -1},
             {"F8_E5M2", 1, -1}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(name, t[i].n)) {
            *size = t[i].sz;
            *edt = t[i].dt;
            return 0;
        }
    return -1;
}

static int cmp_range(const void *a, const void *b) {
    const ekv_tensor_info *x = *(ekv_tensor_info *const *)a, *y = *(ekv_tensor_info *const *)b;
    const char *xd = (const char *)x->data, *yd = (const char *)y->data;
    return (xd > yd) - (xd < yd);
}

void ekv_safetensors_free(ekv_safetensors *st) {
    if (!st) return;
    free(st->buf);
    free(st->t);
    free(st->strings);
    free(st->meta);
    free(st);
}

/* Room for `need` more bytes in the string arena. */
static int strings_reserve(ekv_safetensors *st, size_t *cap, size_t used, size_t need) {
    if (used + need <= *cap) return 0;
    size_t c = *cap;
    while (used + need > c) c *= 2;
    char *ns = realloc(st->strings, c);
    if (!ns) return -1;
    st->strings = ns;
    *cap = c;
    return 0;
}

/* Reads a JSON string of any length into the arena; *off = its offset. NUL bytes are refused
 * (a C string could not hold them). */
static int jstring_arena(jp *p, ekv_safetensors *st, size_t *cap, size_t *used, int64_t *off) {
    ws(p);
    const char *s0 = p->s;
    size_t n;
    if (jstring(p, NULL, 0, &n)) return -1;
    if (strings_reserve(st, cap, *used, n + 1)) return jfail(p, "out of memory");
    p->s = s0;
    if (jstring(p, st->strings + *used, n + 1, NULL)) return -1;
    if (strlen(st->strings + *used) != n) return jfail(p, "NUL byte in a metadata string");
    *off = (int64_t)*used;
    *used += n + 1;
    return 0;
}

/* __metadata__: an object of string keys and string values (the safetensors format), keys
 * unique. Offsets of key i and value i go to (*offs)[2i], (*offs)[2i+1]. */
static int parse_metadata(jp *p, ekv_safetensors *st, size_t *strcap, size_t *strused,
                          int64_t **offs) {
    size_t cap = 0;
    if (jexpect(p, '{', "__metadata__ must be an object of strings")) return -1;
    ws(p);
    if (p->s < p->end && *p->s == '}') {
        p->s++;
        return 0;
    }
    for (;;) {
        if ((size_t)st->nmeta == cap) {
            cap = cap ? 2 * cap : 8;
            int64_t *no = realloc(*offs, 2 * cap * sizeof *no);
            if (!no) return jfail(p, "out of memory");
            *offs = no;
        }
        int64_t *o = *offs + 2 * st->nmeta;
        if (jstring_arena(p, st, strcap, strused, &o[0]) ||
            jexpect(p, ':', "expected ':' in __metadata__"))
            return -1;
        ws(p);
        if (p->s >= p->end || *p->s != '"') return jfail(p, "__metadata__ values must be strings");
        if (jstring_arena(p, st, strcap, strused, &o[1])) return -1;
        for (int64_t i = 0; i < st->nmeta; i++)
            if (!strcmp(st->strings + (*offs)[2 * i], st->strings + o[0]))
                return jfail(p, "repeated key in __metadata__");
        st->nmeta++;
        ws(p);
        if (p->s < p->end && *p->s == ',') {
            p->s++;
            continue;
        }
        return jexpect(p, '}', "expected ',' or '}' in __metadata__");
    }
}

/* State of one header parse. Names are stored as offsets into st->strings until the end
 * (strings_reserve may move the arena); link_strings turns them into pointers. */
typedef struct {
    int64_t data0, datalen; /* where the data section starts in st->buf, and its size */
    size_t cap_t, strcap, strused, off_cap;
    int64_t *name_off, *dt_off, *meta_off;
} header_build;

/* The fields of one tensor entry as read, before they are checked against each other. */
typedef struct {
    char dtn[32];
    int have_dt, have_shape, have_off;
    int64_t b0, b1;
} tensor_fields;

/* Reads the 8-byte little-endian header length, points p at the JSON text and allocates the
 * tensor table and the string arena. */
static int header_bounds(ekv_safetensors *st, jp *p, header_build *b) {
    if (st->len < 8) {
        snprintf(p->err, sizeof p->err,
                 "file of %lld bytes is shorter than the 8-byte header length", (long long)st->len);
        return -1;
    }
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | st->buf[i];
    if (hl < 2 || hl > (uint64_t)MAX_HEADER || (int64_t)hl > st->len - 8) {
        snprintf(p->err, sizeof p->err,
                 "header length %llu does not fit the file (%lld bytes) or exceeds %lld",
                 (unsigned long long)hl, (long long)st->len, (long long)MAX_HEADER);
        return -1;
    }
    b->data0 = 8 + (int64_t)hl;
    b->datalen = st->len - b->data0;
    p->s = p->start = (const char *)st->buf + 8;
    p->end = p->s + hl;
    b->cap_t = 16;
    b->strcap = 4096;
    st->t = calloc(b->cap_t, sizeof *st->t);
    st->strings = malloc(b->strcap);
    if (!st->t || !st->strings) {
        snprintf(p->err, sizeof p->err, "out of memory");
        return -1;
    }
    return 0;
}

/* Room for one more tensor in st->t and in the name / dtype offset arrays. */
static int grow_tensors(jp *p, ekv_safetensors *st, header_build *b) {
    if ((size_t)st->ntensors == b->cap_t) {
        b->cap_t *= 2;
        ekv_tensor_info *nt = realloc(st->t, b->cap_t * sizeof *nt);
        if (!nt) return jfail(p, "out of memory");
        st->t = nt;
    }
    if ((size_t)st->ntensors >= b->off_cap) {
        b->off_cap = b->off_cap ? b->off_cap * 2 : 16;
        int64_t *na = realloc(b->name_off, b->off_cap * sizeof *na),
                *nb = na ? realloc(b->dt_off, b->off_cap * sizeof *nb) : NULL;
        if (na) b->name_off = na;
        if (nb) b->dt_off = nb;
        if (!na || !nb) return jfail(p, "out of memory");
    }
    return 0;
}

/* "shape": an array of at most MAX_DIMS non-negative integers (empty for a scalar). */
static int parse_shape(jp *p, ekv_tensor_info *t) {
    ws(p);
    if (p->s < p->end && *p->s == ']') {
        p->s++;
        return 0;
    }
    for (;;) {
        if (t->ndim == MAX_DIMS) return jfail(p, "more than 8 dimensions");
        if (jint(p, &t->shape[t->ndim])) return -1;
        t->ndim++;
        ws(p);
        if (p->s < p->end && *p->s == ',') {
            p->s++;
            continue;
        }
        return jexpect(p, ']', "expected ',' or ']' in shape");
    }
}

/* One tensor entry's object: dtype, shape and data_offsets once each; other fields are
 * skipped. The shape goes straight into t. */
static int parse_tensor_fields(jp *p, ekv_tensor_info *t, tensor_fields *f) {
    if (jexpect(p, '{', "a tensor entry must be an object")) return -1;
    ws(p);
    if (p->s < p->end && *p->s == '}') return jfail(p, "empty tensor entry");
    for (;;) {
        char name[32];
        if (jstring(p, name, sizeof name, NULL) || jexpect(p, ':', "expected ':'")) return -1;
        if (!strcmp(name, "dtype")) {
            if (f->have_dt++ || jstring(p, f->dtn, sizeof f->dtn, NULL))
                return jfail(p, "bad or repeated dtype");
        } else if (!strcmp(name, "shape")) {
            if (f->have_shape++ || jexpect(p, '[', "shape must be an array"))
                return jfail(p, "bad or repeated shape");
            if (parse_shape(p, t)) return -1;
        } else if (!strcmp(name, "data_offsets")) {
            if (f->have_off++ || jexpect(p, '[', "data_offsets must be an array") ||
                jint(p, &f->b0) || jexpect(p, ',', "data_offsets needs two values") ||
                jint(p, &f->b1) || jexpect(p, ']', "data_offsets needs exactly two values"))
                return jfail(p, "bad data_offsets");
        } else if (jskip(p, 2))
            return -1;
        ws(p);
        if (p->s < p->end && *p->s == ',') {
            p->s++;
            continue;
        }
        return jexpect(p, '}', "expected ',' or '}' in a tensor entry");
    }
}

/* The entry is complete, its dtype known, and data_offsets span exactly numel elements
 * inside the data section; then t gets its size and data pointer. */
static int check_tensor(jp *p, ekv_safetensors *st, const header_build *b, const char *key,
                        const tensor_fields *f, ekv_tensor_info *t) {
    if (!f->have_dt || !f->have_shape || !f->have_off) {
        snprintf(p->err, sizeof p->err, "tensor '%.64s' lacks %s", key,
                 !f->have_dt      ? "dtype"
                 : !f->have_shape ? "shape"
                                  : "data_offsets");
        return -1;
    }
    int64_t esz;
    if (dtype_info(f->dtn, &esz, &t->dtype)) {
        snprintf(p->err, sizeof p->err, "tensor '%.64s' has unknown dtype '%.16s'", key, f->dtn);
        return -1;
    }
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++)
        if (ekv_mul_i64(numel, t->shape[d], &numel)) {
            snprintf(p->err, sizeof p->err, "tensor '%.64s': shape overflows", key);
            return -1;
        }
    int64_t nbytes;
    if (ekv_mul_i64(numel, esz, &nbytes) || f->b1 < f->b0 || f->b1 - f->b0 != nbytes ||
        f->b1 > b->datalen) {
        snprintf(
                p->err, sizeof p->err,
                "tensor '%.64s': data_offsets [%lld, %lld] do not match %lld elements of %s in %lld data bytes",
                key, (long long)f->b0, (long long)f->b1, (long long)numel, f->dtn,
                (long long)b->datalen);
        return -1;
    }
    t->numel = numel;
    t->nbytes = nbytes;
    t->data = st->buf + b->data0 + f->b0;
    return 0;
}

/* One tensor entry (its name already read): parsed, checked, and its name and dtype name
 * copied into the arena. */
static int parse_tensor(jp *p, ekv_safetensors *st, header_build *b, const char *key, size_t klen) {
    if (st->ntensors == INT32_MAX) return jfail(p, "too many tensors");
    if (grow_tensors(p, st, b)) return -1;
    ekv_tensor_info *t = &st->t[st->ntensors];
    memset(t, 0, sizeof *t);
    tensor_fields f;
    memset(&f, 0, sizeof f);
    if (parse_tensor_fields(p, t, &f) || check_tensor(p, st, b, key, &f, t)) return -1;
    const size_t dlen = strlen(f.dtn);
    if (strings_reserve(st, &b->strcap, b->strused, klen + 1 + dlen + 1))
        return jfail(p, "out of memory");
    b->name_off[st->ntensors] = (int64_t)b->strused;
    memcpy(st->strings + b->strused, key, klen + 1);
    b->strused += klen + 1;
    b->dt_off[st->ntensors] = (int64_t)b->strused;
    memcpy(st->strings + b->strused, f.dtn, dlen + 1);
    b->strused += dlen + 1;
    st->ntensors++;
    return 0;
}

/* The header object: tensor entries and at most one __metadata__, then nothing but
 * whitespace. */
static int parse_entries(jp *p, ekv_safetensors *st, header_build *b) {
    int have_meta = 0;
    if (jexpect(p, '{', "the header is not a JSON object")) return -1;
    ws(p);
    if (p->s < p->end && *p->s == '}')
        p->s++;
    else
        for (;;) {
            char key[1024];
            size_t klen;
            if (jstring(p, key, sizeof key, &klen) || jexpect(p, ':', "expected ':' after a name"))
                return -1;
            if (strlen(key) != klen) return jfail(p, "NUL byte in a tensor name");
            if (!strcmp(key, "__metadata__")) {
                if (have_meta++) return jfail(p, "repeated __metadata__");
                if (parse_metadata(p, st, &b->strcap, &b->strused, &b->meta_off)) return -1;
            } else if (parse_tensor(p, st, b, key, klen))
                return -1;
            ws(p);
            if (p->s < p->end && *p->s == ',') {
                p->s++;
                continue;
            }
            if (jexpect(p, '}', "expected ',' or '}' after a header entry")) return -1;
            break;
        }
    ws(p);
    if (p->s != p->end) return jfail(p, "trailing bytes after the JSON header");
    return 0;
}

/* Turns the arena offsets into the name, dtype-name and metadata pointers (the arena no
 * longer moves). */
static int link_strings(ekv_safetensors *st, jp *p, const header_build *b) {
    for (int64_t i = 0; i < st->ntensors; i++) {
        st->t[i].name = st->strings + b->name_off[i];
        st->t[i].dtype_name = st->strings + b->dt_off[i];
    }
    if (st->nmeta > 0) {
        st->meta = malloc(sizeof *st->meta * (size_t)(2 * st->nmeta));
        if (!st->meta) {
            snprintf(p->err, sizeof p->err, "out of memory");
            return -1;
        }
        for (int64_t i = 0; i < 2 * st->nmeta; i++) st->meta[i] = st->strings + b->meta_off[i];
    }
    return 0;
}

/* No two tensors share a byte of the data section. */
static int check_overlaps(const ekv_safetensors *st, jp *p) {
    ekv_tensor_info **v = malloc(sizeof *v * (size_t)st->ntensors);
    if (!v) {
        snprintf(p->err, sizeof p->err, "out of memory");
        return -1;
    }
    for (int64_t i = 0; i < st->ntensors; i++) v[i] = &st->t[i];
    qsort(v, (size_t)st->ntensors, sizeof *v, cmp_range);
    for (int64_t i = 1; i < st->ntensors; i++)
        if ((const char *)v[i - 1]->data + v[i - 1]->nbytes > (const char *)v[i]->data) {
            snprintf(p->err, sizeof p->err, "tensors '%.48s' and '%.48s' overlap", v[i - 1]->name,
                     v[i]->name);
            free(v);
            return -1;
        }
    free(v);
    return 0;
}

/* Tensor names are unique. O(n^2) is fine for headers of a few hundred names; above 100000
 * tensors the check is skipped. */
static int check_unique_names(const ekv_safetensors *st, jp *p) {
    for (int64_t i = 0; i < st->ntensors; i++)
        for (int64_t k = i + 1; k < st->ntensors && st->ntensors <= 100000; k++)
            if (!strcmp(st->t[i].name, st->t[k].name)) {
                snprintf(p->err, sizeof p->err, "tensor name '%.64s' appears twice", st->t[i].name);
                return -1;
            }
    return 0;
}

/* Parses the header of st->buf; on error returns -1 with a message in p->err. */
static int parse_header(ekv_safetensors *st, jp *p) {
    header_build b;
    memset(&b, 0, sizeof b);
    if (header_bounds(st, p, &b)) return -1;
    const int rc = parse_entries(p, st, &b) || link_strings(st, p, &b);
    free(b.name_off);
    free(b.dt_off);
    free(b.meta_off);
    if (rc) {
        if (!p->err[0]) snprintf(p->err, sizeof p->err, "malformed header");
        return -1;
    }
    if (st->ntensors > 1 && (check_overlaps(st, p) || check_unique_names(st, p))) return -1;
    return 0;
}

/* Parses buf[0..len), which becomes the reader's (freed on failure too). */
static ekv_status parse_owned(ekv_context *ctx, unsigned char *buf, int64_t len,
                              ekv_safetensors **out) {
    ekv_safetensors *st = calloc(1, sizeof *st);
    if (!st) {
        free(buf);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    }
    st->buf = buf;
    st->len = len;
    jp p;
    memset(&p, 0, sizeof p);
    if (parse_header(st, &p)) {
        ekv_safetensors_free(st);
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "safetensors: %s", p.err);
    }
    *out = st;
    return EKV_OK;
}

ekv_status ekv_safetensors_parse(ekv_context *ctx, const void *buf, int64_t len,
                                 ekv_safetensors **out) {
    if (!buf || !out)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !buf ? "buf" : "out");
    if (len < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "len=%lld must be >= 0", (long long)len);
    if ((uint64_t)len >= SIZE_MAX)
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "len=%lld is too large", (long long)len);
    unsigned char *copy = malloc((size_t)(len > 0 ? len : 1));
    if (!copy)
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "cannot hold %lld bytes", (long long)len);
    memcpy(copy, buf, (size_t)len);
    return parse_owned(ctx, copy, len, out);
}

/* The file must be a regular file (a directory or a device has no meaningful size: ftell on
 * a directory gives 2^63-1) that fits in physical memory, since it is read whole. */
ekv_status ekv_safetensors_open(ekv_context *ctx, const char *path, ekv_safetensors **out) {
    if (!path || !out)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !path ? "path" : "out");
    FILE *f = fopen(path, "rb");
    if (!f) return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "cannot open '%s'", path);
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "'%s' is not a regular file", path);
    }
    const int64_t n = (int64_t)sb.st_size, phys = ekv_phys_mem_bytes();
    if (n > phys) {
        fclose(f);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY,
                        "'%s' is %lld bytes, more than the physical memory (%lld bytes)", path,
                        (long long)n, (long long)phys);
    }
    unsigned char *b = malloc((size_t)(n > 0 ? n : 1));
    if (!b) {
        fclose(f);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "cannot hold '%s' (%lld bytes)", path,
                        (long long)n);
    }
    size_t got = fread(b, 1, (size_t)n, f);
    fclose(f);
    if ((int64_t)got != n) {
        free(b);
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "short read of '%s'", path);
    }
    return parse_owned(ctx, b, n, out);
}

int64_t ekv_safetensors_count(const ekv_safetensors *st) { return st ? st->ntensors : 0; }

ekv_status ekv_safetensors_at(const ekv_safetensors *st, int64_t i, ekv_tensor_info *out) {
    if (!st || !out) return EKV_ERR_NULL_POINTER;
    if (i < 0 || i >= st->ntensors) return EKV_ERR_INVALID_ARGUMENT;
    *out = st->t[i];
    return EKV_OK;
}

ekv_status ekv_safetensors_find(const ekv_safetensors *st, const char *name, ekv_tensor_info *out) {
    if (!st || !name || !out) return EKV_ERR_NULL_POINTER;
    for (int64_t i = 0; i < st->ntensors; i++)
        if (!strcmp(st->t[i].name, name)) {
            *out = st->t[i];
            return EKV_OK;
        }
    return EKV_ERR_INVALID_ARGUMENT;
}

const char *ekv_safetensors_metadata(const ekv_safetensors *st, const char *key) {
    if (!st || !key) return NULL;
    for (int64_t i = 0; i < st->nmeta; i++)
        if (!strcmp(st->meta[2 * i], key)) return st->meta[2 * i + 1];
    return NULL;
}

int64_t ekv_safetensors_metadata_count(const ekv_safetensors *st) { return st ? st->nmeta : 0; }

ekv_status ekv_safetensors_metadata_at(const ekv_safetensors *st, int64_t i, const char **key,
                                       const char **value) {
    if (!st || !key || !value) return EKV_ERR_NULL_POINTER;
    if (i < 0 || i >= st->nmeta) return EKV_ERR_INVALID_ARGUMENT;
    *key = st->meta[2 * i];
    *value = st->meta[2 * i + 1];
    return EKV_OK;
}
