/* The bound stage (bound.cu): the page bounds of a step. */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 const double *tau_lb, int batch);
