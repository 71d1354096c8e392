/* One-pass softmax on tensor cores (softmax_mma.cu). */
#pragma once
#include "entmaxkv.h"

/* softmax in one pass over K and V on tensor cores (softmax_mma.cu): whether it serves
 * the plan's shapes and this dtype, and its two launches (the splits, then their merge) */
bool ekv_cuda_softmax_one_pass_applies(const ekv_cuda_plan *pl, int dtype);
ekv_status ekv_cuda_launch_softmax_one_pass(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                            const ekv_paged_kv *kv, const ekv_page_table *t,
                                            const float *q, int batch, int use_list, float *out);
