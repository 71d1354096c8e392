/*
 * The sharded CUDA plan (sharded.cuh, docs/architecture.md "The sharded CUDA plan", docs/math.md
 * §11): creation (one ordinary plan per shard, the communicators once), and the step:
 *   1. every shard runs its method on its own pages up to its own tau (ekv_cuda_decode with
 *      skip_values): scores, candidates, tau_j; topk and gaussian first agree on their page
 *      lists (listed_step: 4 + 1 histogram rounds, or one round of the gaussian's sums),
 *      then run the stages after the select on their own lists;
 *   2. allreduce-max of (tau_j, max_j) per head: the bracket [lo, hi] of tau*;
 *   3. rounds of moments: every shard's 6 sums at x, allreduce-sum, the same update on every
 *      shard (adaptive: until every head agreed; tau_rounds = R: exactly R);
 *   4. the support list at the agreed tau and the values on every shard;
 *   5. allreduce-sum of the partial outputs and support counts.
 * Softmax: the shard's whole step, then the log-sum-exps merged (max, then sum) and the outputs
 * rescaled before the same sum. Nothing reads device memory on the host except the adaptive
 * rounds' one word per round.
 */
#include "../stages/bound.cuh"
#include "comm.cuh"
#include "../select/gaussian.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../plan/plan_defaults.h"
#include "sharded.cuh"
#include "../plan/step.cuh"
#include "../stages/values.cuh"
#include "../../math/shard_agree.h"
#include "../../math/shard_select.h"
extern "C" {
#include "../../core/method.h"
}
#include <stdlib.h>
#include <string.h>

enum { ADAPTIVE_ROUNDS_MAX = 200 };

extern "C" ekv_cuda_sharded_params ekv_cuda_sharded_default_params(void) {
    return ekv_cuda_sharded_defaults();
}

extern "C" void ekv_cuda_sharded_free(ekv_cuda_sharded_plan *sp) {
    if (!sp) return;
    for (int j = 0; j < sp->S; j++) {
        if (sp->dev) cudaSetDevice(sp->dev[j]);
        if (sp->red && sp->red[j]) cudaFree(sp->red[j]);
        if (sp->state && sp->state[j]) cudaFree(sp->state[j]);
        if (sp->topk && sp->topk[j]) cudaFree(sp->topk[j]);
        if (sp->pending && sp->pending[j]) cudaFree(sp->pending[j]);
        if (sp->shard && sp->shard[j]) ekv_cuda_plan_free(sp->shard[j]);
    }
    ekv_comm_free(sp->comm);
    if (sp->own_stream) cudaStreamDestroy(sp->own_stream);
    if (sp->host_pending) cudaFreeHost(sp->host_pending);
    free(sp->shard);
    free(sp->dev);
    free(sp->streams);
    free(sp->red);
    free(sp->state);
    free(sp->topk);
    free(sp->pending);
    free(sp);
}

static ekv_status check_sharded_params(ekv_context *ctx, const ekv_cuda_sharded_params *p,
                                       int ndev) {
    if (p->num_shards < 1 || p->num_shards > EKV_COMM_MAX_SHARDS)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_shards=%d must be in [1, %d]",
                        p->num_shards, (int)EKV_COMM_MAX_SHARDS);
    if (p->transport != EKV_TRANSPORT_LOCAL && p->transport != EKV_TRANSPORT_NCCL)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "transport=%d must be local (0) or nccl (1)",
                        p->transport);
    if (p->tau_rounds < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "tau_rounds=%d must be >= 0 (0 = adaptive)",
                        p->tau_rounds);
    if (p->transport == EKV_TRANSPORT_NCCL)
        for (int j = 0; j < p->num_shards; j++) {
            const int d = p->devices ? p->devices[j] : j;
            if (d < 0 || d >= ndev)
                return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                                "shard %d: device %d, but only %d CUDA device(s)", j, d, ndev);
            for (int i = 0; i < j; i++)
                if ((p->devices ? p->devices[i] : i) == d)
                    return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                                    "shards %d and %d share device %d (nccl: one shard per GPU; "
                                    "the local transport serves shards on one device)",
                                    i, j, d);
        }
    return EKV_OK;
}

/* The host arrays, the devices and streams of the shards (local: one stream for all). */
static ekv_status alloc_shards(ekv_cuda_sharded_plan *sp, const int32_t *devices) {
    const int S = sp->S;
    sp->shard = (ekv_cuda_plan **)calloc(S, sizeof(ekv_cuda_plan *));
    sp->dev = (int32_t *)calloc(S, sizeof(int32_t));
    sp->streams = (cudaStream_t *)calloc(S, sizeof(cudaStream_t));
    sp->red = (double **)calloc(S, sizeof(double *));
    sp->state = (ekv_agree_state **)calloc(S, sizeof(ekv_agree_state *));
    sp->topk = (ekv_topk_agree **)calloc(S, sizeof(ekv_topk_agree *));
    sp->pending = (int32_t **)calloc(S, sizeof(int32_t *));
    if (!sp->shard || !sp->dev || !sp->streams || !sp->red || !sp->state || !sp->topk ||
        !sp->pending)
        return ekv_fail(sp->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    const int local = sp->p.transport == EKV_TRANSPORT_LOCAL;
    for (int j = 0; j < S; j++) sp->dev[j] = local ? sp->p.plan.device : devices ? devices[j] : j;
    if (local && !sp->p.plan.stream) {
        EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[0]));
        EKV_CUDA_TRY(sp, cudaStreamCreateWithFlags(&sp->own_stream, cudaStreamNonBlocking));
    }
    return EKV_OK;
}

/* Shard j's plan and its agreement buffers on its device. */
static ekv_status create_shard(ekv_cuda_sharded_plan *sp, int j) {
    ekv_cuda_plan_params pp = sp->p.plan;
    pp.device = sp->dev[j];
    if (sp->p.transport == EKV_TRANSPORT_LOCAL)
        pp.stream = sp->p.plan.stream ? sp->p.plan.stream : (void *)sp->own_stream;
    else
        pp.stream = NULL; /* each GPU its own stream */
    ekv_status s = ekv_cuda_plan_create(sp->ctx, &pp, &sp->shard[j]);
    if (s) return s;
    sp->streams[j] = sp->shard[j]->stream;
    const int64_t BH = (int64_t)pp.max_batch * pp.num_heads;
    EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[j]));
    EKV_CUDA_TRY(sp, cudaMalloc((void **)&sp->red[j], (size_t)(sp->red_len * sizeof(double))));
    EKV_CUDA_TRY(sp, cudaMalloc((void **)&sp->state[j], (size_t)BH * sizeof(ekv_agree_state)));
    EKV_CUDA_TRY(sp, cudaMalloc((void **)&sp->topk[j], (size_t)BH * sizeof(ekv_topk_agree)));
    EKV_CUDA_TRY(sp, cudaMalloc((void **)&sp->pending[j], 2 * sizeof(int32_t)));
    EKV_CUDA_TRY(sp, cudaMemset(sp->pending[j], 0, 2 * sizeof(int32_t)));
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_sharded_create(ekv_context *ctx, const ekv_cuda_sharded_params *p,
                                              ekv_cuda_sharded_plan **out) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!p || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params and out must not be NULL");
    *out = NULL;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "no CUDA device is available");
    }
    ekv_status s = check_sharded_params(ctx, p, ndev);
    if (s) return s;
    ekv_cuda_sharded_plan *sp = (ekv_cuda_sharded_plan *)calloc(1, sizeof *sp);
    if (!sp) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    sp->ctx = ctx;
    sp->p = *p;
    sp->p.devices = NULL; /* the caller's array is read at creation only (sp->dev keeps it) */
    sp->S = p->num_shards;
    const int64_t BH = (int64_t)p->plan.max_batch * p->plan.num_heads;
    const int64_t W =
            p->plan.head_dim + 1 > EKV_AGREE_MOMENTS ? p->plan.head_dim + 1 : EKV_AGREE_MOMENTS;
    /* the largest payload: the merge, or a top-k level over per-query-head lists (its tie
     * round, BH x S, and the gaussian's sums, 4 BH + 2 B, are smaller) */
    const int64_t topk_len = ekv_shard_topk_payload(p->plan.max_batch, p->plan.num_heads, 0);
    sp->red_len = BH * W > topk_len ? BH * W : topk_len;
    s = alloc_shards(sp, p->devices);
    for (int j = 0; j < sp->S && !s; j++) s = create_shard(sp, j);
    if (!s && cudaMallocHost((void **)&sp->host_pending, sizeof(int32_t)) != cudaSuccess)
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "cudaMallocHost for the plan's flag");
    if (!s)
        s = p->transport == EKV_TRANSPORT_LOCAL
                    ? ekv_comm_create_local(ctx, sp->S, &sp->comm)
                    : ekv_comm_create_nccl(ctx, sp->S, sp->dev, &sp->comm);
    if (s) {
        ekv_cuda_sharded_free(sp);
        return s;
    }
    *out = sp;
    ekv_clear_error(ctx);
    return EKV_OK;
}

extern "C" ekv_cuda_plan *ekv_cuda_sharded_shard(ekv_cuda_sharded_plan *sp, int32_t j) {
    return sp && j >= 0 && j < sp->S ? sp->shard[j] : NULL;
}
extern "C" int32_t ekv_cuda_sharded_device(const ekv_cuda_sharded_plan *sp, int32_t j) {
    return sp && j >= 0 && j < sp->S ? sp->dev[j] : -1;
}

/* The host-side checks of a step: the arrays, the methods the sharded step serves. */
static ekv_status check_sharded_step(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                                     const ekv_select_params *sel, const ekv_paged_kv *kv,
                                     const ekv_page_stats *st, const ekv_page_table *tables,
                                     const float *const *q, float *const *out) {
    if (!prm || !kv || !st || !tables || !q || !out)
        return ekv_fail(sp->ctx, EKV_ERR_NULL_POINTER,
                        "params, kv, stats, tables, q and out must not be NULL");
    ekv_status s = ekv_decode_supported(sp->ctx, EKV_BACKEND_CUDA, prm, sel);
    if (s) return s;
    const ekv_select_method m = ekv_step_method(sel);
    if (prm->alpha == 1.0 && m != EKV_SELECT_DENSE)
        return ekv_fail(sp->ctx, EKV_ERR_UNSUPPORTED, "the sharded plan's softmax is dense only");
    if (prm->alibi_slopes)
        return ekv_fail(sp->ctx, EKV_ERR_UNSUPPORTED,
                        "the sharded plan has no ALiBi (a shard's positions are its own)");
    /* a hint or bound of the whole sequence's tau would prune a shard's keys that the agreement's
     * rounds below it still count, and it is one device's array */
    if (sel && (sel->tau_lb || sel->tau_hint))
        return ekv_fail(sp->ctx, EKV_ERR_UNSUPPORTED,
                        "the sharded plan takes no tau_lb or tau_hint (the shards agree on tau "
                        "from their own thresholds)");
    for (int j = 0; j < sp->S; j++) {
        if (!q[j] || !out[j])
            return ekv_fail(sp->ctx, EKV_ERR_NULL_POINTER, "shard %d: q and out must not be NULL",
                            j);
        if (tables[j].batch != tables[0].batch)
            return ekv_fail(sp->ctx, EKV_ERR_INVALID_SIZE,
                            "shard %d: batch %d differs from shard 0's %d", j, tables[j].batch,
                            tables[0].batch);
    }
    return EKV_OK;
}

/* Which rows a shard's method scored: dense the sequence's pages, the listed methods their page
 * lists, screened its token rows. */
static int shard_rows_of(const ekv_select_params *sel) {
    const unsigned stg = ekv_method_info_of(ekv_step_method(sel))->stages;
    if (stg & EKV_STAGE_SCREEN) return EKV_SHARD_ROWS;
    return (stg & EKV_STAGES_LIST) ? EKV_SHARD_LISTED : EKV_SHARD_PAGES;
}

/* An allreduce over the shards' reduction buffers (n doubles of each). */
static ekv_status allreduce(ekv_cuda_sharded_plan *sp, int64_t n, ekv_comm_op op) {
    return ekv_comm_allreduce(sp->comm, sp->red, n, op, sp->streams);
}

/* Calls f(j) for every shard with its device current; stops at the first failure. */
template <typename F> static ekv_status each_shard(ekv_cuda_sharded_plan *sp, F &&f) {
    for (int j = 0; j < sp->S; j++) {
        EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[j]));
        const ekv_status s = f(j);
        if (s) return s;
    }
    return EKV_OK;
}

/* Rounds of moments until every head agreed (adaptive) or exactly tau_rounds. */
static ekv_status agree_rounds(ekv_cuda_sharded_plan *sp, const ekv_page_table *tables, int B,
                               int mode, double alpha) {
    const int64_t BH = (int64_t)B * sp->p.plan.num_heads;
    const int R = sp->p.tau_rounds > 0 ? sp->p.tau_rounds : ADAPTIVE_ROUNDS_MAX;
    sp->last_rounds = 0;
    for (int r = 0; r < R; r++) {
        ekv_status s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_moments(sp->shard[j], &tables[j], B, mode, alpha, sp->state[j],
                                            sp->red[j]);
        });
        if (!s) s = allreduce(sp, BH * EKV_AGREE_MOMENTS, EKV_COMM_SUM);
        if (!s)
            s = each_shard(sp, [&](int j) {
                return ekv_shard_launch_update(sp->shard[j], B, alpha, sp->red[j], sp->state[j],
                                               sp->pending[j]);
            });
        if (s) return s;
        sp->last_rounds++;
        if (sp->p.tau_rounds > 0) continue;
        EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[0]));
        EKV_CUDA_TRY(sp, cudaMemcpyAsync(sp->host_pending, sp->pending[0], sizeof(int32_t),
                                         cudaMemcpyDeviceToHost, sp->streams[0]));
        EKV_CUDA_TRY(sp, cudaStreamSynchronize(sp->streams[0]));
        if (*sp->host_pending == 0) break;
    }
    return EKV_OK;
}

/* Where shard j's table stands in each sequence (src/math/shard_select.h). */
static int shard_pos_of(const ekv_cuda_sharded_plan *sp, int j) {
    return sp->S == 1 ? EKV_SHARD_WHOLE : j == sp->S - 1 ? EKV_SHARD_LAST : EKV_SHARD_INNER;
}

/* topk (docs/math.md §11, "Top-k across shards"): every shard's bounds of its own ranked
 * pages, 4 levels of histograms and the tie round (always all 5 allreduce-sums: no host read),
 * then each shard writes its part of every list. */
static ekv_status select_topk(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *tables,
                              const float *const *q) {
    const int B = tables[0].batch, ph = sel->per_query_head != 0;
    const int lps = ph ? sp->p.plan.num_heads : sp->p.plan.num_kv_heads;
    ekv_status s = each_shard(sp, [&](int j) {
        return ekv_cuda_launch_bound(sp->shard[j], prm, &kv[j], &st[j], &tables[j], q[j],
                                     sel->use_ball, sel->tau_lb, NULL, B);
    });
    for (int level = 0; level < EKV_TOPK_LEVELS && !s; level++) {
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_topk_level(sp->shard[j], &tables[j], B, ph, level, 0, sel,
                                               sp->topk[j], sp->red[j]);
        });
        if (!s) s = allreduce(sp, ekv_shard_topk_payload(B, lps, level), EKV_COMM_SUM);
        if (!s)
            s = each_shard(sp, [&](int j) {
                return ekv_shard_launch_topk_level(sp->shard[j], &tables[j], B, ph, level, 1, sel,
                                                   sp->topk[j], sp->red[j]);
            });
    }
    for (int write = 0; write < 2 && !s; write++) {
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_topk_ties(sp->shard[j], &tables[j], B, ph, j, sp->S, write,
                                              sp->topk[j], sp->red[j]);
        });
        if (!s && !write) s = allreduce(sp, (int64_t)B * lps * sp->S, EKV_COMM_SUM);
    }
    return s;
}

/* gaussian (docs/math.md §11, "Gaussian selector across shards"; exact tau mode, no ALiBi):
 * every shard's page moments and partial sums, one allreduce-sum, then each shard the global
 * stats and the page rule on its own pages. */
static ekv_status select_gaussian(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                                  const ekv_select_params *sel, const ekv_paged_kv *kv,
                                  const ekv_page_stats *st, const ekv_page_table *tables,
                                  const float *const *q) {
    const int B = tables[0].batch, ph = sel->per_query_head != 0;
    const int64_t BH = (int64_t)B * sp->p.plan.num_heads;
    ekv_status s = each_shard(sp, [&](int j) {
        return ekv_cuda_launch_gaussian_shard(sp->shard[j], prm, sel, &kv[j], &st[j], &tables[j],
                                              q[j], B, ph, 0, sp->red[j]);
    });
    if (!s) s = allreduce(sp, 4 * BH + 2 * B, EKV_COMM_SUM);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_cuda_launch_gaussian_shard(sp->shard[j], prm, sel, &kv[j], &st[j],
                                                  &tables[j], q[j], B, ph, 1, sp->red[j]);
        });
    return s;
}

/* topk and gaussian: the lists agreed across the shards, then every shard's stages after the
 * select (union, scores, tau) on its own list, without the values. */
static ekv_status listed_step(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *tables,
                              const float *const *q, float *const *out) {
    ekv_status s = each_shard(sp, [&](int j) {
        sp->shard[j]->shard_pos = shard_pos_of(sp, j);
        sp->shard[j]->skip_values = 1;
        return ekv_cuda_step_begin(sp->shard[j], prm, sel, &kv[j], &st[j], &tables[j], q[j],
                                   out[j]);
    });
    if (!s)
        s = ekv_step_method(sel) == EKV_SELECT_TOPK
                    ? select_topk(sp, prm, sel, kv, st, tables, q)
                    : select_gaussian(sp, prm, sel, kv, st, tables, q);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_cuda_step_attend(sp->shard[j], prm, sel, &kv[j], &tables[j], q[j], out[j]);
        });
    for (int j = 0; j < sp->S; j++) { /* an ordinary plan again, whatever failed */
        sp->shard[j]->shard_pos = EKV_SHARD_WHOLE;
        sp->shard[j]->skip_values = 0;
    }
    return s;
}

/* Entmax: steps 1-4 of the file comment (the merge follows in the caller). */
static ekv_status entmax_step(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *tables,
                              const float *const *q, float *const *out) {
    const int B = tables[0].batch, mode = shard_rows_of(sel);
    const int64_t BH = (int64_t)B * sp->p.plan.num_heads;
    const ekv_select_method m = ekv_step_method(sel);
    ekv_status s;
    if (m == EKV_SELECT_TOPK || m == EKV_SELECT_GAUSSIAN) {
        s = listed_step(sp, prm, sel, kv, st, tables, q, out);
    } else {
        s = each_shard(sp, [&](int j) {
            sp->shard[j]->skip_values = 1;
            const ekv_status r = ekv_cuda_decode(sp->shard[j], prm, sel, &kv[j], &st[j], &tables[j],
                                                 q[j], out[j]);
            sp->shard[j]->skip_values = 0;
            return r;
        });
    }
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_summary(sp->shard[j], &tables[j], B, mode, sp->red[j]);
        });
    if (!s) s = allreduce(sp, 2 * BH, EKV_COMM_MAX);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_start(sp->shard[j], B, sp->red[j], sp->state[j]);
        });
    if (!s) s = agree_rounds(sp, tables, B, mode, prm->alpha);
    if (s) return s;
    return each_shard(sp, [&](int j) {
        ekv_cuda_plan *pl = sp->shard[j];
        ekv_status r = ekv_shard_launch_support(pl, &kv[j], &tables[j], B, mode, prm->alpha,
                                                sp->state[j], sp->pending[j], out[j]);
        if (!r)
            r = ekv_cuda_launch_values_rows(pl, prm, &kv[j], &tables[j], B,
                                            mode == EKV_SHARD_LISTED, out[j],
                                            mode == EKV_SHARD_ROWS);
        return r;
    });
}

/* Softmax: each shard's whole step, then the log-sum-exps merged and the outputs rescaled. */
static ekv_status softmax_step(ekv_cuda_sharded_plan *sp, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *tables,
                               const float *const *q, float *const *out) {
    const int B = tables[0].batch;
    const int64_t BH = (int64_t)B * sp->p.plan.num_heads;
    sp->last_rounds = 0;
    ekv_status s = each_shard(sp, [&](int j) {
        const ekv_status r =
                ekv_cuda_decode(sp->shard[j], prm, sel, &kv[j], &st[j], &tables[j], q[j], out[j]);
        return r ? r : ekv_shard_launch_lse(sp->shard[j], B, 0, sp->red[j], sp->state[j], out[j]);
    });
    if (!s) s = allreduce(sp, BH, EKV_COMM_MAX);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_lse(sp->shard[j], B, 1, sp->red[j], sp->state[j], out[j]);
        });
    if (!s) s = allreduce(sp, BH, EKV_COMM_SUM);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_lse(sp->shard[j], B, 2, sp->red[j], sp->state[j], out[j]);
        });
    return s;
}

extern "C" ekv_status ekv_cuda_sharded_decode(ekv_cuda_sharded_plan *sp,
                                              const ekv_decode_params *prm,
                                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                                              const ekv_page_stats *st,
                                              const ekv_page_table *tables, const float *const *q,
                                              float *const *out) {
    if (!sp) return EKV_ERR_NULL_POINTER;
    ekv_status s = check_sharded_step(sp, prm, sel, kv, st, tables, q, out);
    if (s) return s;
    const int B = tables[0].batch;
    const int64_t BH = (int64_t)B * sp->p.plan.num_heads;
    sp->comm->calls = 0;
    sp->comm->bytes = 0;
    sp->last_batch = B;
    sp->last_entmax = prm->alpha != 1.0;
    s = prm->alpha == 1.0 ? softmax_step(sp, prm, sel, kv, st, tables, q, out)
                          : entmax_step(sp, prm, sel, kv, st, tables, q, out);
    /* the merge: partial outputs and support counts summed */
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_pack(sp->shard[j], B, 0, sp->red[j], out[j]);
        });
    if (!s) s = allreduce(sp, BH * (sp->p.plan.head_dim + 1), EKV_COMM_SUM);
    if (!s)
        s = each_shard(sp, [&](int j) {
            return ekv_shard_launch_pack(sp->shard[j], B, 1, sp->red[j], out[j]);
        });
    sp->last_calls = sp->comm->calls;
    sp->last_bytes = sp->comm->bytes;
    if (!s) ekv_clear_error(sp->ctx);
    return s;
}

extern "C" ekv_status ekv_cuda_sharded_append(ekv_cuda_sharded_plan *sp, const ekv_paged_kv *kv,
                                              const ekv_page_stats *st,
                                              const ekv_cuda_append_item *items, int32_t n_items,
                                              const float *k_new, const float *v_new) {
    if (!sp) return EKV_ERR_NULL_POINTER;
    if (!kv || !st) return ekv_fail(sp->ctx, EKV_ERR_NULL_POINTER, "kv and stats must not be NULL");
    const int last = sp->S - 1; /* the newest page's owner (contiguous ranges) */
    EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[last]));
    return ekv_cuda_append(sp->shard[last], &kv[last], &st[last], items, n_items, k_new, v_new);
}

extern "C" ekv_status ekv_cuda_sharded_read_report(ekv_cuda_sharded_plan *sp, int32_t batch,
                                                   ekv_cuda_report *report,
                                                   ekv_cuda_sharded_report *sr) {
    if (!sp) return EKV_ERR_NULL_POINTER;
    if (batch < 1 || batch > sp->p.plan.max_batch)
        return ekv_fail(sp->ctx, EKV_ERR_INVALID_SIZE, "batch=%d must be in [1, %d]", batch,
                        sp->p.plan.max_batch);
    int32_t pend[2] = {0, 0};
    for (int j = 0; j < sp->S; j++) {
        EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[j]));
        EKV_CUDA_TRY(sp, cudaStreamSynchronize(sp->streams[j]));
    }
    EKV_CUDA_TRY(sp, cudaSetDevice(sp->dev[0]));
    EKV_CUDA_TRY(sp, cudaMemcpy(pend, sp->pending[0], sizeof pend, cudaMemcpyDeviceToHost));
    if (sr) {
        sr->rounds = sp->last_rounds;
        sr->allreduces = sp->last_calls;
        sr->bytes = sp->last_bytes;
        sr->unconverged = sp->last_entmax ? pend[1] : 0;
    }
    return report ? ekv_cuda_read_report(sp->shard[0], batch, report) : EKV_OK;
}
