/* The gaussian selector (gaussian.cu, docs/math.md §4.6-4.8). */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_gaussian(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_select_params *sel, const ekv_paged_kv *kv,
                                    const ekv_page_stats *st, const ekv_page_table *t,
                                    const float *q, int batch, int per_head);
/* The gaussian on a shard of the sharded plan (docs/math.md §11): part 0 the page moments and
 * the shard's partial sums into red ([B*H][4], then [B][2] its pages and tokens), part 1, after
 * their allreduce-sum, the global stats from red and the page rule on the shard's pages. */
ekv_status ekv_cuda_launch_gaussian_shard(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                          const ekv_select_params *sel, const ekv_paged_kv *kv,
                                          const ekv_page_stats *st, const ekv_page_table *t,
                                          const float *q, int batch, int per_head, int part,
                                          double *red);
