/* The gaussian selection policy (gaussian.c), called by ekv_select_pages. */
#ifndef EKV_GAUSSIAN_SELECT_H
#define EKV_GAUSSIAN_SELECT_H
#include "../core/internal.h"

/* Arguments already validated (ekv_decode_supported checks the alpha and the selector's
 * parameters; ekv_validate_select the statistics, the list capacity and list->tau). */
ekv_status ekv_select_gaussian(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_page_list *list);
#endif
