/*
 * The screen (docs/math.md §10.2): per-token lower and upper bounds on the fp32 scores from
 * the b-bit key codes, without reading K. The page's bound is written once in screen_page.h
 * and compiled per ISA (kern->screen_page); this file holds what is done once per list.
 */
#include "screen.h"

const ekv_screen_terms ekv_screen_exact = {1.0, 1};

/* The scratch layout: step, centre and W per channel [3 D], the code weights w' [G D],
 * then what ekv_cpu_screen_prepare keeps for the whole list: |q'| [G D]. */
void ekv_cpu_screen_prepare(const float *qs, int64_t ldq, int G, int64_t D, void *scratch) {
    float *qabs = (float *)scratch + 3 * D + (int64_t)G * D;
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D; c++) qabs[g * D + c] = fabsf(qs[g * ldq + c]);
}

void ekv_cpu_screen_page(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                         int64_t ldq, int G, const ekv_screen_terms *terms, void *scratch,
                         float *lo, float *hi, int64_t ld) {
    const ekv_cpu_kernels *k = EKV_SCREEN_SIMD(G) ? kern : &ekv_cpu_kernels_scalar;
    k->screen_page(pg, qs, ldq, G, terms, (float *)scratch, lo, hi, ld);
}
