/*
 * Screened decode (docs/math.md §10): over the same kinds of cases as certified decode (f32,
 * f16, bf16; pages 1-256; GQA and per-query-head lists; ALiBi; planted keys, outlier
 * channels, near-flat scores, q = 0, duplicated keys; 4- and 8-bit codes; alpha 1.25 to 3)
 * the output equals dense entmax within fp32 rounding with the same tau and the same
 * support, while the screen keeps fewer tokens than exist where the data allow. Softmax is
 * refused with a status, and so is a cache without codes.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

typedef struct {
    int64_t steps, kept, tokens, pages_listed, pages, k_dense, k_screened;
    double worst;
} tally;

static void fill_keys(int kind, int64_t N, int Hk, int D, test_rng *r, float *k, float *v) {
    for (int64_t i = 0; i < N * Hk * D; i++) {
        double x = test_normal(r);
        if (kind == 2 && i % D < 2) x = 20 * x + 6; /* outlier channels */
        k[i] = (float)x;
        v[i] = (float)test_normal(r);
    }
    if (kind == 1) /* a few keys aligned with the queries */
        for (int t = 0; t < 5 && N > 1; t++)
            for (int d = 0; d < D; d++) k[(test_range(r, 0, N - 1) * Hk) * D + d] = 1.5f;
    if (kind == 5) /* many exact duplicates of a few keys: ties at tau */
        for (int64_t t = 1; t < N; t++)
            if (test_next(r) % 3 == 0)
                memcpy(k + t * Hk * D, k + (t % 4) * Hk * D, sizeof(float) * (size_t)(Hk * D));
}

/* One step: screened against dense, output, tau and support. */
static void check_step(ekv_context *ctx, int c, const ekv_decode_params *dp,
                       const ekv_select_params *sp, const ekv_paged_kv *kv,
                       const ekv_page_stats *st, const ekv_page_table *tab, const float *q, int H,
                       int D, tally *t) {
    float od[16 * 64], os[16 * 64];
    double taud[16], taus[16];
    int64_t supd[16], sups[16];
    ekv_decode_info id = {.tau = taud, .support = supd}, is = {.tau = taus, .support = sups};
    CHECK(ekv_decode_dense(ctx, dp, kv, tab, q, od, &id) == EKV_OK, "dense");
    CHECK(ekv_decode(ctx, dp, sp, kv, st, tab, q, os, &is) == EKV_OK, "case %d: screened: %s", c,
          ekv_last_error(ctx));
    for (int h = 0; h < H; h++) {
        double e = 0, mag = 1e-30;
        for (int d = 0; d < D; d++) {
            e = fmax(e, fabs((double)os[h * D + d] - (double)od[h * D + d]));
            mag = fmax(mag, fabs((double)od[h * D + d]));
        }
        t->worst = fmax(t->worst, e / mag);
        CHECK(e <= 1e-5 * mag, "case %d head %d: %.3g from dense", c, h, e / mag);
        CHECK(sups[h] == supd[h], "case %d head %d: support %lld, dense %lld", c, h,
              (long long)sups[h], (long long)supd[h]);
        CHECK(fabs(taus[h] - taud[h]) <= 1e-6 * (1 + fabs(taud[h])),
              "case %d head %d: tau %.9g, dense %.9g", c, h, taus[h], taud[h]);
    }
    /* per-query-head lists read a KV head's rows once per query head, as every list method */
    CHECK(sp->per_query_head || is.bytes_k <= id.bytes_k,
          "case %d: screened read %lld K bytes, dense %lld", c, (long long)is.bytes_k,
          (long long)id.bytes_k);
    t->k_dense += sp->per_query_head ? 0 : id.bytes_k;
    t->k_screened += sp->per_query_head ? 0 : is.bytes_k;
    /* the pages touched hold the surviving rows: at least one per list, at most every page */
    const int64_t lists = sp->per_query_head ? H : kv->num_kv_heads * tab->batch;
    CHECK(is.pages_touched >= lists && is.pages_touched <= lists * tab->indptr[tab->batch],
          "case %d: %lld pages touched for %lld lists", c, (long long)is.pages_touched,
          (long long)lists);
    t->kept += is.survivors;
    t->steps++;
}

static void run_case(ekv_context *ctx, int c, tally *t) {
    static const ekv_dtype dts[3] = {EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_BF16};
    static const double alphas[4] = {1.5, 2.0, 1.25, 3.0};
    static const int pss[5] = {16, 1, 4, 64, 256};
    test_rng r = {0xabc + (uint64_t)c};
    const int Hk = 1 + c % 2, G = 1 << (c % 3), H = Hk * G, D = c % 5 == 0 ? 24 : 32;
    const int ps = pss[(c / 3) % 5], kind = c % 6, alibi = (c / 4) % 2, per_q = (c / 8) % 2;
    const ekv_dtype dt = dts[c % 3];
    /* every twelfth case spans several of the screen's page chunks (2048 tokens each), so its
     * tasks share thresholds and tighten them (docs/math.md §10.3) */
    const int64_t N = c % 12 == 11 ? 2500 + test_range(&r, 0, 4000) : 1 + test_range(&r, 0, 700);
    ekv_cache_params cp = test_cache_params(ps, Hk, D, dt, 1, ekv_cache_pages_for(N, 1, ps));
    cp.code_bits = (c / 2) % 2 ? 8 : 4;
    cp.range_dtype = (ekv_dtype)((c / 5) % 3); /* compact ranges: the codes follow them */
    ekv_cache *cache;
    CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK, "cache");
    int32_t seq;
    ekv_cache_seq_new(cache, &seq);
    float *k = malloc(sizeof(float) * (size_t)(N * Hk * D)),
          *v = malloc(sizeof(float) * (size_t)(N * Hk * D));
    fill_keys(kind, N, Hk, D, &r, k, v);
    if (kind == 2 && dt == EKV_DTYPE_F32) /* a channel beyond f16: f16 ranges turn infinite */
        for (int64_t i = 1; i < N * Hk * D; i += D) k[i] *= 1e5f;
    for (int64_t t0 = 0; t0 < N;) { /* appends of any size: codes re-derived as ranges widen */
        const int64_t want = 1 + test_range(&r, 0, 50), m = want > N - t0 ? N - t0 : want;
        CHECK(ekv_cache_append(cache, seq, m, k + t0 * Hk * D, v + t0 * Hk * D, EKV_DTYPE_F32) ==
                      EKV_OK,
              "append");
        t0 += m;
    }
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_cache_kv_view(cache, &kv, &st);
    int64_t ip[2];
    int32_t lpl[1], *idx = malloc(sizeof(int32_t) * (size_t)(2 * N + 2));
    ekv_cache_page_table(cache, &seq, 1, ip, idx, N + 1, lpl, NULL);
    ekv_page_table tab = {1, ip, idx, lpl};
    /* the long cases decode two sequences: the second is a whole-page prefix of the first (a
     * table may share pages), so the screen's tasks span sequences too */
    int64_t ip2[3];
    int32_t lpl2[2];
    const int64_t P = ip[1], P1 = P / 3;
    if (c % 12 == 11 && P1 > 0) {
        memcpy(idx + P, idx, sizeof(int32_t) * (size_t)P1);
        ip2[0] = 0;
        ip2[1] = P;
        ip2[2] = P + P1;
        lpl2[0] = lpl[0];
        lpl2[1] = ps;
        tab = (ekv_page_table){2, ip2, idx, lpl2};
    }
    const int B = (int)tab.batch;
    float slopes[8], q[16 * 32];
    for (int h = 0; h < H; h++) slopes[h] = h % 2 ? 0.f : (float)pow(2.0, -(h + 1));
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    dp.alpha = alphas[(c / 3) % 4];
    dp.alibi_slopes = alibi ? slopes : NULL;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_SCREENED;
    sp.per_query_head = per_q;
    for (int rep = 0; rep < 6; rep++) {
        const double qs = kind == 3 ? 0.05 : 1.5;
        for (int i = 0; i < B * H * D; i++) q[i] = kind == 4 ? 0.f : (float)(qs * test_normal(&r));
        check_step(ctx, c, &dp, &sp, &kv, &st, &tab, q, B * H, D, t);
        t->tokens += (N + (B > 1 ? P1 * ps : 0)) * H;
    }
    ekv_cache_free(cache);
    free(k);
    free(v);
    free(idx);
}

static void check_refusals(ekv_context *ctx) {
    ekv_cache_params cp = ekv_cache_default_params();
    cp.num_kv_heads = 1;
    cp.head_dim = 8;
    cp.page_size = 4;
    cp.num_pages = 4;
    cp.max_seqs = 1;
    ekv_cache *c;
    CHECK(ekv_cache_create(ctx, &cp, &c) == EKV_OK, "cache without codes");
    int32_t seq;
    ekv_cache_seq_new(c, &seq);
    float kv8[8 * 8] = {0};
    ekv_cache_append(c, seq, 8, kv8, kv8, EKV_DTYPE_F32);
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_cache_kv_view(c, &kv, &st);
    int64_t ip[2];
    int32_t idx[4], lpl[1];
    ekv_cache_page_table(c, &seq, 1, ip, idx, 4, lpl, NULL);
    ekv_page_table tab = {1, ip, idx, lpl};
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = 1;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_SCREENED;
    float q[8] = {1}, out[8];
    CHECK(ekv_decode(ctx, &dp, &sp, &kv, &st, &tab, q, out, NULL) == EKV_ERR_INVALID_ARGUMENT &&
                  strstr(ekv_last_error(ctx), "key codes"),
          "a cache without codes: %s", ekv_last_error(ctx));
    dp.alpha = 1.0;
    CHECK(ekv_decode_supported(ctx, EKV_BACKEND_CPU, &dp, &sp) == EKV_ERR_INVALID_ALPHA,
          "softmax is not screenable");
    ekv_cache_free(c);
}

int main(void) {
    ekv_context *ctx;
    ekv_context_params cpp = ekv_context_default_params();
    cpp.n_threads = 2;
    CHECK(ekv_context_create(&cpp, &ctx) == EKV_OK, "context");
    check_refusals(ctx);
    tally t = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int c = 0; c < 120; c++) run_case(ctx, c, &t);
    printf("screened: %lld steps equal dense (worst %.3g relative); the screen kept %.1f%% of the "
           "(token, head) pairs\n",
           (long long)t.steps, t.worst, 100.0 * (double)t.kept / (double)(t.tokens ? t.tokens : 1));
    CHECK(t.kept < t.tokens, "the screen never ruled a token out");
    /* K is read for the surviving rows only, not for whole pages */
    CHECK(t.k_screened < t.k_dense / 2, "screened read %lld K bytes, dense %lld",
          (long long)t.k_screened, (long long)t.k_dense);
    printf("screened: K bytes read %.1f%% of dense's\n",
           100.0 * (double)t.k_screened / (double)(t.k_dense ? t.k_dense : 1));
    ekv_context_free(ctx);
    return test_finish("test_screened");
}
