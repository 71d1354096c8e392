/* Exact support of one head from kept scores (support.c), shared by the attention stages. */
#ifndef EKV_CPU_SUPPORT_H
#define EKV_CPU_SUPPORT_H
#include "../kernels/kernels.h"

/*
 * From the kept z-space scores z[0..n) of one query head with maximum M: idx[0..sup) the
 * positions in z of the support (ascending), y[0..sup) their unnormalised weights, *wsum
 * their sum and *tau_rel = tau - M. idx, y, y2 hold n entries (y2 is scratch). alpha > 1.
 */
int64_t ekv_cpu_entmax_support(const ekv_cpu_kernels *kern, const float *z, int64_t n, float M,
                               double alpha, int64_t *idx, double *y, double *y2, double *tau_rel,
                               double *wsum);
/* Keeps the entries of (idx, y = z - M) above tau_rel and turns y into weights (z - tau)^beta. */
int64_t ekv_cpu_support_weights(int64_t *idx, double *y, int64_t k, double tau_rel, double alpha,
                                double *wsum);
#endif
