/* Screened decode (screen.cu). */
#pragma once
#include "entmaxkv.h"

/* screened (screen.cu, docs/math.md §10): the code bounds, tau of the lower bounds (the tau
 * launch over them), then the page lists of the pages with a surviving token (5 launches) */
ekv_status ekv_cuda_launch_screened(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_stats *st,
                                    const ekv_page_table *t, const float *q, int batch, float *out);
