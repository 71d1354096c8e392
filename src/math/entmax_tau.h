/*
 * Exact alpha-entmax thresholds on a set of kept scores (entmax_tau.c, docs/math.md §8, 9.8),
 * and the weight of one score given tau. math/ is the bottom of the library's layering
 * (docs/architecture.md, "Source layout"): it includes nothing of src/, only the public status
 * codes.
 */
#ifndef EKV_MATH_ENTMAX_TAU_H
#define EKV_MATH_ENTMAX_TAU_H
#include "entmaxkv/core.h" /* ekv_status */
#include "shard_agree.h"   /* ekv_entmax_pow, which the CUDA backend shares */
#include <math.h>
#include <stdint.h>

/*
 * Solves tau for z-space scores z[0..n) (masked entries are -INFINITY) and alpha.
 * scratch must hold ekv_tau_scratch_doubles(n) doubles (the candidate values).
 * Returns EKV_OK, EKV_ERR_NAN_INPUT or EKV_ERR_EMPTY_INPUT.
 * For alpha == 1, tau is log-sum-exp and support counts finite entries.
 */
int64_t ekv_tau_scratch_doubles(int64_t n);
ekv_status ekv_tau_exact_f32(const float *z, int64_t n, double alpha, double *scratch,
                             double *tau_out, int64_t *support_out);
ekv_status ekv_tau_exact_f64(const double *z, int64_t n, double alpha, double *scratch,
                             double *tau_out, int64_t *support_out);
/* tau relative to the maximum, from the candidates y = z - max(z) with y > -1 (the
 * maximum itself included, y = 0). Reorders/overwrites y. alpha > 1. */
double ekv_tau_candidates(double *y, int64_t k, double alpha);
/* Probability of one entry given tau (z-space). alpha == 1: exp(z - tau). */
static inline double ekv_entmax_weight(double z, double tau, double alpha) {
    if (alpha == 1.0) return exp(z - tau);
    double d = z - tau;
    return d > 0 ? ekv_entmax_pow(d, alpha) : 0.0;
}
#endif
