/* Screened decode (screen.cu, survivors.cu). */
#pragma once
#include "entmaxkv.h"

/* screened (screen.cu, docs/math.md §10): the code bounds (2 launches, 4 with the retry of a
 * plan whose lists are shorter than its tokens), tau of the lower bounds, the survivors and their
 * row lists (survivors.cu, 6), then the rows' exact scores, tau and the values of the support
 * (stages/, 5): 13 launches, or 15 */
ekv_status ekv_cuda_launch_screened(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_stats *st,
                                    const ekv_page_table *t, const float *q, int batch, float *out);

/* survivors.cu: tau(l) of the screen's candidates, the survivor bitmap and the KV heads' row
 * lists (6 launches, over splits of each head's list and bitmap) */
ekv_status ekv_cuda_launch_survivors(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                     const ekv_page_table *t, int batch);
