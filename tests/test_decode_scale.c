/*
 * Scale safety of every decode path (docs/math.md §6.2): finite inputs at any magnitude give
 * finite, correct outputs or a clear status, never NaN or zeros with EKV_OK.
 *  - queries scaled up to 1e36: dense, top-k over every page and certified equal the
 *    long-double reference (which works in shifted coordinates too);
 *  - scores beyond fp32 (|q.k| > 3.4e38): EKV_ERR_NAN_INPUT, output untouched;
 *  - ALiBi slopes whose bias overflows fp32: EKV_ERR_INVALID_ARGUMENT.
 * These failed before the fix: the candidate filter z > M - 1 kept nothing once M - 1
 * rounded to M (all-zero outputs), and the reference lost the -1 of its bracket (NaN).
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

enum { H = 2, D = 16, N = 40 };

/* N keys of normal channels times kscale (f32, pages of ps tokens, b-bit codes), V normal. */
static void make(ekv_context *ctx, float kscale, int ps, int code_bits, ekv_cache **c,
                 ekv_paged_kv *kv, ekv_page_stats *st, ekv_page_table *t, int64_t *ip,
                 int32_t *idx, int32_t *lpl) {
    ekv_cache_params cp = test_cache_params(ps, 1, D, EKV_DTYPE_F32, 1, N);
    cp.superpage_pages = 4;
    cp.code_bits = code_bits;
    CHECK(ekv_cache_create(ctx, &cp, c) == EKV_OK, "cache");
    int32_t s;
    ekv_cache_seq_new(*c, &s);
    test_rng r = {7};
    float k[N * D], v[N * D];
    for (int i = 0; i < N * D; i++) {
        k[i] = kscale * (float)test_normal(&r);
        v[i] = (float)test_normal(&r);
    }
    CHECK(ekv_cache_append(*c, s, N, k, v, EKV_DTYPE_F32) == EKV_OK, "append");
    ekv_cache_kv_view(*c, kv, st);
    int64_t need;
    CHECK(ekv_cache_page_table(*c, &s, 1, ip, idx, N, lpl, &need) == EKV_OK, "table");
    *t = (ekv_page_table){1, ip, idx, lpl};
}

/* Exact methods at extreme key scales (issue 32): certified and screened must equal dense
 * entmax (same support, outputs to 1e-5) or fail where dense fails, for every finite input.
 * A zero query with keys of 1e20 made certified drop pages (support 12 of 16, status OK):
 * ||q'|| * radius was 0 * inf = NaN, and a NaN page bound never exceeds tau. */
static void test_key_scale(ekv_context *ctx) {
    const float kscales[6] = {1e-30f, 1.f, 1e19f, 1e20f, 1e30f, 1e37f};
    const double qscales[4] = {0, 1e-20, 1, 1e12};
    const int pss[3] = {1, 4, 16}, bits[2] = {8, 4};
    test_rng r = {11};
    int compared = 0;
    for (int ki = 0; ki < 6; ki++)
        for (int pi = 0; pi < 3; pi++)
            for (int bi = 0; bi < 2; bi++) {
                ekv_cache *c;
                ekv_paged_kv kv;
                ekv_page_stats st;
                ekv_page_table t;
                int64_t ip[2];
                int32_t idx[N], lpl[1];
                make(ctx, kscales[ki], pss[pi], bits[bi], &c, &kv, &st, &t, ip, idx, lpl);
                for (int qi = 0; qi < 4; qi++)
                    for (int alibi = 0; alibi < 2; alibi++) {
                        float q[H * D], od[H * D], om[H * D], sl[H] = {0.5f, 0.f};
                        for (int i = 0; i < H * D; i++)
                            q[i] = (float)(qscales[qi] * test_normal(&r));
                        ekv_decode_params dp = ekv_decode_default_params();
                        dp.num_heads = H;
                        dp.alibi_slopes = alibi ? sl : NULL;
                        int64_t supd[H], supm[H];
                        ekv_decode_info id = {.support = supd}, im = {.support = supm};
                        const ekv_status sd = ekv_decode_dense(ctx, &dp, &kv, &t, q, od, &id);
                        for (int m = 0; m < 2; m++) {
                            ekv_select_params sp = ekv_select_default_params();
                            sp.method = m ? EKV_SELECT_SCREENED : EKV_SELECT_CERTIFIED;
                            sp.budget_tokens = 4;
                            const ekv_status sm = ekv_decode(ctx, &dp, &sp, &kv, &st, &t, q, om, &im);
                            const char *name = ekv_method_name(sp.method);
                            if (sd != EKV_OK) {
                                CHECK(sm != EKV_OK, "%s k x %g q x %g ps %d: OK where dense fails",
                                      name, (double)kscales[ki], qscales[qi], pss[pi]);
                                continue;
                            }
                            CHECK(sm == EKV_OK, "%s k x %g q x %g ps %d alibi %d: %s", name,
                                  (double)kscales[ki], qscales[qi], pss[pi], alibi,
                                  ekv_last_error(ctx));
                            if (sm != EKV_OK) continue;
                            double e = 0, mag = 0;
                            for (int i = 0; i < H * D; i++) {
                                e = fmax(e, isfinite(om[i]) ? fabs((double)om[i] - od[i]) : INFINITY);
                                mag = fmax(mag, fabs((double)od[i]));
                            }
                            for (int h = 0; h < H; h++)
                                CHECK(supm[h] == supd[h],
                                      "%s k x %g q x %g ps %d bits %d alibi %d head %d: support "
                                      "%lld, dense %lld",
                                      name, (double)kscales[ki], qscales[qi], pss[pi], bits[bi],
                                      alibi, h, (long long)supm[h], (long long)supd[h]);
                            CHECK(e <= 1e-5 * (1 + mag),
                                  "%s k x %g q x %g ps %d bits %d alibi %d: %.3g from dense", name,
                                  (double)kscales[ki], qscales[qi], pss[pi], bits[bi], alibi, e);
                            compared++;
                        }
                    }
                ekv_cache_free(c);
            }
    CHECK(compared > 300, "only %d exact steps compared with dense", compared);
}

int main(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    ekv_cache *c;
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_page_table t;
    int64_t ip[2];
    int32_t idx[N], lpl[1];
    make(ctx, 1.0f, 4, 0, &c, &kv, &st, &t, ip, idx, lpl);
    const double alphas[4] = {1.0, 1.3, 1.5, 2.0}, scales[5] = {1, 1e10, 1e20, 1e30, 1e36};
    test_rng r = {3};
    for (int ai = 0; ai < 4; ai++)
        for (int si = 0; si < 5; si++) {
            float q[H * D], o[H * D], ref[H * D];
            for (int i = 0; i < H * D; i++) q[i] = (float)(test_normal(&r) * scales[si]);
            ekv_decode_params dp = ekv_decode_default_params();
            dp.num_heads = H;
            dp.alpha = alphas[ai];
            CHECK(ekv_decode_dense_ref(ctx, &dp, &kv, &t, q, ref, NULL) == EKV_OK, "ref");
            for (int m = 0; m < 3; m++) {
                ekv_select_params sp = ekv_select_default_params();
                sp.method = m == 0   ? EKV_SELECT_DENSE
                            : m == 1 ? EKV_SELECT_TOPK
                                     : EKV_SELECT_CERTIFIED;
                sp.budget_fraction = 1.0;                  /* top-k over every page: exact */
                if (m == 2 && alphas[ai] == 1.0) continue; /* certified is entmax only */
                CHECK(ekv_decode(ctx, &dp, &sp, &kv, &st, &t, q, o, NULL) == EKV_OK, "%s: %s",
                      ekv_method_name(sp.method), ekv_last_error(ctx));
                double e = 0, mag = 0;
                for (int i = 0; i < H * D; i++) {
                    e = fmax(e, isfinite(o[i]) ? fabs((double)o[i] - (double)ref[i]) : INFINITY);
                    mag = fmax(mag, fabs((double)ref[i]));
                }
                CHECK(e < 1e-5 && mag > 0,
                      "%s alpha %g, q x %g: %.3g from the reference (|ref| %.3g)",
                      ekv_method_name(sp.method), alphas[ai], scales[si], e, mag);
            }
            float sl[H] = {3e38f, 0.f}, keep[H * D];
            memcpy(keep, o, sizeof o);
            dp.alibi_slopes = sl;
            CHECK(ekv_decode_dense(ctx, &dp, &kv, &t, q, o, NULL) == EKV_ERR_INVALID_ARGUMENT,
                  "slope 3e38");
            CHECK(!memcmp(keep, o, sizeof o), "a rejected step wrote the output");
        }
    ekv_cache_free(c);
    make(ctx, 1e30f, 4, 0, &c, &kv, &st, &t, ip, idx, lpl); /* |q.k| ~ 1e60: beyond fp32 */
    float q[H * D], o[H * D];
    for (int i = 0; i < H * D; i++) q[i] = 1e30f;
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_TOPK;
    sp.budget_tokens = 8;
    CHECK(ekv_decode_dense(ctx, &dp, &kv, &t, q, o, NULL) == EKV_ERR_NAN_INPUT,
          "dense overflow: %s", ekv_last_error(ctx));
    CHECK(ekv_decode(ctx, &dp, &sp, &kv, &st, &t, q, o, NULL) == EKV_ERR_NAN_INPUT,
          "topk overflow: %s", ekv_last_error(ctx));
    ekv_cache_free(c);
    test_key_scale(ctx);
    ekv_context_free(ctx);
    return test_finish("test_decode_scale");
}
