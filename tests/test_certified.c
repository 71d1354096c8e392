/*
 * Certified decode and the dropped-mass bound (docs/math.md §9):
 *  - the page bound (min(box, ball) + slack) is never below any token's score, checked in
 *    double precision against every key as stored, in f32/f16/bf16, with and without ALiBi;
 *  - certified decode equals dense entmax (<= 1e-5 relative, identical support) over
 *    thousands of steps, including adversarial ones: a query of norm 0 (every score equal),
 *    near-flat scores (a support spread over many pages), duplicated keys (ties at tau),
 *    one-token pages, heavy outlier channels, GQA and per-query-head lists;
 *  - for top-k steps: delta <= delta_bar, delta_bar = 0 implies an exact output, and
 *    ||o - o*||_2 <= 2 delta max ||v||_2 (docs/math.md §9.4).
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static float kval(const ekv_paged_kv *kv, const void *base, int64_t off) {
    if (kv->dtype == EKV_DTYPE_F32) return ((const float *)base)[off];
    uint16_t h = ((const uint16_t *)base)[off];
    if (kv->dtype == EKV_DTYPE_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    /* f16 */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    uint32_t bits = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int main(void) {
    ekv_context *ctx;
    ekv_context_params cpp = ekv_context_default_params();
    cpp.n_threads = 2;
    if (ekv_context_create(&cpp, &ctx)) return 1;
    test_rng r = {0xc0ffee};
    const ekv_dtype dts[3] = {EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_BF16};
    const double alphas[4] = {1.5, 2.0, 1.25, 3.0};
    int steps = 0, round2 = 0, bar_zero = 0, exact_when_zero = 0, hinted = 0, superpage_steps = 0,
        superpage_saved = 0;
    double worst_rel = 0, worst_bound_gap = 1e300;
    for (int c = 0; c < 240; c++) {
        const int Hk = 1 + c % 2, G = 1 << (c % 3), H = Hk * G, D = c % 5 == 0 ? 24 : 32;
        const int ps = c % 7 == 0 ? 1 : c % 3 == 0 ? 4 : 16;
        const ekv_dtype dt = dts[c % 3];
        const double alpha = alphas[(c / 3) % 4];
        const int alibi = (c / 4) % 2, per_q = (c / 8) % 2;
        const int64_t N = 1 + (int64_t)test_range(&r, 0, 400);
        const int kind =
                c % 6; /* 0 random, 1 planted, 2 heavy, 3 flat, 4 zero query, 5 duplicates */
        ekv_cache_params cp = test_cache_params(ps, Hk, D, dt, 1, ekv_cache_pages_for(N, 1, ps));
        cp.superpage_pages =
                c % 4 == 3 ? 0 : (c % 4 == 1 ? 4 : 16); /* flat, small and default superpages */
        /* every fifth case: compact ranges and the compact ball (docs/math.md §1.2, §9.5) */
        cp.range_dtype = c % 5 == 2 ? (dt == EKV_DTYPE_F32 ? EKV_DTYPE_BF16 : dt) : EKV_DTYPE_F32;
        ekv_cache *cache;
        CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK, "cache");
        int32_t seq;
        ekv_cache_seq_new(cache, &seq);
        float *k = malloc(sizeof(float) * (size_t)(N * Hk * D)),
              *v = malloc(sizeof(float) * (size_t)(N * Hk * D));
        for (int64_t i = 0; i < N * Hk * D; i++) {
            double x = test_normal(&r);
            if (kind == 2 && i % D < 2) x = 20 * x + 6; /* outlier channels */
            k[i] = (float)x;
            v[i] = (float)test_normal(&r);
        }
        if (kind == 1) /* a few keys aligned with channel 0 */
            for (int t = 0; t < 5 && N > 1; t++) k[(test_range(&r, 0, N - 1) * Hk) * D] = 12.f;
        if (kind == 5) /* many exact duplicates of a few keys: ties at tau */
            for (int64_t t = 1; t < N; t++)
                if (test_next(&r) % 3 == 0)
                    memcpy(k + t * Hk * D, k + (t % 4) * Hk * D, sizeof(float) * (size_t)(Hk * D));
        CHECK(ekv_cache_append(cache, seq, N, k, v, EKV_DTYPE_F32) == EKV_OK, "append");
        ekv_paged_kv kv;
        ekv_page_stats st;
        ekv_cache_kv_view(cache, &kv, &st);
        int64_t ip[2];
        int32_t lpl[1], *idx = malloc(sizeof(int32_t) * (size_t)(N + 1));
        ekv_cache_page_table(cache, &seq, 1, ip, idx, N + 1, lpl, NULL);
        ekv_page_table tab = {1, ip, idx, lpl};
        const int64_t P = ip[1];
        float slopes[8];
        for (int h = 0; h < H; h++) slopes[h] = h % 2 ? 0.f : (float)pow(2.0, -(h + 1));
        ekv_decode_params dp = ekv_decode_default_params();
        dp.num_heads = H;
        dp.alpha = alpha;
        dp.alibi_slopes = alibi ? slopes : NULL;
        float *q = malloc(sizeof(float) * (size_t)(H * D)),
              *od = malloc(sizeof(float) * (size_t)(H * D));
        float *oc = malloc(sizeof(float) * (size_t)(H * D)),
              *pr = malloc(sizeof(float) * (size_t)(H * N));
        float *bnd = malloc(sizeof(float) * (size_t)(H * P));
        for (int rep = 0; rep < 12; rep++) {
            double qs = kind == 3 ? 0.05 : 1.5;
            for (int i = 0; i < H * D; i++) q[i] = kind == 4 ? 0.f : (float)(qs * test_normal(&r));
            double taud[8], tauc[8], bar[8];
            int64_t supd[8], supc[8];
            ekv_decode_info idd = {.tau = taud, .support = supd},
                            ic = {.tau = tauc, .support = supc};
            CHECK(ekv_decode_dense(ctx, &dp, &kv, &tab, q, od, &idd) == EKV_OK, "dense");
            ekv_select_params sp = ekv_select_default_params();
            sp.budget_tokens = 1 + (int64_t)(test_next(&r) % (uint64_t)N);
            sp.per_query_head = per_q;
            sp.sink_pages = rep % 3 == 0 ? 1 : 0;
            sp.recent_pages = rep % 4 == 0 ? 2 : 0;
            /* adaptive round 1 from a hint of tau: sometimes the true tau (round 2 must then be
             * empty), sometimes far off in either direction (must stay exact) */
            double hint[8];
            const int hint_kind = rep % 5; /* 0: none, 1: tau*, 2: below, 3: above, 4: +-inf */
            for (int h = 0; h < H; h++)
                hint[h] = hint_kind == 1   ? taud[h] - 1e-9 * (1 + fabs(taud[h]))
                          : hint_kind == 2 ? taud[h] - 2.0
                          : hint_kind == 3 ? taud[h] + 5.0
                                           : (h % 2 ? INFINITY : -INFINITY);
            sp.tau_hint = hint_kind ? hint : NULL;
            int32_t r1[8], r2[8];
            ekv_certified_info ci = {r1, r2, 0, 0, 0};
            ekv_status s = ekv_decode_certified(ctx, &dp, &sp, &kv, &st, &tab, q, oc, &ic, &ci);
            CHECK(s == EKV_OK, "case %d: certified: %s", c, ekv_last_error(ctx));
            CHECK(ci.certified == 1, "case %d: not certified", c);
            if (hint_kind == 1 ||
                hint_kind == 2) { /* a hint at or below tau*: round 2 never needed */
                hinted++;
                CHECK(ci.lists_round2 == 0,
                      "case %d: a hint at/below tau* still needed round 2 (%lld lists)", c,
                      (long long)ci.lists_round2);
            }
            steps++;
            round2 += ci.lists_round2 > 0;
            for (int h = 0; h < H; h++) {
                double e = 0, m = 0;
                for (int d = 0; d < D; d++) {
                    e += ((double)oc[h * D + d] - od[h * D + d]) *
                         ((double)oc[h * D + d] - od[h * D + d]);
                    m += (double)od[h * D + d] * od[h * D + d];
                }
                double rel = sqrt(e / (m > 0 ? m : 1));
                worst_rel = fmax(worst_rel, rel);
                CHECK(rel <= 1e-5,
                      "case %d (kind %d, %s, ps %d, alpha %g, alibi %d, perq %d) head %d: certified differs by %.3g",
                      c, kind, ekv_dtype_name(dt), ps, alpha, alibi, per_q, h, rel);
                CHECK(supc[h] == supd[h], "case %d head %d: support %lld vs dense %lld", c, h,
                      (long long)supc[h], (long long)supd[h]);
            }
            /* top-k with certified bounds: delta <= delta_bar, and the output error bound */
            int64_t lip[9];
            int32_t *lpg = malloc(sizeof(int32_t) * (size_t)(P * H + 1));
            ekv_page_list list = {.indptr = lip,
                                  .pages = lpg,
                                  .capacity = P * H,
                                  .bounds = bnd,
                                  .bounds_stride = P};
            sp.method = EKV_SELECT_TOPK;
            sp.tau_hint = NULL;
            /* half the steps let the bound stage skip superpages below tau* (a valid lower
             * bound): the bound fuzz below then covers the superpage bounds too */
            sp.tau_lb = rep % 2 ? taud : NULL;
            int64_t flat_bytes = 0;
            if (sp.tau_lb) {
                ekv_select_params fl = sp;
                fl.tau_lb = NULL;
                CHECK(ekv_select_pages(ctx, &dp, &fl, &kv, &st, &tab, q, &list) == EKV_OK,
                      "flat topk");
                flat_bytes = list.bytes_summary;
            }
            CHECK(ekv_select_pages(ctx, &dp, &sp, &kv, &st, &tab, q, &list) == EKV_OK, "topk: %s",
                  ekv_last_error(ctx));
            if (sp.tau_lb) {
                superpage_steps++;
                superpage_saved += list.bytes_summary < flat_bytes;
            }
            double taus[8];
            ekv_decode_info is = {.tau = taus, .support = NULL};
            CHECK(ekv_decode_pages(ctx, &dp, &kv, &tab, &list, q, oc, &is) == EKV_OK, "topk pages");
            CHECK(ekv_delta_bound(ctx, &dp, &kv, &tab, &list, taus, bar) == EKV_OK,
                  "delta_bound: %s", ekv_last_error(ctx));
            CHECK(ekv_dense_probs(ctx, &dp, &kv, &tab, q, N, pr, NULL) == EKV_OK, "probs");
            /* the bound fuzz: every token of a scored page below its page's bound (double) */
            const double a = alpha - 1, scale = 1.0 / sqrt((double)D);
            for (int h = 0; h < H; h++) {
                const int l = per_q ? h : h / G, kvh = h / G;
                uint8_t *in = calloc((size_t)P, 1);
                for (int64_t i = lip[l]; i < lip[l + 1]; i++) in[lpg[i]] = 1;
                double delta = 0, vmax = 0;
                for (int64_t t = 0; t < N; t++) {
                    if (!in[t / ps]) delta += pr[h * N + t];
                    double vn = 0;
                    for (int d = 0; d < D; d++) {
                        const int64_t off = (int64_t)idx[t / ps] * kv.stride_page +
                                            kvh * kv.stride_head + (t % ps) * kv.stride_token + d;
                        vn += (double)kval(&kv, kv.v, off) * kval(&kv, kv.v, off);
                    }
                    vmax = fmax(vmax, sqrt(vn));
                    if (t / ps == P - 1) continue;
                    double z = 0;
                    for (int d = 0; d < D; d++) {
                        const int64_t off = (int64_t)idx[t / ps] * kv.stride_page +
                                            kvh * kv.stride_head + (t % ps) * kv.stride_token + d;
                        z += (double)q[h * D + d] * kval(&kv, kv.k, off);
                    }
                    z = a * (scale * z + (alibi ? slopes[h] * (double)(t - (N - 1)) : 0.0));
                    double gap = (double)bnd[h * P + t / ps] - z;
                    worst_bound_gap = fmin(worst_bound_gap, gap);
                    CHECK(gap >= 0,
                          "case %d head %d token %lld: score %.9g above its page bound %.9g", c, h,
                          (long long)t, z, (double)bnd[h * P + t / ps]);
                }
                CHECK(delta <= bar[h] * (1 + 1e-6) + 1e-7,
                      "case %d head %d: delta %.6g > delta_bar %.6g", c, h, delta, bar[h]);
                double e = 0;
                for (int d = 0; d < D; d++)
                    e += ((double)oc[h * D + d] - od[h * D + d]) *
                         ((double)oc[h * D + d] - od[h * D + d]);
                CHECK(sqrt(e) <= 2 * delta * vmax * (1 + 1e-4) + 1e-5,
                      "case %d head %d: ||o - o*|| %.6g > 2 delta max|v| %.6g", c, h, sqrt(e),
                      2 * delta * vmax);
                if (bar[h] == 0) {
                    bar_zero++;
                    exact_when_zero += sqrt(e) <= 1e-5 * (1 + vmax);
                }
                free(in);
            }
            free(lpg);
        }
        free(k);
        free(v);
        free(idx);
        free(q);
        free(od);
        free(oc);
        free(pr);
        free(bnd);
        ekv_cache_free(cache);
    }
    printf("certified steps: %d (round 2 needed in %d), worst relative difference to dense %.3g\n",
           steps, round2, worst_rel);
    printf("top-k heads with delta_bar = 0: %d (all exact: %d); smallest bound - score gap %.3g\n",
           bar_zero, exact_when_zero, worst_bound_gap);
    CHECK(bar_zero == exact_when_zero, "delta_bar = 0 but the output was not exact");
    CHECK(hinted > 500, "too few hinted steps (%d)", hinted);
    printf("superpage skipping read fewer summary bytes in %d of %d steps\n", superpage_saved,
           superpage_steps);
    CHECK(superpage_saved > 50, "superpages never skipped anything (%d of %d)", superpage_saved,
          superpage_steps);
    CHECK(steps >= 2000 && round2 > 50 && round2 < steps,
          "the step mix did not exercise both rounds (%d of %d)", round2, steps);
    ekv_context_free(ctx);
    return test_finish("test_certified");
}
