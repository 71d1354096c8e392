/* The fused dense attend (attend_fused.cu): tau and the values of a dense entmax step in one
 * cooperative launch after the scores, for steps of few (sequence, KV head) pairs. */
#pragma once
#include "entmaxkv.h"

/* Whether the plan's dense entmax step of this batch takes the fused attend: the plan's
 * fused_attend on, a device with cooperative launches, alpha > 1, f16 or bf16 K/V, head dim 64 or 128, groups of at most
 * EKV_CUDA_FUSED_GROUP heads, batch x KV heads at most EKV_CUDA_FUSED_GROUPS, not a shard. */
bool ekv_cuda_fused_attend_applies(const ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                   int dtype, int batch);
/* tau, the support and out of every query head from the step's score rows and split maxima
 * (the scores launch before it), as the candidates, tau and values launches write them. */
ekv_status ekv_cuda_launch_fused_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                        const ekv_paged_kv *kv, const ekv_page_table *t,
                                        int batch, float *out);
