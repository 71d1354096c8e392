/* The bound stage (bound.cu): the page bounds of a step. With superpage boxes, tau_lb (the
 * caller's lower bounds of tau, device [B*H]) or recent > 0 (certified round 0 over the last
 * page and `recent` pages before it, whose bounds go to the plan's round0_tau: recent_bound.cuh)
 * lets it skip superpages. */
#pragma once
#include "entmaxkv.h"

ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 const double *tau_lb, int recent, int batch);
