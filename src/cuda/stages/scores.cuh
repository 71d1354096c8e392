/* The scores stage (scores.cu, scores_mma.cu). */
#pragma once
#include "entmaxkv.h"

/* the exact scores of screened decode's rows, the candidates z >= M - 1 listed on the way
 * (scores.cu) */
ekv_status ekv_cuda_launch_row_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                      const ekv_paged_kv *kv, const ekv_page_table *t,
                                      const float *q, int batch);
/* masked: the heads' scores outside their own lists are -inf (list_heads, per_query_head) */
ekv_status ekv_cuda_launch_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int use_list, int round, int masked);
