/* The bound stage (bound.cu): the page bounds of a step. With `hinted` (certified's select
 * params) it also writes round 1's KV-head lists from tau_lb, every page whose bound exceeds it
 * for a head of the group, the sink and recent pages and the last page, in no particular order
 * (docs/math.md §9.3 "Round 1 from round 0's bound"), where the select stage would; the lists'
 * counts must be zero before it (stages/round0.cu zeroes them). */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 const double *tau_lb, const ekv_select_params *hinted, int batch);
