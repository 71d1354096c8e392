/* The step of a plan (decode.cu), what the sharded plan runs of it on each shard. */
#pragma once
#include "entmaxkv.h"

/* The checks of a step and the plan's record of it (decode.cu: what the report reads). */
ekv_status ekv_cuda_step_begin(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               const float *out);
/* The stages after a page-list select: the union of per-query-head lists, scores, tau (then
 * certified's round 2 and the values, unless skip_values). */
ekv_status ekv_cuda_step_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_table *t, const float *q, float *out);
