/*
 * Key codes and the screen bound (docs/math.md §10.1-10.2):
 *  - the cache keeps every token's codes exact under append (chunks of any size, ranges that
 *    widen): each stored code is the code of the stored key against the page's range, and
 *    the key is within s/2 + 2u A of what the code stands for;
 *  - no fp32 score the score kernels compute (scalar and the best ISA) falls outside the
 *    screen's [lo, hi], over f32/f16/bf16, 4 and 8 bits, pages 1-64, GQA, ALiBi, outlier and
 *    constant channels, narrow ranges far from 0, ranges near the dtype's limits, q = 0 and
 *    huge q;
 *  - mutations are caught: a halved code error, or the rounding slack dropped, each gives
 *    violations somewhere in the same table;
 *  - code_bits other than 0, 4, 8 is refused; the pool's byte count includes the codes.
 */
#include "entmaxkv.h"
#include "core/codes.h"
#include "cpu/stages/attend_tail.h"
#include "cpu/stages/screen.h"
#include "test_util.h"
#include <string.h>

typedef struct {
    int64_t checked, exact, halved, noslack, box; /* box: scores above the page box */
} counts;

enum {
    KIND_RANDOM,
    KIND_OUTLIER,
    KIND_CONSTANT,
    KIND_NARROW,
    KIND_LIMITS,
    KIND_QZERO,
    KIND_QHUGE,
    KIND_TINY,
    KIND_WIDE,
    KINDS
};

static double key_value(int kind, ekv_dtype dt, int64_t d, test_rng *r) {
    const double x = test_normal(r);
    switch (kind) {
    case KIND_OUTLIER: return d < 2 ? 20 * x + 6 : x;
    case KIND_CONSTANT: return d % 3 == 0 ? 0.75 : x;
    case KIND_NARROW: return 1000.0 + 1e-3 * x;
    case KIND_LIMITS: return (dt == EKV_DTYPE_F16 ? 6e4 : 1e30) * (test_uniform(r) * 2 - 1);
    case KIND_TINY: return 1e-44 * x; /* f32 subnormals: a step that rounds to 0 */
    case KIND_WIDE:                   /* f32 ranges whose width M - m overflows fp32 */
        return dt == EKV_DTYPE_F32 ? 3e38 * (test_uniform(r) * 2 - 1) : x;
    default: return x;
    }
}

/* A cache of one sequence of n tokens, appended in random chunks. */
static ekv_cache *make_cache(ekv_context *ctx, ekv_dtype dt, int bits, int ps, int Hk, int D,
                             int64_t n, int kind, test_rng *r, int32_t *seq) {
    ekv_cache_params cp = test_cache_params(ps, Hk, D, dt, 1, ekv_cache_pages_for(n, 1, ps));
    cp.code_bits = bits;
    ekv_cache *c = NULL;
    CHECK(ekv_cache_create(ctx, &cp, &c) == EKV_OK, "cache: %s", ekv_last_error(ctx));
    ekv_cache_seq_new(c, seq);
    float *k = malloc(sizeof(float) * (size_t)(n * Hk * D)),
          *v = calloc((size_t)(n * Hk * D), sizeof(float));
    for (int64_t i = 0; i < n * Hk * D; i++) k[i] = (float)key_value(kind, dt, i % D, r);
    for (int64_t t = 0; t < n;) {
        const int64_t want = 1 + test_range(r, 0, 36), m = want > n - t ? n - t : want;
        CHECK(ekv_cache_append(c, *seq, m, k + t * Hk * D, v + t * Hk * D, EKV_DTYPE_F32) == EKV_OK,
              "append: %s", ekv_last_error(ctx));
        t += m;
    }
    free(k);
    free(v);
    return c;
}

/* Every stored code is the code of the stored key, and stands for a value near it. */
static void check_codes(const ekv_paged_kv *kv, const ekv_page_stats *st, int32_t page, int64_t h,
                        int64_t ntok) {
    const int64_t D = kv->head_dim, rb = ekv_code_row_bytes(D, st->code_bits);
    const int64_t so = ((int64_t)page * kv->num_kv_heads + h) * D;
    const uint8_t *block = st->codes + ((int64_t)page * kv->num_kv_heads + h) * kv->page_size * rb;
    for (int64_t t = 0; t < ntok; t++) {
        for (int64_t d = 0; d < D; d++) {
            const float k = ekv_load_f32(kv->k, kv->dtype,
                                         page * kv->stride_page + h * kv->stride_head +
                                                 t * kv->stride_token + d);
            const float mn = st->kmin[so + d], mx = st->kmax[so + d],
                        s = ekv_code_step(mn, mx, st->code_bits);
            const uint32_t code = ekv_code_get(block, d, t, kv->page_size, st->code_bits);
            const double khat = (double)mn + ((double)code + 0.5) * s;
            const double A = fmax(fabs((double)mn), fabs((double)mx));
            CHECK(code == ekv_code_of(k, mn, s, st->code_bits),
                  "stale code (page %d slot %lld dim %lld)", page, (long long)t, (long long)d);
            CHECK(fabs((double)k - khat) <=
                          0.5 * s + 0x1p-23 * A + 0x1p-140, /* a step below fp32 subnormals is 0 */
                  "code error %.3g > s/2 = %.3g", fabs((double)k - khat), 0.5 * s);
        }
    }
}

/* Screened attention scores its surviving rows alone (pos0 = the row's slot): each must get
 * the bits scoring the whole page gave it (z [G][64]), ALiBi included. */
static void rows_alone(const ekv_cpu_kernels *kern, const ekv_paged_kv *kv, int32_t page, int64_t h,
                       int64_t ntok, ekv_dtype dt, int64_t D, const float *qs, int G,
                       const float *b0, const float *bs, const float *z) {
    for (int64_t t = 0; t < ntok; t++) {
        float zr[4], M[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        kern->score(ekv_cpu_page_ptr(kv, kv->k, page, h) +
                            t * kv->stride_token * ekv_dtype_size(dt),
                    kv->stride_token, 1, dt, D, qs, D, G, b0, bs, t, zr, 1, M, NULL);
        for (int g = 0; g < G; g++)
            CHECK(memcmp(&zr[g], &z[g * 64 + t], 4) == 0,
                  "row %lld head %d scored alone: %.9g, with its page %.9g", (long long)t, g, zr[g],
                  z[g * 64 + t]);
    }
}

/* Counts the tokens (x heads) of one page whose computed score leaves [lo, hi] under terms. */
static int64_t violations(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                          int G, const ekv_screen_terms *terms, const float *z, int64_t ld) {
    float lo[64 * 4], hi[64 * 4];
    float scratch[3 * 33 + 4 * 4 * 33]; /* ekv_screen_scratch_bytes(33, 4) */
    ekv_cpu_screen_prepare(qs, pg->D, G, pg->D, scratch);
    ekv_cpu_screen_page(kern, pg, qs, pg->D, G, terms, scratch, lo, hi, ld);
    int64_t bad = 0;
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < pg->ntok; t++)
            bad += !(lo[g * ld + t] <= z[g * ld + t] && z[g * ld + t] <= hi[g * ld + t]);
    return bad;
}

/* Counts the tokens (x heads) of one page whose computed score is above the page box
 * (docs/math.md §10.4), the test the screen runs before reading a page's codes. */
static int64_t box_violations(const ekv_cpu_kernels *kern, const ekv_screen_page *pg,
                              const float *qs, int G, const float *z, int64_t ld) {
    float scratch[3 * 33 + 4 * 4 * 33]; /* ekv_screen_scratch_bytes(33, 4) */
    double u[4];
    ekv_cpu_screen_prepare(qs, pg->D, G, pg->D, scratch);
    ekv_cpu_screen_page_box(kern, pg, G, scratch, u);
    int64_t bad = 0;
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < pg->ntok; t++) bad += !((double)z[g * ld + t] <= u[g]);
    return bad;
}

/* One case: every page and KV head, scores from the scalar and the best kernels. */
static void check_case(ekv_context *ctx, int ci, counts *n) {
    static const ekv_dtype dts[3] = {EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_BF16};
    static const int pss[4] = {16, 1, 7, 64};
    test_rng r = {0x5eed + (uint64_t)ci};
    const ekv_dtype dt = dts[ci % 3];
    const int bits = (ci / 3) % 2 ? 8 : 4, ps = pss[(ci / 6) % 4], kind = (ci / 2) % KINDS;
    const int Hk = 1 + ci % 2, G = ci % 4 == 0 ? 1 : 4, D = ci % 5 == 0 ? 33 : 32,
              alibi = (ci / 7) % 2;
    const int64_t N = 40 + test_range(&r, 0, 150);
    int32_t seq;
    ekv_cache *c = make_cache(ctx, dt, bits, ps, Hk, D, N, kind, &r, &seq);
    ekv_paged_kv kv;
    ekv_page_stats st;
    ekv_cache_kv_view(c, &kv, &st);
    int64_t ip[2], need;
    int32_t idx[256], lpl;
    ekv_cache_page_table(c, &seq, 1, ip, idx, 256, &lpl, &need);
    const double a = 0.5, scale = 1.0 / sqrt((double)D);
    const float qscale = (float)(a * (float)scale);
    float qs[4 * 33], slopes[4], b0[4], bs[4], z[4 * 64];
    double aslack[4];
    for (int i = 0; i < G * D; i++) {
        const double big = kind == KIND_QHUGE ? 1e20 : kind == KIND_TINY ? 1e30 : 1;
        const double x = kind == KIND_QZERO ? 0 : test_normal(&r) * big;
        qs[i] = (float)(kind == KIND_LIMITS || kind == KIND_WIDE ? x * 1e-9 : x) * qscale;
    }
    for (int g = 0; g < G; g++) slopes[g] = alibi ? (float)(0.25 * (g + 1)) : 0.f;
    const ekv_cpu_kernels *kerns[2] = {ekv_cpu_kernels_for(EKV_ISA_SCALAR),
                                       ekv_cpu_kernels_for(ekv_context_isa(ctx))};
    for (int64_t p = 0; p < need; p++) {
        const int64_t ntok = p == need - 1 ? lpl : ps;
        for (int64_t h = 0; h < Hk; h++) {
            check_codes(&kv, &st, idx[p], h, ntok);
            const int64_t so = ((int64_t)idx[p] * Hk + h) * D;
            const int biased =
                    ekv_cpu_alibi_page(alibi ? slopes : NULL, a, 0, G, p * ps, N, b0, bs);
            for (int g = 0; g < G; g++)
                aslack[g] = 16.0 * 0x1p-24 * a * slopes[g] * ((double)llabs(p * ps - (N - 1)) + ps);
            const ekv_screen_page pg = {st.kmin + so,
                                        st.kmax + so,
                                        st.codes + ((int64_t)idx[p] * Hk + h) * ps *
                                                           ekv_code_row_bytes(D, bits),
                                        bits,
                                        D,
                                        ps,
                                        ntok,
                                        biased ? b0 : NULL,
                                        biased ? bs : NULL,
                                        biased ? aslack : NULL};
            for (int kk = 0; kk < 2; kk++) {
                float M[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
                kerns[kk]->score(ekv_cpu_page_ptr(&kv, kv.k, idx[p], h), kv.stride_token, ntok, dt,
                                 D, qs, D, G, biased ? b0 : NULL, biased ? bs : NULL, 0, z, 64, M,
                                 NULL);
                rows_alone(kerns[kk], &kv, idx[p], h, ntok, dt, D, qs, G, biased ? b0 : NULL,
                           biased ? bs : NULL, z);
                const ekv_screen_terms halved = {0.5, 1}, noslack = {1.0, 0};
                n->checked += ntok * G;
                n->exact += violations(kerns[kk], &pg, qs, G, &ekv_screen_exact, z, 64);
                n->halved += violations(kerns[kk], &pg, qs, G, &halved, z, 64);
                n->noslack += violations(kerns[kk], &pg, qs, G, &noslack, z, 64);
                n->box += box_violations(kerns[kk], &pg, qs, G, z, 64);
            }
        }
    }
    ekv_cache_free(c);
}

static void check_params(ekv_context *ctx) {
    ekv_cache_params cp = ekv_cache_default_params();
    cp.num_pages = 10;
    const int64_t plain = ekv_cache_bytes_needed(&cp);
    cp.code_bits = 4;
    CHECK(ekv_cache_bytes_needed(&cp) - plain ==
                  10 * cp.num_kv_heads * cp.page_size * cp.head_dim / 2,
          "the pool's bytes count the 4-bit codes");
    cp.code_bits = 3;
    ekv_cache *c = NULL;
    CHECK(ekv_cache_create(ctx, &cp, &c) == EKV_ERR_INVALID_ARGUMENT && !c, "code_bits 3 refused");
}

int main(void) {
    ekv_context *ctx;
    CHECK(ekv_context_create(NULL, &ctx) == EKV_OK, "context");
    check_params(ctx);
    counts n = {0, 0, 0, 0, 0};
    for (int ci = 0; ci < 216; ci++) check_case(ctx, ci, &n);
    printf("screen: %lld head-token scores checked; outside [lo, hi]: %lld exact, %lld with the code error "
           "halved, %lld without the slack\n",
           (long long)n.checked, (long long)n.exact, (long long)n.halved, (long long)n.noslack);
    CHECK(n.exact == 0, "%lld computed scores outside the screen's bounds", (long long)n.exact);
    printf("screen: computed scores above the page box: %lld\n", (long long)n.box);
    CHECK(n.box == 0, "%lld computed scores above the page box", (long long)n.box);
    CHECK(n.halved > 0, "a halved code error went unnoticed");
    CHECK(n.noslack > 0, "a dropped rounding slack went unnoticed");
    ekv_context_free(ctx);
    return test_finish("test_screen");
}
