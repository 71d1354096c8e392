/*
 * Properties of the exact entmax solvers (docs/math.md §0, 8, 9.1, 9.8), on random rows and the
 * known hard inputs, against an independent long-double bisection:
 *   sum p = 1, p >= 0, order preserved, invariance to adding a constant, tau of a subset
 *   <= tau of the whole, the one-hot row shifted by -1000, alpha = 3 with 1000*randn,
 *   alpha = 4, single elements, all-equal rows, ties, masked (-inf) entries;
 * and the internal kept-score solver used by decode (ekv_tau_exact_f32) agrees with the
 * row API.
 */
#include "core/internal.h"
#include "math/entmax_tau.h"
#include "test_util.h"
#include <string.h>

/* Independent reference: bisection in long double on sum (z - tau)_+^beta = 1. */
static long double ref_tau(const double *x, int64_t n, double alpha) {
    long double a = alpha - 1.0L, m = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    if (alpha == 1.0) {
        long double s = 0;
        for (int64_t i = 0; i < n; i++) s += expl(x[i] - m);
        return m + logl(s);
    }
    long double lo = a * m - 1, hi = a * m, beta = 1.0L / a;
    for (int it = 0; it < 300; it++) {
        long double mid = 0.5L * (lo + hi), f = 0;
        for (int64_t i = 0; i < n; i++) {
            long double d = a * x[i] - mid;
            if (d > 0) f += powl(d, beta);
        }
        if (f > 1)
            lo = mid;
        else
            hi = mid;
    }
    return 0.5L * (lo + hi);
}

static void ref_probs(const double *x, int64_t n, double alpha, long double tau, double *p) {
    long double a = alpha - 1.0L, s = 0;
    long double *w = malloc(sizeof(long double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        if (alpha == 1.0)
            w[i] = x[i] == -INFINITY ? 0 : expl(x[i] - tau);
        else {
            long double d = a * x[i] - tau;
            w[i] = d > 0 ? powl(d, 1.0L / a) : 0;
        }
        s += w[i];
    }
    for (int64_t i = 0; i < n; i++) p[i] = (double)(w[i] / s);
    free(w);
}

static const double alphas[] = {1.0, 1.05, 1.25, 4.0 / 3.0, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0};
enum { NALPHA = sizeof alphas / sizeof alphas[0] };

/* Checks one row against the reference and the basic properties. */
static void check_row(ekv_context *ctx, const double *x, int64_t n, double alpha,
                      const char *what) {
    double *p = malloc(sizeof(double) * (size_t)n), *pr = malloc(sizeof(double) * (size_t)n), tau;
    int64_t sup;
    ekv_status st = ekv_entmax_f64(ctx, x, n, alpha, p, &tau, &sup);
    CHECK(st == EKV_OK, "%s alpha=%g n=%lld: status %d (%s)", what, alpha, (long long)n, st,
          ekv_last_error(ctx));
    if (st) {
        free(p);
        free(pr);
        return;
    }
    long double rt = ref_tau(x, n, alpha);
    ref_probs(x, n, alpha, rt, pr);
    double sum = 0, err = 0;
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += p[i];
        err = fmax(err, fabs(p[i] - pr[i]));
        cnt += p[i] > 0;
        CHECK(p[i] >= 0 && isfinite(p[i]), "%s alpha=%g: p[%lld]=%g", what, alpha, (long long)i,
              p[i]);
    }
    CHECK(fabs(sum - 1) <= 1e-9, "%s alpha=%g n=%lld: sum p = %.17g", what, alpha, (long long)n,
          sum);
    CHECK(err <= 1e-6, "%s alpha=%g n=%lld: max |p - ref| = %.3g", what, alpha, (long long)n, err);
    CHECK(cnt == sup, "%s alpha=%g: support %lld but %lld positive p", what, alpha, (long long)sup,
          (long long)cnt);
    /* tau agrees with the reference (relative to the scale of z) */
    double zmax = -INFINITY;
    for (int64_t i = 0; i < n; i++) zmax = fmax(zmax, (alpha == 1.0 ? 1.0 : alpha - 1.0) * x[i]);
    CHECK(fabs(tau - (double)rt) <= 1e-9 * fmax(1.0, fabs(zmax)),
          "%s alpha=%g: tau %.17g ref %.17Lg", what, alpha, tau, rt);
    /* order preserved */
    for (int64_t i = 0; i + 1 < n; i++)
        if (x[i] > x[i + 1])
            CHECK(p[i] >= p[i + 1], "%s alpha=%g: order broken at %lld", what, alpha, (long long)i);
        else if (x[i] < x[i + 1])
            CHECK(p[i] <= p[i + 1], "%s alpha=%g: order broken at %lld", what, alpha, (long long)i);
    free(p);
    free(pr);
}

/* ekv_entmax_rows(_f64): each row bit for bit the one-row call; a bad row is named and nothing
 * is written; ekv_abi_sizeof knows the public structs and only them. */
static void rows_check(ekv_context *ctx, test_rng *rng) {
    enum { R = 5, N = 37 };
    double x[R * N], p[R * N], one[N];
    float xf[R * N], pf[R * N], onef[N];
    for (int i = 0; i < R * N; i++) x[i] = 3 * test_normal(rng), xf[i] = (float)x[i];
    x[N + 3] = -INFINITY; /* a masked entry */
    xf[N + 3] = -INFINITY;
    for (int ai = 0; ai < NALPHA; ai++) {
        CHECK(ekv_entmax_rows_f64(ctx, x, R, N, alphas[ai], p) == EKV_OK, "rows: %s",
              ekv_last_error(ctx));
        CHECK(ekv_entmax_rows(ctx, xf, R, N, alphas[ai], pf) == EKV_OK, "rows f32: %s",
              ekv_last_error(ctx));
        for (int r = 0; r < R; r++) {
            ekv_entmax_f64(ctx, x + r * N, N, alphas[ai], one, NULL, NULL);
            ekv_entmax(ctx, xf + r * N, N, alphas[ai], onef, NULL, NULL);
            CHECK(!memcmp(one, p + r * N, sizeof one) && !memcmp(onef, pf + r * N, sizeof onef),
                  "row %d of the batch differs from the one-row call (alpha %g)", r, alphas[ai]);
        }
    }
    for (int i = 0; i < R * N; i++) p[i] = 7;
    x[3 * N + 5] = NAN;
    CHECK(ekv_entmax_rows_f64(ctx, x, R, N, 1.5, p) == EKV_ERR_NAN_INPUT &&
                  strstr(ekv_last_error(ctx), "row 3"),
          "a NaN in row 3: %s", ekv_last_error(ctx));
    x[3 * N + 5] = 0;
    for (int i = 0; i < N; i++) x[4 * N + i] = -INFINITY;
    CHECK(ekv_entmax_rows_f64(ctx, x, R, N, 1.5, p) == EKV_ERR_EMPTY_INPUT &&
                  strstr(ekv_last_error(ctx), "row 4"),
          "row 4 all -inf: %s", ekv_last_error(ctx));
    int untouched = 1;
    for (int i = 0; i < R * N; i++) untouched &= p[i] == 7;
    CHECK(untouched, "a refused batch wrote p");
    CHECK(ekv_entmax_rows(ctx, xf, 0, N, 1.5, pf) == EKV_ERR_INVALID_SIZE, "rows 0 accepted");
    CHECK(ekv_entmax_rows(ctx, xf, R, N, 0.5, pf) == EKV_ERR_INVALID_ALPHA, "alpha 0.5 accepted");
    CHECK(ekv_abi_sizeof("ekv_paged_kv") == (int64_t)sizeof(ekv_paged_kv) &&
                  ekv_abi_sizeof("ekv_select_params") == (int64_t)sizeof(ekv_select_params) &&
                  ekv_abi_sizeof("ekv_cuda_report") == (int64_t)sizeof(ekv_cuda_report) &&
                  ekv_abi_sizeof("ekv_cuda_append_item") == (int64_t)sizeof(ekv_cuda_append_item) &&
                  ekv_abi_sizeof("ekv_cuda_cache_params") == (int64_t)sizeof(ekv_cuda_cache_params),
          "ekv_abi_sizeof");
    CHECK(ekv_abi_sizeof("ekv_nothing") == -1 && ekv_abi_sizeof(NULL) == -1,
          "ekv_abi_sizeof of an unknown name");
}

int main(void) {
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    test_rng rng = {0x1234567ull};
    static double x[4096], y[4096], p1[4096], p2[4096];

    /* random rows, several scales and sizes */
    const int64_t sizes[] = {1, 2, 3, 10, 100, 1000, 4096};
    const double scales[] = {0.01, 1, 10, 100};
    for (int ai = 0; ai < NALPHA; ai++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
            for (size_t ci = 0; ci < sizeof scales / sizeof scales[0]; ci++) {
                int64_t n = sizes[si];
                for (int64_t i = 0; i < n; i++) x[i] = scales[ci] * test_normal(&rng);
                check_row(ctx, x, n, alphas[ai], "randn");
            }

    /* hard inputs */
    for (int ai = 0; ai < NALPHA; ai++) {
        double a = alphas[ai];
        for (int64_t i = 0; i < 10; i++) x[i] = i == 3 ? -999.0 : -1000.0;
        check_row(ctx, x, 10, a, "onehot-1000");
        for (int64_t i = 0; i < 8; i++) x[i] = 3.25;
        check_row(ctx, x, 8, a, "all-equal");
        ekv_entmax_f64(ctx, x, 8, a, p1, NULL, NULL);
        for (int64_t i = 0; i < 8; i++)
            CHECK(fabs(p1[i] - 0.125) < 1e-12, "all-equal alpha=%g p=%g", a, p1[i]);
        double ties[] = {2, 2, 2, 1, 0.5, -1, 2, 0};
        check_row(ctx, ties, 8, a, "ties");
        x[0] = 5.0;
        check_row(ctx, x, 1, a, "single");
        ekv_entmax_f64(ctx, x, 1, a, p1, NULL, NULL);
        CHECK(p1[0] == 1.0, "single element alpha=%g gives %g", a, p1[0]);
        for (int64_t i = 0; i < 20; i++) x[i] = 1000.0 * test_normal(&rng);
        check_row(ctx, x, 20, a, "1000randn");
        for (int64_t i = 0; i < 50; i++) x[i] = test_normal(&rng) + 1e6; /* large offset */
        check_row(ctx, x, 50, a, "offset1e6");
        /* masked entries: -inf gets p = 0 and the rest equals entmax of the finite part */
        double xm[12], xf[8];
        int nf = 0;
        for (int i = 0; i < 12; i++) {
            xm[i] = (i % 3 == 1) ? -INFINITY : test_normal(&rng);
            if (xm[i] > -INFINITY) xf[nf++] = xm[i];
        }
        double pm[12], pf[8];
        CHECK(ekv_entmax_f64(ctx, xm, 12, a, pm, NULL, NULL) == EKV_OK, "masked alpha=%g", a);
        ekv_entmax_f64(ctx, xf, nf, a, pf, NULL, NULL);
        for (int i = 0, k = 0; i < 12; i++) {
            if (xm[i] == -INFINITY)
                CHECK(pm[i] == 0, "masked entry alpha=%g got %g", a, pm[i]);
            else {
                CHECK(fabs(pm[i] - pf[k]) < 1e-12, "masked alpha=%g mismatch", a);
                k++;
            }
        }
    }

    /* invariance to adding a constant (exactly representable shifts) and tau shifting by
     * (alpha-1)*c; tau of a subset <= tau of the whole (docs/math.md §9.1) */
    for (int ai = 0; ai < NALPHA; ai++) {
        double a = alphas[ai], am1 = a == 1.0 ? 1.0 : a - 1.0;
        for (int trial = 0; trial < 50; trial++) {
            int64_t n = test_range(&rng, 2, 500);
            for (int64_t i = 0; i < n; i++) x[i] = ldexp(round(ldexp(test_normal(&rng), 20)), -20);
            double c = (double)test_range(&rng, -64, 64), t1, t2;
            for (int64_t i = 0; i < n; i++) y[i] = x[i] + c;
            ekv_entmax_f64(ctx, x, n, a, p1, &t1, NULL);
            ekv_entmax_f64(ctx, y, n, a, p2, &t2, NULL);
            double err = 0;
            for (int64_t i = 0; i < n; i++) err = fmax(err, fabs(p1[i] - p2[i]));
            CHECK(err < 1e-9, "shift alpha=%g c=%g: max diff %.3g", a, c, err);
            CHECK(fabs((t2 - t1) - am1 * c) < 1e-8 * (1 + fabs(am1 * c)),
                  "shift alpha=%g: tau moved by %.17g, not %.17g", a, t2 - t1, am1 * c);
            if (a > 1.0) { /* subset: a random half */
                int64_t m = 0;
                for (int64_t i = 0; i < n; i++)
                    if (test_next(&rng) & 1) y[m++] = x[i];
                if (m == 0) y[m++] = x[0];
                double ts;
                ekv_entmax_f64(ctx, y, m, a, p2, &ts, NULL);
                CHECK(ts <= t1 + 1e-12 * (1 + fabs(t1)),
                      "subset tau %.17g > whole tau %.17g (alpha=%g)", ts, t1, a);
            }
        }
    }

    /* the decode-path solver on kept float scores agrees with the row API (z-space) */
    for (int ai = 0; ai < NALPHA; ai++) {
        double a = alphas[ai];
        for (int trial = 0; trial < 20; trial++) {
            int64_t n = test_range(&rng, 1, 4096);
            static float z[4096];
            static double scratch[4096];
            double sc = trial % 2 ? 0.3 : 3.0;
            for (int64_t i = 0; i < n; i++) {
                z[i] = (float)(sc * test_normal(&rng));
                x[i] = a == 1.0 ? z[i] : z[i] / (a - 1.0); /* x such that (a-1)x = z */
            }
            double t_fast, t_row;
            int64_t s_fast, s_row;
            CHECK(ekv_tau_exact_f32(z, n, a, scratch, &t_fast, &s_fast) == EKV_OK, "tau_exact_f32");
            ekv_entmax_f64(ctx, x, n, a, p1, &t_row, &s_row);
            CHECK(fabs(t_fast - t_row) <= 1e-9 * (1 + fabs(t_row)),
                  "alpha=%g n=%lld tau fast %.17g row %.17g", a, (long long)n, t_fast, t_row);
            CHECK(labs((long)(s_fast - s_row)) <= 1, "alpha=%g support fast %lld row %lld", a,
                  (long long)s_fast, (long long)s_row);
        }
    }

    /* errors: NaN, +inf, all -inf */
    x[0] = 1;
    x[1] = NAN;
    CHECK(ekv_entmax_f64(ctx, x, 2, 1.5, p1, NULL, NULL) == EKV_ERR_NAN_INPUT, "NaN accepted");
    x[1] = INFINITY;
    CHECK(ekv_entmax_f64(ctx, x, 2, 1.5, p1, NULL, NULL) == EKV_ERR_NAN_INPUT, "+inf accepted");
    x[0] = x[1] = -INFINITY;
    CHECK(ekv_entmax_f64(ctx, x, 2, 1.5, p1, NULL, NULL) == EKV_ERR_EMPTY_INPUT,
          "all -inf accepted");

    rows_check(ctx, &rng);
    ekv_context_free(ctx);
    return test_finish("test_entmax_props");
}
