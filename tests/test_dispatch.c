/*
 * The method table's coverage (docs/architecture.md, "Methods and the stage table"): for
 * every (select method, backend) pair, ekv_decode_supported either says OK and the pair is
 * run against a reference, or it says why not and the dispatcher (ekv_decode on the CPU)
 * answers the very same status. Also the checks that moved into that one function (tau
 * modes, budgets, superpage summaries) and the names of methods and backends.
 */
#include "entmaxkv.h"
#include "core/internal.h" /* ekv_ctx_enter: hold the context as another call would */
#include "test_util.h"
#include <pthread.h>
#include <string.h>

enum { H = 4, HK = 2, D = 32, PS = 8, B = 2 };
static const int64_t lens[B] = {203, 97};

typedef struct {
    ekv_context *ctx;
    ekv_cache *cache;
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_page_table tab;
    int64_t indptr[B + 1];
    int32_t indices[64], lpl[B];
    float q[B * H * D];
} fixture;

static void setup(fixture *f) {
    ekv_context_params cpp = ekv_context_default_params();
    cpp.n_threads = 2;
    CHECK(ekv_context_create(&cpp, &f->ctx) == EKV_OK, "context");
    ekv_cache_params cp =
            test_cache_params(PS, HK, D, EKV_DTYPE_F32, B, ekv_cache_pages_for(lens[0], B, PS));
    cp.superpage_pages = 4;
    cp.code_bits = 4; /* for screened */
    CHECK(ekv_cache_create(f->ctx, &cp, &f->cache) == EKV_OK, "cache");
    test_rng r = {42};
    int32_t seqs[B];
    for (int b = 0; b < B; b++) {
        ekv_cache_seq_new(f->cache, &seqs[b]);
        float *k = malloc(sizeof(float) * (size_t)(lens[b] * HK * D)),
              *v = malloc(sizeof(float) * (size_t)(lens[b] * HK * D));
        for (int64_t i = 0; i < lens[b] * HK * D; i++) {
            k[i] = (float)test_normal(&r);
            v[i] = (float)test_normal(&r);
        }
        for (int64_t t = 17; t < lens[b];
             t += 41) /* a few keys aligned with the queries: a sparse support */
            for (int d = 0; d < D; d++) k[(t * HK) * D + d] = 3.0f;
        CHECK(ekv_cache_append(f->cache, seqs[b], lens[b], k, v, EKV_DTYPE_F32) == EKV_OK,
              "append");
        free(k);
        free(v);
    }
    for (int i = 0; i < B * H * D; i++) f->q[i] = 0.6f + 0.3f * (float)test_normal(&r);
    ekv_cache_kv_view(f->cache, &f->kv, &f->st);
    int64_t needed = 0;
    CHECK(ekv_cache_page_table(f->cache, seqs, B, f->indptr, f->indices, 64, f->lpl, &needed) ==
                  EKV_OK,
          "table");
    f->tab = (ekv_page_table){B, f->indptr, f->indices, f->lpl};
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - (double)b[i]));
    return m;
}

/* The stages the table lists, run one public call at a time: what ekv_decode must equal. */
static ekv_status composed(fixture *f, const ekv_decode_params *dp, const ekv_select_params *sp,
                           float *out) {
    if (sp->method == EKV_SELECT_DENSE)
        return ekv_decode_dense(f->ctx, dp, &f->kv, &f->tab, f->q, out, NULL);
    if (sp->method == EKV_SELECT_CERTIFIED)
        return ekv_decode_certified(f->ctx, dp, sp, &f->kv, &f->st, &f->tab, f->q, out, NULL, NULL);
    int64_t ip[B * H + 1];
    int32_t pages[B * H * 32];
    ekv_page_list list = {.indptr = ip, .pages = pages, .capacity = B * H * 32};
    ekv_status s = ekv_select_pages(f->ctx, dp, sp, &f->kv, &f->st, &f->tab, f->q, &list);
    return s ? s : ekv_decode_pages(f->ctx, dp, &f->kv, &f->tab, &list, f->q, out, NULL);
}

/* One (method, alpha) on the CPU: the dispatcher's answer is the support check's, and what
 * runs equals the composed stages (bitwise) and, for the exact methods, the reference. */
static void check_cpu(fixture *f, ekv_select_method m, double alpha, int full_budget) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    dp.alpha = alpha;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = m;
    sp.budget_tokens = 3 * PS;
    sp.budget_fraction = full_budget ? 1.0 : 0.0; /* every token of every sequence */
    float out[B * H * D], want[B * H * D], ref[B * H * D];
    const ekv_status sup = ekv_decode_supported(f->ctx, EKV_BACKEND_CPU, &dp, &sp);
    ekv_decode_info info = {0};
    const ekv_status got = ekv_decode(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, out, &info);
    CHECK(got == sup, "%s alpha %g: ekv_decode %d, ekv_decode_supported %d", ekv_method_name(m),
          alpha, got, sup);
    if (sup != EKV_OK) {
        CHECK(strlen(ekv_last_error(f->ctx)) > 0, "%s: no message", ekv_method_name(m));
        return;
    }
    CHECK(composed(f, &dp, &sp, want) == EKV_OK, "%s composed: %s", ekv_method_name(m),
          ekv_last_error(f->ctx));
    CHECK(!memcmp(out, want, sizeof out), "%s alpha %g: ekv_decode differs from its stages (%.3g)",
          ekv_method_name(m), alpha, max_abs_diff(out, want, B * H * D));
    const int exact = m == EKV_SELECT_DENSE || m == EKV_SELECT_CERTIFIED ||
                      m == EKV_SELECT_ORACLE || m == EKV_SELECT_SCREENED ||
                      (m == EKV_SELECT_TOPK && full_budget);
    if (!exact) return;
    CHECK(ekv_decode_dense_ref(f->ctx, &dp, &f->kv, &f->tab, f->q, ref, NULL) == EKV_OK, "ref");
    const double e = max_abs_diff(out, ref, B * H * D);
    CHECK(e < 2e-5, "%s alpha %g: %.3g from the long-double reference", ekv_method_name(m), alpha,
          e);
    CHECK(info.bytes_k > 0 && info.bytes_v > 0, "%s: bytes read not reported", ekv_method_name(m));
}

/* The reference and CUDA backends: the support check follows the table. */
static void check_other_backends(fixture *f) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    for (int m = 0; m < EKV_SELECT_METHOD_COUNT; m++) {
        ekv_select_params sp = ekv_select_default_params();
        sp.method = (ekv_select_method)m;
        const ekv_status r = ekv_decode_supported(f->ctx, EKV_BACKEND_REF, &dp, &sp);
        CHECK((r == EKV_OK) == (m == EKV_SELECT_DENSE), "ref backend, %s: %d",
              ekv_method_name(sp.method), r);
        const ekv_status c = ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &sp);
        CHECK((c == EKV_OK) == (m != EKV_SELECT_ORACLE), "cuda backend, %s: %d",
              ekv_method_name(sp.method), c);
        sp.per_query_head = 1; /* per-query-head lists are served on the GPU too */
        CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &sp) == c,
              "cuda per_query_head, %s", ekv_method_name(sp.method));
        sp.per_query_head = 0;
        sp.tau_mode = EKV_TAU_FIXED; /* the paper's fixed/corrected modes are CPU only */
        CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &sp) ==
                      (m == EKV_SELECT_ORACLE ? c : EKV_ERR_UNSUPPORTED),
              "cuda tau_mode fixed, %s", ekv_method_name(sp.method));
    }
    /* the gaussian with ALiBi (the mixture) is served on the GPU */
    ekv_decode_params ap = dp;
    const float slopes[H] = {0};
    ap.alibi_slopes = slopes;
    ekv_select_params gs = ekv_select_default_params();
    gs.method = EKV_SELECT_GAUSSIAN;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &ap, &gs) == EKV_OK,
          "cuda gaussian with ALiBi: %s", ekv_last_error(f->ctx));
    /* certified's tau hint and tau_lb are served on the GPU (device arrays) */
    const double lb = 0.0;
    ekv_select_params hinted = ekv_select_default_params();
    hinted.method = EKV_SELECT_CERTIFIED;
    hinted.tau_hint = &lb;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &hinted) == EKV_OK,
          "cuda tau_hint: %s", ekv_last_error(f->ctx));
    hinted.tau_hint = NULL;
    hinted.tau_lb = &lb;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &hinted) == EKV_OK,
          "cuda tau_lb (superpage skipping on the GPU): %s", ekv_last_error(f->ctx));
    ekv_select_params frac = ekv_select_default_params(); /* a per-sequence budget: both */
    frac.method = EKV_SELECT_TOPK;
    frac.budget_fraction = 0.25;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, &frac) == EKV_OK,
          "cuda budget_fraction: %s", ekv_last_error(f->ctx));
    CHECK(ekv_decode_supported(f->ctx, (ekv_backend)7, &dp, NULL) == EKV_ERR_INVALID_ARGUMENT,
          "backend 7");
    dp.scale = INFINITY;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CUDA, &dp, NULL) == EKV_ERR_INVALID_ARGUMENT,
          "cuda scale +inf");
}

/* Checks that used to be missing or written in several places. */
static void check_rules(fixture *f) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    ekv_select_params sp = ekv_select_default_params();
    float out[B * H * D];
    sp.method = EKV_SELECT_CERTIFIED;
    for (int64_t bad = -1; bad <= 0; bad++) {
        sp.budget_tokens = bad;
        CHECK(ekv_decode_certified(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, out, NULL,
                                   NULL) == EKV_ERR_INVALID_ARGUMENT,
              "certified budget %lld", (long long)bad);
    }
    sp.budget_tokens = 16;
    sp.budget_fraction = 1.5;
    CHECK(ekv_decode(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, out, NULL) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "fraction 1.5");
    sp.budget_fraction = NAN;
    CHECK(ekv_decode(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, out, NULL) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "fraction NaN");
    sp.budget_fraction = 0;
    ekv_page_stats st =
            f->st; /* superpages that do not match the cache's: rejected, not read out of bounds */
    st.superpage_pages = 1;
    CHECK(ekv_decode_certified(f->ctx, &dp, &sp, &f->kv, &st, &f->tab, f->q, out, NULL, NULL) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "superpage_pages 1 against the cache's 4");
    st.superpage_pages = 64;
    CHECK(ekv_decode(f->ctx, &dp, &sp, &f->kv, &st, &f->tab, f->q, out, NULL) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "superpage_pages 64 against the cache's 4");
    int64_t ip[B * HK + 1];
    int32_t pages[B * HK * 32];
    ekv_page_list list = {.indptr = ip, .pages = pages, .capacity = B * HK * 32};
    sp.method = EKV_SELECT_TOPK;
    CHECK(ekv_select_pages(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, &list) == EKV_OK,
          "select");
    list.tau_mode = 7;
    CHECK(ekv_decode_pages(f->ctx, &dp, &f->kv, &f->tab, &list, f->q, out, NULL) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "tau_mode 7");
    sp.tau_mode = (ekv_tau_mode)7;
    CHECK(ekv_decode_supported(f->ctx, EKV_BACKEND_CPU, &dp, &sp) == EKV_ERR_INVALID_ARGUMENT,
          "select tau_mode 7");
}

/* Every decode entry point, called from a second thread while the context is held: each
 * refuses (a context is single-threaded) and writes nothing; released, each runs. */
typedef struct {
    fixture *f;
    ekv_status st[7];
    float out[B * H * D];
} entry_arg;

static void *call_entries(void *vp) {
    entry_arg *e = vp;
    fixture *f = e->f;
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    ekv_select_params sp = ekv_select_default_params();
    sp.budget_tokens = 2 * PS;
    int64_t ip[B * HK + 1];
    int32_t pages[B * HK * 32];
    float bnd[B * H * 32], probs[B * H * 256];
    double tau[B * H], bar[B * H];
    ekv_page_list list = {.indptr = ip,
                          .pages = pages,
                          .capacity = B * HK * 32,
                          .bounds = bnd,
                          .bounds_stride = 32};
    e->st[0] = ekv_decode(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, e->out, NULL);
    e->st[1] = ekv_decode_dense(f->ctx, &dp, &f->kv, &f->tab, f->q, e->out, NULL);
    e->st[2] = ekv_select_pages(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, &list);
    ekv_decode_info info = {.tau = tau};
    e->st[3] = e->st[2]
                       ? e->st[2]
                       : ekv_decode_pages(f->ctx, &dp, &f->kv, &f->tab, &list, f->q, e->out, &info);
    e->st[4] = ekv_decode_certified(f->ctx, &dp, &sp, &f->kv, &f->st, &f->tab, f->q, e->out, NULL,
                                    NULL);
    e->st[5] = ekv_dense_probs(f->ctx, &dp, &f->kv, &f->tab, f->q, 256, probs, NULL);
    e->st[6] = e->st[3] ? e->st[3] : ekv_delta_bound(f->ctx, &dp, &f->kv, &f->tab, &list, tau, bar);
    return NULL;
}

static void check_single_thread(fixture *f) {
    entry_arg held = {.f = f}, free_ = {.f = f};
    for (int i = 0; i < B * H * D; i++) held.out[i] = 12345.f;
    CHECK(ekv_ctx_enter(f->ctx) == EKV_OK, "hold the context");
    pthread_t t;
    pthread_create(&t, NULL, call_entries, &held);
    pthread_join(t, NULL);
    ekv_ctx_leave(f->ctx);
    for (int i = 0; i < 7; i++)
        CHECK(held.st[i] == EKV_ERR_INVALID_ARGUMENT, "entry %d on a held context: %d", i,
              held.st[i]);
    int untouched = 1;
    for (int i = 0; i < B * H * D; i++) untouched &= held.out[i] == 12345.f;
    CHECK(untouched, "a refused call wrote its output");
    pthread_create(&t, NULL, call_entries, &free_);
    pthread_join(t, NULL);
    for (int i = 0; i < 7; i++)
        CHECK(free_.st[i] == EKV_OK, "entry %d on a free context: %d (%s)", i, free_.st[i],
              ekv_last_error(f->ctx));
}

static void check_names(void) {
    for (int m = 0; m < EKV_SELECT_METHOD_COUNT; m++) {
        ekv_select_method back;
        const char *n = ekv_method_name((ekv_select_method)m);
        CHECK(n && ekv_method_from_name(n, &back) == EKV_OK && (int)back == m,
              "method %d name round trip", m);
    }
    CHECK(ekv_method_name((ekv_select_method)EKV_SELECT_METHOD_COUNT) == NULL,
          "name past the table");
    for (int b = 0; b < 3; b++) {
        ekv_backend back;
        const char *n = ekv_backend_name((ekv_backend)b);
        CHECK(n && ekv_backend_from_name(n, &back) == EKV_OK && (int)back == b,
              "backend %d name round trip", b);
    }
    ekv_backend bk;
    CHECK(ekv_backend_from_name("tpu", &bk) == EKV_ERR_INVALID_ARGUMENT, "unknown backend");
}

int main(void) {
    fixture f;
    setup(&f);
    const double alphas[4] = {1.0, 1.5, 4.0 / 3.0, 2.0};
    for (int m = 0; m < EKV_SELECT_METHOD_COUNT; m++)
        for (int a = 0; a < 4; a++)
            for (int full = 0; full < 2; full++)
                check_cpu(&f, (ekv_select_method)m, alphas[a], full);
    check_other_backends(&f);
    check_rules(&f);
    check_names();
    check_single_thread(&f);
    ekv_cache_free(f.cache);
    ekv_context_free(f.ctx);
    return test_finish("test_dispatch");
}
