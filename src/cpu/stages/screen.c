/*
 * The screen (docs/math.md §10.2): per-token lower and upper bounds on the fp32 scores from
 * the b-bit key codes, without reading K. The page's bound is written once in
 * ../kernels/screen_page.h and compiled per ISA (kern->screen_page); this file holds what is
 * done once per list.
 */
#include "screen.h"

const ekv_screen_terms ekv_screen_exact = {1.0, 1};

void ekv_cpu_screen_prepare(const float *qs, int64_t ldq, int G, int64_t D, void *scratch) {
    const ekv_screen_scratch sc = ekv_screen_scratch_of(scratch, D, G);
    float *qabs = sc.qabs, *qpos = sc.qpos, *qneg = sc.qneg;
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D; c++) {
            const float x = qs[g * ldq + c];
            qabs[g * D + c] = fabsf(x);
            qpos[g * D + c] = x > 0 ? x : 0.f;
            qneg[g * D + c] = x < 0 ? x : 0.f;
        }
}

/* sum_c x_c y_c of non-negative terms in fp32, eight lanes (so that it vectorises). */
static float dot_nonneg(const float *x, const float *y, int64_t n) {
    float r[8] = {0};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int k = 0; k < 8; k++) r[k] += x[c + k] * y[c + k];
    for (; c < n; c++) r[0] += x[c] * y[c];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* box + (gamma + gamma_box) sum |q'| A (times 1 + 2 gamma for that sum's own rounding) + D nu,
 * and the last token's ALiBi term with 2 E_p (alibi_slack; docs/math.md §10.4). */
void ekv_cpu_screen_page_box(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, int G,
                             void *scratch, double *u) {
    const int64_t D = pg->D;
    const ekv_screen_scratch sc = ekv_screen_scratch_of(scratch, D, G);
    float *A = sc.step; /* the step slots: free until the page is screened */
    const float *qabs = sc.qabs, *qpos = sc.qpos, *qneg = sc.qneg;
    for (int64_t c = 0; c < D; c++) {
        const float a0 = fabsf(pg->kmin[c]), a1 = fabsf(pg->kmax[c]);
        A[c] = a0 > a1 ? a0 : a1;
    }
    float box[EKV_CPU_MAX_GROUP];
    kern->bound_box(qpos, qneg, D, G, &pg->kmin, &pg->kmax, 1, D, box, 1);
    const double u24 = 0x1p-24, gam = 4.0 * (double)(D + 4) * u24,
                 gam_box = 4.0 * (double)(2 * D + 4) * u24;
    for (int g = 0; g < G; g++) {
        const double qa = (double)dot_nonneg(qabs + g * D, A, D) * (1.0 + 2.0 * gam);
        double U = (double)box[g] + (gam + gam_box) * qa + (double)D * EKV_SCREEN_NU;
        if (pg->bias0)
            U += (double)pg->bias0[g] + (double)pg->bias_step[g] * (double)(pg->ntok - 1) +
                 pg->alibi_slack[g];  /* 2 E_p */
        u[g] = U == U ? U : INFINITY; /* a bound that is not a number bounds nothing */
    }
}

void ekv_cpu_screen_page(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                         int64_t ldq, int G, const ekv_screen_terms *terms, void *scratch,
                         float *lo, float *hi, int64_t ld) {
    const ekv_cpu_kernels *k = EKV_SCREEN_SIMD(G) ? kern : &ekv_cpu_kernels_scalar;
    k->screen_page(pg, qs, ldq, G, terms, (float *)scratch, lo, hi, ld);
}
