/* The values stage (values.cu). */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_values_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                       const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                       int use_list, float *out, int rows);
/* whether the values stage reads each V row once for the GQA group (values.cu); the
 * final tau launch then marks the support slots in ubits instead of listing them */
bool ekv_cuda_values_union(const ekv_cuda_plan *pl, double alpha);
ekv_status ekv_cuda_launch_values(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                  int use_list, float *out);
