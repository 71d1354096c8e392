/*
 * Exact entmax attention of many query rows, forward and backward (docs/math.md §13):
 *   forward = dense decode (ekv_decode_dense) of every row over its causal prefix, GQA, ALiBi,
 *   alpha 1 (softmax), 1.25, 1.5, 2, 3; forward = the row API (ekv_entmax_f64) on scores built
 *   here, causal and not (T > N too);
 *   backward = central finite differences of L = sum dout * out in double (T 3, N 7, H 4, Hk 2,
 *   D 8; alpha 1, 1.25, 1.5, 2, 3; causal and not; ALiBi on and off): the random data is
 *   checked to keep every z at least 1e-3 from its row's tau (so a step of the differences never
 *   crosses the edge of the support, where alpha = 2's derivative jumps) and to have keys on both
 *   sides of it;
 *   a key exactly at tau (p = 0): sparsemax's one-sided derivative, entmax-1.5's two-sided one;
 *   alpha > 2: a gradient that overflows float fails, the double call returns it;
 *   every invalid input: its status and message, outputs untouched.
 */
#include "test_util.h"

enum { MAXN = 64, MAXE = 4096 };

typedef struct shape {
    int64_t T, N, H, Hk, D;
    double alpha;
    int causal, alibi;
} shape;

static const float slopes8[8] = {0.25f, 0.0625f, 0.015625f, 0.00390625f, 0, 0, 0, 0};

static ekv_attention_params params_of(const shape *s) {
    ekv_attention_params p = ekv_attention_default_params();
    p.num_queries = s->T, p.num_keys = s->N, p.num_heads = (int32_t)s->H;
    p.num_kv_heads = (int32_t)s->Hk, p.head_dim = (int32_t)s->D, p.alpha = s->alpha;
    p.causal = s->causal, p.alibi_slopes = s->alibi ? slopes8 : NULL;
    return p;
}

/* q scaled by qs: large enough that entmax rows have keys outside the support. */
static void fill(test_rng *r, double *x, int64_t n, double sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * test_normal(r);
}

/* Row t's scores s_j (x-space, docs/math.md §13) as this test reads the definition. */
static int64_t row_scores(const shape *s, const double *q, const double *k, int64_t t, int64_t h,
                          double *x) {
    const int64_t n = s->causal ? s->N - s->T + t + 1 : s->N, i = s->N - s->T + t;
    const double m = s->alibi ? slopes8[h] : 0, sc = 1.0 / sqrt((double)s->D);
    for (int64_t j = 0; j < n; j++) {
        double dot = 0;
        for (int64_t d = 0; d < s->D; d++)
            dot += q[(t * s->H + h) * s->D + d] * k[(j * s->Hk + h / (s->H / s->Hk)) * s->D + d];
        x[j] = sc * dot - m * fabs((double)(j - i));
    }
    return n;
}

/* Forward (double) against the row API on the same scores: out and tau; and o-hat (from the
 * forward's tau) against sum w v / sum w of the row API's p, w = p^(2 - alpha) where p > 0. */
static void check_row_api(ekv_context *ctx, const shape *s, uint64_t seed) {
    test_rng r = {seed};
    double q[MAXE], k[MAXE], v[MAXE], out[MAXE], oh[MAXE], tau[256], x[MAXN], p[MAXN];
    fill(&r, q, s->T * s->H * s->D, 3), fill(&r, k, s->N * s->Hk * s->D, 1);
    fill(&r, v, s->N * s->Hk * s->D, 1);
    const ekv_attention_params prm = params_of(s);
    ekv_status st = ekv_entmax_attention_forward_f64(ctx, &prm, q, k, v, out, tau);
    CHECK(st == EKV_OK, "forward_f64: %s", ekv_last_error(ctx));
    st = ekv_entmax_attention_ohat_f64(ctx, &prm, q, k, v, tau, oh);
    CHECK(st == EKV_OK, "ohat_f64: %s", ekv_last_error(ctx));
    double worst = 0, worst_tau = 0, worst_oh = 0;
    for (int64_t t = 0; t < s->T; t++)
        for (int64_t h = 0; h < s->H; h++) {
            const int64_t n = row_scores(s, q, k, t, h, x), r0 = t * s->H + h;
            double tr;
            CHECK(ekv_entmax_f64(ctx, x, n, s->alpha, p, &tr, NULL) == EKV_OK, "row api");
            worst_tau = fmax(worst_tau, fabs(tr - tau[r0]) / (1 + fabs(tr)));
            for (int64_t d = 0; d < s->D; d++) {
                double o = 0, ow = 0, sw = 0;
                for (int64_t j = 0; j < n; j++) {
                    const double vj = v[(j * s->Hk + h / (s->H / s->Hk)) * s->D + d];
                    const double w = p[j] > 0 ? pow(p[j], 2.0 - s->alpha) : 0;
                    o += p[j] * vj, ow += w * vj, sw += w;
                }
                worst = fmax(worst, fabs(o - out[r0 * s->D + d]));
                worst_oh = fmax(worst_oh, fabs(ow / sw - oh[r0 * s->D + d]));
            }
        }
    CHECK(worst < 1e-12 && worst_tau < 1e-12 && worst_oh < 1e-10,
          "alpha %g causal %d alibi %d T %lld N %lld: |out - row api| %g, tau %g, ohat %g",
          s->alpha, s->causal, s->alibi, (long long)s->T, (long long)s->N, worst, worst_tau,
          worst_oh);
}

/* A cache of page size 1 holding k, v (f32): the prefix of n tokens is the table's first n
 * pages, so row t's causal prefix is a decode step of n = N - T + t + 1 tokens. */
static void check_decode(ekv_context *ctx, const shape *s, uint64_t seed) {
    test_rng r = {seed};
    float q[MAXE], k[MAXE], v[MAXE], out[MAXE], dec[MAXE];
    double tau[256], dtau[8];
    for (int64_t i = 0; i < s->T * s->H * s->D; i++) q[i] = (float)(3 * test_normal(&r));
    for (int64_t i = 0; i < s->N * s->Hk * s->D; i++) {
        k[i] = (float)test_normal(&r);
        v[i] = (float)test_normal(&r);
    }
    ekv_cache_params cp = ekv_cache_default_params();
    cp.page_size = 1, cp.num_kv_heads = (int32_t)s->Hk, cp.head_dim = (int32_t)s->D;
    cp.dtype = EKV_DTYPE_F32, cp.num_pages = s->N, cp.max_seqs = 1, cp.superpage_pages = 0;
    ekv_cache *cache = NULL;
    int32_t seq = -1, idx[MAXN], lpl = 1;
    int64_t indptr[2], need;
    ekv_paged_kv kv;
    CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK && !ekv_cache_seq_new(cache, &seq) &&
                  !ekv_cache_append(cache, seq, s->N, k, v, EKV_DTYPE_F32) &&
                  !ekv_cache_page_table(cache, &seq, 1, indptr, idx, MAXN, &lpl, &need) &&
                  !ekv_cache_kv_view(cache, &kv, NULL),
          "cache: %s", ekv_last_error(ctx));
    const ekv_attention_params prm = params_of(s);
    CHECK(ekv_entmax_attention_forward(ctx, &prm, q, k, v, out, tau) == EKV_OK, "forward: %s",
          ekv_last_error(ctx));
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = (int32_t)s->H, dp.alpha = s->alpha, dp.alibi_slopes = prm.alibi_slopes;
    double worst = 0, worst_tau = 0;
    for (int64_t t = 0; t < s->T; t++) {
        int64_t ip[2] = {0, s->N - s->T + t + 1};
        int32_t one = 1;
        ekv_page_table tab = {1, ip, idx, &one};
        ekv_decode_info info = {0};
        info.tau = dtau;
        CHECK(ekv_decode_dense(ctx, &dp, &kv, &tab, q + t * s->H * s->D, dec, &info) == EKV_OK,
              "decode: %s", ekv_last_error(ctx));
        worst = fmax(worst, test_head_rel_err(out + t * s->H * s->D, dec, s->H, s->D, 1e-3));
        for (int64_t h = 0; h < s->H; h++)
            worst_tau = fmax(worst_tau, fabs(tau[t * s->H + h] - dtau[h]) / (1 + fabs(dtau[h])));
    }
    CHECK(worst < 2e-5 && worst_tau < 2e-5, "alpha %g alibi %d: vs decode: out %g, tau %g",
          s->alpha, s->alibi, worst, worst_tau);
    ekv_cache_free(cache);
}

/* L = sum dout * out in double. */
static double loss(ekv_context *ctx, const ekv_attention_params *p, const double *q,
                   const double *k, const double *v, const double *dout, int64_t nq) {
    double out[MAXE], L = 0;
    if (ekv_entmax_attention_forward_f64(ctx, p, q, k, v, out, NULL)) return NAN;
    for (int64_t i = 0; i < nq; i++) L += dout[i] * out[i];
    return L;
}

/* The smallest |z - tau| over every row and key the row sees, and how many keys lie outside
 * the supports (so the data has keys on both sides of the edge). */
static double tau_gap(const shape *s, const double *q, const double *k, const double *tau,
                      int64_t *outside) {
    double gap = INFINITY, x[MAXN];
    const double a = s->alpha == 1 ? 1 : s->alpha - 1;
    *outside = 0;
    for (int64_t t = 0; t < s->T; t++)
        for (int64_t h = 0; h < s->H; h++) {
            const int64_t n = row_scores(s, q, k, t, h, x);
            for (int64_t j = 0; j < n; j++) {
                gap = fmin(gap, fabs(a * x[j] - tau[t * s->H + h]));
                *outside += a * x[j] <= tau[t * s->H + h];
            }
        }
    return gap;
}

/* Central differences of L against backward_f64, every element of q, k and v. */
static double fd_error(ekv_context *ctx, const ekv_attention_params *p, double *x, int64_t n,
                       const double *grad, double *qkv[3], const double *dout, int64_t nq) {
    double worst = 0, scale = 0;
    const double hstep = 1e-6;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(grad[i]));
    for (int64_t i = 0; i < n; i++) {
        const double x0 = x[i];
        x[i] = x0 + hstep;
        const double lp = loss(ctx, p, qkv[0], qkv[1], qkv[2], dout, nq);
        x[i] = x0 - hstep;
        const double lm = loss(ctx, p, qkv[0], qkv[1], qkv[2], dout, nq);
        x[i] = x0;
        worst = fmax(worst, fabs((lp - lm) / (2 * hstep) - grad[i]));
    }
    return worst / (scale > 0 ? scale : 1);
}

static void check_gradients(ekv_context *ctx, const shape *s, uint64_t seed) {
    const int64_t nq = s->T * s->H * s->D, nk = s->N * s->Hk * s->D;
    double q[MAXE], k[MAXE], v[MAXE], dout[MAXE], out[MAXE], tau[256], dq[MAXE], dk[MAXE], dv[MAXE];
    const ekv_attention_params p = params_of(s);
    double gap = 0;
    int64_t outside = 0;
    test_rng r = {seed};
    for (int tries = 0; tries < 200 && gap < 1e-3; tries++) { /* data away from the edge */
        fill(&r, q, nq, 3), fill(&r, k, nk, 1), fill(&r, v, nk, 1), fill(&r, dout, nq, 1);
        CHECK(!ekv_entmax_attention_forward_f64(ctx, &p, q, k, v, out, tau), "forward");
        gap = tau_gap(s, q, k, tau, &outside);
    }
    CHECK(gap >= 1e-3, "no data with every z 1e-3 from tau (alpha %g)", s->alpha);
    CHECK(s->alpha == 1 || outside > 0, "alpha %g: every key in the support", s->alpha);
    CHECK(ekv_entmax_attention_backward_f64(ctx, &p, q, k, v, tau, dout, dq, dk, dv) == EKV_OK,
          "backward_f64: %s", ekv_last_error(ctx));
    double *qkv[3] = {q, k, v};
    const double eq = fd_error(ctx, &p, q, nq, dq, qkv, dout, nq),
                 ek = fd_error(ctx, &p, k, nk, dk, qkv, dout, nq),
                 ev = fd_error(ctx, &p, v, nk, dv, qkv, dout, nq);
    CHECK(eq < 1e-6 && ek < 1e-6 && ev < 1e-6,
          "alpha %g causal %d alibi %d: finite differences vs backward: dq %g dk %g dv %g",
          s->alpha, s->causal, s->alibi, eq, ek, ev);
    /* the float entry points: the same gradients to float rounding */
    float qf[MAXE], kf[MAXE], vf[MAXE], df[MAXE], dqf[MAXE], dkf[MAXE], dvf[MAXE];
    for (int64_t i = 0; i < nq; i++) qf[i] = (float)q[i], df[i] = (float)dout[i];
    for (int64_t i = 0; i < nk; i++) kf[i] = (float)k[i], vf[i] = (float)v[i];
    CHECK(ekv_entmax_attention_backward(ctx, &p, qf, kf, vf, tau, df, dqf, dkf, dvf) == EKV_OK,
          "backward: %s", ekv_last_error(ctx));
    double ef = 0, big = 0;
    for (int64_t i = 0; i < nk; i++) big = fmax(big, fmax(fabs(dk[i]), fabs(dv[i])));
    for (int64_t i = 0; i < nk; i++)
        ef = fmax(ef, fmax(fabs(dkf[i] - dk[i]), fabs(dvf[i] - dv[i])));
    for (int64_t i = 0; i < nq; i++) ef = fmax(ef, fabs(dqf[i] - dq[i]));
    CHECK(ef < 1e-4 * big, "alpha %g: float backward differs by %g (largest %g)", s->alpha, ef,
          big);
}

/* One query (q = 1, D = 1, scale 1) over keys k with values v: z = a k. dq, dk of key 1. */
static void tie_case(ekv_context *ctx, double alpha, const double *k, double *dq, double *dk,
                     double *fd_up, double *fd_down) {
    ekv_attention_params p = ekv_attention_default_params();
    p.num_keys = 2, p.head_dim = 1, p.causal = 0, p.alpha = alpha, p.scale = 1.f;
    double q = 1, v[2] = {0.5, -1.5}, dout = 1, out, tau, dkk[2], dv[2], kk[2] = {k[0], k[1]};
    CHECK(!ekv_entmax_attention_forward_f64(ctx, &p, &q, kk, v, &out, &tau), "tie forward");
    CHECK(!ekv_entmax_attention_backward_f64(ctx, &p, &q, kk, v, &tau, &dout, dq, dkk, dv),
          "tie backward: %s", ekv_last_error(ctx));
    *dk = dkk[1];
    const double h = 1e-7, L0 = loss(ctx, &p, &q, kk, v, &dout, 1);
    kk[1] = k[1] + h;
    *fd_up = (loss(ctx, &p, &q, kk, v, &dout, 1) - L0) / h;
    kk[1] = k[1] - h;
    *fd_down = (loss(ctx, &p, &q, kk, v, &dout, 1) - L0) / h * -1;
}

/* A key exactly at tau (p = 0, z = tau): outside S, so its gradient is 0. For sparsemax that is
 * the derivative from below (the one-sided difference down), while from above the key enters
 * with slope w = 1; for alpha = 1.5 the derivative is continuous (w = p^(1/2) -> 0) and both
 * sides give 0 (docs/math.md §13). */
static void check_ties(ekv_context *ctx) {
    double dq, dk, up, down;
    const double k2[2] = {1.0, 0.0}; /* sparsemax: tau = 0 exactly, key 1 at it */
    tie_case(ctx, 2.0, k2, &dq, &dk, &up, &down);
    CHECK(dk == 0 && fabs(down) < 1e-6 && fabs(up - (-1.5 - 0.5) / 2) < 1e-5,
          "sparsemax tie: dk %g, one-sided differences down %g up %g", dk, down, up);
    const double k15[2] = {2.0, 0.0}; /* alpha 1.5: z = [1, 0], tau = 0 exactly */
    tie_case(ctx, 1.5, k15, &dq, &dk, &up, &down);
    CHECK(dk == 0 && fabs(down) < 1e-5 && fabs(up) < 1e-5,
          "entmax-1.5 tie: dk %g, differences down %g up %g", dk, down, up);
}

/* alpha = 4: two keys 1e-300 above tau have w = p^-2 = 1e200: the float call fails and writes
 * nothing, the double call returns the (finite) gradient. */
static void check_alpha_above_2(ekv_context *ctx) {
    ekv_attention_params p = ekv_attention_default_params();
    p.num_keys = 3, p.head_dim = 1, p.causal = 0, p.alpha = 4.0, p.scale = 1.f;
    const double tau = -1e-300, dd = 1, qd = 1, kd[3] = {1.0 / 3, 0, 0}, vd[3] = {0, 1, -1};
    double dqd, dkd[3], dvd[3];
    CHECK(ekv_entmax_attention_backward_f64(ctx, &p, &qd, kd, vd, &tau, &dd, &dqd, dkd, dvd) ==
                          EKV_OK &&
                  dkd[1] > 1e199 && isfinite(dkd[1]),
          "alpha 4 double: %s, dk[1] %g", ekv_last_error(ctx), dkd[1]);
    const float qf = 1, kf[3] = {1.0f / 3, 0, 0}, vf[3] = {0, 1, -1}, df = 1;
    float dq = 7, dk[3] = {7, 7, 7}, dv[3] = {7, 7, 7};
    const ekv_status st =
            ekv_entmax_attention_backward(ctx, &p, &qf, kf, vf, &tau, &df, &dq, dk, dv);
    CHECK(st == EKV_ERR_INVALID_ARGUMENT && strstr(ekv_last_error(ctx), "dk[1]") &&
                  strstr(ekv_last_error(ctx), "alpha > 2"),
          "alpha 4 float: %d %s", (int)st, ekv_last_error(ctx));
    CHECK(dq == 7 && dk[0] == 7 && dk[1] == 7 && dv[2] == 7, "outputs written on failure");
}

/* Runs forward and backward (float) on p and expects status st with `msg` in the message and
 * every output untouched. */
static const float kk[64] = {0.5f}, vv[64] = {0.25f};

static void expect_fail(ekv_context *ctx, const ekv_attention_params *p, const float *q,
                        const double *tau, ekv_status st, const char *msg) {
    static const float dout[64] = {1};
    const float *k = kk, *v = vv;
    float out[64], dq[64], dk[64], dv[64];
    double tout[16];
    for (int i = 0; i < 64; i++) out[i] = dq[i] = dk[i] = dv[i] = 7;
    for (int i = 0; i < 16; i++) tout[i] = 7;
    ekv_status a = ekv_entmax_attention_forward(ctx, p, q, k, v, out, tout);
    if (!tau) /* the forward takes no tau: a case for the backward only */
        CHECK(a == st && strstr(ekv_last_error(ctx), msg), "forward: want %d '%s', got %d '%s'",
              (int)st, msg, (int)a, ekv_last_error(ctx));
    const double good_tau[16] = {0};
    ekv_status b =
            ekv_entmax_attention_backward(ctx, p, q, k, v, tau ? tau : good_tau, dout, dq, dk, dv);
    CHECK(b == st && strstr(ekv_last_error(ctx), msg), "backward: want %d '%s', got %d '%s'",
          (int)st, msg, (int)b, ekv_last_error(ctx));
    int touched = 0;
    for (int i = 0; i < 64; i++) touched += dq[i] != 7 || dk[i] != 7 || dv[i] != 7;
    for (int i = 0; i < 64 && !tau; i++) touched += out[i] != 7;
    for (int i = 0; i < 16 && !tau; i++) touched += tout[i] != 7;
    CHECK(!touched, "'%s': %d outputs written on failure", msg, touched);
}

static void check_invalid(ekv_context *ctx) {
    const ekv_attention_params ok = {2, 4, 2, 2, 4, 1, 1.5, 0.f, NULL};
    float q[64] = {0.5f};
    ekv_attention_params p = ok;
#define BAD(field, value, st, msg)                                                                 \
    do {                                                                                           \
        p = ok;                                                                                    \
        p.field = value;                                                                           \
        expect_fail(ctx, &p, q, NULL, st, msg);                                                    \
    } while (0)
    BAD(alpha, 0.5, EKV_ERR_INVALID_ALPHA, "alpha=0.5 is outside [1, 4]");
    BAD(alpha, NAN, EKV_ERR_INVALID_ALPHA, "alpha is NaN");
    BAD(num_heads, 0, EKV_ERR_INVALID_SIZE, "num_heads=0 must be >= 1");
    BAD(num_heads, 3, EKV_ERR_HEAD_MISMATCH, "num_heads=3 is not a multiple of num_kv_heads=2");
    BAD(num_kv_heads, 0, EKV_ERR_INVALID_SIZE, "num_kv_heads=0 must be >= 1");
    BAD(head_dim, 0, EKV_ERR_INVALID_SIZE, "head_dim=0 must be in [1, 65536]");
    BAD(scale, -1.f, EKV_ERR_INVALID_ARGUMENT, "scale=-1 must be finite and >= 0");
    BAD(num_queries, 0, EKV_ERR_INVALID_SIZE, "num_queries=0 and num_keys=4 must be >= 1");
    BAD(num_keys, -1, EKV_ERR_INVALID_SIZE, "num_queries=2 and num_keys=-1 must be >= 1");
    BAD(causal, 2, EKV_ERR_INVALID_ARGUMENT, "causal=2 must be 0 or 1");
    BAD(num_queries, 5, EKV_ERR_INVALID_SIZE, "causal attention needs num_queries=5 <= num_keys=4");
    BAD(num_keys, INT64_MAX / 2, EKV_ERR_SIZE_OVERFLOW, "overflows int64 bytes");
    const float neg[2] = {0.5f, -1.f}, huge[2] = {1e37f, 0}, nan2[2] = {NAN, 0};
    BAD(alibi_slopes, neg, EKV_ERR_INVALID_ARGUMENT, "alibi_slopes[1]=-1 must be finite and >= 0");
    BAD(alibi_slopes, nan2, EKV_ERR_INVALID_ARGUMENT, "alibi_slopes[0]=nan must be finite");
    BAD(alibi_slopes, huge, EKV_ERR_INVALID_ARGUMENT, "alibi_slopes[0]=1e+37 is too large");
#undef BAD
    p = ok;
    q[5] = NAN;
    expect_fail(ctx, &p, q, NULL, EKV_ERR_NAN_INPUT, "q[5] is NaN or infinite");
    q[5] = 0.5f;
    float out[64];
    double bad_tau[4], far_tau[4]; /* the forward's, one row changed */
    CHECK(!ekv_entmax_attention_forward(ctx, &p, q, kk, vv, out, far_tau), "forward");
    memcpy(bad_tau, far_tau, sizeof bad_tau);
    bad_tau[2] = INFINITY, far_tau[2] = -5;
    expect_fail(ctx, &p, q, bad_tau, EKV_ERR_NAN_INPUT, "tau[2] is NaN or infinite");
    expect_fail(ctx, &p, q, far_tau, EKV_ERR_INVALID_ARGUMENT,
                "tau[2]=-5 is not the threshold of row 1, head 0");
    /* o-hat takes the backward's check of tau, and writes nothing on failure */
    float oh[64];
    for (int i = 0; i < 64; i++) oh[i] = 7;
    CHECK(ekv_entmax_attention_ohat(ctx, &p, q, kk, vv, far_tau, oh) == EKV_ERR_INVALID_ARGUMENT &&
                  strstr(ekv_last_error(ctx), "tau[2]=-5 is not the threshold") && oh[0] == 7,
          "ohat, far tau: %s", ekv_last_error(ctx));
    CHECK(ekv_entmax_attention_ohat(ctx, &p, q, kk, vv, far_tau, NULL) == EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "ohat is NULL"),
          "ohat NULL: %s", ekv_last_error(ctx));
    /* NULL pointers, each by name */
    float o[64], g[64];
    const float x[64] = {0};
    const double t[4] = {0};
    CHECK(ekv_entmax_attention_forward(ctx, NULL, x, x, x, o, NULL) == EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "params is NULL"),
          "params NULL");
    CHECK(ekv_entmax_attention_forward(ctx, &ok, x, NULL, x, o, NULL) == EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "k is NULL"),
          "k NULL");
    CHECK(ekv_entmax_attention_forward_f64(ctx, &ok, NULL, NULL, NULL, NULL, NULL) ==
                          EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "q is NULL"),
          "q NULL");
    CHECK(ekv_entmax_attention_backward(ctx, &ok, x, x, x, NULL, x, o, g, g) ==
                          EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "tau is NULL"),
          "tau NULL");
    CHECK(ekv_entmax_attention_backward(ctx, &ok, x, x, x, t, x, o, g, NULL) ==
                          EKV_ERR_NULL_POINTER &&
                  strstr(ekv_last_error(ctx), "dv is NULL"),
          "dv NULL");
    CHECK(ekv_entmax_attention_forward(NULL, &ok, x, x, x, o, NULL) == EKV_ERR_NULL_POINTER,
          "ctx NULL");
    /* finite inputs whose scores overflow a double (the f64 entry point) */
    double big[64], od[64], td[4];
    for (int i = 0; i < 64; i++) big[i] = 1e200, od[i] = 7;
    CHECK(ekv_entmax_attention_forward_f64(ctx, &ok, big, big, big, od, td) == EKV_ERR_NAN_INPUT &&
                  strstr(ekv_last_error(ctx), "the score of row 0, head 0, key 0 overflows") &&
                  od[0] == 7,
          "score overflow: %s", ekv_last_error(ctx));
    CHECK(ekv_abi_sizeof("ekv_attention_params") == (int64_t)sizeof(ekv_attention_params),
          "abi size");
}

int main(void) {
    ekv_context_params cpar = ekv_context_default_params();
    cpar.n_threads = 1;
    ekv_context *ctx = NULL;
    if (ekv_context_create(&cpar, &ctx)) return 1;
    const double alphas[] = {1.0, 1.25, 1.5, 2.0, 3.0};
    uint64_t seed = 11;
    for (int a = 0; a < 5; a++)
        for (int alibi = 0; alibi < 2; alibi++) {
            const shape dec = {5, 40, 4, 2, 16, alphas[a], 1, alibi};
            check_decode(ctx, &dec, seed++);
            for (int causal = 0; causal < 2; causal++) {
                const shape s = {3, 7, 4, 2, 8, alphas[a], causal, alibi};
                check_row_api(ctx, &s, seed++);
                check_gradients(ctx, &s, seed++);
            }
            const shape wide = {9, 6, 8, 2, 4, alphas[a], 0, alibi}; /* T > N, not causal */
            check_row_api(ctx, &wide, seed++);
        }
    check_ties(ctx);
    check_alpha_above_2(ctx);
    check_invalid(ctx);
    ekv_context_free(ctx);
    return test_finish("test_entmax_attention");
}
