/* Gaussian score model (docs/math.md §4.6-4.8), src/math/gaussian.c. */
#ifndef EKV_MATH_GAUSSIAN_H
#define EKV_MATH_GAUSSIAN_H
#include <stdint.h>

/* Phi^-1(p), about 1e-15 relative after refinement. */
double ekv_normal_quantile(double p);
/* alpha values with closed-form moments: 2, 1.5 and 4/3 (exact float equality). */
int ekv_gauss_supported(double alpha);
void ekv_gauss_term(double alpha, double mu, double sigma, double tau, int reference_m3, double *f,
                    double *f1, double *f2);
/* tau-hat solving n * E[(aS - tau)_+^beta] = 1, S ~ N(mu, sigma^2) (docs/math.md §4.7; run to double
 * precision rather than a fixed 120 float iterations). */
double ekv_gauss_tau_single(double alpha, double mu, double sigma, double n, int reference_m3);
/* tau-hat solving sum_i w_i E[(a S_i - tau)_+^beta] = 1 (docs/math.md §4.8); 0 if no weight. */
double ekv_gauss_tau_mixture(double alpha, const double *mu, const double *sigma, const double *w,
                             int64_t n, int reference_m3);
#endif
