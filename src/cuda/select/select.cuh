/* The top-k select stage (select.cu): page lists by the bounds, their union per KV head,
 * certified's round 2. */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_topk(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                int64_t budget_tokens, double budget_fraction, int32_t sink_pages,
                                int32_t recent_pages, const double *hint, int per_head);
/* The union per KV head of the query heads' lists, in page order, with each entry's head mask
 * (list_heads); round 2 (certified) extends it as any KV-head list. */
ekv_status ekv_cuda_launch_union(ekv_cuda_plan *pl, const ekv_page_table *t, int batch);
ekv_status ekv_cuda_launch_round2(ekv_cuda_plan *pl, const ekv_page_table *t, int batch);
