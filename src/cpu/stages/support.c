/*
 * The exact entmax support of one query head from its kept fp32 scores, shared by dense
 * decode and attention over page lists (docs/math.md §9.7, phase 2): the candidates z > max - 1
 * (the only tokens that can be in the support, since tau >= max - 1), tau solved exactly on them,
 * and the weights (z - tau)_+^beta of the support.
 */
#include "support.h"
#include "../../math/entmax_tau.h"

int64_t ekv_cpu_support_weights(int64_t *idx, double *y, int64_t k, double tau_rel, double alpha,
                                double *wsum) {
    double s = 0;
    int64_t sup = 0;
    for (int64_t i = 0; i < k; i++) {
        const double d = y[i] - tau_rel;
        if (d > 0) {
            y[sup] = ekv_entmax_pow(d, alpha);
            idx[sup] = idx[i];
            s += y[sup];
            sup++;
        }
    }
    *wsum = s;
    return sup;
}

int64_t ekv_cpu_entmax_support(const ekv_cpu_kernels *kern, const float *z, int64_t n, float M,
                               double alpha, int64_t *idx, double *y, double *y2, double *tau_rel,
                               double *wsum) {
    /* M - 1 rounded down, so that the float filter keeps every y > -1; at |M| >= 2^24 it
     * rounds to M itself, and then the filter is z >= M (no float lies between) */
    float thr = M - 1.0f;
    if ((double)thr > (double)M - 1.0) thr = nextafterf(thr, -INFINITY);
    if (thr >= M) thr = nextafterf(M, -INFINITY);
    const int64_t k = kern->compact_gt(z, n, thr, (double)M, 0, idx, y);
    memcpy(y2, y, sizeof(double) * (size_t)k); /* the solver reorders its input */
    *tau_rel = ekv_tau_candidates(y2, k, alpha);
    return ekv_cpu_support_weights(idx, y, k, *tau_rel, alpha, wsum);
}
