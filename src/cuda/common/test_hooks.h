/*
 * The CUDA backend's test hooks: what a plan's last step left on the device, copied to the
 * host for the GPU tests (tests/gpu/test_cuda.c) and the bench (tools/bench_cuda/). Not part
 * of the public API (include/entmaxkv/cuda.h): declared once here, for the C tests, the tools
 * and the .cu files that define them (named beside each). Each synchronises the plan's stream;
 * batch is the step's batch, at most the plan's max_batch.
 */
#ifndef EKV_CUDA_TEST_HOOKS_H
#define EKV_CUDA_TEST_HOOKS_H
#include "entmaxkv.h"
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* screen/screen.cu: the last screened step. */
/* Rows each KV-head list read ([batch * num_kv_heads]; screened reads K of those rows only):
 * the bench's byte count and the GPU tests. */
EKV_API ekv_status ekv_cuda_screen_rows(ekv_cuda_plan *pl, int32_t batch, int64_t *rows);
/* Query heads whose candidate list overflowed (out[0]: they took the retry pass) and whose
 * retry list overflowed too (out[1]: every token kept). */
EKV_API ekv_status ekv_cuda_screen_overflow(ekv_cuda_plan *pl, int32_t batch, int64_t *out);
/* Pages the page box dropped unread (the fast screen kernel's, docs/math.md §10.4). */
EKV_API ekv_status ekv_cuda_screen_dropped(ekv_cuda_plan *pl, int32_t batch, int64_t *pages);
/* The screen kernel: 0 generic, 1 fast (CUDA cores), 2 tensor cores (EKV_SCREEN_GENERIC, _FAST,
 * _MMA of screen/screen_common.cuh); -1 before any screened step. */
EKV_API ekv_status ekv_cuda_screen_kernel(const ekv_cuda_plan *pl, int32_t *kind);
/* The candidate lists per query head: l, u and token of the first n[h] entries
 * ([batch * num_heads][scap] each; the retry's list for a head that retried). */
EKV_API ekv_status ekv_cuda_screen_lists(ekv_cuda_plan *pl, int32_t batch, float *l, float *u,
                                         int32_t *tok, int64_t *n);
/* The row lists ([batch * num_kv_heads][cap_tokens]: the union of the group's survivors,
 * ascending; ekv_cuda_screen_rows says how many). */
EKV_API ekv_status ekv_cuda_screen_row_list(ekv_cuda_plan *pl, int32_t batch, int32_t *rows);

/* stages/scores.cu: the score rows of the last step ([batch * num_heads][cap_tokens], z-space;
 * slot e page_size + t of a row is entry e's token t). */
EKV_API ekv_status ekv_cuda_score_rows(ekv_cuda_plan *pl, int32_t batch, float *out);

/* stages/round0.cu: the lower bounds of tau certified's round 0 gave in the last step with
 * superpage boxes ([batch * num_heads], z-space). */
EKV_API ekv_status ekv_cuda_round0_bounds(ekv_cuda_plan *pl, int32_t batch, double *out);

/* stages/tau.cu: the query heads whose tau the steps since the last ekv_cuda_read_report (which
 * clears what this reads) solved over a cluster of blocks (ekv_cuda_plan_params.tau_cluster). */
EKV_API ekv_status ekv_cuda_tau_cluster_rows(ekv_cuda_plan *pl, int32_t batch, int64_t *rows);

/* stages/bound.cu: the page bounds of the last step with a bound stage
 * ([batch * num_heads][cap_pages], z-space; the last page of a sequence: -inf; the entries past
 * it are not written). */
EKV_API ekv_status ekv_cuda_page_bounds(ekv_cuda_plan *pl, int32_t batch, float *out);

#ifdef __cplusplus
}
#endif
#endif
