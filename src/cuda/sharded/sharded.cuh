/*
 * The sharded CUDA plan (docs/architecture.md, "The sharded CUDA plan"; docs/math.md §11):
 * S shards, each an ordinary CUDA plan over its contiguous range of every sequence's pages,
 * and the collectives that make their steps one exact step: the shards' own thresholds and
 * maxima (allreduce-max), rounds of moments (allreduce-sum) until tau is agreed, the values at
 * the agreed tau on each shard, and the sum of the partial outputs. topk and gaussian agree on
 * their page lists first (sharded_select.cu, select/gaussian.cu's shard parts). sharded.cu
 * orchestrates; sharded_tau.cu holds the agreement's kernels (one launch per stage and shard).
 */
#pragma once
#include "comm.cuh"
#include "../../math/shard_agree.h"
#include "../../math/shard_select.h"

struct ekv_cuda_sharded_plan {
    ekv_context *ctx;
    ekv_cuda_sharded_params p;
    int S;
    ekv_cuda_plan **shard; /* [S] */
    int32_t *dev;          /* [S] the shards' devices                                */
    cudaStream_t *streams; /* [S] their streams (local: one stream, S times)         */
    cudaStream_t own_stream;
    ekv_comm *comm;
    int64_t red_len;         /* doubles of each shard's reduction buffer               */
    double **red;            /* [S] device: the payload of the allreduces              */
    ekv_agree_state **state; /* [S] device [B*H]: every shard's copy of the agreement  */
    ekv_topk_agree **topk;   /* [S] device [B*H]: every shard's copy of the top-k lists */
    int32_t **pending;       /* [S] device [2]: heads still agreeing, unconverged      */
    int32_t *host_pending;   /* pinned: shard 0's pending, read by adaptive rounds     */
    int32_t last_rounds;     /* agreement rounds of the last step                      */
    int32_t last_calls;      /* allreduce calls of the last step                       */
    int64_t last_bytes;      /* payload bytes one shard sent in the last step          */
    int32_t last_batch;
    int last_entmax; /* the last step agreed by rounds (alpha > 1), not softmax's merge  */
};

/* What the agreement kernels of one shard read: its plan's score rows and candidate lists. */
enum ekv_shard_rows { EKV_SHARD_PAGES = 0, EKV_SHARD_LISTED = 1, EKV_SHARD_ROWS = 2 };

/* alpha > 1: red[2 row] = the shard's own tau, red[2 row + 1] = its maximum */
ekv_status ekv_shard_launch_summary(ekv_cuda_plan *pl, const ekv_page_table *t, int batch, int mode,
                                    double *red);
/* every shard's copy of the agreement from the reduced summary */
ekv_status ekv_shard_launch_start(ekv_cuda_plan *pl, int batch, const double *red,
                                  ekv_agree_state *state);
/* red[6 row ..] = the shard's moments at the state's x (zeros for agreed heads) */
ekv_status ekv_shard_launch_moments(ekv_cuda_plan *pl, const ekv_page_table *t, int batch, int mode,
                                    double alpha, const ekv_agree_state *state, double *red);
/* one round's update from the summed moments; pending[0] counts the heads still agreeing */
ekv_status ekv_shard_launch_update(ekv_cuda_plan *pl, int batch, double alpha, const double *red,
                                   ekv_agree_state *state, int32_t *pending);
/* the agreed tau into the plan, the support list at it rebuilt from the candidates, out zeroed
 * for the values kernel; pending[1] counts heads whose agreement did not converge */
ekv_status ekv_shard_launch_support(ekv_cuda_plan *pl, const ekv_paged_kv *kv,
                                    const ekv_page_table *t, int batch, int mode, double alpha,
                                    const ekv_agree_state *state, int32_t *pending, float *out);
/* softmax: phase 0 red = own log-sum-exp, 1 red = e^(own - max), 2 out scaled to the global one */
ekv_status ekv_shard_launch_lse(ekv_cuda_plan *pl, int batch, int phase, double *red,
                                ekv_agree_state *state, float *out);
/* the partial output and support into red (unpack = 0), or the summed ones back (1) */
ekv_status ekv_shard_launch_pack(ekv_cuda_plan *pl, int batch, int unpack, double *red, float *out);

/* top-k lists (sharded_select.cu; the plan's lists, per query head with per_head): the doubles
 * a level's allreduce-sum carries (level 0: the sequences' pages and tokens too) */
int64_t ekv_shard_topk_payload(int batch, int lists_per_seq, int level);
/* level's histogram into red (update = 0), or the step from the summed one (update = 1) */
ekv_status ekv_shard_launch_topk_level(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                       int per_head, int level, int update,
                                       const ekv_select_params *sel, ekv_topk_agree *ag,
                                       double *red);
/* the shard's ties at T into its slot red[list S + shard] (write = 0), or the lists written
 * from the summed slots (write = 1) */
ekv_status ekv_shard_launch_topk_ties(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                      int per_head, int shard, int S, int write, ekv_topk_agree *ag,
                                      double *red);
