/* Public row-wise entmax: validation, exact tau, probabilities. */
#include "../core/internal.h"
#include <stdlib.h>

ekv_status ekv_validate_alpha(ekv_context *ctx, double alpha) {
    if (alpha != alpha)
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA, "alpha is NaN");
    if (alpha < 1.0 || alpha > 4.0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA,
                        "alpha=%g is outside [1, 4] (1 = softmax, 1.5 = entmax15, 2 = sparsemax)",
                        alpha);
    return EKV_OK;
}

#define ROW_BODY(REAL, SOLVER)                                                                \
    if (!x || !p)                                                                             \
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !x ? "x" : "p");             \
    if (n <= 0) return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "n=%lld must be >= 1", (long long)n); \
    ekv_status st = ekv_validate_alpha(ctx, alpha);                                           \
    if (st) return st;                                                                        \
    if ((uint64_t)n > SIZE_MAX / sizeof(double))                                              \
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "n=%lld is too large", (long long)n);     \
    double *scratch = malloc((size_t)ekv_tau_scratch_doubles(n) * sizeof(double));           \
    if (!scratch) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for %lld scores", (long long)n); \
    double t;                                                                                 \
    int64_t sup;                                                                              \
    st = SOLVER(x, n, alpha, scratch, &t, &sup);                                              \
    free(scratch);                                                                            \
    if (st == EKV_ERR_NAN_INPUT)                                                              \
        return ekv_fail(ctx, st, "x contains NaN or +inf (masked entries must be -inf)");      \
    if (st == EKV_ERR_EMPTY_INPUT)                                                            \
        return ekv_fail(ctx, st, "every entry of x is -inf: nothing to normalise");           \
    if (st) return ekv_fail(ctx, st, "threshold solve failed");                               \
    /* Probabilities in double, renormalised (exact paths already sum to 1 to rounding;     \
     * the generic path is renormalised as SPEC 9.8 asks). */                                 \
    double a = alpha - 1.0, sum = 0;                                                          \
    for (int64_t i = 0; i < n; i++) {                                                         \
        double zi = alpha == 1.0 ? (double)x[i] : a * (double)x[i];                           \
        sum += ekv_entmax_weight(zi, t, alpha);                                               \
    }                                                                                         \
    sup = 0; /* the support is what the caller sees: entries with p > 0 */                   \
    for (int64_t i = 0; i < n; i++) {                                                         \
        double zi = alpha == 1.0 ? (double)x[i] : a * (double)x[i];                           \
        p[i] = (REAL)(ekv_entmax_weight(zi, t, alpha) / sum);                                 \
        sup += p[i] > 0;                                                                      \
    }                                                                                         \
    if (tau) *tau = t;                                                                        \
    if (support) *support = sup;                                                              \
    ekv_clear_error(ctx);                                                                     \
    return EKV_OK;

/* z = (alpha-1)*x is formed in double before the solve. */
static ekv_status solve_f32(const float *x, int64_t n, double alpha, double *scratch,
                            double *t, int64_t *sup) {
    if (alpha == 1.0) return ekv_tau_exact_f32(x, n, alpha, scratch, t, sup);
    double *z = malloc((size_t)n * sizeof *z);
    if (!z) return EKV_ERR_OUT_OF_MEMORY;
    for (int64_t i = 0; i < n; i++) z[i] = (alpha - 1.0) * (double)x[i];
    ekv_status st = ekv_tau_exact_f64(z, n, alpha, scratch, t, sup);
    free(z);
    return st;
}

static ekv_status solve_f64(const double *x, int64_t n, double alpha, double *scratch,
                            double *t, int64_t *sup) {
    if (alpha == 1.0) return ekv_tau_exact_f64(x, n, alpha, scratch, t, sup);
    double *z = malloc((size_t)n * sizeof *z);
    if (!z) return EKV_ERR_OUT_OF_MEMORY;
    for (int64_t i = 0; i < n; i++) z[i] = (alpha - 1.0) * x[i];
    ekv_status st = ekv_tau_exact_f64(z, n, alpha, scratch, t, sup);
    free(z);
    return st;
}

ekv_status ekv_entmax(ekv_context *ctx, const float *x, int64_t n, double alpha, float *p,
                      double *tau, int64_t *support) {
    ROW_BODY(float, solve_f32)
}

ekv_status ekv_entmax_f64(ekv_context *ctx, const double *x, int64_t n, double alpha,
                          double *p, double *tau, int64_t *support) {
    ROW_BODY(double, solve_f64)
}
