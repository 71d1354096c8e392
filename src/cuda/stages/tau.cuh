/* The tau stage (tau.cu): candidates and the threshold. */
#pragma once
#include "entmaxkv.h"

/* entmax: candidates + tau (2 launches); softmax: log-sum-exp (1 launch); with rows
 * (screened) tau alone over the candidates the row scores kernel listed */
ekv_status ekv_cuda_launch_tau(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                               int use_list, int round, float *out_zero);
ekv_status ekv_cuda_launch_tau_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                    int use_list, int round, float *out_zero, int rows);
/* entmax (alpha > 1), a round of the step's lists whose tau is read only as a lower bound of
 * tau* (certified's rounds 0 and 1): each row's histogram bound, within two bins below the
 * round's tau, as the plan's tau (2 launches: every row's histogram, then one block a row) */
ekv_status ekv_cuda_launch_tau_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                     const ekv_page_table *t, int batch);
