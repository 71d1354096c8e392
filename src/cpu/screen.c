/*
 * The screen (docs/math.md §10.2): per-token lower and upper bounds on the fp32 scores from
 * the b-bit key codes, without reading K. With the page's step s_c and range [m_c, M_c],
 * token t stands for m_c + (code + 1/2) s_c, so for a head with scaled query q'
 *   z^_t = C0 + sum_c w'_c code_tc,  C0 = sum_c q'_c (m_c + s_c/2),  w'_c = q'_c s_c,
 * and every token of the page is within e = sum_c |q'_c| W_c of it, W_c covering the code
 * error s_c/2, the code's own rounding (2u A_c) and the fp32 rounding of both dot products
 * (gamma = 4(D+4)u per |q'_c| (|k_c| + |k^_c|), |k_c|, |k^_c| <= A_c + s_c).
 */
#include "screen.h"
#include "../core/codes.h"

const ekv_screen_terms ekv_screen_exact = {1.0, 1};

/* Rounded down / up to float: a lower bound must not rise, an upper bound must not fall. A
 * bound that is not a number bounds nothing: -inf / +inf, so its token survives. */
static float down(double x) {
    if (x != x) return -INFINITY;
    float f = (float)x;
    return (double)f > x ? nextafterf(f, -INFINITY) : f;
}
static float up(double x) {
    if (x != x) return INFINITY;
    float f = (float)x;
    return (double)f < x ? nextafterf(f, INFINITY) : f;
}

/* Below fp32's subnormals an exact product can vanish where the kernel's does not: every
 * channel and the sum get this absolute floor (docs/math.md §10.2). */
#define SCREEN_NU 0x1p-140

/* Per channel: the step s_c, and W_c, the error per unit of |q'_c|. 0 when a step is not
 * finite (M - m overflowed fp32). */
static int channel_terms(const ekv_screen_page *pg, const ekv_screen_terms *terms, float *step,
                         double *w) {
    const double u = 0x1p-24, gamma = 4.0 * (double)(pg->D + 4) * u;
    for (int64_t c = 0; c < pg->D; c++) {
        step[c] = ekv_code_step(pg->kmin[c], pg->kmax[c], pg->bits);
        const double s = step[c], A = fmax(fabs((double)pg->kmin[c]), fabs((double)pg->kmax[c]));
        w[c] = terms->code_error * 0.5 * s * (1.0 + 0x1p-20) + SCREEN_NU;
        if (terms->slack) w[c] += 4.0 * u * A + 2.0 * gamma * (3.0 * A + s);
        if (!isfinite(step[c])) return 0;
    }
    return 1;
}

/* One head: C0, the weights w' of the codes, and the error e. */
static void head_terms(const ekv_screen_page *pg, const float *q, const float *step,
                       const double *w, float *wq, double *c0, double *e) {
    double sum = 0, err = 0;
    for (int64_t c = 0; c < pg->D; c++) {
        sum += (double)q[c] * ((double)pg->kmin[c] + 0.5 * (double)step[c]);
        wq[c] = q[c] * step[c];
        err += fabs((double)q[c]) * w[c];
    }
    *c0 = sum;
    *e = err + (double)pg->D * SCREEN_NU;
}

void ekv_cpu_screen_page(const ekv_screen_page *pg, const float *qs, int64_t ldq, int G,
                         const ekv_screen_terms *terms, void *scratch, float *lo, float *hi,
                         int64_t ld) {
    const int64_t D = pg->D, rb = ekv_code_row_bytes(D, pg->bits);
    double *wc = (double *)scratch;
    float *step = (float *)(wc + D), *wq = step + D;
    if (!channel_terms(pg, terms, step, wc)) { /* a range too wide for fp32: not screened */
        for (int g = 0; g < G; g++)
            for (int64_t t = 0; t < pg->ntok; t++) {
                lo[g * ld + t] = -INFINITY;
                hi[g * ld + t] = INFINITY;
            }
        return;
    }
    for (int g = 0; g < G; g++) {
        double c0, e;
        head_terms(pg, qs + g * ldq, step, wc, wq, &c0, &e);
        if (pg->alibi_slack && terms->slack) e += pg->alibi_slack[g];
        for (int64_t t = 0; t < pg->ntok; t++) {
            const uint8_t *row = pg->codes + t * rb;
            float dot = 0.f;
            for (int64_t c = 0; c < D; c++) dot += wq[c] * (float)ekv_code_get(row, c, pg->bits);
            double z = c0 + (double)dot;
            if (pg->bias0) z += (double)(pg->bias0[g] + pg->bias_step[g] * (float)t);
            lo[g * ld + t] = down(z - e);
            hi[g * ld + t] = up(z + e);
        }
    }
}
