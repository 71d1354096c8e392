/*
 * Page selection and attention over page lists (docs/math.md §2, 3):
 *  - top-k on hand-made page statistics: the right pages, in descending bound order, ties
 *    to the lower page, the last page always last, budget clamping, ALiBi bonus in z-space;
 *  - attention over a dense list equals dense decode; whenever a selection contains the
 *    whole support, `exact` equals dense entmax (<= 1e-5 relative, fp32); the oracle always
 *    does; softmax over a list is softmax restricted to the list;
 *  - invalid inputs: budgets <= 0, NaN queries, empty lists, bad pages; a 1-token sequence
 *    works;
 *  - a token budget above a sequence's length reads the whole sequence, for top-k as for
 *    certified, each sequence of a batch against its own length (issue 32: top-k refused it).
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

typedef struct {
    ekv_cache *cache;
    int32_t seq[4];
    int B;
    int64_t indptr[5];
    int32_t *indices, lpl[4];
    ekv_page_table tab;
    ekv_paged_kv kv;
    ekv_page_stats st;
} fixture;

static void build(ekv_context *ctx, fixture *f, int B, const int64_t *lens, int Hk, int D, int ps,
                  ekv_dtype dt, ekv_dtype range_dt, test_rng *r, double kscale) {
    memset(f, 0, sizeof *f);
    int64_t tot = 0;
    for (int b = 0; b < B; b++) tot += lens[b];
    ekv_cache_params cp = test_cache_params(ps, Hk, D, dt, 4, ekv_cache_pages_for(tot, 1, ps) + B);
    cp.range_dtype = range_dt;
    CHECK(ekv_cache_create(ctx, &cp, &f->cache) == EKV_OK, "cache");
    f->B = B;
    for (int b = 0; b < B; b++) {
        ekv_cache_seq_new(f->cache, &f->seq[b]);
        int64_t n = lens[b] * Hk * D;
        float *k = malloc(sizeof(float) * (size_t)n), *v = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) {
            k[i] = (float)(kscale * test_normal(r));
            v[i] = (float)test_normal(r);
        }
        CHECK(ekv_cache_append(f->cache, f->seq[b], lens[b], k, v, EKV_DTYPE_F32) == EKV_OK,
              "append");
        free(k);
        free(v);
    }
    int64_t need;
    ekv_cache_page_table(f->cache, f->seq, B, NULL, NULL, 0, NULL, &need);
    f->indices = malloc(sizeof(int32_t) * (size_t)need);
    ekv_cache_page_table(f->cache, f->seq, B, f->indptr, f->indices, need, f->lpl, NULL);
    f->tab = (ekv_page_table){B, f->indptr, f->indices, f->lpl};
    ekv_cache_kv_view(f->cache, &f->kv, &f->st);
}

static void release(fixture *f) {
    ekv_cache_free(f->cache);
    free(f->indices);
}

/* top-k on hand-made statistics: D = 2, one KV head, query (1, -1) => U_p = kmax_p0 - kmin_p1 */
static void test_handmade(ekv_context *ctx) {
    enum { P = 6, PS = 4, D = 2 };
    float kmin[P * D], kmax[P * D], kv_dummy[P * PS * D] = {0};
    const float want_u[P] = {0.5f, 3.0f, 1.0f, 3.0f, 2.0f, 9.0f}; /* page 5 is the last page */
    for (int p = 0; p < P; p++) {
        kmax[p * D + 0] = want_u[p] + 1.0f;
        kmin[p * D + 0] = -5.0f;
        kmin[p * D + 1] = 1.0f; /* q_1 = -1 picks kmin: -1 * 1 */
        kmax[p * D + 1] = 4.0f;
    }
    ekv_paged_kv kv = {kv_dummy, kv_dummy, EKV_DTYPE_F32, PS, 1, D, P, PS * D, PS * D, D};
    ekv_page_stats st = {.kmin = kmin,
                         .kmax = kmax,
                         .kmean = kmin,
                         .km2 = kmax,
                         .radius = kmin,
                         .num_pages = P,
                         .num_kv_heads = 1,
                         .head_dim = D,
                         .page_size = PS};
    int64_t indptr[2] = {0, P};
    int32_t idx[P] = {0, 1, 2, 3, 4, 5}, lpl[1] = {PS};
    ekv_page_table tab = {1, indptr, idx, lpl};
    /* scale chosen so that z = a*scale*<q,k> = <q,k> exactly: alpha = 2 (a = 1), scale = 1 */
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = 1;
    dp.alpha = 2.0;
    dp.scale = 1.0f;
    float q[2] = {1.0f, -1.0f};
    int64_t lip[2];
    int32_t pages[P];
    ekv_page_list list = {.indptr = lip, .pages = pages, .capacity = P};
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_TOPK;
    const int64_t budgets[] = {1, 4, 8, 12, 16, 20, 24};
    const int want[][6] = {{1, 5},
                           {1, 5},
                           {1, 3, 5},
                           {1, 3, 4, 5},
                           {1, 3, 4, 2, 5},
                           {1, 3, 4, 2, 0, 5},
                           {1, 3, 4, 2, 0, 5}};
    const int nwant[] = {2, 2, 3, 4, 5, 6, 6};
    for (int i = 0; i < 7; i++) {
        sp.budget_tokens = budgets[i];
        ekv_status s = ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list);
        CHECK(s == EKV_OK, "budget %lld: %s", (long long)budgets[i], ekv_last_error(ctx));
        CHECK(lip[1] == nwant[i], "budget %lld: %lld pages, want %d", (long long)budgets[i],
              (long long)lip[1], nwant[i]);
        for (int k = 0; k < nwant[i] && k < lip[1]; k++)
            CHECK(pages[k] == want[i][k], "budget %lld: slot %d has page %d, want %d",
                  (long long)budgets[i], k, pages[k], want[i][k]);
        CHECK(list.bytes_summary == (P - 1) * D * 8, "bytes_summary %lld",
              (long long)list.bytes_summary);
    }
    /* ALiBi bonus in z-space: slope 1 (a = 1) costs page p (last token 4p+3) 4p+3-23 */
    float slope = 0.3f;
    dp.alibi_slopes = &slope;
    sp.budget_tokens = 4; /* one page: U = {0.5-6, 3-4.8, 1-3.6, 3-2.4, 2-1.2} => page 4 (0.8) */
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_OK, "alibi select");
    CHECK(lip[1] == 2 && pages[0] == 4 && pages[1] == 5, "alibi: got page %d", pages[0]);
    dp.alibi_slopes = NULL;
    /* invalid budgets and NaN queries */
    sp.budget_tokens = 0;
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_ERR_INVALID_ARGUMENT,
          "budget 0");
    sp.budget_tokens = -3;
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_ERR_INVALID_ARGUMENT,
          "budget < 0");
    const int64_t overs[3] = {P * PS + 1, 1000, INT64_MAX};
    for (int o = 0; o < 3; o++) {
        const int64_t over = overs[o];
        sp.budget_tokens = over; /* more than the sequence: all of it, as budget = length */
        ekv_status s = ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list);
        CHECK(s == EKV_OK && lip[1] == P, "budget %lld > length: %s, %lld pages", (long long)over,
              ekv_last_error(ctx), (long long)lip[1]);
        for (int k = 0; k < P && !s; k++)
            CHECK(pages[k] == want[6][k], "budget > length: slot %d has page %d, want %d", k,
                  pages[k], want[6][k]);
    }
    sp.budget_tokens = 8;
    float qn[2] = {NAN, 1};
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, qn, &list) == EKV_ERR_NAN_INPUT,
          "NaN query");
    list.capacity = 3;
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_ERR_INVALID_SIZE,
          "small capacity");
    list.capacity = P;
    sp.method = (ekv_select_method)9;
    CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_ERR_INVALID_ARGUMENT,
          "bad method");
}

/* The page bounds and lists of a top-k selection (the lists' pages and their bounds). */
static void topk_bounds(ekv_context *ctx, fixture *f, const float *q, int H, float *bounds,
                        int64_t stride, int32_t *pages, int64_t cap) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_TOPK;
    sp.budget_tokens = 64;
    int64_t lip[8];
    ekv_page_list list = {.indptr = lip,
                          .pages = pages,
                          .capacity = cap,
                          .bounds = bounds,
                          .bounds_stride = stride};
    CHECK(ekv_select_pages(ctx, &dp, &sp, &f->kv, &f->st, &f->tab, q, &list) == EKV_OK,
          "topk with bounds: %s", ekv_last_error(ctx));
}

/* Compact ranges (docs/math.md §1.2): in K's own dtype they are exact, so every page bound and
 * page list equals fp32 ranges'; narrower than K they are rounded outward, so every bound is at
 * least the fp32 one (still a bound), and the bounds read half the range bytes. */
static void test_compact_ranges(ekv_context *ctx) {
    const ekv_dtype kd[3] = {EKV_DTYPE_F16, EKV_DTYPE_BF16, EKV_DTYPE_F32};
    const ekv_dtype rd[3] = {EKV_DTYPE_F16, EKV_DTYPE_BF16, EKV_DTYPE_BF16};
    for (int c = 0; c < 3; c++) {
        const int H = 4, Hk = 2, D = 32, ps = 8;
        const int64_t lens[1] = {900};
        fixture a, b;
        test_rng r1 = {0x5151 + (uint64_t)c}, r2 = r1;
        build(ctx, &a, 1, lens, Hk, D, ps, kd[c], EKV_DTYPE_F32, &r1, 3.0);
        build(ctx, &b, 1, lens, Hk, D, ps, kd[c], rd[c], &r2, 3.0);
        CHECK(b.st.range_dtype == rd[c] && b.st.kmin16 && b.st.kmax16 && b.st.kmean16 &&
                      b.st.radius16,
              "compact ranges and ball in the view");
        b.st.kmean16 = NULL; /* the ranges alone here (the compact ball: test_certified) */
        b.st.radius16 = NULL;
        float q[4 * 32];
        for (int i = 0; i < H * D; i++) q[i] = (float)(2.0 * test_normal(&r1));
        const int64_t P = a.indptr[1], cap = ekv_page_list_capacity(&a.tab, Hk);
        float *ua = calloc((size_t)(H * P), sizeof(float)),
              *ub = calloc((size_t)(H * P), sizeof(float));
        int32_t *pa = malloc(sizeof(int32_t) * (size_t)cap),
                *pb = malloc(sizeof(int32_t) * (size_t)cap);
        topk_bounds(ctx, &a, q, H, ua, P, pa, cap);
        topk_bounds(ctx, &b, q, H, ub, P, pb, cap);
        int64_t same = 0, looser = 0;
        for (int64_t i = 0; i < H * P; i++) {
            if (i % P == P - 1) continue; /* the last page carries no bound */
            same += ua[i] == ub[i];
            looser += ub[i] >= ua[i];
        }
        const int64_t n = H * (P - 1);
        if (kd[c] == rd[c]) {
            CHECK(same == n, "%s K, %s ranges: %lld of %lld bounds differ from fp32 ranges'",
                  ekv_dtype_name(kd[c]), ekv_dtype_name(rd[c]), (long long)(n - same),
                  (long long)n);
            CHECK(!memcmp(pa, pb, sizeof(int32_t) * (size_t)(2 * (64 / ps + 1))),
                  "%s K: the top-k lists differ with compact ranges", ekv_dtype_name(kd[c]));
        } else {
            CHECK(looser == n && same < n,
                  "f32 K, bf16 ranges: %lld of %lld bounds below fp32's, %lld equal",
                  (long long)(n - looser), (long long)n, (long long)same);
        }
        if (c == 0) { /* compact stats without their arrays, or with a dtype that is none */
            ekv_page_stats bad = b.st;
            bad.kmin16 = NULL;
            ekv_decode_params dp = ekv_decode_default_params();
            dp.num_heads = H;
            ekv_select_params sp = ekv_select_default_params();
            sp.method = EKV_SELECT_TOPK;
            int64_t lip[8];
            ekv_page_list list = {.indptr = lip, .pages = pb, .capacity = cap};
            CHECK(ekv_select_pages(ctx, &dp, &sp, &b.kv, &bad, &b.tab, q, &list) ==
                                  EKV_ERR_NULL_POINTER &&
                          strstr(ekv_last_error(ctx), "kmin16"),
                  "f16 ranges without kmin16: %s", ekv_last_error(ctx));
            bad = b.st;
            bad.range_dtype = (ekv_dtype)5;
            CHECK(ekv_select_pages(ctx, &dp, &sp, &b.kv, &bad, &b.tab, q, &list) ==
                          EKV_ERR_INVALID_DTYPE,
                  "range dtype 5: %s", ekv_last_error(ctx));
        }
        free(ua);
        free(ub);
        free(pa);
        free(pb);
        release(&a);
        release(&b);
    }
}

static double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        m += (double)b[i] * b[i];
    }
    return sqrt(e / (m > 0 ? m : 1));
}

/* A token budget longer than a short sequence of a batch: top-k and certified take the same
 * rule (ekv_seq_budget_tokens), each sequence clamped to its own length. */
static void test_budget_past_length(ekv_context *ctx) {
    enum { PS = 4, H = 2, D = 32 };
    const int64_t lens[2] = {6, 64}; /* 2 and 16 pages */
    test_rng r = {0x5eed5eedull};
    fixture f;
    build(ctx, &f, 2, lens, 1, D, PS, EKV_DTYPE_F32, EKV_DTYPE_F32, &r, 1.0);
    float q[2 * H * D], out[2 * H * D];
    for (int i = 0; i < 2 * H * D; i++) q[i] = (float)test_normal(&r);
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    dp.alpha = 1.5;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_TOPK;
    sp.budget_tokens = 32; /* 8 scored pages: all of sequence 0's one, 8 of sequence 1's 15 */
    const int64_t want[2] = {2, 9};
    int64_t lip[3];
    int32_t pages[32];
    ekv_page_list list = {.indptr = lip, .pages = pages, .capacity = 32};
    ekv_status s = ekv_select_pages(ctx, &dp, &sp, &f.kv, &f.st, &f.tab, q, &list);
    CHECK(s == EKV_OK, "topk, budget 32 over a 6-token sequence: %s", ekv_last_error(ctx));
    for (int b = 0; b < 2 && !s; b++)
        CHECK(lip[b + 1] - lip[b] == want[b], "topk: sequence %d lists %lld pages, want %lld", b,
              (long long)(lip[b + 1] - lip[b]), (long long)want[b]);
    int32_t round1[2] = {-1, -1};
    ekv_decode_info info = {.pages_round1 = round1};
    const ekv_select_method m[2] = {EKV_SELECT_TOPK, EKV_SELECT_CERTIFIED};
    for (int i = 0; i < 2; i++) {
        sp.method = m[i];
        s = ekv_decode(ctx, &dp, &sp, &f.kv, &f.st, &f.tab, q, out, &info);
        CHECK(s == EKV_OK, "%s decode, budget 32 over a 6-token sequence: %s",
              ekv_method_name(m[i]), ekv_last_error(ctx));
    }
    for (int b = 0; b < 2; b++) /* certified's candidates: the very top-k lists */
        CHECK(round1[b] == want[b], "certified: round 1 of sequence %d has %d pages, want %lld", b,
              round1[b], (long long)want[b]);
    release(&f);
}

int main(void) {
    ekv_context *ctx;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    if (ekv_context_create(&cp, &ctx)) return 1;
    test_handmade(ctx);
    test_compact_ranges(ctx);
    test_budget_past_length(ctx);
    test_rng r = {0xfeedbeefull};
    const ekv_dtype dts[] = {EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_BF16};
    const double alphas[] = {1.0, 1.5, 2.0, 1.25, 3.0};
    int contained = 0, trials = 0;
    for (int c = 0; c < 120; c++) {
        const int Hk = 1 + c % 2, G = 1 + (c / 2) % 4, H = Hk * G, D = c % 3 == 0 ? 64 : 32,
                  ps = (c % 4 == 0) ? 1 : 8 << (c % 3);
        const ekv_dtype dt = dts[c % 3];
        const double alpha = alphas[(c / 3) % 5];
        const int alibi = (c / 5) % 2, per_q = (c / 7) % 2;
        int B = 1 + c % 3;
        int64_t lens[3];
        for (int b = 0; b < B; b++) lens[b] = test_range(&r, 1, 600);
        if (c == 7) {
            B = 1;
            lens[0] = 1;
        } /* a 1-token sequence */
        fixture f;
        build(ctx, &f, B, lens, Hk, D, ps, dt, EKV_DTYPE_F32, &r, c % 4 == 1 ? 3.0 : 1.0);
        int64_t nmax = 0;
        for (int b = 0; b < B; b++) nmax = lens[b] > nmax ? lens[b] : nmax;
        float *q = malloc(sizeof(float) * (size_t)(B * H * D)), slopes[64];
        for (int64_t i = 0; i < B * H * D; i++) q[i] = (float)(2.0 * test_normal(&r));
        for (int h = 0; h < H; h++) slopes[h] = h % 2 ? 0.f : (float)pow(2.0, -(h + 1));
        ekv_decode_params dp = ekv_decode_default_params();
        dp.num_heads = H;
        dp.alpha = alpha;
        dp.alibi_slopes = alibi ? slopes : NULL;
        /* dense reference */
        float *od = malloc(sizeof(float) * (size_t)(B * H * D)),
              *os = malloc(sizeof(float) * (size_t)(B * H * D));
        float *pr = malloc(sizeof(float) * (size_t)(B * H * nmax));
        CHECK(ekv_decode_dense(ctx, &dp, &f.kv, &f.tab, q, od, NULL) == EKV_OK, "dense");
        CHECK(ekv_dense_probs(ctx, &dp, &f.kv, &f.tab, q, nmax, pr, NULL) == EKV_OK, "probs: %s",
              ekv_last_error(ctx));
        int32_t heads = per_q ? H : Hk;
        int64_t cap = ekv_page_list_capacity(&f.tab, heads);
        int64_t *lip = malloc(sizeof(int64_t) * (size_t)(B * heads + 1));
        int32_t *lpg = malloc(sizeof(int32_t) * (size_t)cap);
        ekv_page_list list = {.indptr = lip, .pages = lpg, .capacity = cap};
        ekv_select_params sp = ekv_select_default_params();
        sp.per_query_head = per_q;
        /* dense list == dense decode */
        sp.method = EKV_SELECT_DENSE;
        CHECK(ekv_select_pages(ctx, &dp, &sp, &f.kv, &f.st, &f.tab, q, &list) == EKV_OK,
              "dense list");
        CHECK(ekv_decode_pages(ctx, &dp, &f.kv, &f.tab, &list, q, os, NULL) == EKV_OK, "pages: %s",
              ekv_last_error(ctx));
        CHECK(rel_err(os, od, B * H * D) <= 1e-5,
              "case %d: dense list differs from dense decode: %.3g", c, rel_err(os, od, B * H * D));
        /* the bound: every token's probability-carrying score is below its page bound, tested
         * indirectly: the oracle list holds the support, so its output equals dense */
        if (alpha != 1.0) {
            sp.method = EKV_SELECT_ORACLE;
            CHECK(ekv_select_pages(ctx, &dp, &sp, &f.kv, &f.st, &f.tab, q, &list) == EKV_OK,
                  "oracle");
            CHECK(ekv_decode_pages(ctx, &dp, &f.kv, &f.tab, &list, q, os, NULL) == EKV_OK,
                  "oracle pages");
            CHECK(rel_err(os, od, B * H * D) <= 1e-5, "case %d: oracle differs from dense: %.3g", c,
                  rel_err(os, od, B * H * D));
        }
        /* top-k at several budgets: exact whenever the selection holds the support */
        int64_t minlen = lens[0];
        for (int b = 1; b < B; b++) minlen = lens[b] < minlen ? lens[b] : minlen;
        for (int bi = 0; bi < 3; bi++) {
            sp.method = EKV_SELECT_TOPK;
            sp.budget_tokens = bi == 0 ? 1 : bi == 1 ? (minlen + 3) / 4 : minlen;
            if (sp.budget_tokens < 1) sp.budget_tokens = 1;
            CHECK(ekv_select_pages(ctx, &dp, &sp, &f.kv, &f.st, &f.tab, q, &list) == EKV_OK,
                  "topk: %s", ekv_last_error(ctx));
            CHECK(ekv_decode_pages(ctx, &dp, &f.kv, &f.tab, &list, q, os, NULL) == EKV_OK,
                  "topk pages");
            for (int b = 0; b < B; b++) {
                const int64_t P = f.indptr[b + 1] - f.indptr[b];
                for (int l = 0; l < heads; l++) {
                    int64_t i0 = lip[b * heads + l], i1 = lip[b * heads + l + 1];
                    int64_t nsel = sp.budget_tokens / ps < 1 ? 1 : sp.budget_tokens / ps;
                    if (nsel > P - 1) nsel = P - 1;
                    CHECK(i1 - i0 == nsel + 1, "case %d: list has %lld pages, want %lld", c,
                          (long long)(i1 - i0), (long long)(nsel + 1));
                    CHECK(lpg[i1 - 1] == P - 1, "case %d: last page not last", c);
                    for (int g = 0; g < (per_q ? 1 : G); g++) {
                        const int h = per_q ? l : l * G + g;
                        const float *ph = pr + ((int64_t)b * H + h) * nmax;
                        int holds = 1;
                        for (int64_t jt = 0; jt < lens[b] && holds; jt++) {
                            if (ph[jt] <= 0 || alpha == 1.0) continue;
                            int in = 0;
                            for (int64_t i = i0; i < i1; i++) in |= lpg[i] == jt / ps;
                            holds = in;
                        }
                        trials++;
                        if (holds && alpha != 1.0) {
                            contained++;
                            CHECK(rel_err(os + ((int64_t)b * H + h) * D,
                                          od + ((int64_t)b * H + h) * D, D) <= 1e-5,
                                  "case %d head %d: support inside the selection but output differs by %.3g",
                                  c, h,
                                  rel_err(os + ((int64_t)b * H + h) * D,
                                          od + ((int64_t)b * H + h) * D, D));
                        }
                    }
                }
            }
        }
        free(q);
        free(od);
        free(os);
        free(pr);
        free(lip);
        free(lpg);
        release(&f);
    }
    printf("selections that held the support: %d of %d (exactness checked on each)\n", contained,
           trials);
    CHECK(contained > 50, "too few contained selections (%d) for the property to mean anything",
          contained);
    ekv_context_free(ctx);
    return test_finish("test_select");
}
