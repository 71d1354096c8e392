/* Certified round 0 (round0.cu): each query head's lower bound of tau from the last page and
 * `recent` pages before it, into the plan's round0_tau (docs/math.md §9.3, "Round 0 on the
 * GPU"); with zero_lists, the KV-head lists' counts zeroed for the bound stage's hinted lists. */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_round0(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int recent, int zero_lists);
