/* Attention over page lists, internal entry points (attend_pages.c). */
#ifndef EKV_CPU_ATTEND_H
#define EKV_CPU_ATTEND_H
#include "../core/internal.h"

/*
 * Certified attention (SPEC 9.3) over round-1 lists: per list, score the listed pages, solve
 * tau_C per head, add every page outside the list whose certified bound (bounds[(b*H +
 * h)*bstride + p]) exceeds tau_C for a head of the list, score only those, and solve exactly
 * over all kept scores; V is read once, for the final support. round2[l] = pages added.
 * Arguments (other than the list) must already be validated; alpha > 1.
 */
ekv_status ekv_cpu_attend_certified(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                                    const ekv_page_table *tab, const ekv_page_list *list, const float *bounds,
                                    int64_t bstride, const float *q, float *out, ekv_decode_info *info,
                                    int64_t *round2);
#endif
