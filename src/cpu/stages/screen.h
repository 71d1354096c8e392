/* Per-token score bounds from the key codes (screen.c, docs/math.md §10.2): the stage's calls
 * around the per-ISA kernel (../kernels/screen_page.h, its arguments in screen_types.h there). */
#ifndef EKV_CPU_SCREEN_H
#define EKV_CPU_SCREEN_H
#include "../kernels/kernels.h"
#include "../kernels/screen_types.h"

extern const ekv_screen_terms ekv_screen_exact; /* every term: production's */

/* Prepares the scratch for the queries qs [G][D] (ldq apart) of one list: what depends on the
 * queries alone, kept for every page of the list. */
void ekv_cpu_screen_prepare(const float *qs, int64_t ldq, int G, int64_t D, void *scratch);
/* The page test before the codes (docs/math.md §10.4): u[g] >= every fp32 score of the page's
 * tokens for head g, from the page's range (the box) with the rounding of the box and of the
 * scores, and the ALiBi term of its last token. Same scratch; it uses the per-channel slots. */
void ekv_cpu_screen_page_box(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, int G,
                             void *scratch, double *u);
/*
 * lo[g*ld + t] <= z_t,g <= hi[g*ld + t] for every token t < ntok and head g < G, where z is
 * the fp32 score the score kernels compute from the scaled queries qs [G][D] (ldq apart).
 * The page's bound runs on kern->screen_page. scratch: ekv_screen_scratch_bytes(D, G)
 * bytes, 8-byte aligned, prepared for these queries by ekv_cpu_screen_prepare (once per
 * list: what depends on the queries alone is not redone per page).
 */
void ekv_cpu_screen_page(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                         int64_t ldq, int G, const ekv_screen_terms *terms, void *scratch,
                         float *lo, float *hi, int64_t ld);
#endif
