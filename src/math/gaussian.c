/*
 * The Gaussian model of the scores (docs/math.md §4.6-4.8): truncated moments of a normal variable,
 * the single-Gaussian and mixture solvers for the threshold estimate tau-hat, and the
 * inverse normal CDF used by the page rule. All in double precision.
 *
 * With Y = a*S - tau ~ N(mu_Y, sigma_Y^2) and t = mu_Y / sigma_Y, the moments
 * m_k = E[Y_+^k] are
 *   m0 = Phi(t), m1 = mu Phi + s phi, m2 = (mu^2 + s^2) Phi + mu s phi,
 *   m3 = (mu^3 + 3 mu s^2) Phi + (mu^2 s + 2 s^3) phi           (correct),
 *   m3_ref = (mu^3 + 3 mu s^2) Phi + (s^3 + 2 mu^2 s) phi       (the reference's, docs/math.md §6.1-1),
 * and F(tau) = w * E[(aS - tau)_+^beta] - 1 with beta = 1/(alpha-1) in {1, 2, 3}.
 */
#include "gaussian.h"
#include "gaussian_core.h"
#include <math.h>

double ekv_normal_quantile(double p) {
    if (!(p > 0 && p < 1)) return p == 0 ? -INFINITY : p == 1 ? INFINITY : NAN;
    /* Acklam's rational approximation (|rel err| < 1.2e-9), then two Newton steps on erfc */
    static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                               -2.759285104469687e+02, 1.383577518672690e+02,
                               -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                               -1.556989798598866e+02, 6.680131188771972e+01,
                               -1.328068155288572e+01};
    static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                               -2.400758277161838e+00, -2.549732539343734e+00,
                               4.374664141464968e+00,  2.938163982698783e+00};
    static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                               3.754408661907416e+00};
    double x;
    if (p < 0.02425) {
        double q = sqrt(-2 * log(p));
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    } else if (p <= 1 - 0.02425) {
        double q = p - 0.5, r = q * q;
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
    } else {
        double q = sqrt(-2 * log(1 - p));
        x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    }
    for (int i = 0; i < 2; i++) x -= (ekv_phi_cdf(x) - p) / ekv_phi_pdf(x);
    return x;
}

int ekv_gauss_supported(double alpha) { return alpha == 2.0 || alpha == 1.5 || alpha == 4.0 / 3.0; }

void ekv_gauss_term(double alpha, double mu, double sigma, double tau, int reference_m3, double *f,
                    double *f1, double *f2) {
    ekv_gauss_term_core(alpha, mu, sigma, tau, reference_m3, f, f1, f2);
}

double ekv_gauss_tau_single(double alpha, double mu, double sigma, double n, int reference_m3) {
    return ekv_gauss_tau_single_core(alpha, mu, sigma, n, reference_m3);
}

typedef struct {
    double alpha;
    const double *mu, *sigma, *w;
    int64_t n;
    int reference_m3;
} mixture_env;

static double mixture_F(void *vp, double tau, double *F1, double *F2) {
    const mixture_env *m = vp;
    double F = -1, d1 = 0, d2 = 0;
    for (int64_t i = 0; i < m->n; i++) {
        double f, f1, f2;
        ekv_gauss_term_core(m->alpha, m->mu[i], fmax(m->sigma[i], 1e-6), tau, m->reference_m3, &f,
                            &f1, &f2);
        F += m->w[i] * f;
        d1 += m->w[i] * f1;
        d2 += m->w[i] * f2;
    }
    if (F1) *F1 = d1;
    if (F2) *F2 = d2;
    return F;
}

double ekv_gauss_tau_mixture(double alpha, const double *mu, const double *sigma, const double *w,
                             int64_t n, int reference_m3) {
    const double a = alpha - 1.0;
    double W = 0, ymax = -INFINITY, smax = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        if (w[i] > 0) W += w[i];
        ymax = fmax(ymax, a * mu[i]);
        smax = fmax(smax, a * fmax(sigma[i], 1e-6));
    }
    if (!(W > 0)) return 0.0;
    mixture_env env = {alpha, mu, sigma, w, n, reference_m3};
    return ekv_gauss_tau_mixture_core(ymax, smax, fmax(W, 1), mixture_F, &env);
}
