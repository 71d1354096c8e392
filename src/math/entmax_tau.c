/*
 * Exact alpha-entmax thresholds on a set of kept scores (docs/math.md §8, 9.8).
 *
 * Every path works on max-shifted candidates y = z - max(z) in double precision. Because
 * the maximum alone contributes 1 to F(tau) = sum (z - tau)_+^beta at tau = M - 1, the
 * threshold satisfies tau >= M - 1, so only entries with y > -1 can be in the support:
 * they are compacted first (a few hundred out of 10^5 in practice), and the solvers below
 * touch only them.
 *
 *   alpha = 2   Michelot's iteration from below: tau <- (sum_S y - 1)/|S| over
 *               S = {y > tau}; tau never overshoots and S shrinks to the support. Exact.
 *   alpha = 1.5 Newton from below on the convex F (never overshoots), and at every step the
 *               closed form of docs/math.md §8 on S = {y > tau}; it is accepted as soon as it is
 *               consistent (every y in S is >= the root), which makes the result exact to
 *               rounding. A sort-based solve is the fallback after many steps.
 *   other alpha safeguarded Halley/Newton with bisection in the bracket
 *               [-1, -k^(1-alpha)] until the bracket is at double precision.
 */
#include "entmax_tau.h"
#include <stdlib.h>

int64_t ekv_tau_scratch_doubles(int64_t n) { return n > 0 ? n : 1; }

/* Keep only y > thr (the order is irrelevant). Returns the new count. */
static int64_t compact_above(double *y, int64_t k, double thr) {
    int64_t m = 0;
    for (int64_t i = 0; i < k; i++)
        if (y[i] > thr) y[m++] = y[i];
    return m;
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Sort-based exact solve for alpha in {1.5, 2} (docs/math.md §8); reorders y. */
static double tau_sorted(double *y, int64_t k, double alpha) {
    qsort(y, (size_t)k, sizeof *y, cmp_desc);
    double c = 0, q = 0, best = y[0] - 1.0;
    for (int64_t i = 0; i < k; i++) {
        double n = (double)(i + 1);
        c += y[i];
        q += y[i] * y[i];
        double t;
        if (alpha == 2.0) {
            t = (c - 1.0) / n;
        } else {
            double mean = c / n, ss = q - n * mean * mean, d = (1.0 - ss) / n;
            t = mean - sqrt(d > 0 ? d : 0);
        }
        if (t < y[i])
            best = t; /* largest k with tau_k < y_(k) */
        else
            break;
    }
    return best;
}

static double tau_sparsemax(double *y, int64_t k) {
    double tau = -1.0;
    for (int it = 0; it < 128; it++) {
        k = compact_above(y, k, tau);
        double s = 0;
        for (int64_t i = 0; i < k; i++) s += y[i];
        double next = (s - 1.0) / (double)k;
        int64_t still = 0; /* does S change at the new tau? */
        for (int64_t i = 0; i < k; i++) still += y[i] > next;
        if (still == k) return next;
        tau = next;
    }
    return tau_sorted(y, k, 2.0);
}

static double tau_entmax15(double *y, int64_t k) {
    double tau = -1.0;
    for (int it = 0; it < 128; it++) {
        k = compact_above(y, k, tau);
        double s = 0, q = 0, ymin = 0, f = 0, fp = 0;
        for (int64_t i = 0; i < k; i++) {
            double d = y[i] - tau;
            s += y[i];
            q += y[i] * y[i];
            ymin = i == 0 || y[i] < ymin ? y[i] : ymin;
            f += d * d;
            fp += d;
        }
        double n = (double)k, mean = s / n;
        double ss = q - n * mean * mean, disc = (1.0 - ss) / n;
        if (disc >= 0) {
            double root = mean - sqrt(disc);
            if (ymin >= root) return root; /* S is the support: exact closed form */
        }
        if (f <= 1.0) return tau; /* cannot happen from below except at the root itself */
        double next = tau + (f - 1.0) / (2.0 * fp); /* Newton, stays <= tau* (convexity) */
        if (!(next > tau)) break;                   /* no progress left at this precision */
        tau = next;
    }
    return tau_sorted(y, k, 1.5);
}

/* F, F', F'' of F(tau) = sum (y - tau)_+^beta over the kept y. */
static void generic_eval(const double *y, int64_t k, double tau, double beta, double *f, double *f1,
                         double *f2) {
    double s0 = 0, s1 = 0, s2 = 0;
    for (int64_t i = 0; i < k; i++) {
        double d = y[i] - tau;
        if (d > 0) {
            double pb = pow(d, beta);
            s0 += pb;
            s1 += pb / d;
            s2 += pb / (d * d);
        }
    }
    *f = s0;
    *f1 = -beta * s1;
    *f2 = beta * (beta - 1.0) * s2;
}

static double tau_generic(double *y, int64_t k, double alpha) {
    double a = alpha - 1.0, beta = 1.0 / a;
    double lo = -1.0, hi = -pow((double)k, -a);
    if (hi < lo) hi = lo;
    double tau = 0.5 * (lo + hi);
    for (int it = 0; it < 400; it++) {
        double f, f1, f2;
        generic_eval(y, k, tau, beta, &f, &f1, &f2);
        double g = f - 1.0;
        if (g == 0) return tau;
        if (g > 0)
            lo = tau;
        else
            hi = tau;
        if (hi - lo <= 4e-16 * (1.0 + fabs(lo))) break;
        double den = 2.0 * f1 * f1 - g * f2, next;
        if (isfinite(den) && den != 0 && isfinite(f2))
            next = tau - 2.0 * g * f1 / den; /* Halley */
        else if (f1 < 0)
            next = tau - g / f1; /* Newton */
        else
            next = 0.5 * (lo + hi);
        if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
        tau = next;
        if (it % 8 == 7) k = compact_above(y, k, lo); /* entries <= lo never count again */
    }
    return 0.5 * (lo + hi);
}

double ekv_tau_candidates(double *y, int64_t k, double alpha) {
    if (alpha == 2.0) return tau_sparsemax(y, k);
    if (alpha == 1.5) return tau_entmax15(y, k);
    return tau_generic(y, k, alpha);
}

/* Scans z: NaN/+inf check, max, finite count. */
#define SCAN_BODY                                                                                  \
    double m = -INFINITY;                                                                          \
    int64_t finite = 0;                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                              \
        double v = z[i];                                                                           \
        if (v != v || v == INFINITY) return EKV_ERR_NAN_INPUT;                                     \
        if (v > -INFINITY) {                                                                       \
            finite++;                                                                              \
            if (v > m) m = v;                                                                      \
        }                                                                                          \
    }                                                                                              \
    if (finite == 0) return EKV_ERR_EMPTY_INPUT;

#define SOLVE_BODY                                                                                 \
    if (alpha == 1.0) {                                                                            \
        double s = 0;                                                                              \
        for (int64_t i = 0; i < n; i++) s += exp((double)z[i] - m);                                \
        *tau_out = m + log(s);                                                                     \
        if (support_out) *support_out = finite;                                                    \
        return EKV_OK;                                                                             \
    }                                                                                              \
    int64_t k = 0;                                                                                 \
    for (int64_t i = 0; i < n; i++) {                                                              \
        double y = (double)z[i] - m;                                                               \
        if (y > -1.0) scratch[k++] = y;                                                            \
    }                                                                                              \
    double tau = m + ekv_tau_candidates(scratch, k, alpha);                                        \
    if (support_out) {                                                                             \
        int64_t sup = 0;                                                                           \
        for (int64_t i = 0; i < n; i++) sup += ((double)z[i] - tau) > 0;                           \
        *support_out = sup;                                                                        \
    }                                                                                              \
    *tau_out = tau;                                                                                \
    return EKV_OK;

ekv_status ekv_tau_exact_f32(const float *z, int64_t n, double alpha, double *scratch,
                             double *tau_out, int64_t *support_out){SCAN_BODY SOLVE_BODY}

ekv_status ekv_tau_exact_f64(const double *z, int64_t n, double alpha, double *scratch,
                             double *tau_out, int64_t *support_out) {
    SCAN_BODY
    SOLVE_BODY
}
