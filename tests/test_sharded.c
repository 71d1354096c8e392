/*
 * Context-parallel decode simulated on the CPU (ekv_decode_sharded_sim, docs/math.md §11): for
 * 1 to 8 shards, every alpha path (softmax, 1.25, the closed forms 1.5 and 2, 3), f32/f16,
 * GQA, ALiBi, ragged batches with one-token sequences, and adversarial scores (planted support,
 * every key equal (a flat row, the whole sequence in the support), one dominant key, ties at
 * tau): the output equals dense entmax (<= 1e-5 relative), tau to 1e-9 and the support exactly;
 * the rounds the collectives need are counted (closed forms: few), and bad arguments refused.
 * Top-k and gaussian (listed_cases): for 1 to 8 shards, ragged batches, GQA/MHA, per-KV-head
 * and per-query-head lists, budgets below, at and above the ranked pages, ties of page bounds
 * (identical pages), ALiBi, the gaussian tau modes: the agreed page lists equal
 * ekv_select_pages's exactly (as sets) and the outputs, tau and supports ekv_decode's.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0, nb = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        nb += (double)b[i] * b[i];
    }
    return sqrt(e) / (sqrt(nb) + 1e-12);
}

/* keys by kind: 0 random, 1 a planted direction in 2 % of tokens, 2 every key equal, 3 one
 * dominant key, 4 duplicated pairs (ties at tau), 5 every page the same keys (ties of page
 * bounds), with a planted direction on every seventh page */
static void make_keys(test_rng *r, int kind, float *k, int64_t n, int Hk, int D, const float *dir,
                      int ps) {
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < Hk; h++)
            for (int d = 0; d < D; d++) {
                float x = (float)test_normal(r);
                if (kind == 1 && test_uniform(r) < 0.02) x += 3 * dir[d];
                if (kind == 2) x = dir[d];
                if (kind == 3) x = t == n / 3 ? 6 * dir[d] : 0.1f * x;
                if (kind == 4 && t % 2) x = k[((t - 1) * Hk + h) * D + d];
                if (kind == 5)
                    x = t >= ps ? k[((t % ps) * Hk + h) * D + d] + ((t / ps) % 7 == 3 ? dir[d] : 0)
                                : x;
                k[(t * Hk + h) * D + d] = x;
            }
}

/* n sequences of lens[b] tokens into cache: keys by kind (make_keys), values N(0, 1); their
 * ids into seqs. */
static void fill_seqs(ekv_context *ctx, ekv_cache *cache, test_rng *r, int kind,
                      const int64_t *lens, int n, int Hk, int D, const float *dir, int ps,
                      int32_t *seqs) {
    for (int b = 0; b < n; b++) {
        float *k = malloc(sizeof(float) * lens[b] * Hk * D),
              *v = malloc(sizeof(float) * lens[b] * Hk * D);
        make_keys(r, kind, k, lens[b], Hk, D, dir, ps);
        for (int64_t i = 0; i < lens[b] * Hk * D; i++) v[i] = (float)test_normal(r);
        ekv_cache_seq_new(cache, &seqs[b]);
        CHECK(ekv_cache_append(cache, seqs[b], lens[b], k, v, EKV_DTYPE_F32) == EKV_OK,
              "append: %s", ekv_last_error(ctx));
        free(k);
        free(v);
    }
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Lists l of a and b hold the same pages (sorted copies compared); returns the lists differing. */
static int64_t lists_differ(const ekv_page_list *a, const ekv_page_list *b, int64_t n) {
    int64_t bad = 0;
    int32_t x[1024], y[1024];
    for (int64_t l = 0; l < n; l++) {
        const int64_t na = a->indptr[l + 1] - a->indptr[l], nb = b->indptr[l + 1] - b->indptr[l];
        if (na != nb || na > 1024) {
            bad++;
            continue;
        }
        memcpy(x, a->pages + a->indptr[l], sizeof(int32_t) * (size_t)na);
        memcpy(y, b->pages + b->indptr[l], sizeof(int32_t) * (size_t)nb);
        qsort(x, (size_t)na, sizeof *x, cmp_i32);
        qsort(y, (size_t)nb, sizeof *y, cmp_i32);
        bad += memcmp(x, y, sizeof(int32_t) * (size_t)na) != 0;
    }
    return bad;
}

/* The select parameters of listed case c. */
static ekv_select_params listed_select(int c, int topk) {
    ekv_select_params sp = ekv_select_default_params();
    sp.method = topk ? EKV_SELECT_TOPK : EKV_SELECT_GAUSSIAN;
    sp.per_query_head = (c / 3) % 2;
    if (topk) {
        const double fr[4] = {0.1, 0.35, 1.0, 0.0}; /* 1.0: every ranked page; 0: budget 1 */
        sp.budget_fraction = fr[(c / 6) % 4];
        sp.budget_tokens = 1;
        sp.use_ball = (c / 5) % 2;
    } else {
        const ekv_tau_mode modes[3] = {EKV_TAU_EXACT, EKV_TAU_FIXED, EKV_TAU_CORRECTED};
        sp.tau_mode = modes[(c / 4) % 3];
        sp.auto_margin = (c / 7) % 2;
        sp.margin_z = 0.1;
    }
    return sp;
}

/* Top-k and gaussian steps against the single-device ones. */
static void listed_cases(ekv_context *ctx, test_rng *r) {
    const double topk_alphas[4] = {1.0, 1.5, 2.0, 1.25}, gauss_alphas[3] = {1.5, 2.0, 4.0 / 3.0};
    const int kinds[4] = {0, 1, 2, 5};
    int select_max[2] = {0, 0};
    int64_t lists_seen = 0;
    for (int c = 0; c < 192; c++) {
        const int topk = c % 2, Hk = 1 + (c / 2) % 2, G = 1 + (c / 4) % 3, H = Hk * G, D = 16;
        const int ps = (c / 8) % 3 == 0 ? 4 : 16, S = 1 + (c * 5) % 8, kind = kinds[(c / 12) % 4];
        const int alibi = (c / 48) % 2;
        const double alpha = topk ? topk_alphas[(c / 2) % 4] : gauss_alphas[(c / 2) % 3];
        const int64_t lens[4] = {1 + (int64_t)test_range(r, 0, 700), 1, 97, 4 * ps};
        ekv_cache_params cp = ekv_cache_default_params();
        cp.page_size = ps;
        cp.num_kv_heads = Hk;
        cp.head_dim = D;
        cp.dtype = c % 3 ? EKV_DTYPE_F16 : EKV_DTYPE_F32;
        cp.num_pages = 1000;
        cp.superpage_pages = 0;
        ekv_cache *cache = NULL;
        CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK, "cache: %s", ekv_last_error(ctx));
        float dir[16], slopes[8];
        for (int d = 0; d < D; d++) dir[d] = (float)test_normal(r);
        for (int h = 0; h < H; h++) slopes[h] = 0.02f * (float)(h + 1);
        int32_t seqs[4];
        fill_seqs(ctx, cache, r, kind, lens, 4, Hk, D, dir, ps, seqs);
        ekv_paged_kv kv;
        ekv_page_stats st;
        ekv_cache_kv_view(cache, &kv, &st);
        int64_t indptr[5], lpl_need;
        int32_t indices[1000], lpl[4];
        ekv_cache_page_table(cache, seqs, 4, indptr, indices, 1000, lpl, &lpl_need);
        const ekv_page_table tab = {4, indptr, indices, lpl};
        float q[4 * 6 * 16], ref[4 * 6 * 16], out[4 * 6 * 16];
        for (int i = 0; i < 4 * H * D; i++) q[i] = (float)test_normal(r) * 2;
        ekv_decode_params dp = ekv_decode_default_params();
        dp.num_heads = H;
        dp.alpha = alpha;
        dp.alibi_slopes = alibi ? slopes : NULL;
        const ekv_select_params sp = listed_select(c, topk);
        const int32_t heads = sp.per_query_head ? H : Hk;
        const int64_t cap = ekv_page_list_capacity(&tab, heads);
        int64_t ip_a[4 * 6 + 1], ip_b[4 * 6 + 1];
        int32_t *pa = malloc(sizeof(int32_t) * cap), *pb = malloc(sizeof(int32_t) * cap);
        double ta[24], tb[24], tr[24], ts[24];
        ekv_page_list la = {.indptr = ip_a, .pages = pa, .capacity = cap, .tau = ta};
        ekv_page_list lb = {.indptr = ip_b, .pages = pb, .capacity = cap, .tau = tb};
        int64_t sr[24], ss[24];
        ekv_decode_info ri = {.tau = tr, .support = sr}, si = {.tau = ts, .support = ss};
        ekv_shard_report rep;
        CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &la) == EKV_OK, "select: %s",
              ekv_last_error(ctx));
        /* the fixed/corrected modes need the list's tau-hat: ekv_decode_pages over the list */
        CHECK((sp.tau_mode == EKV_TAU_EXACT
                       ? ekv_decode(ctx, &dp, &sp, &kv, &st, &tab, q, ref, &ri)
                       : ekv_decode_pages(ctx, &dp, &kv, &tab, &la, q, ref, &ri)) == EKV_OK,
              "decode: %s", ekv_last_error(ctx));
        CHECK(ekv_decode_sharded_sim(ctx, &dp, &sp, &kv, &st, &tab, q, out, S, &lb, &si, &rep) ==
                      EKV_OK,
              "sharded: %s", ekv_last_error(ctx));
        const int64_t bad = lists_differ(&la, &lb, 4 * heads);
        lists_seen += 4 * heads;
        CHECK(lb.heads == heads && bad == 0,
              "case %d (%s, alpha %g, kind %d, %d shards, ps %d, alibi %d): %lld of %d lists "
              "differ",
              c, topk ? "topk" : "gaussian", alpha, kind, S, ps, alibi, (long long)bad, 4 * heads);
        const double e = test_head_rel_err(out, ref, 4 * H, D, 1e-6);
        CHECK(e <= 1e-5, "case %d (%s, alpha %g, kind %d, %d shards): rel err %.3g", c,
              topk ? "topk" : "gaussian", alpha, kind, S, e);
        /* tau-hat of identical pages (kind 2): sigma_g^2 is then a cancellation (the mean of
         * mu_p^2 less mu_g^2), whose rounding follows the order of the sums */
        const double tol_hat = kind == 2 ? 1e-7 : 1e-9;
        for (int i = 0; i < 4 * H; i++) {
            const double tol = alpha == 1.0                            ? 1e-6
                               : !topk && sp.tau_mode != EKV_TAU_EXACT ? tol_hat
                                                                       : 1e-9;
            CHECK(fabs(ts[i] - tr[i]) <= tol * (1 + fabs(tr[i])),
                  "case %d head %d: tau %.17g vs %.17g", c, i, ts[i], tr[i]);
            CHECK(ss[i] == sr[i], "case %d head %d: support %lld vs %lld", c, i, (long long)ss[i],
                  (long long)sr[i]);
            if (!topk && sp.tau_mode != EKV_TAU_EXACT)
                CHECK(fabs(tb[i] - ta[i]) <= tol_hat * (1 + fabs(ta[i])),
                      "case %d head %d: tau-hat %.17g vs %.17g", c, i, tb[i], ta[i]);
        }
        select_max[topk] =
                rep.select_rounds > select_max[topk] ? rep.select_rounds : select_max[topk];
        if (topk)
            CHECK(rep.select_rounds <= 5, "case %d: top-k took %d rounds", c, rep.select_rounds);
        if (!topk && !alibi)
            CHECK(rep.select_rounds == 1 + (sp.tau_mode != EKV_TAU_EXACT),
                  "case %d: gaussian took %d rounds", c, rep.select_rounds);
        if (c < 2) { /* the lists from the step arena: the same step; a budget above a length */
            float o2[4 * 6 * 16];
            CHECK(ekv_decode_sharded_sim(ctx, &dp, &sp, &kv, &st, &tab, q, o2, S, NULL, NULL,
                                         NULL) == EKV_OK &&
                          !memcmp(o2, out, sizeof(float) * 4 * H * D),
                  "case %d: without lists the step differs", c);
            ekv_select_params big = sp; /* clamped to each length, as on one device */
            big.budget_fraction = 0;
            big.budget_tokens = 2;
            float o3[4 * 6 * 16];
            CHECK(!topk || (ekv_decode_sharded_sim(ctx, &dp, &big, &kv, &st, &tab, q, o2, S, NULL,
                                                   NULL, NULL) == EKV_OK &&
                            ekv_decode(ctx, &dp, &big, &kv, &st, &tab, q, o3, NULL) == EKV_OK &&
                            test_head_rel_err(o2, o3, 4 * H, D, 1e-6) <= 1e-5),
                  "case %d: a budget above a sequence's length: %s", c, ekv_last_error(ctx));
            ekv_select_params orc = sp;
            orc.method = EKV_SELECT_ORACLE;
            CHECK(ekv_decode_sharded_sim(ctx, &dp, &orc, &kv, &st, &tab, q, o2, S, NULL, NULL,
                                         NULL) == EKV_ERR_UNSUPPORTED,
                  "oracle accepted");
        }
        free(pa);
        free(pb);
        ekv_cache_free(cache);
    }
    printf("listed: %lld page lists equal to one device's; selection rounds at most %d (top-k), "
           "%d (gaussian, ALiBi's mixture included)\n",
           (long long)lists_seen, select_max[1], select_max[0]);
}

int main(void) {
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    test_rng r = {0x5eed5};
    const double alphas[5] = {1.0, 1.25, 1.5, 2.0, 3.0};
    int rounds_closed = 0, rounds_generic = 0, n_closed = 0, n_generic = 0;
    double mean_closed = 0, mean_generic = 0;
    int64_t bytes_seen = 0;
    for (int c = 0; c < 120; c++) {
        const int Hk = 1 + c % 2, G = 1 + (c / 2) % 3, H = Hk * G, D = 16, ps = c % 4 ? 16 : 3;
        const double alpha = alphas[c % 5];
        const int kind = (c / 5) % 5, alibi = (c / 25) % 2, S = 1 + (c * 7) % 8;
        const ekv_dtype dt = c % 3 ? EKV_DTYPE_F16 : EKV_DTYPE_F32;
        const int64_t lens[3] = {1 + (int64_t)test_range(&r, 0, 700), 1, 97};
        ekv_cache_params cp = ekv_cache_default_params();
        cp.page_size = ps;
        cp.num_kv_heads = Hk;
        cp.head_dim = D;
        cp.dtype = dt;
        cp.num_pages = 800;
        cp.superpage_pages = 0;
        ekv_cache *cache = NULL;
        CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK, "cache: %s", ekv_last_error(ctx));
        float dir[16], slopes[16];
        for (int d = 0; d < D; d++) dir[d] = (float)test_normal(&r);
        for (int h = 0; h < H; h++) slopes[h] = 0.02f * (float)(h + 1);
        int32_t seqs[3];
        fill_seqs(ctx, cache, &r, kind, lens, 3, Hk, D, dir, ps, seqs);
        ekv_paged_kv kv;
        ekv_cache_kv_view(cache, &kv, NULL);
        int64_t indptr[4], lpl_need;
        int32_t indices[800], lpl[3];
        ekv_cache_page_table(cache, seqs, 3, indptr, indices, 800, lpl, &lpl_need);
        const ekv_page_table tab = {3, indptr, indices, lpl};
        float q[3 * 8 * 16], ref[3 * 8 * 16], out[3 * 8 * 16];
        for (int i = 0; i < 3 * H * D; i++) q[i] = (float)test_normal(&r) * 2;
        ekv_decode_params dp = ekv_decode_default_params();
        dp.num_heads = H;
        dp.alpha = alpha;
        dp.alibi_slopes = alibi ? slopes : NULL;
        double tr[24], ts[24];
        int64_t sr[24], ss[24];
        ekv_decode_info ri = {.tau = tr, .support = sr}, si = {.tau = ts, .support = ss};
        ekv_shard_report rep;
        CHECK(ekv_decode_dense(ctx, &dp, &kv, &tab, q, ref, &ri) == EKV_OK, "dense: %s",
              ekv_last_error(ctx));
        CHECK(ekv_decode_sharded_sim(ctx, &dp, NULL, &kv, NULL, &tab, q, out, S, NULL, &si, &rep) ==
                      EKV_OK,
              "sharded: %s", ekv_last_error(ctx));
        const double e = rel_err(out, ref, 3 * H * D);
        CHECK(e <= 1e-5, "case %d (alpha %g, kind %d, %d shards, alibi %d): rel err %.3g", c, alpha,
              kind, S, alibi, e);
        for (int i = 0; i < 3 * H; i++) {
            /* softmax: dense sums its log-sum-exp in fp32 */
            const double tol = alpha == 1.0 ? 1e-6 : 1e-9;
            CHECK(fabs(ts[i] - tr[i]) <= tol * (1 + fabs(tr[i])),
                  "case %d head %d: tau %.17g vs dense %.17g", c, i, ts[i], tr[i]);
            CHECK(ss[i] == sr[i], "case %d head %d: support %lld vs dense %lld", c, i,
                  (long long)ss[i], (long long)sr[i]);
        }
        if (alpha == 1.5 || alpha == 2.0) {
            rounds_closed = rep.rounds_max > rounds_closed ? rep.rounds_max : rounds_closed;
            mean_closed += rep.rounds_mean;
            n_closed++;
        } else if (alpha != 1.0) {
            rounds_generic = rep.rounds_max > rounds_generic ? rep.rounds_max : rounds_generic;
            mean_generic += rep.rounds_mean;
            n_generic++;
        }
        if (alpha == 1.0) CHECK(rep.rounds_max == 3, "softmax: %d rounds", rep.rounds_max);
        CHECK(rep.bytes > 0, "no bytes counted");
        bytes_seen += rep.bytes;
        if (c == 0) { /* refusals */
            CHECK(ekv_decode_sharded_sim(ctx, &dp, NULL, &kv, NULL, &tab, q, out, 0, NULL, NULL,
                                         NULL) == EKV_ERR_INVALID_SIZE,
                  "0 shards accepted");
            CHECK(ekv_decode_sharded_sim(ctx, &dp, NULL, &kv, NULL, &tab, q, out, 65, NULL, NULL,
                                         NULL) == EKV_ERR_INVALID_SIZE,
                  "65 shards accepted");
            CHECK(ekv_decode_sharded_sim(ctx, &dp, NULL, &kv, NULL, &tab, q, NULL, 2, NULL, NULL,
                                         NULL) == EKV_ERR_NULL_POINTER,
                  "a NULL output accepted");
        }
        ekv_cache_free(cache);
    }
    printf("allreduce rounds per head: with the closed forms (alpha 1.5, 2) %.2f on average, %d "
           "at most; alpha 1.25 and 3 (bracketed Newton) %.2f, %d; %lld payload bytes in all\n",
           mean_closed / n_closed, rounds_closed, mean_generic / n_generic, rounds_generic,
           (long long)bytes_seen);
    CHECK(rounds_closed <= 10, "the closed forms took %d rounds", rounds_closed);
    listed_cases(ctx, &r);
    ekv_context_free(ctx);
    return test_finish("test_sharded");
}
