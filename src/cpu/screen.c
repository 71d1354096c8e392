/*
 * The screen (docs/math.md §10.2): per-token lower and upper bounds on the fp32 scores from
 * the b-bit key codes, without reading K. With the page's step s_c and range [m_c, M_c],
 * token t stands for m_c + (code + 1/2) s_c, so for a head with scaled query q'
 *   z^_t = C0 + sum_c w'_c code_tc,  C0 = sum_c q'_c (m_c + s_c/2),  w'_c = q'_c s_c,
 * and every token of the page is within e = sum_c |q'_c| W_c of it, W_c covering the code
 * error s_c/2 and the fp32 rounding of the centre, the codes and every dot product involved
 * (gamma = 4(D+4)u per |q'_c| A_c and per |q'_c| s_c; |k_c|, |k^_c| <= A_c + s_c).
 */
#include "screen.h"
#include "../core/codes.h"

const ekv_screen_terms ekv_screen_exact = {1.0, 1};

/* Rounded down / up to float: a lower bound must not rise, an upper bound must not fall. A
 * bound that is not a number bounds nothing: -inf / +inf, so its token survives. The next
 * float is taken on the bits (x is finite here or the rounding already went the right way). */
static float down(double x) {
    if (x != x) return -INFINITY;
    float f = (float)x;
    if (!((double)f > x)) return f;
    if (f == 0.f) return -0x1p-149f;
    uint32_t b;
    memcpy(&b, &f, 4);
    b = f > 0.f ? b - 1 : b + 1;
    memcpy(&f, &b, 4);
    return f;
}
static float up(double x) { return -down(-x); }

/* Below fp32's subnormals an exact product can vanish where the kernel's does not: every
 * channel and the sum get this absolute floor (docs/math.md §10.2). */
#define SCREEN_NU 0x1p-140

/* Per channel: the step s_c, the centre m_c + s_c/2 the codes count from, and W_c, the error
 * per unit of |q'_c|. 0 when a step is not finite (M - m overflowed fp32). The centre's and
 * the sums' own fp32 rounding are inside W_c: 6u A_c and 2 gamma (4 A_c + s_c) cover the code's
 * rounding, the centre's, and four dot products of gamma each (the score kernel's, the
 * screen's code dots, C0's and the error sum's). W_c is formed in fp32 (a few operations on
 * non-negative terms) and raised by 2^-20 relative, far above their rounding. */
static int channel_terms(const ekv_screen_page *pg, const ekv_screen_terms *terms, float *step,
                         float *mid, float *w) {
    const float u = 0x1p-24f, gamma = 4.0f * (float)(pg->D + 4) * u;
    const float half = (float)(terms->code_error * 0.5), su = terms->slack ? 1.f : 0.f;
    int ok = 1;
    for (int64_t c = 0; c < pg->D; c++) { /* branch-free, so that it vectorises */
        const float s = ekv_code_step(pg->kmin[c], pg->kmax[c], pg->bits);
        const float a0 = fabsf(pg->kmin[c]), a1 = fabsf(pg->kmax[c]), A = a0 > a1 ? a0 : a1;
        const float m = pg->kmin[c] + 0.5f * s;
        step[c] = s;
        mid[c] = m;
        ok &= (s - s == 0.f) & (m - m == 0.f); /* false once a step or centre is not finite */
        w[c] = (half * s + su * (6.0f * u * A + 2.0f * gamma * (4.0f * A + s))) *
                       (1.0f + 0x1p-20f) +
               (float)SCREEN_NU;
    }
    return ok;
}

/* Every token of the page unbounded: a range too wide for fp32 is not screened. */
static void unbounded(int64_t ntok, int G, float *lo, float *hi, int64_t ld) {
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < ntok; t++) {
            lo[g * ld + t] = -INFINITY;
            hi[g * ld + t] = INFINITY;
        }
}

/* Per head: C0 = <q', centre>, e = <|q'|, W> (times 1 + 2 gamma: a sum of non-negative
 * terms in fp32), and the code weights w' = q' s; the sums run on the box kernel (qneg 0). */
static void head_terms(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                       int64_t ldq, int G, const float *step, const float *mid, const float *w,
                       int slack, float *wq, const float *qabs, const float *zero, double *c0,
                       double *e) {
    const int64_t D = pg->D;
    const double gamma = 4.0 * (double)(D + 4) * 0x1p-24;
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D; c++) wq[g * D + c] = qs[g * ldq + c] * step[c];
    float cf[EKV_CPU_MAX_GROUP], ef[EKV_CPU_MAX_GROUP];
    kern->bound_box(qs, zero, ldq, G, &mid, &mid, 1, D, cf, 1);
    kern->bound_box(qabs, zero, D, G, &w, &w, 1, D, ef, 1);
    for (int g = 0; g < G; g++) {
        c0[g] = cf[g];
        e[g] = (double)ef[g] * (1.0 + 2.0 * gamma * slack) + (double)D * SCREEN_NU;
    }
}

/* The scratch layout: step, centre and W per channel [3 D], the code weights w' [G D],
 * then what ekv_cpu_screen_prepare keeps for the whole list: |q'| [G D] and zeros [G D]. */
void ekv_cpu_screen_prepare(const float *qs, int64_t ldq, int G, int64_t D, void *scratch) {
    float *qabs = (float *)scratch + 3 * D + (int64_t)G * D, *zero = qabs + (int64_t)G * D;
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D; c++) {
            qabs[g * D + c] = fabsf(qs[g * ldq + c]);
            zero[g * D + c] = 0.f;
        }
}

void ekv_cpu_screen_page(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                         int64_t ldq, int G, const ekv_screen_terms *terms, void *scratch,
                         float *lo, float *hi, int64_t ld) {
    const int64_t D = pg->D;
    float *step = (float *)scratch, *mid = step + D, *w = mid + D, *wq = w + D;
    double c0[EKV_CPU_MAX_GROUP], e[EKV_CPU_MAX_GROUP];
    if (!channel_terms(pg, terms, step, mid, w)) {
        unbounded(pg->ntok, G, lo, hi, ld);
        return;
    }
    head_terms(kern, pg, qs, ldq, G, step, mid, w, terms->slack, wq, wq + G * D, wq + 2 * G * D, c0,
               e);
    for (int g = 0; g < G; g++)
        if (pg->alibi_slack && terms->slack) e[g] += pg->alibi_slack[g];
    /* the dots land in lo, then become the bounds: z = C0 + dot + bias in fp32, widened by
     * 8u (|C0| + |dot| + |bias| + e) for the three roundings of z and the one of z -+ E */
    const ekv_cpu_kernels *dk = EKV_CODE_DOTS_SIMD(D, G) ? kern : &ekv_cpu_kernels_scalar;
    dk->code_dots(pg->codes, ekv_code_row_bytes(D, pg->bits), pg->ntok, pg->bits, D, wq, D, G, lo,
                  ld);
    const float u8 = terms->slack ? 8.0f * 0x1p-24f : 0.f;
    for (int g = 0; g < G; g++) {
        const float cf = (float)c0[g], ef = up(e[g]);
        const float b0 = pg->bias0 ? pg->bias0[g] : 0.f, bs = pg->bias0 ? pg->bias_step[g] : 0.f;
        for (int64_t t = 0; t < pg->ntok; t++) {
            const float dot = lo[g * ld + t], bias = b0 + bs * (float)t, z = cf + dot + bias;
            const float E = ef + u8 * (fabsf(cf) + fabsf(dot) + fabsf(bias) + ef);
            lo[g * ld + t] = z - E;
            hi[g * ld + t] = z + E;
        }
    }
}
