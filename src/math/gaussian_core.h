/*
 * The scalar core of the Gaussian score model (docs/math.md §4.6-4.7), shared by the CPU selector
 * (src/math/gaussian.c) and the CUDA one (src/cuda/select/gaussian.cu): the normal pdf/cdf, the
 * truncated moments E[(aS - tau)_+^beta], the single-Gaussian tau-hat solver and the mixture's
 * iteration (its sums left to the caller). Functions
 * are static inline, and __host__ __device__ under nvcc.
 */
#ifndef EKV_MATH_GAUSSIAN_CORE_H
#define EKV_MATH_GAUSSIAN_CORE_H
#include <math.h>
#include <stddef.h> /* NULL */
#include <stdint.h>

#include "hd.h"

EKV_HD double ekv_phi_pdf(double t) { return 0.3989422804014327 * exp(-0.5 * t * t); }
EKV_HD double ekv_phi_cdf(double t) { return 0.5 * erfc(-t * 0.7071067811865476); }

/* E[(aS - tau)_+^beta] and its first two tau-derivatives for S ~ N(mu, sigma^2). */
EKV_HD void ekv_gauss_term_core(double alpha, double mu, double sigma, double tau, int reference_m3,
                                double *f, double *f1, double *f2) {
    const double a = alpha - 1.0;
    const double my = a * mu - tau, sy = fmax(a * sigma, 1e-10), t = my / sy;
    const double P = ekv_phi_cdf(t), p = ekv_phi_pdf(t);
    const double m0 = P, m1 = my * P + sy * p, m2 = (my * my + sy * sy) * P + my * sy * p;
    if (alpha == 2.0) {
        *f = m1;
        *f1 = -m0;
        *f2 = p / sy;
    } else if (alpha == 1.5) {
        *f = m2;
        *f1 = -2 * m1;
        *f2 = 2 * m0;
    } else {
        double m3 = reference_m3 ? (my * my * my + 3 * my * sy * sy) * P +
                                           (sy * sy * sy + 2 * my * my * sy) * p
                                 : (my * my * my + 3 * my * sy * sy) * P +
                                           (my * my * sy + 2 * sy * sy * sy) * p;
        *f = m3;
        *f1 = -3 * m2;
        *f2 = 6 * m1;
    }
}

/* One safeguarded Halley/Newton update inside (lo, hi), as docs/math.md §4.7. */
EKV_HD double ekv_halley_step(double tau, double F, double F1, double F2, double lo, double hi) {
    double den = 2 * F1 * F1 - F * F2;
    double step = fabs(den) > 1e-18 ? 2 * F * F1 / den : F / fmin(F1, -1e-12);
    double cand = tau - step;
    if (!(cand > lo && cand < hi) || !isfinite(cand) || fabs(cand) >= 1e20) cand = 0.5 * (lo + hi);
    return cand;
}

EKV_HD double ekv_gauss_tau_single_core(double alpha, double mu, double sigma, double n,
                                        int reference_m3) {
    const double a = alpha - 1.0, s = fmax(sigma, 1e-6),
                 tol = 1e-13; /* converged, not the reference 1e-6 */
    const double R = a * s * (sqrt(2 * log(n + 1)) + 8);
    double lo = a * mu - R, hi = a * mu + R, tau = 0.5 * (lo + hi);
    for (int it = 0; it < 120; it++) {
        double f, f1, f2;
        ekv_gauss_term_core(alpha, mu, s, tau, reference_m3, &f, &f1, &f2);
        double F = n * f - 1, F1 = n * f1, F2 = n * f2;
        double cand = ekv_halley_step(tau, F, F1, F2, lo, hi);
        ekv_gauss_term_core(alpha, mu, s, cand, reference_m3, &f, &f1, &f2);
        double Fc = n * f - 1;
        if (Fc > 0)
            lo = cand;
        else
            hi = cand;
        tau = fabs(Fc) <= tol ? cand : 0.5 * (lo + hi);
        if (hi - lo < 1e-13 * (1 + fabs(tau))) break; /* converged to double precision */
    }
    return tau;
}

/* The mixture's F(tau) = sum_i w_i E_i[(aS_i - tau)_+^beta] - 1 and its two tau-derivatives
 * (F1, F2 may be NULL), evaluated by the caller over its pages: a loop on the CPU, block
 * reductions on the GPU (every thread of the block calls it and gets the same value). */
typedef double (*ekv_mixture_F)(void *env, double tau, double *F1, double *F2);

/* tau-hat of a mixture of page Gaussians (docs/math.md §4.4, §4.7): bracket expansion, then
 * safeguarded Halley steps, to double precision. ymax = max a mu_i, smax = max a sigma_i
 * (at least 1e-6), W = the weights' sum (at least 1); W <= 0 before the floor gives 0. */
EKV_HD double ekv_gauss_tau_mixture_core(double ymax, double smax, double W, ekv_mixture_F F,
                                         void *env) {
    const double tol = 1e-13;
    double R = smax * (sqrt(2 * log(W + 1)) + 8), lo = ymax - R, hi = ymax + R;
    for (int e = 0; e < 8; e++) { /* bracket expansion */
        if (F(env, lo, NULL, NULL) <= 0) lo -= R;
        if (F(env, hi, NULL, NULL) > 0) hi += R;
        R *= 2;
    }
    double tau = 0.5 * (lo + hi);
    for (int it = 0; it < 200; it++) {
        double F1, F2;
        const double Fv = F(env, tau, &F1, &F2);
        const double cand = ekv_halley_step(tau, Fv, F1, F2, lo, hi);
        const double Fc = F(env, cand, NULL, NULL);
        if (Fc > 0)
            lo = cand;
        else
            hi = cand;
        tau = fabs(Fc) <= tol ? cand : 0.5 * (lo + hi);
        if (hi - lo < 1e-13 * (1 + fabs(tau))) break;
    }
    return tau;
}

/* The global moments of the equal-weight mixture of Ps page Gaussians (docs/math.md §4.3) from
 * the sums over the pages of mu_p, sigma_p^2 and mu_p^2 (sums: the sharded plan allreduces
 * them), with the guards against a degenerate head. */
EKV_HD void ekv_gauss_global_moments(double s_mu, double s_var, double s_mu2, double Ps,
                                     double *mug, double *sgg) {
    double m = s_mu / Ps;
    const double vin = s_var / Ps, vbtw = fmax(s_mu2 / Ps - m * m, 0.0);
    double sg = fmax(sqrt(vin + vbtw), 1e-6);
    if (!isfinite(m)) m = 0;
    if (sg != sg) sg = 1e-6;
    if (sg == INFINITY) sg = 1e6;
    *mug = m;
    *sgg = sg;
}

/* ALiBi (docs/math.md §4.4): page p's mean moved to the bias at its centre (the centre capped
 * at n - 1, the last stats token), in a sequence of N tokens, slope m_h. */
EKV_HD double ekv_gauss_alibi_mean(double mu, int64_t p, int64_t ps, int64_t n, int64_t N,
                                   double m_h) {
    double c = (double)(p * ps) + (double)(ps - 1) / 2.0;
    if (c > (double)(n - 1)) c = (double)(n - 1);
    return mu + m_h * (c - (double)(N - 1));
}

/* The page rule's floor (docs/math.md §4.9): tau-hat less a times the larger of the margin
 * margin_z sigma_g and the excess rho (theta - u_avg), theta = tau / a. */
EKV_HD double ekv_gauss_floor(double tau, double a, double uavg, double margin_z, double sgg,
                              double excess) {
    return tau - a * fmax(margin_z * sgg, excess * fmax(tau / a - uavg, 0.0));
}

/* The page rule: its upper quantile a (mu + z_page sigma) clears the floor. */
EKV_HD int ekv_gauss_page_taken(double a, double mu, double sig, double zpage, double tfloor) {
    return a * (mu + zpage * sig) > tfloor;
}

/* The clamp of docs/math.md §4.10 (fixed/corrected modes): capmax = the largest mu + z_c sigma / 3
 * over the pages taken (-inf: none, no clamp). */
EKV_HD double ekv_gauss_clamp(double tau, double a, double capmax, double tfloor) {
    return capmax == -INFINITY ? tau : fmin(tau, fmax(a * capmax - 1e-4, tfloor));
}

/* The automatic margin and quantile of docs/math.md §4.5 from sigma-bar, the mean of the heads'
 * global score deviations over the batch. */
EKV_HD void ekv_gauss_auto_margin(double sbar, double *margin_z, double *q_max) {
    *margin_z = sbar < 1.5 ? 0.01 * sbar : 0.05 * sbar;
    *q_max = sbar < 1.5 ? 0.99 : 0.995;
}

#endif
