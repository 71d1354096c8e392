/*
 * Hostile and extreme inputs (issue 11, item 9): every case here failed, crashed or hung
 * before its fix.
 *   1. entmax of huge finite rows: finite, exact probabilities (was NaN with OK);
 *   2. one context from two threads: a clear status, not a crash or a deadlock; two
 *      contexts in two threads still give single-thread results;
 *   3. a cache pool larger than physical memory fails fast (was granted under overcommit);
 *   4. a directory or a device as a safetensors file: "not a regular file" (was malloc(2^63-1));
 *   5. ekv_model_step checks the count before reading the tokens;
 *   6. misaligned data: a model whose safetensors header has an odd length gives the logits of
 *      an aligned copy, and ekv_cache_append from misaligned K/V (a trace file's data) stores
 *      what an aligned append stores (the sanitizer build caught the misaligned load).
 * Issue 32 (round 2):
 *   7. every cache call, the readers too, refuses a second thread on its context (a page table
 *      read during an append was a heap-use-after-free and overflowed the caller's indices);
 *   8. a view and statistics of different caches: a status (was a heap-buffer-overflow);
 *   9. offsets past int64: huge view strides, certified sink/recent pages of INT32_MAX and
 *      ekv_shard_pages of INT64_MAX pages give a status or the right answer (were signed
 *      overflows, reported by UBSan, which the sanitizer build makes fatal).
 */
#include "core/internal.h"
#include "test_util.h"
#include <float.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const double ALPHAS[] = {1.0, 1.25, 1.5, 2.0, 4.0};
enum { NALPHA = 5 };

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* p must be exactly `want` (one-hot or an even split): the obvious answer for huge gaps. */
static void check_row_f32(const char *what, const float *x, int n, const double *want) {
    for (int a = 0; a < NALPHA; a++) {
        float p[8];
        double tau = NAN;
        int64_t sup = -1;
        ekv_status st = ekv_entmax(NULL, x, n, ALPHAS[a], p, &tau, &sup);
        CHECK(st == EKV_OK, "%s alpha %g: %s", what, ALPHAS[a], ekv_status_string(st));
        CHECK(isfinite(tau), "%s alpha %g: tau %g", what, ALPHAS[a], tau);
        int64_t want_sup = 0;
        for (int i = 0; i < n; i++) {
            want_sup += want[i] > 0;
            CHECK(fabs((double)p[i] - want[i]) <= 1e-7, "%s alpha %g: p[%d] = %g, want %g", what,
                  ALPHAS[a], i, (double)p[i], want[i]);
        }
        CHECK(sup == want_sup, "%s alpha %g: support %lld, want %lld", what, ALPHAS[a],
              (long long)sup, (long long)want_sup);
    }
}

static void test_entmax_scale(void) {
    const float big[2] = {2e16f, 0.f}; /* the CLI's `echo "2e16 0" | entmaxkv entmax` */
    check_row_f32("2e16 0", big, 2, (const double[]){1, 0});
    const float neg[3] = {-3e38f, -3.1e38f, -INFINITY};
    check_row_f32("-3e38 -3.1e38 -inf", neg, 3, (const double[]){1, 0, 0});
    const float mixed[4] = {-INFINITY, 3e38f, -INFINITY, -3e38f};
    check_row_f32("mixed -inf, +-3e38", mixed, 4, (const double[]){0, 1, 0, 0});
    const float tie[3] = {1e30f, 1e30f, -INFINITY}; /* exact tie at a huge magnitude */
    check_row_f32("1e30 tie", tie, 3, (const double[]){0.5, 0.5, 0});
    /* near tie: 1e30*(1+1e-7) is one float ulp (7.6e22) above 1e30, a huge gap in p terms */
    const float near[2] = {1e30f, 1e30f * (1.0f + 1e-7f)};
    CHECK(near[1] > near[0], "near tie collapsed in float");
    check_row_f32("1e30 near tie", near, 2, (const double[]){0, 1});

    /* double precision: the same answers as the unshifted small row, at any offset */
    for (int a = 0; a < NALPHA; a++) {
        const double small[3] = {0.5, 0.0, -0.25};
        double ps[3], pb[3], x[3], tau;
        CHECK(ekv_entmax_f64(NULL, small, 3, ALPHAS[a], ps, NULL, NULL) == EKV_OK, "small row");
        for (int i = 0; i < 3; i++)
            x[i] = 1e300 + small[i]; /* the offset swallows the row: a tie */
        CHECK(ekv_entmax_f64(NULL, x, 3, ALPHAS[a], pb, &tau, NULL) == EKV_OK, "1e300 row");
        for (int i = 0; i < 3; i++)
            CHECK(fabs(pb[i] - 1.0 / 3) < 1e-12 && isfinite(tau), "alpha %g: 1e300 tie p[%d] = %g",
                  ALPHAS[a], i, pb[i]);
        for (int i = 0; i < 3; i++)
            x[i] = 1e9 + small[i]; /* exactly representable: p of the small row */
        CHECK(ekv_entmax_f64(NULL, x, 3, ALPHAS[a], pb, NULL, NULL) == EKV_OK, "1e9 row");
        for (int i = 0; i < 3; i++)
            CHECK(fabs(pb[i] - ps[i]) < 1e-12, "alpha %g: 1e9 + x: p[%d] = %.17g, want %.17g",
                  ALPHAS[a], i, pb[i], ps[i]);
        const double extreme[2] = {DBL_MAX, -DBL_MAX}; /* x - max overflows to -inf: weight 0 */
        CHECK(ekv_entmax_f64(NULL, extreme, 2, ALPHAS[a], pb, NULL, NULL) == EKV_OK && pb[0] == 1 &&
                      pb[1] == 0,
              "alpha %g: +-DBL_MAX gives %g %g", ALPHAS[a], pb[0], pb[1]);
    }
    /* tau = 3 * DBL_MAX is not a double: a clear status, never inf or NaN with OK */
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    const double extreme[2] = {DBL_MAX, 0};
    double p[2], tau = 0;
    ekv_status st = ekv_entmax_f64(ctx, extreme, 2, 4.0, p, &tau, NULL);
    CHECK(st == EKV_ERR_INVALID_ARGUMENT && strstr(ekv_last_error(ctx), "overflows"),
          "tau overflow: %s: %s", ekv_status_string(st), ekv_last_error(ctx));
    ekv_context_free(ctx);
}

/* ---- 2. one context, two threads ---- */
typedef struct {
    ekv_model *m;
    int steps, ok, busy, other;
    pthread_barrier_t *start;
} hammer_arg;

static void *hammer(void *vp) {
    hammer_arg *h = vp;
    pthread_barrier_wait(h->start);
    int32_t tok[4] = {1, 2, 3, 4};
    for (int i = 0; i < h->steps; i++) {
        if (ekv_model_position(h->m) + 4 > 64) ekv_model_reset(h->m);
        ekv_status st = ekv_model_step(h->m, tok, 4, NULL);
        if (st == EKV_OK)
            h->ok++;
        else if (st == EKV_ERR_INVALID_ARGUMENT)
            h->busy++;
        else
            h->other++;
    }
    return NULL;
}

static ekv_model *load_model(ekv_context *ctx, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", EKV_TEST_DATA_DIR, name);
    ekv_model_params mp = ekv_model_default_params();
    mp.max_tokens = 64;
    ekv_model *m = NULL;
    ekv_status st = ekv_model_load(ctx, path, &mp, &m);
    CHECK(st == EKV_OK, "load %s: %s: %s", name, ekv_status_string(st), ekv_last_error(ctx));
    return st == EKV_OK ? m : NULL;
}

/* The held context refuses every entry from another thread, deterministically. */
typedef struct {
    ekv_model *m;
    ekv_context *ctx;
    ekv_status st;
    char msg[512];
} probe_arg;
static void *probe(void *vp) {
    probe_arg *pa = vp;
    const int32_t tok = 7;
    pa->st = ekv_model_step(pa->m, &tok, 1, NULL);
    snprintf(pa->msg, sizeof pa->msg, "%s", ekv_last_error(pa->ctx));
    return NULL;
}

static void test_threads(void) {
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    ekv_context *ctx;
    CHECK(ekv_context_create(&cp, &ctx) == EKV_OK, "context");
    ekv_model *a = load_model(ctx, "tiny_model.safetensors"),
              *b = load_model(ctx, "tiny_model.safetensors");
    if (!a || !b) {
        ekv_model_free(a);
        ekv_model_free(b);
        ekv_context_free(ctx);
        return;
    }
    /* deterministic: this thread holds the context, another thread's step is refused */
    CHECK(ekv_ctx_enter(ctx) == EKV_OK && ekv_ctx_enter(ctx) == EKV_OK,
          "enter (nested) from the owner");
    probe_arg pa = {b, ctx, EKV_OK, ""};
    pthread_t t;
    pthread_create(&t, NULL, probe, &pa);
    pthread_join(t, NULL);
    CHECK(pa.st == EKV_ERR_INVALID_ARGUMENT && strstr(pa.msg, "two threads"),
          "held context: %s: %s", ekv_status_string(pa.st), pa.msg);
    CHECK(ekv_model_position(b) == 0, "a refused step must not run");
    ekv_ctx_leave(ctx);
    pthread_create(&t, NULL, probe, &pa); /* still held once (nested enter) */
    pthread_join(t, NULL);
    CHECK(pa.st == EKV_ERR_INVALID_ARGUMENT, "after one of two leaves: %s",
          ekv_status_string(pa.st));
    ekv_ctx_leave(ctx);
    pthread_create(&t, NULL, probe, &pa);
    pthread_join(t, NULL);
    CHECK(pa.st == EKV_OK, "released context: %s: %s", ekv_status_string(pa.st), pa.msg);

    /* hammering: every call either runs or is refused; no crash, no hang */
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    hammer_arg h[2] = {{a, 300, 0, 0, 0, &bar}, {b, 300, 0, 0, 0, &bar}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, hammer, &h[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&bar);
    for (int i = 0; i < 2; i++)
        CHECK(h[i].ok + h[i].busy == h[i].steps && h[i].other == 0,
              "thread %d: %d ok, %d refused, %d other", i, h[i].ok, h[i].busy, h[i].other);
    fprintf(stderr, "  one context, two threads: %d + %d steps ran, %d + %d refused\n", h[0].ok,
            h[1].ok, h[0].busy, h[1].busy);
    ekv_model_free(a);
    ekv_model_free(b);
    ekv_context_free(ctx);
}

/* Two contexts in two threads: bitwise the logits of one thread. */
typedef struct {
    float logits[4 * 256];
    ekv_status st;
} own_arg;
static void *own_ctx_run(void *vp) {
    own_arg *o = vp;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    ekv_context *ctx;
    o->st = ekv_context_create(&cp, &ctx);
    if (o->st) return NULL;
    ekv_model *m = load_model(ctx, "tiny_model.safetensors");
    const int32_t tok[4] = {72, 101, 108, 108};
    o->st = m ? EKV_OK : EKV_ERR_INVALID_ARGUMENT;
    for (int r = 0; r < 50 && !o->st; r++) {
        ekv_model_reset(m);
        o->st = ekv_model_step(m, tok, 4, o->logits);
    }
    ekv_model_free(m);
    ekv_context_free(ctx);
    return NULL;
}

static void test_two_contexts(void) {
    static own_arg ref, x[2];
    own_ctx_run(&ref);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, own_ctx_run, &x[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        CHECK(ref.st == EKV_OK && x[i].st == EKV_OK &&
                      !memcmp(ref.logits, x[i].logits, sizeof ref.logits),
              "two contexts: thread %d differs from one thread (%s)", i,
              ekv_status_string(x[i].st));
}

/* ---- 3. memory ---- */
static void test_cache_larger_than_ram(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    ekv_cache_params p = ekv_cache_default_params();
    p.num_kv_heads = 8;
    p.head_dim = 128;
    p.page_size = 16;
    p.dtype = EKV_DTYPE_F16;
    p.max_seqs = 1;
    const int64_t phys = ekv_phys_mem_bytes(), per_page = 2 * 16 * 8 * 128 * 2;
    p.num_pages =
            phys / per_page + phys / per_page / 4 + 1; /* 1.25x RAM: granted under overcommit */
    if (p.num_pages > INT32_MAX) p.num_pages = INT32_MAX;
    ekv_cache *c = (ekv_cache *)&p;
    const double t0 = now_s();
    ekv_status st = ekv_cache_create(ctx, &p, &c);
    const double dt = now_s() - t0;
    CHECK(st == EKV_ERR_OUT_OF_MEMORY, "cache of %.1f GiB on %.1f GiB RAM: %s",
          (double)ekv_cache_bytes_needed(&p) / (1 << 30), (double)phys / (1 << 30),
          ekv_status_string(st));
    CHECK(strstr(ekv_last_error(ctx), "physical memory") != NULL, "message: %s",
          ekv_last_error(ctx));
    CHECK(dt < 1.0, "the refusal took %.2f s", dt);
    if (st == EKV_OK)
        ekv_cache_free(c);
    else
        CHECK(c == (ekv_cache *)&p, "out written on error");
    ekv_context_free(ctx);
}

/* ---- 4. files ---- */
static void test_not_regular_files(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    const char *paths[] = {EKV_TEST_DATA_DIR, "/dev/zero", "/dev/null"};
    for (int i = 0; i < 3; i++) {
        if (access(paths[i], R_OK)) continue;
        ekv_safetensors *st = NULL;
        const double t0 = now_s();
        ekv_status s = ekv_safetensors_open(ctx, paths[i], &st);
        CHECK(s == EKV_ERR_INVALID_ARGUMENT && strstr(ekv_last_error(ctx), "not a regular file") &&
                      now_s() - t0 < 1.0,
              "open %s: %s: %s", paths[i], ekv_status_string(s), ekv_last_error(ctx));
        if (!s) ekv_safetensors_free(st);
        ekv_model *m = NULL;
        s = ekv_model_load(ctx, paths[i], NULL, &m);
        CHECK(s == EKV_ERR_INVALID_ARGUMENT, "model_load %s: %s", paths[i], ekv_status_string(s));
        if (!s) ekv_model_free(m);
    }
    ekv_context_free(ctx);
}

/* ---- 5 and 6: the model's counts, misaligned data ---- */
static int read_file(const char *path, unsigned char **buf, int64_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    *buf = malloc((size_t)*len + 1);
    int ok = *buf && fread(*buf, 1, (size_t)*len, f) == (size_t)*len;
    fclose(f);
    return ok ? 0 : -1;
}

static void test_model_counts_and_alignment(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    unsigned char *odd = NULL;
    int64_t len = 0;
    CHECK(read_file(EKV_TEST_DATA_DIR "/min_model_odd_header.safetensors", &odd, &len) == 0,
          "read the odd-header model");
    if (!odd) {
        ekv_context_free(ctx);
        return;
    }
    uint64_t hl;
    memcpy(&hl, odd, 8);
    CHECK(hl % 2 == 1, "the header length %llu must be odd", (unsigned long long)hl);
    /* the aligned twin: one more trailing space in the header */
    unsigned char *even = malloc((size_t)len + 1);
    const uint64_t hl2 = hl + 1;
    memcpy(even, &hl2, 8);
    memcpy(even + 8, odd + 8, (size_t)hl);
    even[8 + hl] = ' ';
    memcpy(even + 9 + hl, odd + 8 + hl, (size_t)(len - 8 - (int64_t)hl));
    float logits[2][3 * 256];
    const int32_t tok[3] = {0, 97, 255};
    for (int v = 0; v < 2; v++) {
        ekv_safetensors *st = NULL;
        ekv_model *m = NULL;
        ekv_model_params mp = ekv_model_default_params();
        mp.max_tokens = 3;
        ekv_status s = ekv_safetensors_parse(ctx, v ? even : odd, v ? len + 1 : len, &st);
        if (!s) s = ekv_model_from_safetensors(ctx, st, &mp, &m);
        if (!s) s = ekv_model_step(m, tok, 3, logits[v]);
        CHECK(s == EKV_OK, "%s header: %s: %s", v ? "even" : "odd", ekv_status_string(s),
              ekv_last_error(ctx));
        if (m && v == 0) {
            /* 5: n past max_tokens with a one-token array: the count is refused before the
             * tokens are read (ASan: a heap overflow before the fix) */
            int32_t *one = malloc(sizeof *one);
            *one = 5;
            ekv_model_reset(m);
            s = ekv_model_step(m, one, 1000, NULL);
            CHECK(s == EKV_ERR_CACHE_FULL, "n = 1000 > max_tokens = 3: %s", ekv_status_string(s));
            free(one);
        }
        ekv_model_free(m);
        ekv_safetensors_free(st);
    }
    CHECK(!memcmp(logits[0], logits[1], sizeof logits[0]),
          "odd and even headers give different logits");
    free(odd);
    free(even);
    ekv_context_free(ctx);
}

/* 6b. ekv_cache_append from misaligned user buffers (a trace's K/V come straight from a
 * file whose data may start at an odd offset): stored exactly as from aligned ones. The
 * sanitizer build reported the misaligned uint16_t/float load before the fix. */
static void test_misaligned_append(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    enum { HK = 2, D = 8, N = 5 };
    const ekv_dtype src[2] = {EKV_DTYPE_F16, EKV_DTYPE_F32};
    for (int s = 0; s < 2; s++) {
        const int64_t es = ekv_dtype_size(src[s]), bytes = N * HK * D * es;
        unsigned char *al = malloc((size_t)bytes), *mis = malloc((size_t)bytes + 1);
        for (int64_t i = 0; i < N * HK * D; i++)
            ekv_store_f32(al, src[s], i, (float)(i % 13) * 0.25f - 1.0f);
        memcpy(mis + 1, al, (size_t)bytes);
        ekv_paged_kv kv[2];
        ekv_cache *c[2] = {NULL, NULL};
        for (int v = 0; v < 2; v++) {
            ekv_cache_params p = ekv_cache_default_params();
            p.num_kv_heads = HK;
            p.head_dim = D;
            p.page_size = 4;
            p.num_pages = 4;
            p.max_seqs = 1;
            p.dtype = EKV_DTYPE_F32;
            int32_t seq;
            const void *x = v ? (const void *)(mis + 1) : (const void *)al;
            ekv_status st = ekv_cache_create(ctx, &p, &c[v]);
            if (!st) st = ekv_cache_seq_new(c[v], &seq);
            if (!st) st = ekv_cache_append(c[v], seq, N, x, x, src[s]);
            if (!st) st = ekv_cache_kv_view(c[v], &kv[v], NULL);
            CHECK(st == EKV_OK, "%s append (%s): %s", v ? "misaligned" : "aligned",
                  ekv_dtype_name(src[s]), ekv_status_string(st));
        }
        if (c[0] && c[1])
            CHECK(!memcmp(kv[0].k, kv[1].k, 4 * HK * D * sizeof(float)),
                  "%s: misaligned append stored other keys (page 0)", ekv_dtype_name(src[s]));
        ekv_cache_free(c[0]);
        ekv_cache_free(c[1]);
        free(al);
        free(mis);
    }
    ekv_context_free(ctx);
}

/* ---- 7. cache calls from two threads (issue 32) ---- */
enum { TC_HK = 2, TC_D = 8, TC_PS = 4 };

/* A small f32 cache on ctx with one sequence of n tokens (values from the position). */
static ekv_cache *small_cache(ekv_context *ctx, int64_t pages, int32_t hk, int32_t ps,
                              int32_t code_bits, int64_t n, int32_t *seq) {
    ekv_cache_params p = test_cache_params(ps, hk, TC_D, EKV_DTYPE_F32, 4, pages);
    p.superpage_pages = 2;
    p.code_bits = code_bits;
    ekv_cache *c = NULL;
    ekv_status st = ekv_cache_create(ctx, &p, &c);
    if (!st) st = ekv_cache_seq_new(c, seq);
    float *k = malloc(sizeof(float) * (size_t)(n * hk * TC_D));
    for (int64_t i = 0; i < n * hk * TC_D; i++) k[i] = (float)((i * 7) % 11) * 0.3f - 1.5f;
    if (!st && n) st = ekv_cache_append(c, *seq, n, k, k, EKV_DTYPE_F32);
    free(k);
    CHECK(st == EKV_OK, "small cache: %s: %s", ekv_status_string(st), ekv_last_error(ctx));
    if (st) {
        ekv_cache_free(c);
        return NULL;
    }
    return c;
}

/* Every cache call, from a thread that is not the context's holder. */
typedef struct {
    ekv_cache *c;
    ekv_context *ctx;
    int32_t seq, new_seq, lpl, indices[8];
    int64_t len, needed, free_pages, indptr[2];
    uint64_t version;
    ekv_paged_kv kv;
    ekv_page_stats ps;
    ekv_status st[9];
    char msg[512];
} cache_probe;

static void *cache_calls(void *vp) {
    cache_probe *p = vp;
    const float row[TC_HK * TC_D] = {0};
    const int32_t page = 3;
    int i = 0;
    p->st[i++] = ekv_cache_seq_length(p->c, p->seq, &p->len);
    p->st[i++] =
            ekv_cache_page_table(p->c, &p->seq, 1, p->indptr, p->indices, 8, &p->lpl, &p->needed);
    p->st[i++] = ekv_cache_kv_view(p->c, &p->kv, &p->ps);
    p->st[i++] = ekv_cache_seq_version(p->c, p->seq, &p->version);
    p->st[i++] = ekv_cache_seq_new(p->c, &p->new_seq);
    p->st[i++] = ekv_cache_seq_adopt(p->c, p->seq + 1, &page, 1, 1);
    p->st[i++] = ekv_cache_seq_free(p->c, p->seq);
    p->st[i++] = ekv_cache_append(p->c, p->seq, 1, row, row, EKV_DTYPE_F32);
    p->st[i++] = ekv_cache_truncate(p->c, p->seq, 1);
    p->free_pages = ekv_cache_free_pages(p->c);
    snprintf(p->msg, sizeof p->msg, "%s", ekv_last_error(p->ctx));
    return NULL;
}

static void cache_probe_reset(cache_probe *p) {
    memset(p->indices, 0x5a, sizeof p->indices);
    memset(&p->kv, 0x5a, sizeof p->kv);
    memset(&p->ps, 0x5a, sizeof p->ps);
    p->len = p->needed = p->indptr[0] = -7;
    p->version = 7;
    p->new_seq = -7;
}

/* Deterministic: this thread holds the context, so every call of the other is refused and
 * writes nothing; released, they all run. */
static void test_cache_threads_held(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    cache_probe p = {.ctx = ctx};
    p.c = small_cache(ctx, 8, TC_HK, TC_PS, 0, 6, &p.seq);
    if (!p.c) {
        ekv_context_free(ctx);
        return;
    }
    const int64_t free0 = ekv_cache_free_pages(p.c);
    CHECK(ekv_ctx_enter(ctx) == EKV_OK, "enter");
    cache_probe_reset(&p);
    pthread_t t;
    pthread_create(&t, NULL, cache_calls, &p);
    pthread_join(t, NULL);
    for (int i = 0; i < 9; i++)
        CHECK(p.st[i] == EKV_ERR_INVALID_ARGUMENT, "held context: cache call %d gave %s", i,
              ekv_status_string(p.st[i]));
    CHECK(strstr(p.msg, "two threads") != NULL, "held context: message '%s'", p.msg);
    CHECK(p.free_pages == -1, "held context: ekv_cache_free_pages gave %lld",
          (long long)p.free_pages);
    const unsigned char *kvb = (const unsigned char *)&p.kv, *psb = (const unsigned char *)&p.ps;
    int untouched = p.len == -7 && p.needed == -7 && p.indptr[0] == -7 && p.version == 7 &&
                    p.new_seq == -7 && p.indices[0] == 0x5a5a5a5a;
    for (size_t i = 0; i < sizeof p.kv; i++) untouched &= kvb[i] == 0x5a;
    for (size_t i = 0; i < sizeof p.ps; i++) untouched &= psb[i] == 0x5a;
    CHECK(untouched, "held context: a refused call wrote an output");
    ekv_ctx_leave(ctx);
    int64_t len = -1;
    CHECK(ekv_cache_seq_length(p.c, p.seq, &len) == EKV_OK && len == 6 &&
                  ekv_cache_free_pages(p.c) == free0,
          "held context: a refused call changed the cache (length %lld)", (long long)len);
    cache_probe_reset(&p);
    pthread_create(&t, NULL, cache_calls, &p);
    pthread_join(t, NULL);
    for (int i = 0; i < 9; i++) /* adopt: page 3 is the sequence's; free then append: gone */
        CHECK(p.st[i] != EKV_ERR_INVALID_ARGUMENT || i == 5,
              "released context: cache call %d refused: %s", i, p.msg);
    CHECK(p.st[0] == EKV_OK && p.len == 6 && p.st[1] == EKV_OK && p.needed == 2 &&
                  p.st[2] == EKV_OK && p.st[3] == EKV_OK && p.st[4] == EKV_OK && p.st[6] == EKV_OK,
          "released context: the readers failed: %s", p.msg);
    ekv_cache_free(p.c);
    ekv_context_free(ctx);
}

/* Hammering: one thread appends and truncates, the other builds page tables sized exactly as
 * the count it asked for (a fresh allocation: the sanitizer sees any write past it). Each runs
 * for half a second at least, so that the two overlap however the threads are scheduled. */
typedef struct {
    ekv_cache *c;
    int32_t seq;
    int iters, ok, busy, other;
    pthread_barrier_t *start;
} cache_hammer;

static int hammer_more(const cache_hammer *h, int i, double t0) {
    return i < h->iters || (i < 100 * h->iters && now_s() - t0 < 0.5);
}

static void *cache_writer(void *vp) {
    cache_hammer *h = vp;
    float row[8 * TC_HK * TC_D];
    for (int i = 0; i < 8 * TC_HK * TC_D; i++) row[i] = (float)(i % 5) - 2.0f;
    pthread_barrier_wait(h->start);
    const double t0 = now_s();
    int appended = 0; /* since the last truncation: at most 7 x 8 tokens, 14 of 64 pages */
    for (int i = 0; hammer_more(h, i, t0); i++) {
        ekv_status st = appended == 7 ? ekv_cache_truncate(h->c, h->seq, 0)
                                      : ekv_cache_append(h->c, h->seq, 8, row, row, EKV_DTYPE_F32);
        if (!st) appended = appended == 7 ? 0 : appended + 1;
        st == EKV_OK ? h->ok++ : st == EKV_ERR_INVALID_ARGUMENT ? h->busy++ : h->other++;
        sched_yield(); /* let the reader in between two appends too */
    }
    return NULL;
}

static void *cache_reader(void *vp) {
    cache_hammer *h = vp;
    pthread_barrier_wait(h->start);
    const double t0 = now_s();
    for (int i = 0; hammer_more(h, i, t0); i++) {
        int64_t need = -1, ip[2], len;
        int32_t lpl;
        ekv_status st = ekv_cache_page_table(h->c, &h->seq, 1, NULL, NULL, 0, NULL, &need);
        if (!st) {
            int32_t *idx = malloc(sizeof(int32_t) * (size_t)(need > 0 ? need : 1));
            st = ekv_cache_page_table(h->c, &h->seq, 1, ip, idx, need, &lpl, NULL);
            free(idx);
        }
        if (st == EKV_ERR_INVALID_SIZE) st = EKV_OK; /* it grew between the two calls: fine */
        if (!st) st = ekv_cache_seq_length(h->c, h->seq, &len);
        st == EKV_OK ? h->ok++ : st == EKV_ERR_INVALID_ARGUMENT ? h->busy++ : h->other++;
    }
    return NULL;
}

static void test_cache_threads_hammer(void) {
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 1;
    ekv_context *ctx;
    CHECK(ekv_context_create(&cp, &ctx) == EKV_OK, "context");
    int32_t seq;
    ekv_cache *c = small_cache(ctx, 64, TC_HK, TC_PS, 0, 0, &seq);
    if (!c) {
        ekv_context_free(ctx);
        return;
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    cache_hammer h[2] = {{c, seq, 2000, 0, 0, 0, &bar}, {c, seq, 2000, 0, 0, 0, &bar}};
    pthread_t th[2];
    pthread_create(&th[0], NULL, cache_writer, &h[0]);
    pthread_create(&th[1], NULL, cache_reader, &h[1]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&bar);
    for (int i = 0; i < 2; i++)
        CHECK(h[i].ok + h[i].busy >= h[i].iters && h[i].other == 0,
              "cache %s: %d ok, %d refused, %d other", i ? "reader" : "writer", h[i].ok, h[i].busy,
              h[i].other);
    fprintf(stderr, "  one cache, two threads: %d + %d calls ran, %d + %d refused\n", h[0].ok,
            h[1].ok, h[0].busy, h[1].busy);
    ekv_cache_free(c);
    ekv_context_free(ctx);
}

/* ---- 8. a view and statistics of different caches (issue 32) ---- */
typedef struct {
    ekv_decode_params dp;
    ekv_page_table tab;
    int64_t indptr[2];
    int32_t idx[16], lpl;
    float q[4 * TC_D], out[4 * TC_D];
} step_args;

static void step_args_of(ekv_cache *c, int32_t seq, step_args *a) {
    a->dp = ekv_decode_default_params();
    a->dp.num_heads = 4;
    a->dp.alpha = 1.5;
    CHECK(ekv_cache_page_table(c, &seq, 1, a->indptr, a->idx, 16, &a->lpl, NULL) == EKV_OK,
          "page table");
    a->tab = (ekv_page_table){1, a->indptr, a->idx, &a->lpl};
    for (int i = 0; i < 4 * TC_D; i++) a->q[i] = (float)(i % 7) * 0.25f - 0.75f;
}

/* Every entry point that takes a view and statistics: `want` for stats with kv. */
static void stats_entry_points(ekv_context *ctx, const char *what, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, step_args *a, ekv_status want) {
    const ekv_select_method methods[] = {EKV_SELECT_TOPK, EKV_SELECT_GAUSSIAN, EKV_SELECT_CERTIFIED,
                                         EKV_SELECT_SCREENED};
    ekv_select_params sp = ekv_select_default_params();
    sp.budget_tokens = TC_PS;
    for (int m = 0; m < 4; m++) {
        sp.method = methods[m];
        ekv_status s = ekv_decode(ctx, &a->dp, &sp, kv, st, &a->tab, a->q, a->out, NULL);
        CHECK(s == want, "%s: ekv_decode %s: %s (%s)", what, ekv_method_name(sp.method),
              ekv_status_string(s), ekv_last_error(ctx));
        if (want)
            CHECK(strstr(ekv_last_error(ctx), "stats cover"), "%s: message '%s'", what,
                  ekv_last_error(ctx));
        if (sp.method == EKV_SELECT_CERTIFIED) continue; /* a decode method, not a list */
        int64_t lip[3];
        int32_t pages[32];
        ekv_page_list list = {.indptr = lip, .pages = pages, .capacity = 32};
        s = ekv_select_pages(ctx, &a->dp, &sp, kv, st, &a->tab, a->q, &list);
        CHECK(s == want, "%s: ekv_select_pages %s: %s", what, ekv_method_name(sp.method),
              ekv_status_string(s));
    }
    sp.method = EKV_SELECT_CERTIFIED;
    ekv_status s =
            ekv_decode_certified(ctx, &a->dp, &sp, kv, st, &a->tab, a->q, a->out, NULL, NULL);
    CHECK(s == want, "%s: ekv_decode_certified: %s", what, ekv_status_string(s));
    sp.method = EKV_SELECT_TOPK;
    s = ekv_decode_sharded_sim(ctx, &a->dp, &sp, kv, st, &a->tab, a->q, a->out, 2, NULL, NULL,
                               NULL);
    CHECK(s == want, "%s: ekv_decode_sharded_sim: %s", what, ekv_status_string(s));
}

static void test_stats_of_another_cache(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    int32_t sa, sb, sc, sd;
    ekv_cache *small = small_cache(ctx, 2, TC_HK, TC_PS, 8, 6, &sa),
              *big = small_cache(ctx, 16, TC_HK, TC_PS, 8, 60, &sb),
              *heads = small_cache(ctx, 16, 2 * TC_HK, TC_PS, 8, 60, &sc),
              *pages8 = small_cache(ctx, 16, TC_HK, 2 * TC_PS, 8, 60, &sd);
    if (small && big && heads && pages8) {
        ekv_paged_kv kv;
        ekv_page_stats own, st;
        step_args a;
        step_args_of(big, sb, &a);
        CHECK(ekv_cache_kv_view(big, &kv, &own) == EKV_OK, "view");
        stats_entry_points(ctx, "one cache", &kv, &own, &a, EKV_OK);
        CHECK(ekv_cache_kv_view(small, NULL, &st) == EKV_OK, "view");
        stats_entry_points(ctx, "2-page stats, 16-page view", &kv, &st, &a,
                           EKV_ERR_INVALID_ARGUMENT);
        CHECK(ekv_cache_kv_view(heads, NULL, &st) == EKV_OK, "view");
        stats_entry_points(ctx, "stats of 4 KV heads, view of 2", &kv, &st, &a,
                           EKV_ERR_INVALID_ARGUMENT);
        CHECK(ekv_cache_kv_view(pages8, NULL, &st) == EKV_OK, "view");
        stats_entry_points(ctx, "stats of 8-token pages, view of 4", &kv, &st, &a,
                           EKV_ERR_INVALID_ARGUMENT);
        st = own; /* hand-assembled statistics without their counts */
        st.num_pages = 0;
        st.num_kv_heads = st.head_dim = st.page_size = 0;
        stats_entry_points(ctx, "stats without counts", &kv, &st, &a, EKV_ERR_INVALID_ARGUMENT);
    }
    ekv_cache_free(small);
    ekv_cache_free(big);
    ekv_cache_free(heads);
    ekv_cache_free(pages8);
    ekv_context_free(ctx);
}

/* ---- 9. offsets past int64 (issue 32) ---- */
static void test_offsets_past_int64(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    int32_t seq;
    ekv_cache *c = small_cache(ctx, 16, TC_HK, TC_PS, 0, 30, &seq);
    if (c) {
        ekv_paged_kv kv, bad;
        ekv_page_stats st;
        step_args a;
        step_args_of(c, seq, &a);
        CHECK(ekv_cache_kv_view(c, &kv, &st) == EKV_OK, "view");
        /* each stride alone: its offsets, or their bytes, pass INT64_MAX */
        const int64_t huge[3] = {INT64_MAX / 2, (int64_t)1 << 61, (int64_t)1 << 60};
        for (int w = 0; w < 3; w++)
            for (int i = 0; i < 3; i++) {
                bad = kv;
                int64_t *stride = w == 0   ? &bad.stride_page
                                  : w == 1 ? &bad.stride_head
                                           : &bad.stride_token;
                *stride = huge[i];
                ekv_status s = ekv_decode_dense(ctx, &a.dp, &bad, &a.tab, a.q, a.out, NULL);
                CHECK(s == EKV_ERR_SIZE_OVERFLOW, "stride %d = %lld: %s (%s)", w,
                      (long long)huge[i], ekv_status_string(s), ekv_last_error(ctx));
            }
        /* certified with sink and recent pages of INT32_MAX: every page, the dense answer */
        float dense[4 * TC_D];
        CHECK(ekv_decode_dense(ctx, &a.dp, &kv, &a.tab, a.q, dense, NULL) == EKV_OK, "dense");
        ekv_select_params sp = ekv_select_default_params();
        sp.method = EKV_SELECT_CERTIFIED;
        sp.budget_tokens = TC_PS;
        sp.sink_pages = sp.recent_pages = INT32_MAX;
        ekv_status s = ekv_decode(ctx, &a.dp, &sp, &kv, &st, &a.tab, a.q, a.out, NULL);
        CHECK(s == EKV_OK, "certified, sink = recent = INT32_MAX: %s (%s)", ekv_status_string(s),
              ekv_last_error(ctx));
        CHECK(s || test_head_rel_err(a.out, dense, 4, TC_D, 1e-6) < 1e-5,
              "certified, sink = recent = INT32_MAX: not the dense output");
    }
    ekv_cache_free(c);
    /* ekv_shard_pages over INT64_MAX pages: floor(j P / S), without forming j P */
    const int64_t Ps[3] = {INT64_MAX, INT64_MAX - 1, ((int64_t)1 << 62) + 5};
    for (int i = 0; i < 3; i++)
        for (int S = 63; S <= 64; S++) {
            __int128 end = 0;
            for (int j = 0; j < S; j++) {
                int64_t first = -1, count = -1;
                ekv_status s = ekv_shard_pages(Ps[i], S, j, &first, &count);
                const __int128 want = (__int128)Ps[i] * j / S,
                               want_end = (__int128)Ps[i] * (j + 1) / S;
                CHECK(s == EKV_OK && first == want && first + (__int128)count == want_end &&
                              first == end,
                      "ekv_shard_pages(%lld, %d, %d) = [%lld, +%lld)", (long long)Ps[i], S, j,
                      (long long)first, (long long)count);
                end = (__int128)first + count;
            }
            CHECK(end == Ps[i], "shards of %lld pages end at %lld", (long long)Ps[i],
                  (long long)end);
        }
    ekv_context_free(ctx);
}

/* 10. A value the cache's dtype cannot hold is said as such (issue 32, low): 1e6 in an f16 cache
 * is finite but outside f16's range (it said "is NaN or infinite"); a NaN still says NaN. */
static void test_unstorable_messages(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    ekv_cache_params cp = ekv_cache_default_params();
    cp.num_pages = 2;
    cp.page_size = 4;
    cp.num_kv_heads = 1;
    cp.head_dim = 8;
    cp.dtype = EKV_DTYPE_F16;
    cp.max_seqs = 1;
    ekv_cache *c;
    int32_t s;
    CHECK(ekv_cache_create(ctx, &cp, &c) == EKV_OK && ekv_cache_seq_new(c, &s) == EKV_OK, "cache");
    float k[8] = {0}, v[8] = {0};
    k[3] = 1e6f;
    CHECK(ekv_cache_append(c, s, 1, k, v, EKV_DTYPE_F32) == EKV_ERR_NAN_INPUT, "1e6 in f16");
    CHECK(strstr(ekv_last_error(ctx), "k[3] = 1e+06 is outside the range of the f16 cache") != NULL,
          "1e6 in f16 says: %s", ekv_last_error(ctx));
    k[3] = 0.f;
    v[5] = NAN;
    CHECK(ekv_cache_append(c, s, 1, k, v, EKV_DTYPE_F32) == EKV_ERR_NAN_INPUT, "NaN");
    CHECK(strstr(ekv_last_error(ctx), "v[5] = nan is NaN or infinite") != NULL, "NaN says: %s",
          ekv_last_error(ctx));
    int64_t len = -1;
    CHECK(ekv_cache_seq_length(c, s, &len) == EKV_OK && len == 0, "refused appends stored %lld",
          (long long)len);
    ekv_cache_free(c);
    ekv_context_free(ctx);
}

int main(void) {
    test_entmax_scale();
    test_threads();
    test_two_contexts();
    test_cache_larger_than_ram();
    test_not_regular_files();
    test_model_counts_and_alignment();
    test_misaligned_append();
    test_cache_threads_held();
    test_cache_threads_hammer();
    test_stats_of_another_cache();
    test_offsets_past_int64();
    test_unstorable_messages();
    return test_finish("test_hardening");
}
