/*
 * Invalid-input tables for the public API. Every row is one call with exactly one bad
 * argument (on top of a baseline that is valid). For each row the test checks:
 *   - the exact ekv_status;
 *   - that ekv_last_error(ctx) holds a non-empty message when a context is involved (the
 *     error is cleared by a successful call before every row, so a stale message does not
 *     count);
 *   - that every output is untouched: output buffers are filled with a sentinel byte
 *     pattern before the call and compared after; for the cache, the whole pool (K, V,
 *     statistics), the sequence lengths and the free-page count are compared.
 * Rows are X-macro lists: the text of the mutation is the row's name in failure messages.
 * Set EKV_TEST_VERBOSE=1 to print every row's error message.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include "cuda/cache/layout.h" /* the device cache's views over a block (host arithmetic) */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#define SENT     0xA5
#define SENT_PTR ((void *)(uintptr_t)0xA5A5A5A5A5A5A5A5ull)

#if defined(__SANITIZE_ADDRESS__) || defined(EKV_TEST_SANITIZED)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif

static ekv_context *g_ctx;
static int g_verbose;

static int filled(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != SENT) return 0;
    return 1;
}

/* A successful call clears the context's message. */
static void clear_error(ekv_context *ctx) {
    if (!ctx) return;
    float x = 0.f, p = 0.f;
    ekv_status st = ekv_entmax(ctx, &x, 1, 1.5, &p, NULL, NULL);
    CHECK(st == EKV_OK && ekv_last_error(ctx)[0] == '\0',
          "could not clear the error (status %d, '%s')", st, ekv_last_error(ctx));
}

/* Status check plus message check (msg_ctx = the context that must hold a message). */
static void expect(const char *group, const char *row, ekv_status got, ekv_status want,
                   const ekv_context *msg_ctx) {
    CHECK(got == want, "%s [%s]: got %d (%s), want %d (%s)", group, row, (int)got,
          ekv_status_string(got), (int)want, ekv_status_string(want));
    if (msg_ctx) {
        const char *m = ekv_last_error(msg_ctx);
        CHECK(m && m[0], "%s [%s]: status %d but ekv_last_error is empty", group, row, (int)got);
        if (g_verbose)
            printf("  %-10s %-60.60s -> %-22s '%s'\n", group, row, ekv_status_string(got),
                   m ? m : "(null)");
    } else if (g_verbose) {
        printf("  %-10s %-60.60s -> %s\n", group, row, ekv_status_string(got));
    }
}

/* ================================================================================== */
/* Status strings, dtype names, ISA names                                              */
/* ================================================================================== */
static void test_names(void) {
    const char *seen[16];
    for (int s = 0; s >= -15; s--) {
        const char *str = ekv_status_string((ekv_status)s);
        CHECK(str && str[0], "ekv_status_string(%d) is empty", s);
        seen[-s] = str ? str : "";
        for (int t = 0; t < -s; t++)
            CHECK(strcmp(seen[t], seen[-s]) != 0,
                  "ekv_status_string(%d) == ekv_status_string(%d) = '%s'", s, -t, seen[-s]);
    }
    const char *unk = ekv_status_string((ekv_status)-99);
    CHECK(unk && unk[0], "ekv_status_string(-99) is empty");
    for (int t = 0; unk && t < 16; t++)
        CHECK(strcmp(unk, seen[t]) != 0, "unknown status has the string of status %d", -t);
    unk = ekv_status_string((ekv_status)7);
    CHECK(unk && unk[0], "ekv_status_string(7) is empty");

    static const struct {
        const char *name;
        ekv_dtype d;
    } ok[] = {
            {"f32", EKV_DTYPE_F32},       {"fp32", EKV_DTYPE_F32},  {"float32", EKV_DTYPE_F32},
            {"F32", EKV_DTYPE_F32},       {"f16", EKV_DTYPE_F16},   {"fp16", EKV_DTYPE_F16},
            {"float16", EKV_DTYPE_F16},   {"FP16", EKV_DTYPE_F16},  {"bf16", EKV_DTYPE_BF16},
            {"bfloat16", EKV_DTYPE_BF16}, {"BF16", EKV_DTYPE_BF16},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        ekv_dtype d;
        memset(&d, SENT, sizeof d);
        ekv_status st = ekv_dtype_from_name(ok[i].name, &d);
        CHECK(st == EKV_OK && d == ok[i].d, "ekv_dtype_from_name('%s'): status %d dtype %d",
              ok[i].name, st, (int)d);
    }
    static const char *bad[] = {"",     "f8",    "fp8",    "f64",  "fp64", "float64", "float",
                                "half", "int8",  "bf",     "bf8",  "f1",   "f160",    "f16 ",
                                " f16", "f16\n", "bfloat", "f 16", "7",    "1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ekv_dtype d;
        memset(&d, SENT, sizeof d);
        ekv_status st = ekv_dtype_from_name(bad[i], &d);
        CHECK(st == EKV_ERR_INVALID_DTYPE,
              "ekv_dtype_from_name('%s'): status %d, want INVALID_DTYPE", bad[i], st);
        CHECK(filled(&d, sizeof d), "ekv_dtype_from_name('%s') wrote its output on error", bad[i]);
    }
    {
        ekv_dtype d;
        memset(&d, SENT, sizeof d);
        CHECK(ekv_dtype_from_name(NULL, &d) == EKV_ERR_NULL_POINTER,
              "ekv_dtype_from_name(NULL, out)");
        CHECK(filled(&d, sizeof d), "ekv_dtype_from_name(NULL) wrote its output");
        CHECK(ekv_dtype_from_name("f16", NULL) == EKV_ERR_NULL_POINTER,
              "ekv_dtype_from_name(name, NULL)");
    }
    for (int d = 0; d < 3; d++) {
        const char *n = ekv_dtype_name((ekv_dtype)d);
        ekv_dtype back;
        CHECK(n && ekv_dtype_from_name(n, &back) == EKV_OK && back == (ekv_dtype)d,
              "dtype %d name round trip", d);
        CHECK(ekv_dtype_size((ekv_dtype)d) == (d == 0 ? 4 : 2), "ekv_dtype_size(%d)", d);
    }
    CHECK(ekv_dtype_name((ekv_dtype)7) == NULL, "ekv_dtype_name(7) should be NULL");
    CHECK(ekv_dtype_name((ekv_dtype)-1) == NULL, "ekv_dtype_name(-1) should be NULL");
    CHECK(ekv_dtype_size((ekv_dtype)7) == 0, "ekv_dtype_size(7) should be 0");
    CHECK(ekv_dtype_size((ekv_dtype)-1) == 0, "ekv_dtype_size(-1) should be 0");
    for (int i = 0; i < 4; i++)
        CHECK(ekv_isa_name((ekv_isa)i) && ekv_isa_name((ekv_isa)i)[0], "ekv_isa_name(%d)", i);
    CHECK(ekv_isa_name((ekv_isa)9) && ekv_isa_name((ekv_isa)9)[0], "ekv_isa_name(9) is empty");
    CHECK(ekv_last_error(NULL) && ekv_last_error(NULL)[0] == '\0',
          "ekv_last_error(NULL) should be \"\"");
}

/* ================================================================================== */
/* ekv_context_create                                                                  */
/* ================================================================================== */
typedef struct {
    ekv_context_params p;
    const ekv_context_params *pp;
    ekv_context *out;
    ekv_context **outp;
} context_case;

#define CONTEXT_ROWS(X)                                                                            \
    X(EKV_ERR_NULL_POINTER, c->outp = NULL)                                                        \
    X(EKV_ERR_INVALID_SIZE, c->p.n_threads = -1)                                                   \
    X(EKV_ERR_INVALID_SIZE, c->p.n_threads = INT32_MIN)                                            \
    X(EKV_ERR_INVALID_SIZE, c->p.n_threads = 1025)                                                 \
    X(EKV_ERR_INVALID_SIZE, c->p.n_threads = INT32_MAX)                                            \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.isa = (ekv_isa)7)                                             \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.isa = (ekv_isa)4)                                             \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.isa = (ekv_isa)-1)

static const struct {
    const char *name;
    ekv_status want;
} context_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        CONTEXT_ROWS(X)
#undef X
};

static void context_mutate(context_case *c, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    CONTEXT_ROWS(X)
#undef X
}

static void context_init(context_case *c) {
    c->p = ekv_context_default_params();
    c->p.n_threads = 1;
    c->pp = &c->p;
    c->out = SENT_PTR;
    c->outp = &c->out;
}

static void test_context(void) {
    for (int r = 0; r < (int)(sizeof context_rows / sizeof context_rows[0]); r++) {
        context_case c;
        context_init(&c);
        context_mutate(&c, r);
        ekv_status st = ekv_context_create(c.pp, c.outp);
        expect("context", context_rows[r].name, st, context_rows[r].want, NULL);
        CHECK(c.out == SENT_PTR, "context [%s]: *out written on error", context_rows[r].name);
        if (st == EKV_OK && c.outp) ekv_context_free(c.out);
    }
    /* params = NULL means defaults */
    ekv_context *c = SENT_PTR;
    CHECK(ekv_context_create(NULL, &c) == EKV_OK && c != SENT_PTR,
          "ekv_context_create(NULL params) should work");
    if (c != SENT_PTR) ekv_context_free(c);
    ekv_context_free(NULL);

    /* ISAs the CPU lacks (only detectable when the CPU is not the best level) */
    ekv_isa best = ekv_cpu_best_isa();
    int tested = 0;
    for (int isa = (int)best + 1; isa <= (int)EKV_ISA_AVX512; isa++) {
        context_case cc;
        context_init(&cc);
        cc.p.isa = (ekv_isa)isa;
        ekv_status st = ekv_context_create(cc.pp, cc.outp);
        CHECK(st == EKV_ERR_UNSUPPORTED, "context isa=%s on a %s CPU: got %d, want UNSUPPORTED",
              ekv_isa_name((ekv_isa)isa), ekv_isa_name(best), st);
        CHECK(cc.out == SENT_PTR, "context isa=%s: *out written on error",
              ekv_isa_name((ekv_isa)isa));
        if (st == EKV_OK) ekv_context_free(cc.out);
        tested++;
    }
    if (!tested)
        printf("note: CPU supports %s, the best ISA: no unsupported-ISA row to test\n",
               ekv_isa_name(best));
    /* every supported level can be requested */
    for (int isa = 0; isa <= (int)best; isa++) {
        context_case cc;
        context_init(&cc);
        cc.p.isa = (ekv_isa)isa;
        ekv_status st = ekv_context_create(cc.pp, cc.outp);
        CHECK(st == EKV_OK, "context isa=%s: got %d", ekv_isa_name((ekv_isa)isa), st);
        if (st == EKV_OK) {
            CHECK(ekv_context_isa(cc.out) == (isa == 0 ? best : (ekv_isa)isa),
                  "context isa=%d reports %d", isa, (int)ekv_context_isa(cc.out));
            ekv_context_free(cc.out);
        }
    }
}

/* ================================================================================== */
/* ekv_entmax / ekv_entmax_f64                                                         */
/* ================================================================================== */
enum {
    X_OK,
    X_NAN_MID,
    X_NAN_FIRST,
    X_NAN_LAST,
    X_PINF,
    X_NAN_AND_MINF,
    X_PINF_AND_MINF,
    X_ALL_MINF
};
#define ALL_ALPHAS (-99.0)

typedef struct {
    const char *name;
    int x_null, p_null;
    int64_t n;
    double alpha; /* ALL_ALPHAS = every alpha of entmax_alphas */
    int xkind;
    ekv_status want;
} entmax_row;

static const double entmax_alphas[] = {1.0, 1.25, 1.5, 2.0, 3.0, 4.0};

static const entmax_row entmax_rows[] = {
        {"x = NULL", 1, 0, 4, 1.5, X_OK, EKV_ERR_NULL_POINTER},
        {"p = NULL", 0, 1, 4, 1.5, X_OK, EKV_ERR_NULL_POINTER},
        {"x = NULL, softmax", 1, 0, 4, 1.0, X_OK, EKV_ERR_NULL_POINTER},
        {"n = 0", 0, 0, 0, 1.5, X_OK, EKV_ERR_INVALID_SIZE},
        {"n = -1", 0, 0, -1, 1.5, X_OK, EKV_ERR_INVALID_SIZE},
        {"n = INT64_MIN", 0, 0, INT64_MIN, 1.5, X_OK, EKV_ERR_INVALID_SIZE},
        {"n = 0, softmax", 0, 0, 0, 1.0, X_OK, EKV_ERR_INVALID_SIZE},
        {"n = INT64_MAX", 0, 0, INT64_MAX, 1.5, X_OK, EKV_ERR_SIZE_OVERFLOW},
        {"n = SIZE_MAX/8 + 1", 0, 0, (int64_t)(SIZE_MAX / sizeof(double)) + 1, 1.5, X_OK,
         EKV_ERR_SIZE_OVERFLOW},
        {"n = INT64_MAX, softmax", 0, 0, INT64_MAX, 1.0, X_OK, EKV_ERR_SIZE_OVERFLOW},
        {"alpha = 0", 0, 0, 4, 0.0, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = -0", 0, 0, 4, -0.0, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = -1.5", 0, 0, 4, -1.5, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = 0.5", 0, 0, 4, 0.5, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = 1 - eps", 0, 0, 4, 1.0 - DBL_EPSILON / 2, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = 4 + eps", 0, 0, 4, 4.0 + 4 * DBL_EPSILON, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = 4.5", 0, 0, 4, 4.5, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = 9", 0, 0, 4, 9.0, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = NaN", 0, 0, 4, NAN, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = -NaN", 0, 0, 4, -NAN, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = +inf", 0, 0, 4, INFINITY, X_OK, EKV_ERR_INVALID_ALPHA},
        {"alpha = -inf", 0, 0, 4, -INFINITY, X_OK, EKV_ERR_INVALID_ALPHA},
        {"x has NaN (middle)", 0, 0, 4, ALL_ALPHAS, X_NAN_MID, EKV_ERR_NAN_INPUT},
        {"x has NaN (first)", 0, 0, 4, ALL_ALPHAS, X_NAN_FIRST, EKV_ERR_NAN_INPUT},
        {"x has NaN (last)", 0, 0, 4, ALL_ALPHAS, X_NAN_LAST, EKV_ERR_NAN_INPUT},
        {"x has +inf", 0, 0, 4, ALL_ALPHAS, X_PINF, EKV_ERR_NAN_INPUT},
        {"x has NaN and -inf", 0, 0, 4, ALL_ALPHAS, X_NAN_AND_MINF, EKV_ERR_NAN_INPUT},
        {"x has +inf and -inf", 0, 0, 4, ALL_ALPHAS, X_PINF_AND_MINF, EKV_ERR_NAN_INPUT},
        {"x all -inf", 0, 0, 4, ALL_ALPHAS, X_ALL_MINF, EKV_ERR_EMPTY_INPUT},
        {"x = {-inf}, n = 1", 0, 0, 1, ALL_ALPHAS, X_ALL_MINF, EKV_ERR_EMPTY_INPUT},
        {"x = NaN, n = 1", 0, 0, 1, ALL_ALPHAS, X_NAN_FIRST, EKV_ERR_NAN_INPUT},
};

static void make_x(int kind, double x[4]) {
    x[0] = 0.5;
    x[1] = -1.0;
    x[2] = 2.0;
    x[3] = 0.25;
    switch (kind) {
    case X_NAN_MID: x[2] = NAN; break;
    case X_NAN_FIRST: x[0] = NAN; break;
    case X_NAN_LAST: x[3] = NAN; break;
    case X_PINF: x[1] = INFINITY; break;
    case X_NAN_AND_MINF:
        x[0] = -INFINITY;
        x[3] = NAN;
        break;
    case X_PINF_AND_MINF:
        x[0] = -INFINITY;
        x[2] = INFINITY;
        break;
    case X_ALL_MINF: x[0] = x[1] = x[2] = x[3] = -INFINITY; break;
    default: break;
    }
}

static void run_entmax_row(const entmax_row *r, double alpha, ekv_context *ctx, int f64) {
    double xd[4], pd[8], tau;
    float xf[4], pf[8];
    int64_t sup;
    char name[160];
    snprintf(name, sizeof name, "%s, alpha=%g, %s, ctx %s", r->name, alpha, f64 ? "f64" : "f32",
             ctx ? "set" : "NULL");
    make_x(r->xkind, xd);
    for (int i = 0; i < 4; i++) xf[i] = (float)xd[i];
    memset(pd, SENT, sizeof pd);
    memset(pf, SENT, sizeof pf);
    memset(&tau, SENT, sizeof tau);
    memset(&sup, SENT, sizeof sup);
    clear_error(ctx);
    ekv_status st = f64 ? ekv_entmax_f64(ctx, r->x_null ? NULL : xd, r->n, alpha,
                                         r->p_null ? NULL : pd, &tau, &sup)
                        : ekv_entmax(ctx, r->x_null ? NULL : xf, r->n, alpha, r->p_null ? NULL : pf,
                                     &tau, &sup);
    expect("entmax", name, st, r->want, ctx);
    CHECK(filled(pd, sizeof pd) && filled(pf, sizeof pf), "entmax [%s]: p written on error", name);
    CHECK(filled(&tau, sizeof tau), "entmax [%s]: tau written on error", name);
    CHECK(filled(&sup, sizeof sup), "entmax [%s]: support written on error", name);
}

static void test_entmax(void) {
    for (size_t r = 0; r < sizeof entmax_rows / sizeof entmax_rows[0]; r++) {
        const entmax_row *row = &entmax_rows[r];
        size_t na = row->alpha == ALL_ALPHAS ? sizeof entmax_alphas / sizeof entmax_alphas[0] : 1;
        for (size_t a = 0; a < na; a++) {
            double alpha = row->alpha == ALL_ALPHAS ? entmax_alphas[a] : row->alpha;
            for (int f64 = 0; f64 < 2; f64++) {
                run_entmax_row(row, alpha, g_ctx, f64);
                run_entmax_row(row, alpha, NULL, f64); /* ctx may be NULL */
            }
        }
    }
    /* tau and support are optional; -inf entries are masked, not errors */
    double x[4] = {1, -INFINITY, 3, -INFINITY}, p[4];
    float xf[4] = {1, -INFINITY, 3, -INFINITY}, pf[4];
    CHECK(ekv_entmax_f64(g_ctx, x, 4, 1.5, p, NULL, NULL) == EKV_OK && p[1] == 0 && p[3] == 0,
          "entmax_f64 with masked entries and NULL tau/support");
    CHECK(ekv_entmax(NULL, xf, 4, 1.0, pf, NULL, NULL) == EKV_OK && pf[1] == 0 && pf[3] == 0,
          "entmax with masked entries and NULL ctx/tau/support");
}

/* ================================================================================== */
/* ekv_cache_create / ekv_cache_bytes_needed / ekv_cache_pages_for                     */
/* ================================================================================== */
static ekv_cache_params small_cache_params(void) {
    ekv_cache_params p = ekv_cache_default_params();
    p.num_pages = 4;
    p.page_size = 4;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    p.dtype = EKV_DTYPE_F16;
    p.max_seqs = 3;
    return p;
}

typedef struct {
    ekv_context *ctx;
    ekv_cache_params p;
    const ekv_cache_params *pp;
    ekv_cache *out;
    ekv_cache **outp;
} cache_case;

/* Caller pools for the baseline's shape: 4 pages x 2 heads x 4 tokens x 8 dims of f16 = 512
 * bytes each. K and V sharing a byte would overwrite each other. */
enum { POOL_BYTES = 512 };
static _Alignas(64) unsigned char g_pool[4 * POOL_BYTES];

#define CACHE_ROWS(X)                                                                              \
    X(EKV_ERR_NULL_POINTER, c->ctx = NULL)                                                         \
    X(EKV_ERR_NULL_POINTER, c->pp = NULL)                                                          \
    X(EKV_ERR_NULL_POINTER, c->outp = NULL)                                                        \
    X(EKV_ERR_INVALID_SIZE, c->p.num_pages = 0)                                                    \
    X(EKV_ERR_INVALID_SIZE, c->p.num_pages = -1)                                                   \
    X(EKV_ERR_INVALID_SIZE, c->p.num_pages = INT64_MIN)                                            \
    X(EKV_ERR_SIZE_OVERFLOW, c->p.num_pages = (int64_t)INT32_MAX + 1)                              \
    X(EKV_ERR_SIZE_OVERFLOW, c->p.num_pages = INT64_MAX)                                           \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->p.page_size = 0)                                               \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->p.page_size = 257)                                             \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->p.page_size = -1)                                              \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->p.page_size = INT32_MIN)                                       \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->p.page_size = INT32_MAX)                                       \
    X(EKV_ERR_INVALID_SIZE, c->p.num_kv_heads = 0)                                                 \
    X(EKV_ERR_INVALID_SIZE, c->p.num_kv_heads = -2)                                                \
    X(EKV_ERR_INVALID_SIZE, c->p.num_kv_heads = 4097)                                              \
    X(EKV_ERR_INVALID_SIZE, c->p.head_dim = 0)                                                     \
    X(EKV_ERR_INVALID_SIZE, c->p.head_dim = -8)                                                    \
    X(EKV_ERR_INVALID_SIZE, c->p.head_dim = 65537)                                                 \
    X(EKV_ERR_INVALID_DTYPE, c->p.dtype = (ekv_dtype)7)                                            \
    X(EKV_ERR_INVALID_DTYPE, c->p.dtype = (ekv_dtype)3)                                            \
    X(EKV_ERR_INVALID_DTYPE, c->p.dtype = (ekv_dtype)-1)                                           \
    X(EKV_ERR_INVALID_DTYPE, c->p.range_dtype = (ekv_dtype)3)                                      \
    X(EKV_ERR_INVALID_DTYPE, c->p.range_dtype = (ekv_dtype)-1)                                     \
    X(EKV_ERR_INVALID_SIZE, c->p.max_seqs = 0)                                                     \
    X(EKV_ERR_INVALID_SIZE, c->p.max_seqs = -1)                                                    \
    X(EKV_ERR_INVALID_SIZE, c->p.max_seqs = INT32_MAX)                                             \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.k_pool = c->p.v_pool = g_pool)                                \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.k_pool = g_pool; c->p.v_pool = g_pool + POOL_BYTES / 2)       \
    X(EKV_ERR_INVALID_ARGUMENT, c->p.k_pool = g_pool + POOL_BYTES - 16; c->p.v_pool = g_pool)      \
    X(EKV_ERR_SIZE_OVERFLOW, c->p.num_pages = INT32_MAX; c->p.num_kv_heads = 4096;                 \
      c->p.page_size = 256; c->p.head_dim = 65536)                                                 \
    X(EKV_ERR_SIZE_OVERFLOW, c->p.num_pages = (int64_t)1 << 30; c->p.num_kv_heads = 4096;          \
      c->p.page_size = 16; c->p.head_dim = 65536)                                                  \
    X(EKV_ERR_SIZE_OVERFLOW, c->p.num_pages = (int64_t)1 << 31 >> 1; c->p.num_kv_heads = 4096;     \
      c->p.page_size = 256; c->p.head_dim = 65536; c->p.dtype = EKV_DTYPE_F32)

static const struct {
    const char *name;
    ekv_status want;
} cache_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        CACHE_ROWS(X)
#undef X
};

static void cache_mutate(cache_case *c, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    CACHE_ROWS(X)
#undef X
}

static void cache_init(cache_case *c) {
    c->ctx = g_ctx;
    c->p = small_cache_params();
    c->pp = &c->p;
    c->out = SENT_PTR;
    c->outp = &c->out;
}

static void test_cache_create(void) {
    cache_case base;
    cache_init(&base);
    ekv_cache *ok = NULL;
    CHECK(ekv_cache_create(g_ctx, base.pp, &ok) == EKV_OK && ok, "baseline cache params fail: %s",
          ekv_last_error(g_ctx));
    ekv_cache_free(ok);
    CHECK(ekv_cache_bytes_needed(base.pp) > 0, "bytes_needed of the baseline");
    ekv_cache_free(NULL);

    for (int r = 0; r < (int)(sizeof cache_rows / sizeof cache_rows[0]); r++) {
        cache_case c;
        cache_init(&c);
        cache_mutate(&c, r);
        clear_error(g_ctx);
        ekv_status st = ekv_cache_create(c.ctx, c.pp, c.outp);
        expect("cache", cache_rows[r].name, st, cache_rows[r].want, c.ctx);
        CHECK(c.out == SENT_PTR, "cache [%s]: *out written on error", cache_rows[r].name);
        if (st == EKV_OK && c.outp) ekv_cache_free(c.out);
        if (c.pp && cache_rows[r].want != EKV_ERR_NULL_POINTER)
            CHECK(ekv_cache_bytes_needed(c.pp) == -1, "ekv_cache_bytes_needed [%s] = %lld, want -1",
                  cache_rows[r].name, (long long)ekv_cache_bytes_needed(c.pp));
    }
    CHECK(ekv_cache_bytes_needed(NULL) == -1, "ekv_cache_bytes_needed(NULL)");
    /* pools that only touch (V right after K, or before it) are fine */
    for (int order = 0; order < 2; order++) {
        cache_case c;
        cache_init(&c);
        c.p.k_pool = g_pool + (order ? POOL_BYTES : 0);
        c.p.v_pool = g_pool + (order ? 0 : POOL_BYTES);
        ekv_cache *adj = NULL;
        CHECK(ekv_cache_create(g_ctx, c.pp, &adj) == EKV_OK, "adjacent pools (order %d): %s", order,
              ekv_last_error(g_ctx));
        ekv_cache_free(adj);
    }

    /* a pool that fits int64 but not in memory: OUT_OF_MEMORY, not a crash (ASan's
     * allocator aborts on such requests unless allocator_may_return_null=1, so skip) */
    if (!UNDER_ASAN) {
        cache_case c;
        cache_init(&c);
        c.p.num_pages = (int64_t)1 << 20;
        c.p.num_kv_heads = 4096;
        c.p.page_size = 256;
        c.p.head_dim = 1024;
        c.p.dtype = EKV_DTYPE_F32; /* 4 PiB per tensor */
        CHECK(ekv_cache_bytes_needed(c.pp) > 0, "bytes_needed of a valid huge pool");
        clear_error(g_ctx);
        ekv_status st = ekv_cache_create(c.ctx, c.pp, c.outp);
        expect("cache", "4 PiB pool", st, EKV_ERR_OUT_OF_MEMORY, g_ctx);
        CHECK(c.out == SENT_PTR, "cache [4 PiB pool]: *out written on error");
        if (st == EKV_OK) ekv_cache_free(c.out);
    }

    CHECK(ekv_cache_pages_for(-1, 1, 16) == -1, "pages_for(tokens=-1)");
    CHECK(ekv_cache_pages_for(1, -1, 16) == -1, "pages_for(seqs=-1)");
    CHECK(ekv_cache_pages_for(1, 1, 0) == -1, "pages_for(page_size=0)");
    CHECK(ekv_cache_pages_for(1, 1, -16) == -1, "pages_for(page_size=-16)");
    CHECK(ekv_cache_pages_for(INT64_MAX, INT64_MAX, 1) == -1, "pages_for overflow");
    CHECK(ekv_cache_pages_for(17, 2, 16) == 4, "pages_for(17, 2, 16)");
}

/* ================================================================================== */
/* Cache operations: append, page table, sequences, views                              */
/* ================================================================================== */
enum { A_TOK = 128, A_HK = 2, A_D = 8, A_ELEMS = A_TOK * A_HK * A_D };

typedef struct {
    ekv_cache *cache;
    int32_t seq;
    int64_t n;
    const void *k, *v;
    ekv_dtype dt;
} append_case;

/* The pool state that a failed call must leave alone. */
typedef struct {
    void *k, *v;
    float *st[5]; /* kmin, kmax, kmean, km2, radius */
    int32_t *count;
    size_t kv_bytes, stat_floats, radius_floats, count_n;
    int64_t free_pages, len[3];
    int alive[3];
} pool_snapshot;

static float g_kf[A_ELEMS], g_vf[A_ELEMS];
static uint16_t g_kh[A_ELEMS], g_vh[A_ELEMS];
static int32_t g_s0, g_s1_freed; /* s0: 5 tokens (2 pages); s1: created and freed */

#define APPEND_ROWS(X)                                                                             \
    X(EKV_ERR_NULL_POINTER, c->cache = NULL)                                                       \
    X(EKV_ERR_NULL_POINTER, c->k = NULL)                                                           \
    X(EKV_ERR_NULL_POINTER, c->v = NULL)                                                           \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = -1)                                                       \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = 3 /* max_seqs */)                                         \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = 2 /* never created */)                                    \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = g_s1_freed)                                               \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = INT32_MAX)                                                \
    X(EKV_ERR_INVALID_SEQUENCE, c->seq = INT32_MIN)                                                \
    X(EKV_ERR_INVALID_SIZE, c->n = 0)                                                              \
    X(EKV_ERR_INVALID_SIZE, c->n = -1)                                                             \
    X(EKV_ERR_INVALID_SIZE, c->n = INT64_MIN)                                                      \
    X(EKV_ERR_SIZE_OVERFLOW, c->n = INT64_MAX)                                                     \
    X(EKV_ERR_SIZE_OVERFLOW, c->n = INT64_MAX - 2)                                                 \
    X(EKV_ERR_CACHE_FULL, c->n = 12 /* 3 more pages needed, 2 free */)                             \
    X(EKV_ERR_CACHE_FULL, c->n = A_TOK)                                                            \
    X(EKV_ERR_INVALID_DTYPE, c->dt = (ekv_dtype)7)                                                 \
    X(EKV_ERR_INVALID_DTYPE, c->dt = (ekv_dtype)3)                                                 \
    X(EKV_ERR_INVALID_DTYPE, c->dt = (ekv_dtype)-1)                                                \
    X(EKV_ERR_NAN_INPUT, g_kf[5] = NAN)                                                            \
    X(EKV_ERR_NAN_INPUT, g_kf[0] = -INFINITY)                                                      \
    X(EKV_ERR_NAN_INPUT, g_kf[3 * A_HK * A_D - 1] = INFINITY)                                      \
    X(EKV_ERR_NAN_INPUT, g_vf[0] = NAN)                                                            \
    X(EKV_ERR_NAN_INPUT, g_vf[3 * A_HK * A_D - 1] = -INFINITY)                                     \
    X(EKV_ERR_NAN_INPUT, c->dt = EKV_DTYPE_F16; c->k = g_kh; c->v = g_vh; g_kh[7] = 0x7e00)        \
    X(EKV_ERR_NAN_INPUT, c->dt = EKV_DTYPE_F16; c->k = g_kh; c->v = g_vh; g_vh[40] = 0xfc00)       \
    X(EKV_ERR_NAN_INPUT, c->dt = EKV_DTYPE_BF16; c->k = g_kh; c->v = g_vh; g_kh[1] = 0x7f80)       \
    X(EKV_ERR_NAN_INPUT, c->dt = EKV_DTYPE_BF16; c->k = g_kh; c->v = g_vh; g_vh[47] = 0xffc1)

static const struct {
    const char *name;
    ekv_status want;
} append_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        APPEND_ROWS(X)
#undef X
};

static void append_mutate(append_case *c, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    APPEND_ROWS(X)
#undef X
}

static void fill_src(void) {
    for (int i = 0; i < A_ELEMS; i++) {
        g_kf[i] = (float)((i * 37 % 23) - 11) * 0.125f;
        g_vf[i] = (float)((i * 11 % 19) - 9) * 0.25f;
        g_kh[i] = 0x3800; /* f16 0.5; as bf16 a small finite number */
        g_vh[i] = 0xb800;
    }
}

static void append_init(append_case *c, ekv_cache *cache) {
    fill_src();
    c->cache = cache;
    c->seq = g_s0;
    c->n = 3;
    c->k = g_kf;
    c->v = g_vf;
    c->dt = EKV_DTYPE_F32;
}

static void snap_take(ekv_cache *c, pool_snapshot *s) {
    ekv_paged_kv kv;
    ekv_page_stats ps;
    memset(s, 0, sizeof *s);
    if (ekv_cache_kv_view(c, &kv, &ps) != EKV_OK) return;
    s->kv_bytes = (size_t)(kv.num_pages * kv.stride_page * ekv_dtype_size(kv.dtype));
    s->stat_floats = (size_t)(kv.num_pages * kv.num_kv_heads * kv.head_dim);
    s->radius_floats = (size_t)(kv.num_pages * kv.num_kv_heads);
    s->count_n = (size_t)kv.num_pages;
    s->k = malloc(s->kv_bytes);
    s->v = malloc(s->kv_bytes);
    memcpy(s->k, kv.k, s->kv_bytes);
    memcpy(s->v, kv.v, s->kv_bytes);
    const float *src[5] = {ps.kmin, ps.kmax, ps.kmean, ps.km2, ps.radius};
    for (int i = 0; i < 5; i++) {
        size_t n = i == 4 ? s->radius_floats : s->stat_floats;
        s->st[i] = malloc(n * sizeof(float));
        memcpy(s->st[i], src[i], n * sizeof(float));
    }
    s->count = malloc(s->count_n * sizeof(int32_t));
    memcpy(s->count, ps.count, s->count_n * sizeof(int32_t));
    s->free_pages = ekv_cache_free_pages(c);
    for (int32_t q = 0; q < 3; q++) {
        s->len[q] = -1;
        s->alive[q] = ekv_cache_seq_length(c, q, &s->len[q]) == EKV_OK;
    }
}

static int snap_same(ekv_cache *c, const pool_snapshot *s) {
    pool_snapshot now;
    snap_take(c, &now);
    int same = now.kv_bytes == s->kv_bytes && !memcmp(now.k, s->k, s->kv_bytes) &&
               !memcmp(now.v, s->v, s->kv_bytes) &&
               !memcmp(now.count, s->count, s->count_n * sizeof(int32_t)) &&
               now.free_pages == s->free_pages;
    for (int i = 0; i < 5; i++)
        same = same && !memcmp(now.st[i], s->st[i],
                               (i == 4 ? s->radius_floats : s->stat_floats) * sizeof(float));
    for (int q = 0; q < 3; q++)
        same = same && now.alive[q] == s->alive[q] && now.len[q] == s->len[q];
    free(now.k);
    free(now.v);
    free(now.count);
    for (int i = 0; i < 5; i++) free(now.st[i]);
    return same;
}

static void snap_free(pool_snapshot *s) {
    free(s->k);
    free(s->v);
    free(s->count);
    for (int i = 0; i < 5; i++) free(s->st[i]);
}

typedef struct {
    ekv_cache *cache;
    int32_t seqs[4];
    const int32_t *seqsp;
    int32_t n;
    int64_t indptr[5];
    int32_t indices[8];
    int32_t lpl[4];
    int64_t needed;
    int64_t *indptrp;
    int32_t *indicesp;
    int64_t cap;
    int32_t *lplp;
    int64_t *neededp;
} table_case;

#define TABLE_ROWS(X)                                                                              \
    X(EKV_ERR_NULL_POINTER, c->cache = NULL)                                                       \
    X(EKV_ERR_NULL_POINTER, c->seqsp = NULL)                                                       \
    X(EKV_ERR_NULL_POINTER, c->indptrp = NULL)                                                     \
    X(EKV_ERR_NULL_POINTER, c->lplp = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->indicesp = NULL; c->neededp = NULL)                                 \
    X(EKV_ERR_INVALID_SIZE, c->n = 0)                                                              \
    X(EKV_ERR_INVALID_SIZE, c->n = -1)                                                             \
    X(EKV_ERR_INVALID_SIZE, c->n = 0; c->indicesp = NULL)                                          \
    X(EKV_ERR_INVALID_SEQUENCE, c->seqs[0] = -1)                                                   \
    X(EKV_ERR_INVALID_SEQUENCE, c->seqs[0] = 3)                                                    \
    X(EKV_ERR_INVALID_SEQUENCE, c->seqs[0] = g_s1_freed)                                           \
    X(EKV_ERR_INVALID_SEQUENCE, c->n = 2; c->seqs[1] = 2 /* never created */)                      \
    X(EKV_ERR_INVALID_SEQUENCE, c->seqs[0] = g_s1_freed; c->indicesp = NULL)                       \
    X(EKV_ERR_INVALID_SIZE, c->cap = 1 /* 2 page ids needed */)                                    \
    X(EKV_ERR_INVALID_SIZE, c->cap = 0)                                                            \
    X(EKV_ERR_INVALID_SIZE, c->cap = -1)                                                           \
    X(EKV_ERR_INVALID_SIZE, c->cap = 1; c->neededp = NULL)

static const struct {
    const char *name;
    ekv_status want;
} table_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        TABLE_ROWS(X)
#undef X
};

static void table_mutate(table_case *c, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    TABLE_ROWS(X)
#undef X
}

static void table_init(table_case *c, ekv_cache *cache) {
    memset(c, SENT, sizeof *c);
    c->cache = cache;
    c->seqs[0] = g_s0;
    c->seqs[1] = g_s0;
    c->seqsp = c->seqs;
    c->n = 1;
    c->indptrp = c->indptr;
    c->indicesp = c->indices;
    c->cap = 8;
    c->lplp = c->lpl;
    c->neededp = &c->needed;
}

static void test_cache_ops(void) {
    ekv_cache_params p = small_cache_params();
    ekv_cache *cache = NULL;
    if (ekv_cache_create(g_ctx, &p, &cache) != EKV_OK) {
        CHECK(0, "cannot create the small cache: %s", ekv_last_error(g_ctx));
        return;
    }
    int32_t s1 = -1;
    CHECK(ekv_cache_seq_new(cache, &g_s0) == EKV_OK && ekv_cache_seq_new(cache, &s1) == EKV_OK,
          "seq_new");
    g_s1_freed = s1;
    CHECK(ekv_cache_seq_free(cache, s1) == EKV_OK, "seq_free");
    fill_src();
    CHECK(ekv_cache_append(cache, g_s0, 3, g_kf, g_vf, EKV_DTYPE_F32) == EKV_OK,
          "baseline append: %s", ekv_last_error(g_ctx));
    CHECK(ekv_cache_append(cache, g_s0, 2, g_kh, g_vh, EKV_DTYPE_F16) == EKV_OK,
          "baseline append f16: %s", ekv_last_error(g_ctx));
    int64_t len = 0;
    CHECK(ekv_cache_seq_length(cache, g_s0, &len) == EKV_OK && len == 5, "s0 length %lld",
          (long long)len);
    CHECK(ekv_cache_free_pages(cache) == 2, "free pages %lld",
          (long long)ekv_cache_free_pages(cache));
    CHECK(g_s0 != 2 && g_s1_freed != 2, "slot 2 is expected unused (s0=%d s1=%d)", g_s0,
          g_s1_freed);

    pool_snapshot snap;
    snap_take(cache, &snap);

    /* ---- append ---- */
    for (int r = 0; r < (int)(sizeof append_rows / sizeof append_rows[0]); r++) {
        append_case c;
        append_init(&c, cache);
        append_mutate(&c, r);
        clear_error(g_ctx);
        ekv_status st = ekv_cache_append(c.cache, c.seq, c.n, c.k, c.v, c.dt);
        expect("append", append_rows[r].name, st, append_rows[r].want, c.cache ? g_ctx : NULL);
        CHECK(snap_same(cache, &snap), "append [%s]: the cache changed on error",
              append_rows[r].name);
    }
    fill_src();

    /* ---- page table ---- */
    for (int r = 0; r < (int)(sizeof table_rows / sizeof table_rows[0]); r++) {
        table_case c;
        table_init(&c, cache);
        table_mutate(&c, r);
        clear_error(g_ctx);
        ekv_status st = ekv_cache_page_table(c.cache, c.seqsp, c.n, c.indptrp, c.indicesp, c.cap,
                                             c.lplp, c.neededp);
        expect("table", table_rows[r].name, st, table_rows[r].want, c.cache ? g_ctx : NULL);
        CHECK(filled(c.indptr, sizeof c.indptr) && filled(c.indices, sizeof c.indices) &&
                      filled(c.lpl, sizeof c.lpl) && filled(&c.needed, sizeof c.needed),
              "table [%s]: an output was written on error", table_rows[r].name);
        CHECK(snap_same(cache, &snap), "table [%s]: the cache changed", table_rows[r].name);
    }
    { /* the query form writes only *needed; the full form writes the table */
        table_case c;
        table_init(&c, cache);
        CHECK(ekv_cache_page_table(cache, c.seqs, 1, NULL, NULL, 0, NULL, &c.needed) == EKV_OK &&
                      c.needed == 2,
              "page_table query: needed = %lld", (long long)c.needed);
        CHECK(filled(c.indptr, sizeof c.indptr) && filled(c.indices, sizeof c.indices) &&
                      filled(c.lpl, sizeof c.lpl),
              "page_table query wrote the table");
        CHECK(ekv_cache_page_table(cache, c.seqs, 1, c.indptr, c.indices, 2, c.lpl, NULL) ==
                              EKV_OK &&
                      c.indptr[0] == 0 && c.indptr[1] == 2 && c.lpl[0] == 1,
              "page_table with exact capacity");
    }

    /* ---- sequences and views ---- */
    {
        int32_t s = 77;
        memset(&s, SENT, sizeof s);
        CHECK(ekv_cache_seq_new(NULL, &s) == EKV_ERR_NULL_POINTER && filled(&s, sizeof s),
              "seq_new(NULL cache)");
        clear_error(g_ctx);
        expect("seq", "seq_new(cache, NULL)", ekv_cache_seq_new(cache, NULL), EKV_ERR_NULL_POINTER,
               g_ctx);
        CHECK(snap_same(cache, &snap), "seq_new(cache, NULL) changed the cache");

        static const struct {
            const char *name;
            int32_t seq;
        } bad[] = {{"-1", -1},
                   {"max_seqs", 3},
                   {"never created", 2},
                   {"INT32_MAX", INT32_MAX},
                   {"INT32_MIN", INT32_MIN},
                   {"freed", -2}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            int32_t q = bad[i].seq == -2 ? g_s1_freed : bad[i].seq;
            char name[64];
            int64_t l;
            snprintf(name, sizeof name, "seq_length(%s)", bad[i].name);
            memset(&l, SENT, sizeof l);
            clear_error(g_ctx);
            expect("seq", name, ekv_cache_seq_length(cache, q, &l), EKV_ERR_INVALID_SEQUENCE,
                   g_ctx);
            CHECK(filled(&l, sizeof l), "%s wrote its output", name);
            snprintf(name, sizeof name, "seq_free(%s)", bad[i].name);
            clear_error(g_ctx);
            expect("seq", name, ekv_cache_seq_free(cache, q), EKV_ERR_INVALID_SEQUENCE, g_ctx);
            CHECK(snap_same(cache, &snap), "%s changed the cache", name);
        }
        int64_t l;
        memset(&l, SENT, sizeof l);
        CHECK(ekv_cache_seq_length(NULL, g_s0, &l) == EKV_ERR_NULL_POINTER && filled(&l, sizeof l),
              "seq_length(NULL)");
        clear_error(g_ctx);
        expect("seq", "seq_length(cache, s0, NULL)", ekv_cache_seq_length(cache, g_s0, NULL),
               EKV_ERR_NULL_POINTER, g_ctx);
        CHECK(ekv_cache_seq_free(NULL, g_s0) == EKV_ERR_NULL_POINTER, "seq_free(NULL)");
        CHECK(ekv_cache_free_pages(NULL) == 0, "free_pages(NULL)");

        ekv_paged_kv kv;
        ekv_page_stats ps;
        memset(&kv, SENT, sizeof kv);
        memset(&ps, SENT, sizeof ps);
        CHECK(ekv_cache_kv_view(NULL, &kv, &ps) == EKV_ERR_NULL_POINTER, "kv_view(NULL)");
        clear_error(g_ctx);
        expect("view", "kv_view(cache, NULL, NULL)", ekv_cache_kv_view(cache, NULL, NULL),
               EKV_ERR_NULL_POINTER, g_ctx);
        CHECK(filled(&kv, sizeof kv) && filled(&ps, sizeof ps),
              "kv_view wrote its outputs on error");
        CHECK(snap_same(cache, &snap), "seq/view rows changed the cache");
    }
    snap_free(&snap);

    /* all sequence slots in use */
    {
        ekv_cache_params p1 = small_cache_params();
        p1.max_seqs = 1;
        ekv_cache *c1 = NULL;
        int32_t a = -1, b;
        if (ekv_cache_create(g_ctx, &p1, &c1) == EKV_OK) {
            CHECK(ekv_cache_seq_new(c1, &a) == EKV_OK && a == 0, "seq_new on a fresh cache");
            memset(&b, SENT, sizeof b);
            clear_error(g_ctx);
            expect("seq", "seq_new with every slot in use", ekv_cache_seq_new(c1, &b),
                   EKV_ERR_INVALID_SEQUENCE, g_ctx);
            CHECK(filled(&b, sizeof b), "seq_new wrote *seq_out on error");
            CHECK(ekv_cache_seq_free(c1, a) == EKV_OK, "seq_free");
            clear_error(g_ctx);
            expect("seq", "seq_free twice", ekv_cache_seq_free(c1, a), EKV_ERR_INVALID_SEQUENCE,
                   g_ctx);
            CHECK(ekv_cache_free_pages(c1) == p1.num_pages, "a double free changed the free list");
            ekv_cache_free(c1);
        } else {
            CHECK(0, "cannot create the one-slot cache");
        }
    }
    ekv_cache_free(cache);
}

/* ================================================================================== */
/* ekv_decode_dense / ekv_decode_dense_ref                                             */
/* ================================================================================== */
enum {
    D_PS = 4,
    D_HK = 2,
    D_D = 8,
    D_NP = 4,
    D_B = 2,
    D_H = 4,
    D_HMAX = 520,
    D_QMAX = D_B * D_HMAX * D_D
};

typedef struct {
    ekv_context *ctx;
    ekv_decode_params prm;
    ekv_paged_kv kv;
    ekv_page_table tab;
    int64_t indptr[D_B + 1];
    int32_t indices[4];
    int32_t lpl[D_B];
    float slopes[D_HMAX];
    float q[D_QMAX];
    const ekv_decode_params *prmp;
    const ekv_paged_kv *kvp;
    const ekv_page_table *tabp;
    const float *qp;
    float *outp;
    ekv_decode_info *infop;
} decode_case;

static float g_k[D_NP * D_HK * D_PS * D_D], g_v[D_NP * D_HK * D_PS * D_D];
static float g_out[D_QMAX];
static double g_tau[D_B * D_HMAX];
static int64_t g_sup[D_B * D_HMAX];
static ekv_decode_info g_info;
static decode_case g_dc;

#define DECODE_ROWS(X)                                                                             \
    X(EKV_ERR_NULL_POINTER, c->prmp = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->kvp = NULL)                                                         \
    X(EKV_ERR_NULL_POINTER, c->tabp = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->qp = NULL)                                                          \
    X(EKV_ERR_NULL_POINTER, c->outp = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->kv.k = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->kv.v = NULL)                                                        \
    X(EKV_ERR_NULL_POINTER, c->tab.indptr = NULL)                                                  \
    X(EKV_ERR_NULL_POINTER, c->tab.indices = NULL)                                                 \
    X(EKV_ERR_NULL_POINTER, c->tab.last_page_len = NULL)                                           \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = 0)                                                     \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = -2)                                                    \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = 0.999)                                                 \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = 4.001)                                                 \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = NAN)                                                   \
    X(EKV_ERR_INVALID_ALPHA, c->prm.alpha = INFINITY)                                              \
    X(EKV_ERR_INVALID_DTYPE, c->kv.dtype = (ekv_dtype)7)                                           \
    X(EKV_ERR_INVALID_DTYPE, c->kv.dtype = (ekv_dtype)3)                                           \
    X(EKV_ERR_INVALID_DTYPE, c->kv.dtype = (ekv_dtype)-1)                                          \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->kv.page_size = 0)                                              \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->kv.page_size = 257)                                            \
    X(EKV_ERR_INVALID_PAGE_SIZE, c->kv.page_size = -4)                                             \
    X(EKV_ERR_INVALID_SIZE, c->kv.head_dim = 0)                                                    \
    X(EKV_ERR_INVALID_SIZE, c->kv.head_dim = -8)                                                   \
    X(EKV_ERR_INVALID_SIZE, c->kv.head_dim = 65537)                                                \
    X(EKV_ERR_INVALID_SIZE, c->kv.num_kv_heads = 0)                                                \
    X(EKV_ERR_INVALID_SIZE, c->kv.num_kv_heads = -2)                                               \
    X(EKV_ERR_INVALID_SIZE, c->prm.num_heads = 0)                                                  \
    X(EKV_ERR_INVALID_SIZE, c->prm.num_heads = -4)                                                 \
    X(EKV_ERR_HEAD_MISMATCH, c->prm.num_heads = 3)                                                 \
    X(EKV_ERR_HEAD_MISMATCH, c->prm.num_heads = 1)                                                 \
    X(EKV_ERR_HEAD_MISMATCH, c->kv.num_kv_heads = 3)                                               \
    X(EKV_ERR_HEAD_MISMATCH, c->kv.num_kv_heads = 8)                                               \
    X(EKV_ERR_INVALID_SIZE, c->kv.num_pages = 0)                                                   \
    X(EKV_ERR_INVALID_SIZE, c->kv.num_pages = -1)                                                  \
    X(EKV_ERR_INVALID_SIZE, c->kv.num_pages = (int64_t)INT32_MAX + 1)                              \
    X(EKV_ERR_INVALID_SIZE, c->kv.stride_token = D_D - 1)                                          \
    X(EKV_ERR_INVALID_SIZE, c->kv.stride_token = -D_D)                                             \
    X(EKV_ERR_INVALID_SIZE, c->kv.stride_head = 0)                                                 \
    X(EKV_ERR_INVALID_SIZE, c->kv.stride_page = 0)                                                 \
    X(EKV_ERR_INVALID_SIZE, c->kv.stride_page = -1)                                                \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.stride_page = INT64_MAX / 2)                                    \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.stride_page = INT64_MAX / 8; c->kv.dtype = EKV_DTYPE_F32)       \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.num_pages = INT32_MAX; c->kv.stride_page = (int64_t)1 << 40)    \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.stride_head = INT64_MAX / 2)                                    \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.stride_head = (int64_t)1 << 61 /* bytes */)                     \
    X(EKV_ERR_SIZE_OVERFLOW, c->kv.stride_token = (int64_t)1 << 61)                                \
    X(EKV_ERR_INVALID_ARGUMENT, c->prm.scale = -1.0f)                                              \
    X(EKV_ERR_INVALID_ARGUMENT, c->prm.scale = -FLT_MIN)                                           \
    X(EKV_ERR_INVALID_ARGUMENT, c->prm.scale = NAN)                                                \
    X(EKV_ERR_INVALID_ARGUMENT, c->prm.scale = INFINITY)                                           \
    X(EKV_ERR_INVALID_ARGUMENT, c->slopes[0] = -0.5f)                                              \
    X(EKV_ERR_INVALID_ARGUMENT, c->slopes[D_H - 1] = NAN)                                          \
    X(EKV_ERR_INVALID_ARGUMENT, c->slopes[1] = INFINITY)                                           \
    X(EKV_ERR_INVALID_ARGUMENT, c->slopes[2] = -INFINITY)                                          \
    X(EKV_ERR_INVALID_SIZE, c->tab.batch = 0)                                                      \
    X(EKV_ERR_INVALID_SIZE, c->tab.batch = -1)                                                     \
    X(EKV_ERR_INVALID_ARGUMENT, c->indptr[0] = 1)                                                  \
    X(EKV_ERR_INVALID_ARGUMENT, c->indptr[0] = -1)                                                 \
    X(EKV_ERR_INVALID_ARGUMENT, c->indptr[2] = 1 /* decreasing */)                                 \
    X(EKV_ERR_INVALID_ARGUMENT, c->indptr[1] = -1; c->indptr[2] = 0)                               \
    X(EKV_ERR_EMPTY_INPUT, c->indptr[2] = 2 /* sequence 1 has no pages */)                         \
    X(EKV_ERR_EMPTY_INPUT, c->indptr[1] = 0 /* sequence 0 has no pages */)                         \
    X(EKV_ERR_INVALID_ARGUMENT, c->lpl[0] = 0)                                                     \
    X(EKV_ERR_INVALID_ARGUMENT, c->lpl[1] = 0)                                                     \
    X(EKV_ERR_INVALID_ARGUMENT, c->lpl[1] = -1)                                                    \
    X(EKV_ERR_INVALID_ARGUMENT, c->lpl[0] = D_PS + 1)                                              \
    X(EKV_ERR_INVALID_ARGUMENT, c->lpl[1] = INT32_MAX)                                             \
    X(EKV_ERR_INVALID_ARGUMENT, c->indices[0] = D_NP)                                              \
    X(EKV_ERR_INVALID_ARGUMENT, c->indices[2] = -1)                                                \
    X(EKV_ERR_INVALID_ARGUMENT, c->indices[1] = INT32_MAX)                                         \
    X(EKV_ERR_INVALID_ARGUMENT, c->kv.num_pages = 2 /* page 2 is used */)                          \
    X(EKV_ERR_NAN_INPUT, c->q[0] = NAN)                                                            \
    X(EKV_ERR_NAN_INPUT, c->q[D_B * D_H * D_D - 1] = NAN)                                          \
    X(EKV_ERR_NAN_INPUT, c->q[17] = INFINITY)                                                      \
    X(EKV_ERR_NAN_INPUT, c->q[40] = -INFINITY)

static const struct {
    const char *name;
    ekv_status want;
} decode_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        DECODE_ROWS(X)
#undef X
};

static void decode_mutate(decode_case *c, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    DECODE_ROWS(X)
#undef X
}

static void decode_init(decode_case *c, ekv_context *ctx, double alpha) {
    memset(c, 0, sizeof *c);
    c->ctx = ctx;
    c->prm = ekv_decode_default_params();
    c->prm.num_heads = D_H;
    c->prm.alpha = alpha;
    c->prm.scale = 0.f;
    for (int h = 0; h < D_HMAX; h++) c->slopes[h] = 0.0625f * (float)(h % 5);
    c->prm.alibi_slopes = c->slopes;
    c->kv.k = g_k;
    c->kv.v = g_v;
    c->kv.dtype = EKV_DTYPE_F32;
    c->kv.page_size = D_PS;
    c->kv.num_kv_heads = D_HK;
    c->kv.head_dim = D_D;
    c->kv.num_pages = D_NP;
    c->kv.stride_token = D_D;
    c->kv.stride_head = D_PS * D_D;
    c->kv.stride_page = D_HK * D_PS * D_D;
    /* sequence 0: pages {3, 1}, 3 tokens in the last (7 tokens); sequence 1: page {2}, full */
    c->indptr[0] = 0;
    c->indptr[1] = 2;
    c->indptr[2] = 3;
    c->indices[0] = 3;
    c->indices[1] = 1;
    c->indices[2] = 2;
    c->indices[3] = 0;
    c->lpl[0] = 3;
    c->lpl[1] = D_PS;
    c->tab.batch = D_B;
    c->tab.indptr = c->indptr;
    c->tab.indices = c->indices;
    c->tab.last_page_len = c->lpl;
    for (int i = 0; i < D_QMAX; i++) c->q[i] = (float)((i * 13 % 17) - 8) * 0.25f;
    c->prmp = &c->prm;
    c->kvp = &c->kv;
    c->tabp = &c->tab;
    c->qp = c->q;
    c->outp = g_out;
    c->infop = &g_info;
}

static void decode_sentinels(void) {
    memset(g_out, SENT, sizeof g_out);
    memset(g_tau, SENT, sizeof g_tau);
    memset(g_sup, SENT, sizeof g_sup);
    memset(&g_info, SENT, sizeof g_info);
    g_info.tau = g_tau;
    g_info.support = g_sup;
}

static int decode_untouched(void) {
    return filled(g_out, sizeof g_out) && filled(g_tau, sizeof g_tau) &&
           filled(g_sup, sizeof g_sup) && filled(&g_info.bytes_k, sizeof g_info.bytes_k) &&
           filled(&g_info.bytes_v, sizeof g_info.bytes_v) && g_info.tau == g_tau &&
           g_info.support == g_sup;
}

static ekv_status decode_call(const decode_case *c, int ref) {
    return ref ? ekv_decode_dense_ref(c->ctx, c->prmp, c->kvp, c->tabp, c->qp, c->outp, c->infop)
               : ekv_decode_dense(c->ctx, c->prmp, c->kvp, c->tabp, c->qp, c->outp, c->infop);
}

static void test_decode(void) {
    for (int i = 0; i < (int)(sizeof g_k / sizeof g_k[0]); i++) {
        g_k[i] = (float)((i * 7 % 13) - 6) * 0.2f;
        g_v[i] = (float)((i * 5 % 11) - 5) * 0.3f;
    }
    static const double alphas[] = {1.5, 1.0, 2.0};
    for (size_t a = 0; a < sizeof alphas / sizeof alphas[0]; a++) {
        for (int ref = 0; ref < 2; ref++) {
            const char *be = ref ? "decode_ref" : "decode";
            /* the baseline is valid */
            decode_case *c = &g_dc;
            decode_init(c, g_ctx, alphas[a]);
            decode_sentinels();
            ekv_status st = decode_call(c, ref);
            CHECK(st == EKV_OK, "%s baseline alpha=%g: %d (%s)", be, alphas[a], st,
                  ekv_last_error(g_ctx));
            CHECK(!filled(g_out, D_B * D_H * D_D * sizeof(float)), "%s baseline wrote no output",
                  be);
            c->infop = NULL; /* info is optional */
            CHECK(decode_call(c, ref) == EKV_OK, "%s baseline with info = NULL", be);
            c->prm.alibi_slopes = NULL; /* no ALiBi is valid */
            CHECK(decode_call(c, ref) == EKV_OK, "%s baseline without ALiBi", be);

            for (int r = 0; r < (int)(sizeof decode_rows / sizeof decode_rows[0]); r++) {
                for (int with_ctx = 1; with_ctx >= 0; with_ctx--) {
                    if (!with_ctx && !ref) continue; /* dense requires a context: tested below */
                    char name[200];
                    snprintf(name, sizeof name, "%s, alpha=%g%s", decode_rows[r].name, alphas[a],
                             with_ctx ? "" : ", ctx NULL");
                    decode_init(c, with_ctx ? g_ctx : NULL, alphas[a]);
                    decode_mutate(c, r);
                    decode_sentinels();
                    clear_error(c->ctx);
                    st = decode_call(c, ref);
                    expect(be, name, st, decode_rows[r].want, c->ctx);
                    CHECK(decode_untouched(), "%s [%s]: an output was written on error", be, name);
                }
            }
        }
        /* dense needs a context */
        decode_init(&g_dc, NULL, alphas[a]);
        decode_sentinels();
        expect("decode", "ctx = NULL",
               ekv_decode_dense(NULL, g_dc.prmp, g_dc.kvp, g_dc.tabp, g_dc.qp, g_dc.outp,
                                g_dc.infop),
               EKV_ERR_NULL_POINTER, NULL);
        CHECK(decode_untouched(), "decode [ctx = NULL]: an output was written");
        /* GQA groups above 256 are a documented limit of the CPU backend */
        decode_init(&g_dc, g_ctx, alphas[a]);
        g_dc.prm.num_heads = 2 * 257;
        decode_sentinels();
        clear_error(g_ctx);
        expect("decode", "GQA group 257", decode_call(&g_dc, 0), EKV_ERR_UNSUPPORTED, g_ctx);
        CHECK(decode_untouched(), "decode [GQA group 257]: an output was written");
    }
}

/* ================================================================================== */
/* The device cache: its params and layout (host arithmetic, every build), and the     */
/* answers of a build or a machine without CUDA                                        */
/* ================================================================================== */
#define CUDA_CACHE_ROWS(X)                                                                         \
    X(EKV_ERR_INVALID_SIZE, p->num_pages = 0)                                                      \
    X(EKV_ERR_SIZE_OVERFLOW, p->num_pages = (int64_t)INT32_MAX + 1)                                \
    X(EKV_ERR_INVALID_PAGE_SIZE, p->page_size = 257)                                               \
    X(EKV_ERR_INVALID_SIZE, p->num_kv_heads = 0)                                                   \
    X(EKV_ERR_INVALID_SIZE, p->head_dim = 0)                                                       \
    X(EKV_ERR_INVALID_SIZE, p->head_dim = 12)                                                      \
    X(EKV_ERR_INVALID_SIZE, p->head_dim = 520)                                                     \
    X(EKV_ERR_INVALID_DTYPE, p->dtype = (ekv_dtype)3)                                              \
    X(EKV_ERR_INVALID_DTYPE, p->range_dtype = (ekv_dtype)-1)                                       \
    X(EKV_ERR_INVALID_ARGUMENT, p->layout = (ekv_kv_layout)2)                                      \
    X(EKV_ERR_INVALID_ARGUMENT, p->code_bits = 2)                                                  \
    X(EKV_ERR_INVALID_SIZE, p->superpage_pages = -1)                                               \
    X(EKV_ERR_INVALID_ARGUMENT, p->compact_ball = 2)                                               \
    X(EKV_ERR_INVALID_ARGUMENT, p->device = -1)

static const struct {
    const char *name;
    ekv_status want;
} cuda_cache_rows[] = {
#define X(want, ...) {#__VA_ARGS__, want},
        CUDA_CACHE_ROWS(X)
#undef X
};

static void cuda_cache_mutate(ekv_cuda_cache_params *p, int row) {
    int i = 0;
#define X(want, ...)                                                                               \
    if (row == i++) { __VA_ARGS__; }
    CUDA_CACHE_ROWS(X)
#undef X
}

/* 10 pages of 16 tokens, 2 KV heads of 64 dims in f16, f16 ranges with the compact ball,
 * superpages of 4, 4-bit codes: every array of the block. */
static ekv_cuda_cache_params cuda_cache_params_full(void) {
    ekv_cuda_cache_params p = ekv_cuda_cache_default_params();
    p.num_pages = 10;
    p.num_kv_heads = 2;
    p.head_dim = 64;
    p.range_dtype = EKV_DTYPE_F16;
    p.superpage_pages = 4;
    p.code_bits = 4;
    return p;
}

/* The views over a block: each array where the layout says (256-byte steps; its bytes: kmin
 * 10*2*64*4 = 5120, radius 80, count 40, kmin16 2560, smin 3 superpages * 2 * 64 * 4 = 1536,
 * codes 10*2*16 rows of 32 bytes), absent arrays NULL, the strides of each layout. */
static void test_cuda_cache_layout(void) {
    ekv_cuda_cache_params p = cuda_cache_params_full();
    ekv_cuda_cache_layout lay;
    CHECK(ekv_cuda_cache_layout_of(g_ctx, &p, &lay) == EKV_OK, "layout: %s", ekv_last_error(g_ctx));
    char *b = aligned_alloc(256, (size_t)lay.stats_bytes);
    if (!b) return;
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_cuda_cache_views(&p, &lay, (void *)16, (void *)32, b, &kv, &st);
    const void *got[] = {st.kmin,  st.kmax,   st.kmean,  st.km2,     st.radius,
                         st.count, st.kmin16, st.kmax16, st.kmean16, st.radius16,
                         st.smin,  st.smax,   st.codes};
    const int64_t want[] = {0,     5120,  10240, 15360, 20480, 20736, 20992,
                            23552, 26112, 28672, 28928, 30464, 32000};
    for (int i = 0; i < 13; i++)
        CHECK((const char *)got[i] == b + want[i], "array %d at %lld, want %lld", i,
              (long long)((const char *)got[i] - b), (long long)want[i]);
    CHECK(st.code_bits == 4 && st.range_dtype == EKV_DTYPE_F16 && st.superpage_pages == 4 &&
                  st.num_superpages == 3 && st.num_pages == 10 && st.num_kv_heads == 2 &&
                  st.head_dim == 64 && st.page_size == 16,
          "the statistics' counts");
    CHECK(kv.k == (void *)16 && kv.v == (void *)32 && kv.stride_page == 2 * 16 * 64 &&
                  kv.stride_head == 16 * 64 && kv.stride_token == 64 && kv.num_pages == 10,
          "HND view");
    p.layout = EKV_LAYOUT_NHD;
    p.compact_ball = 0;
    p.code_bits = 0;
    p.superpage_pages = 0;
    ekv_cuda_cache_layout_of(g_ctx, &p, &lay);
    ekv_cuda_cache_views(&p, &lay, (void *)16, (void *)32, b, &kv, &st);
    CHECK(kv.stride_head == 64 && kv.stride_token == 2 * 64 && st.kmin16 && !st.kmean16 &&
                  !st.radius16 && !st.codes && st.code_bits == 0 && !st.smin && !st.smax &&
                  st.superpage_pages == 0 && st.num_superpages == 0 && lay.stats_bytes == 26112,
          "NHD, no ball, codes or boxes: %lld bytes", (long long)lay.stats_bytes);
    free(b);
}

static void test_cuda_cache(void) {
    const ekv_cuda_cache_params base = cuda_cache_params_full();
    int64_t pool = -1, stats = -1;
    CHECK(ekv_cuda_cache_sizes(g_ctx, &base, &pool, &stats) == EKV_OK &&
                  pool == 10 * 2 * 16 * 64 * 2 && stats == 32000 + 10240,
          "sizes of the baseline: %lld, %lld (%s)", (long long)pool, (long long)stats,
          ekv_last_error(g_ctx));
    for (int r = 0; r < (int)(sizeof cuda_cache_rows / sizeof cuda_cache_rows[0]); r++) {
        ekv_cuda_cache_params p = base;
        cuda_cache_mutate(&p, r);
        clear_error(g_ctx);
        pool = stats = -7;
        expect("cuda cache", cuda_cache_rows[r].name,
               ekv_cuda_cache_sizes(g_ctx, &p, &pool, &stats), cuda_cache_rows[r].want, g_ctx);
        CHECK(pool == -7 && stats == -7, "cuda cache [%s]: sizes written", cuda_cache_rows[r].name);
    }
    expect("cuda cache", "params NULL", ekv_cuda_cache_sizes(g_ctx, NULL, &pool, &stats),
           EKV_ERR_NULL_POINTER, g_ctx);
    test_cuda_cache_layout();
    int32_t ndev = 0;
    ekv_cuda_device_count(g_ctx, &ndev);
    if (ndev) return; /* a GPU machine: tests/gpu/test_cuda.c */
#ifdef EKV_HAVE_CUDA
    const char *why = "no CUDA device";
#else
    const char *why = "this build has no CUDA backend";
#endif
    ekv_cuda_cache *c = SENT_PTR;
    char k[64], v[64], st[64];
    const ekv_status got[2] = {ekv_cuda_cache_create(g_ctx, &base, &c),
                               c == NULL ? ekv_cuda_cache_adopt(g_ctx, &base, k, v, st, &c)
                                         : EKV_OK};
    for (int i = 0; i < 2; i++)
        expect("cuda cache", i ? "adopt without a device" : "create without a device", got[i],
               EKV_ERR_UNSUPPORTED, g_ctx);
    CHECK(c == NULL && strstr(ekv_last_error(g_ctx), why), "without a device: '%s', want '%s'",
          ekv_last_error(g_ctx), why);
    ekv_cuda_cache_free(NULL);
#ifndef EKV_HAVE_CUDA
    ekv_cuda_append_item item = {0, 0, 1, 0, 0};
    ekv_paged_kv kv;
    int32_t page = 0;
    float x[64] = {0};
    CHECK(ekv_cuda_cache_view(c, &kv, NULL) == EKV_ERR_UNSUPPORTED &&
                  ekv_cuda_cache_append(NULL, c, &item, 1, x, x) == EKV_ERR_UNSUPPORTED &&
                  ekv_cuda_cache_truncate(NULL, c, &page, 1, 1, 0) == EKV_ERR_UNSUPPORTED,
          "the stubs of a build without CUDA");
#endif
}

int main(void) {
    const char *v = getenv("EKV_TEST_VERBOSE");
    g_verbose = v && v[0] && v[0] != '0';
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    ekv_status st = ekv_context_create(&cp, &g_ctx);
    if (st != EKV_OK) {
        fprintf(stderr, "cannot create a context: %s\n", ekv_status_string(st));
        return 1;
    }
    test_names();
    test_context();
    test_entmax();
    test_cache_create();
    test_cache_ops();
    test_decode();
    test_cuda_cache();
    ekv_context_free(g_ctx);
    return test_finish("test_invalid");
}
