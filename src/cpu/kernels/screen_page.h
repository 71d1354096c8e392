/*
 * The screen of one page (docs/math.md §10.2), written once and compiled once per ISA: each
 * kernels_*.c includes this file and instantiates EKV_SCREEN_PAGE_IMPL with its own code dot
 * products and box kernel, so the element-wise loops below are vectorised for that ISA
 * (those files build with -ffp-contract=off: every ISA rounds these loops the same way).
 *
 * With the page's step s_c and range [m_c, M_c], token t stands for m_c + (code + 1/2) s_c, so
 * for a head with scaled query q'
 *   z^_t = C0 + sum_c w'_c code_tc,  C0 = sum_c q'_c (m_c + s_c/2),  w'_c = q'_c s_c,
 * and every token of the page is within e = sum_c |q'_c| W_c of it, W_c covering the code
 * error s_c/2 and the fp32 rounding of the centre, the codes and every dot product involved
 * (gamma = 4(D+4)u per |q'_c| A_c and per |q'_c| s_c; |k_c|, |k^_c| <= A_c + s_c).
 */
#ifndef EKV_CPU_SCREEN_PAGE_H
#define EKV_CPU_SCREEN_PAGE_H
#include "../../core/codes.h"
#include "kernels.h"
#include "screen_types.h"

/* Rounded up to float: an upper bound must not fall. A bound that is not a number bounds
 * nothing: +inf, so its token survives. The next float is taken on the bits. */
static inline float ekv_screen_up(double x) {
    if (x != x) return INFINITY;
    float f = (float)x;
    if (!((double)f < x)) return f;
    if (f == 0.f) return 0x1p-149f;
    uint32_t b;
    memcpy(&b, &f, 4);
    b = f > 0.f ? b + 1 : b - 1;
    memcpy(&f, &b, 4);
    return f;
}

/* Per channel: the step s_c, the centre m_c + s_c/2 the codes count from, and W_c, the error
 * per unit of |q'_c|. 0 when a step is not finite (M - m overflowed fp32). The centre's and
 * the sums' own fp32 rounding are inside W_c: 6u A_c and 2 gamma (4 A_c + s_c) cover the code's
 * rounding, the centre's, and four dot products of gamma each (the score kernel's, the
 * screen's code dots, C0's and the error sum's). W_c is formed in fp32 (a few operations on
 * non-negative terms) and raised by 2^-20 relative, far above their rounding. */
static inline int ekv_screen_channel_terms(const ekv_screen_page *pg, const ekv_screen_terms *terms,
                                           float *step, float *mid, float *w) {
    const float u = 0x1p-24f, gamma = 4.0f * (float)(pg->D + 4) * u;
    const float half = (float)(terms->code_error * 0.5), su = terms->slack ? 1.f : 0.f;
    const float scale = pg->bits == 8 ? 0x1p-8f : 0x1p-4f; /* ekv_code_step, vectorisable */
    int ok = 1;
    for (int64_t c = 0; c < pg->D; c++) { /* branch-free, so that it vectorises */
        const float mn = pg->kmin[c], mx = pg->kmax[c], s = (mx - mn) * scale;
        const float a0 = fabsf(mn), a1 = fabsf(mx), A = a0 > a1 ? a0 : a1;
        const float m = mn + 0.5f * s;
        step[c] = s;
        mid[c] = m;
        ok &= (s - s == 0.f) & (m - m == 0.f); /* false once a step or centre is not finite */
        w[c] = (half * s + su * (6.0f * u * A + 2.0f * gamma * (4.0f * A + s))) *
                       (1.0f + 0x1p-20f) +
               (float)EKV_SCREEN_NU;
    }
    return ok;
}

/* Every token of the page unbounded: a range too wide for fp32 is not screened. */
static inline void ekv_screen_unbounded(int64_t ntok, int G, float *lo, float *hi, int64_t ld) {
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < ntok; t++) {
            lo[g * ld + t] = -INFINITY;
            hi[g * ld + t] = INFINITY;
        }
}

/* The bounds of head g from its code dots (in lo): z = C0 + dot + bias in fp32 (the bias as
 * the score kernels form it), widened by 8u (|C0| + |dot| + |bias| + e) for the three
 * roundings of z and the one of z -+ E. */
static inline void ekv_screen_finish(const ekv_screen_page *pg, int g, float cf, float ef,
                                     int slack, float *lo, float *hi) {
    const float u8 = slack ? 8.0f * 0x1p-24f : 0.f;
    const float b0 = pg->bias0 ? pg->bias0[g] : 0.f, bs = pg->bias0 ? pg->bias_step[g] : 0.f;
    for (int64_t t = 0; t < pg->ntok; t++) {
        const float dot = lo[t], bias = b0 + bs * (float)t, z = cf + dot + bias;
        const float E = ef + u8 * (fabsf(cf) + fabsf(dot) + fabsf(bias) + ef);
        lo[t] = z - E;
        hi[t] = z + E;
    }
}

/* *c0 = <q, mid> and *e = <qabs, w> over D channels, in any order (each ISA its own). */
typedef void ekv_screen_dots2_fn(const float *q, const float *mid, const float *qabs,
                                 const float *w, int64_t D, float *c0, float *e);

typedef void ekv_code_dots_fn(const uint8_t *block, int64_t page_size, int64_t ntok, int32_t bits,
                              int64_t D, const float *w, int64_t ldw, int G, float *dots,
                              int64_t ldd);

/*
 * The page's bounds, for one ISA: its code dots come in. C0 = <q', centre>, e = <|q'|, W>
 * (times 1 + 2 gamma: a sum of non-negative terms in fp32), and the code weights w' = q' s.
 * The scratch layout is that of screen_types.h.
 */
static inline void ekv_screen_page_impl(ekv_code_dots_fn *dots, ekv_screen_dots2_fn *dots2,
                                        const ekv_screen_page *pg, const float *qs, int64_t ldq,
                                        int G, const ekv_screen_terms *terms, float *scratch,
                                        float *lo, float *hi, int64_t ld) {
    const int64_t D = pg->D;
    const ekv_screen_scratch sc = ekv_screen_scratch_of(scratch, D, G);
    float *step = sc.step, *mid = sc.mid, *w = sc.w, *wq = sc.wq;
    const float *qabs = sc.qabs;
    if (!ekv_screen_channel_terms(pg, terms, step, mid, w)) {
        ekv_screen_unbounded(pg->ntok, G, lo, hi, ld);
        return;
    }
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D; c++) wq[g * D + c] = qs[g * ldq + c] * step[c];
    float cf[EKV_CPU_MAX_GROUP], ef[EKV_CPU_MAX_GROUP];
    for (int g = 0; g < G; g++) dots2(qs + g * ldq, mid, qabs + g * D, w, D, cf + g, ef + g);
    dots(pg->codes, pg->page_size, pg->ntok, pg->bits, D, wq, D, G, lo, ld);
    const double gamma = 4.0 * (double)(D + 4) * 0x1p-24;
    for (int g = 0; g < G; g++) {
        double e = (double)ef[g] * (1.0 + 2.0 * gamma * terms->slack) + (double)D * EKV_SCREEN_NU;
        if (pg->alibi_slack && terms->slack) e += pg->alibi_slack[g];
        ekv_screen_finish(pg, g, cf[g], ekv_screen_up(e), terms->slack, lo + g * ld, hi + g * ld);
    }
}
#endif
