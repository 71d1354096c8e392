/* Public row-wise entmax: validation, exact tau (src/math/entmax_tau.c), probabilities. A public
 * entry point with the context's messages, so it lives with the API's other ones in core/. */
#include "internal.h"
#include "../math/entmax_tau.h"
#include <stdlib.h>

ekv_status ekv_validate_alpha(ekv_context *ctx, double alpha) {
    if (alpha != alpha) return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA, "alpha is NaN");
    if (alpha < 1.0 || alpha > 4.0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA,
                        "alpha=%g is outside [1, 4] (1 = softmax, 1.5 = entmax15, 2 = sparsemax)",
                        alpha);
    return EKV_OK;
}

/*
 * Scale safety (docs/math.md §6.2): the row is shifted before it is scaled, z_i = a(x_i - M)
 * with M = max x and a = alpha - 1 (1 for softmax). Every z is <= 0 = max z, so nothing
 * overflows, and tau is solved relative to the maximum instead of as M + tau_rel, which for
 * |M| >= 2^53 rounds the support to zero weight (0/0 = NaN). tau in x's z-space is
 * a*M + tau_rel, reported only when it is a finite double.
 */
/* The row's rule, written once: no NaN or +inf, not every entry -inf; *xmax its maximum. */
#define SCAN_BODY                                                                                  \
    double m = -INFINITY;                                                                          \
    for (int64_t i = 0; i < n; i++) {                                                              \
        double v = (double)x[i];                                                                   \
        if (v != v || v == INFINITY) return EKV_ERR_NAN_INPUT;                                     \
        if (v > m) m = v;                                                                          \
    }                                                                                              \
    if (m == -INFINITY) return EKV_ERR_EMPTY_INPUT;                                                \
    *xmax = m;                                                                                     \
    return EKV_OK;

static ekv_status scan_f32(const float *x, int64_t n, double *xmax) { SCAN_BODY }
static ekv_status scan_f64(const double *x, int64_t n, double *xmax) { SCAN_BODY }

#define SHIFT_BODY(SCAN)                                                                           \
    ekv_status st = SCAN(x, n, xmax);                                                              \
    if (st) return st;                                                                             \
    for (int64_t i = 0; i < n; i++) z[i] = a * ((double)x[i] - *xmax); /* -inf stays -inf */       \
    return EKV_OK;

static ekv_status shift_f32(const float *x, int64_t n, double a, double *z, double *xmax) {
    SHIFT_BODY(scan_f32)
}
static ekv_status shift_f64(const double *x, int64_t n, double a, double *z, double *xmax) {
    SHIFT_BODY(scan_f64)
}

/* tau relative to the maximum of the shifted row z (support: see ekv_tau_exact_f64). */
static ekv_status solve_shifted(ekv_context *ctx, const double *z, int64_t n, double alpha,
                                double *t) {
    double *scratch = malloc((size_t)ekv_tau_scratch_doubles(n) * sizeof(double));
    if (!scratch)
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for %lld scores", (long long)n);
    ekv_status st = ekv_tau_exact_f64(z, n, alpha, scratch, t, NULL);
    free(scratch);
    return st ? ekv_fail(ctx, st, "threshold solve failed") : EKV_OK;
}

#define ROW_BODY(REAL, SHIFT)                                                                      \
    if (!x || !p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !x ? "x" : "p");        \
    if (n <= 0) return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "n=%lld must be >= 1", (long long)n);   \
    ekv_status st = ekv_validate_alpha(ctx, alpha);                                                \
    if (st) return st;                                                                             \
    if ((uint64_t)n > SIZE_MAX / sizeof(double))                                                   \
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "n=%lld is too large", (long long)n);          \
    double *z = malloc((size_t)n * sizeof *z);                                                     \
    if (!z)                                                                                        \
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for %lld scores", (long long)n);    \
    const double a = alpha == 1.0 ? 1.0 : alpha - 1.0;                                             \
    double m = 0, t = 0, sum = 0;                                                                  \
    st = SHIFT(x, n, a, z, &m);                                                                    \
    if (st == EKV_ERR_NAN_INPUT)                                                                   \
        st = ekv_fail(ctx, st, "x contains NaN or +inf (masked entries must be -inf)");            \
    else if (st == EKV_ERR_EMPTY_INPUT)                                                            \
        st = ekv_fail(ctx, st, "every entry of x is -inf: nothing to normalise");                  \
    else                                                                                           \
        st = solve_shifted(ctx, z, n, alpha, &t);                                                  \
    if (!st && tau && !isfinite(a * m + t))                                                        \
        st = ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,                                               \
                      "tau = %g * max(x) overflows a double (max(x) = %g); pass tau = NULL "       \
                      "or scale x down",                                                           \
                      a, m);                                                                       \
    if (st) {                                                                                      \
        free(z);                                                                                   \
        return st;                                                                                 \
    }                                                                                              \
    /* Probabilities in double, renormalised (exact paths already sum to 1 to rounding;            \
     * the generic path is renormalised, docs/math.md §9.8). The maximum has weight > 0,          \
     * so sum > 0. */                                                                              \
    for (int64_t i = 0; i < n; i++) sum += ekv_entmax_weight(z[i], t, alpha);                      \
    int64_t sup = 0; /* the support is what the caller sees: entries with p > 0 */                 \
    for (int64_t i = 0; i < n; i++) {                                                              \
        p[i] = (REAL)(ekv_entmax_weight(z[i], t, alpha) / sum);                                    \
        sup += p[i] > 0;                                                                           \
    }                                                                                              \
    free(z);                                                                                       \
    if (tau) *tau = a * m + t;                                                                     \
    if (support) *support = sup;                                                                   \
    ekv_clear_error(ctx);                                                                          \
    return EKV_OK;

ekv_status ekv_entmax(ekv_context *ctx, const float *x, int64_t n, double alpha, float *p,
                      double *tau, int64_t *support){ROW_BODY(float, shift_f32)}

ekv_status ekv_entmax_f64(ekv_context *ctx, const double *x, int64_t n, double alpha, double *p,
                          double *tau, int64_t *support){ROW_BODY(double, shift_f64)}

/* Many rows: every row is checked first by the one-row rule (a NaN or +inf, or a row of -inf
 * only, is named by its index and nothing is written), then each row as ekv_entmax. */
#define ROWS_BODY(ROW_FN, SCAN)                                                                    \
    if (!x || !p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !x ? "x" : "p");        \
    if (rows < 1 || n < 1)                                                                         \
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "rows=%lld and n=%lld must be >= 1",            \
                        (long long)rows, (long long)n);                                            \
    if ((uint64_t)rows > (uint64_t)INT64_MAX / (uint64_t)n)                                        \
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "rows x n overflows");                         \
    ekv_status st = ekv_validate_alpha(ctx, alpha);                                                \
    if (st) return st;                                                                             \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        double m;                                                                                  \
        st = SCAN(x + r * n, n, &m);                                                               \
        if (st == EKV_ERR_NAN_INPUT)                                                               \
            return ekv_fail(ctx, st,                                                               \
                            "row %lld contains NaN or +inf (masked entries must be -inf)",         \
                            (long long)r);                                                         \
        if (st)                                                                                    \
            return ekv_fail(ctx, st, "every entry of row %lld is -inf: nothing to normalise",      \
                            (long long)r);                                                         \
    }                                                                                              \
    for (int64_t r = 0; r < rows; r++)                                                             \
        if ((st = ROW_FN(ctx, x + r * n, n, alpha, p + r * n, NULL, NULL))) return st;             \
    return EKV_OK;

ekv_status ekv_entmax_rows(ekv_context *ctx, const float *x, int64_t rows, int64_t n, double alpha,
                           float *p){ROWS_BODY(ekv_entmax, scan_f32)}

ekv_status ekv_entmax_rows_f64(ekv_context *ctx, const double *x, int64_t rows, int64_t n,
                               double alpha, double *p) {
    ROWS_BODY(ekv_entmax_f64, scan_f64)
}
