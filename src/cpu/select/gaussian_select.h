/* The gaussian selection policy (gaussian.c), called by ekv_select_pages. */
#ifndef EKV_GAUSSIAN_SELECT_H
#define EKV_GAUSSIAN_SELECT_H
#include "select.h"

/* Arguments already validated (ekv_decode_supported checks the alpha and the selector's
 * parameters; ekv_validate_select the statistics, the list capacity and list->tau). */
ekv_list_policy ekv_select_gaussian;

/* Pages with statistics the selector models: all but the last (a one-page sequence: its page). */
static inline int64_t ekv_gauss_stats_pages(int64_t P) { return P > 1 ? P - 1 : 1; }
/* q' = scale * q in fp32 for the G query heads of KV head kvh of sequence b: qs[G][D]. */
void ekv_gauss_group_query(const float *q, double scale, int64_t b, int64_t H, int64_t kvh,
                           int64_t G, int64_t D, float *qs);
/* mu and sigma of the scores on one stats page (docs/math.md §4.2) for the G heads of a group
 * (qs from ekv_gauss_group_query): head g's into mu[g * hstride], sig[g * hstride]. */
void ekv_gauss_page_moments(const ekv_paged_kv *kv, const ekv_page_stats *st, int32_t page,
                            int64_t kvh, const float *qs, int64_t G, double *mu, double *sig,
                            int64_t hstride);
#endif
