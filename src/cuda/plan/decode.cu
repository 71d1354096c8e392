/*
 * The CUDA decode step (mirrors src/cpu/methods/decode.c): plan creation (every buffer, once, from
 * one table), validation on the host from static shapes only (ekv_decode_supported, the
 * check every backend runs, then the plan's shapes), and the launches of the stages the
 * method table (src/core/method.c) lists for the select method:
 *   dense:     scores -> tau -> values                                   (5 launches)
 *   topk:      bound -> topk -> scores -> tau -> values                  (7 launches)
 *   gaussian:  moments -> stats -> rule -> scores -> tau -> values       (8 launches)
 *   certified: bound -> topk -> scores -> tau -> round2 -> scores -> tau -> values (12;
 *              with superpage boxes first round 0: recent pages -> scores -> tau, 5 more)
 *   screened:  screen -> tau(l) + mark -> rows -> row scores -> tau -> values
 *              (10 kernels and a memset, screen/screen.cu; tau is three of them)
 * (per_query_head lists: one more, the union of the heads' lists after the select), where
 * tau is three launches for entmax (candidates, the refine pass of a list that overflowed,
 * then the solve; stages/tau.cu) and one for softmax;
 * softmax on tensor cores replaces scores -> tau -> values by one pass over K and V and the
 * merge of its splits (2 launches, stages/softmax_mma.cu).
 * Nothing here reads device memory or synchronises, so a step can be captured in a graph.
 */
#include "../stages/bound.cuh"
#include "../select/gaussian.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "plan_defaults.h"
#include "../stages/scores.cuh"
#include "../screen/screen.cuh"
#include "../select/select.cuh"
#include "../common/sizes.cuh"
#include "../stages/softmax.cuh"
#include "../common/splits.cuh"
#include "step.cuh"
#include "../stages/tau.cuh"
#include "../stages/values.cuh"
#include <math.h>
#include <string.h>
extern "C" {
#include "../../core/method.h" /* the method table and the checks every backend shares (C) */
}
#include <stdlib.h>
#include <string.h>
#include <math.h>

extern "C" ekv_cuda_plan_params ekv_cuda_plan_default_params(void) {
    return ekv_cuda_plan_defaults();
}

extern "C" ekv_status ekv_cuda_device_count(ekv_context *ctx, int32_t *count) {
    if (!count)
        return ctx ? ekv_fail(ctx, EKV_ERR_NULL_POINTER, "count must not be NULL")
                   : EKV_ERR_NULL_POINTER;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        n = 0;
    }
    *count = n;
    return EKV_OK;
}

/* Every device buffer of a plan with its size: the one list that plan creation allocates,
 * ekv_cuda_plan_bytes counts and ekv_cuda_plan_free frees. */
typedef struct {
    void **ptr;
    int64_t bytes;
} plan_buffer;

enum { PLAN_BUFFERS = 44 };

static void plan_buffers(ekv_cuda_plan *pl, plan_buffer *b) {
    const int64_t B = pl->p.max_batch, H = pl->p.num_heads, Hk = pl->p.num_kv_heads,
                  ns = pl->split_cap;
    const int64_t BH = B * H, BHk = B * Hk, P = pl->cap_pages, C = pl->cand_cap;
    const plan_buffer t[PLAN_BUFFERS] = {
            {(void **)&pl->scores, BH * pl->cap_tokens * (int64_t)sizeof(float)},
            {(void **)&pl->split_max, BH * 2 * ns * (int64_t)sizeof(float)},
            {(void **)&pl->bounds, BH * P * (int64_t)sizeof(float)},
            {(void **)&pl->list_bounds, BHk * P * (int64_t)sizeof(float)},
            {(void **)&pl->list_pages, BHk * P * (int64_t)sizeof(int32_t)},
            {(void **)&pl->list_count, BHk * 2 * (int64_t)sizeof(int32_t)},
            {(void **)&pl->in_list, BHk * P},
            {(void **)&pl->tau, BH * (int64_t)sizeof(double)},
            {(void **)&pl->tau_m, BH * (int64_t)sizeof(float)},
            {(void **)&pl->tau_t, BH * (int64_t)sizeof(double)},
            {(void **)&pl->support, BH * (int64_t)sizeof(int64_t)},
            {(void **)&pl->v_rows, BHk * (int64_t)sizeof(int64_t)},
            {(void **)&pl->flags, BH * (int64_t)sizeof(int32_t)},
            {(void **)&pl->gmu, BH * P * (int64_t)sizeof(double)},
            {(void **)&pl->gsig, BH * P * (int64_t)sizeof(double)},
            {(void **)&pl->cand_z, BH * C * (int64_t)sizeof(float)},
            {(void **)&pl->cand_slot, BH * C * (int64_t)sizeof(int64_t)},
            {(void **)&pl->cand_count, BH * (int64_t)sizeof(int32_t)},
            {(void **)&pl->cand_hist, BH * EKV_CUDA_TAU_HIST_BINS * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->cand_done, BH * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->cand_thr, BH * (int64_t)sizeof(float)},
            {(void **)&pl->refine_count, BH * (int64_t)sizeof(int32_t)},
            {(void **)&pl->sup_p, BH * C * (int64_t)sizeof(float)},
            {(void **)&pl->sup_off, BH * C * (int64_t)sizeof(int64_t)},
            {(void **)&pl->sup_count, BH * (int64_t)sizeof(int64_t)},
            {(void **)&pl->survivors, BHk * (int64_t)sizeof(int64_t)},
            {(void **)&pl->scr_state, 5 * BH * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->scr_f, BH * EKV_SCREEN_GRID * (int64_t)sizeof(double)},
            {(void **)&pl->scl, BH * pl->scap * (int64_t)sizeof(float)},
            {(void **)&pl->scu, BH * pl->scap * (int64_t)sizeof(float)},
            {(void **)&pl->sct, BH * pl->scap * (int64_t)sizeof(int32_t)},
            {(void **)&pl->sbits, BHk * pl->cap_words * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->rows, BHk * pl->cap_tokens * (int64_t)sizeof(int32_t)},
            {(void **)&pl->row_count, BHk * (int64_t)sizeof(int32_t)},
            {(void **)&pl->gstat, BH * 3 * (int64_t)sizeof(double)},
            {(void **)&pl->flash_part, BH * ns * (pl->p.head_dim + 4) * (int64_t)sizeof(float)},
            {(void **)&pl->hlist_pages, BH * P * (int64_t)sizeof(int32_t)},
            {(void **)&pl->hlist_count, BH * 2 * (int64_t)sizeof(int32_t)},
            {(void **)&pl->hlist_in, BH * P},
            {(void **)&pl->list_heads, BHk * P * (int64_t)sizeof(uint16_t)},
            {(void **)&pl->sp_count, 2 * (int64_t)sizeof(unsigned long long)},
            {(void **)&pl->ubits, BHk * pl->cap_words * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->ulist, BHk * pl->cap_tokens * (int64_t)sizeof(int32_t)},
            {(void **)&pl->ucount, BHk * (int64_t)sizeof(int32_t)},
    };
    memcpy(b, t, sizeof t);
}

extern "C" void ekv_cuda_plan_free(ekv_cuda_plan *pl) {
    if (!pl) return;
    plan_buffer bufs[PLAN_BUFFERS];
    plan_buffers(pl, bufs);
    for (int i = 0; i < PLAN_BUFFERS; i++)
        if (*bufs[i].ptr) cudaFree(*bufs[i].ptr);
    if (pl->own_stream && pl->stream) cudaStreamDestroy(pl->stream);
    free(pl);
}

extern "C" int64_t ekv_cuda_plan_bytes(const ekv_cuda_plan *pl) { return pl ? pl->bytes : 0; }

/* The plan's static shapes, checked on the host before anything is allocated. */
static ekv_status check_plan_params(ekv_context *ctx, const ekv_cuda_plan_params *p) {
    if (p->max_batch < 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "max_batch=%d must be >= 1", p->max_batch);
    ekv_status st = ekv_check_heads(ctx, p->num_heads, p->num_kv_heads);
    if (!st) st = ekv_check_page_size(ctx, p->page_size);
    if (st) return st;
    if (p->num_heads / p->num_kv_heads > EKV_CUDA_MAX_GROUP)
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "GQA group %d > %d is not supported by the CUDA backend",
                        p->num_heads / p->num_kv_heads, (int)EKV_CUDA_MAX_GROUP);
    if (p->head_dim < 8 || p->head_dim % 8 || p->head_dim > EKV_CUDA_MAX_DIM)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "head_dim=%d must be a multiple of 8 in [8, %d] on the CUDA backend",
                        p->head_dim, (int)EKV_CUDA_MAX_DIM);
    if (p->max_pages_per_seq < 1 || p->max_pages_per_seq * p->page_size >= INT32_MAX)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_SIZE,
                "max_pages_per_seq=%lld must be >= 1 with max_pages_per_seq * page_size < 2^31 tokens",
                (long long)p->max_pages_per_seq);
    if (p->max_candidates < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "max_candidates=%lld must be >= 0 (0 = the default)",
                        (long long)p->max_candidates);
    if (p->tensor_cores != 0 && p->tensor_cores != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "tensor_cores=%d must be 0 or 1",
                        p->tensor_cores);
    return EKV_OK;
}

/* The scores kernel's splits per row for `batch` sequences of Hk KV heads. The kernel (2
 * blocks per SM) streams K best in one wave of long-lived blocks: ramping a block's pipeline
 * up and down costs more than the tail of a single wave (the softmax values and the screen
 * size their one wave at launch, ekv_cuda_one_wave). Never more splits than pages. */
static int64_t score_splits(int sms, int64_t batch, int64_t Hk, int64_t pages) {
    int64_t ns = 2 * (int64_t)sms / (batch * Hk);
    if (ns > pages) ns = pages;
    return ns < 1 ? 1 : ns;
}

/* The values kernels' splits per row over `rows` rows: about 2 blocks per SM, at most 64. */
static int32_t value_splits(int sms, int64_t rows) {
    const int64_t vs = (2 * (int64_t)sms + rows - 1) / rows;
    return (int32_t)(vs < 1 ? 1 : vs > 64 ? 64 : vs);
}

/* Computed at every launch from the step's batch (a graph captures the batch with its
 * arguments, so replays stay consistent); the score splits are capped by split_cap, the
 * pitch of the per-row split buffers sized at the plan's max_batch. */
ekv_step_splits ekv_cuda_step_splits(const ekv_cuda_plan *pl, int batch) {
    const int64_t H = pl->p.num_heads, Hk = pl->p.num_kv_heads;
    int64_t ns = score_splits(pl->sms, batch, Hk, pl->cap_pages);
    if (ns > pl->split_cap) ns = pl->split_cap;
    ekv_step_splits s;
    s.scores = (int32_t)ns;
    s.values = value_splits(pl->sms, batch * H);
    s.unions = value_splits(pl->sms, batch * Hk);
    return s;
}

/* Buffer capacities from the plan's shapes and the device's SM count. */
static void plan_geometry(ekv_cuda_plan *pl, int sms) {
    const ekv_cuda_plan_params *p = &pl->p;
    const int64_t B = p->max_batch, Hk = p->num_kv_heads;
    const int64_t ns = score_splits(sms, B, Hk, p->max_pages_per_seq);
    /* ragged batches (ekv_seq_splits): a row takes at most the splits that fill the GPU with
     * its KV heads alone, and never more than T = ns B or the pages */
    int64_t cap = 2 * (int64_t)sms / Hk;
    if (cap < ns) cap = ns;
    if (cap > ns * B) cap = ns * B;
    if (cap > p->max_pages_per_seq) cap = p->max_pages_per_seq;
    pl->split_cap = (int32_t)cap;
    pl->sms = sms;
    pl->cap_pages = p->max_pages_per_seq;
    pl->cap_tokens = pl->cap_pages * p->page_size;
    pl->cand_cap = p->max_candidates > 0 ? p->max_candidates : (int64_t)EKV_CUDA_CAND_CAP;
    if (pl->cand_cap > pl->cap_tokens) pl->cand_cap = pl->cap_tokens;
    /* the screen's candidates (u > max l - 1, docs/math.md §10.3 Claim 3): max_candidates when
     * given, else a quarter of the tokens per query head (at least the default list); a head
     * with more is retried against a higher threshold (docs/architecture.md, CUDA screened) */
    pl->scap = pl->cap_tokens / 4 > pl->cand_cap ? pl->cap_tokens / 4 : pl->cand_cap;
    if (p->max_candidates > 0) pl->scap = pl->cand_cap;
    pl->cap_words = (pl->cap_tokens + 31) / 32;
}

extern "C" ekv_status ekv_cuda_plan_create(ekv_context *ctx, const ekv_cuda_plan_params *p,
                                           ekv_cuda_plan **out) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!p || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params and out must not be NULL");
    *out = NULL;
    ekv_status st = check_plan_params(ctx, p);
    if (st) return st;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "no CUDA device is available");
    }
    if (p->device < 0 || p->device >= ndev)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "device=%d: only %d CUDA device(s)",
                        p->device, ndev);
    ekv_cuda_plan *pl = (ekv_cuda_plan *)calloc(1, sizeof *pl);
    if (!pl) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    pl->ctx = ctx;
    pl->p = *p;
    cudaError_t e = cudaSetDevice(p->device);
    if (e != cudaSuccess) {
        free(pl);
        return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaSetDevice: %s", cudaGetErrorString(e));
    }
    if (p->stream)
        pl->stream = (cudaStream_t)p->stream;
    else {
        /* a blocking stream: ordered after the caller's work on the legacy default stream
         * (cudaMemcpy, cudaMemset, torch's default stream), whose pageable copies may still be
         * in flight when cudaMemcpy returns; a non-blocking one raced them */
        e = cudaStreamCreate(&pl->stream);
        if (e != cudaSuccess) {
            free(pl);
            return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaStreamCreate: %s", cudaGetErrorString(e));
        }
        pl->own_stream = 1;
    }
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p->device);
    plan_geometry(pl, sms);
    const int64_t B = p->max_batch, H = p->num_heads, Hk = p->num_kv_heads;
    plan_buffer want[PLAN_BUFFERS];
    plan_buffers(pl, want);
    for (int i = 0; i < PLAN_BUFFERS; i++) {
        e = cudaMalloc(want[i].ptr, (size_t)want[i].bytes);
        if (e != cudaSuccess) {
            ekv_cuda_plan_free(pl);
            return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "cudaMalloc(%lld bytes) for the plan: %s",
                            (long long)want[i].bytes, cudaGetErrorString(e));
        }
        pl->bytes += want[i].bytes;
    }
    /* on the plan's stream, then waited for: a caller's non-blocking stream (torch's side
     * streams) is not ordered after the legacy stream a plain cudaMemset uses, so the first
     * step could read the buffers before they are zero */
    e = cudaMemsetAsync(pl->flags, 0, (size_t)(B * H) * sizeof(int32_t), pl->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(pl->list_count, 0, (size_t)(B * Hk * 2) * sizeof(int32_t), pl->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(pl->sbits, 0, (size_t)(B * Hk * pl->cap_words) * sizeof(uint32_t),
                            pl->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(pl->ubits, 0, (size_t)(B * Hk * pl->cap_words) * sizeof(uint32_t),
                            pl->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(pl->row_count, 0, (size_t)(B * Hk) * sizeof(int32_t), pl->stream);
    if (e == cudaSuccess) /* the candidates' histograms and done counts (stages/tau.cu) */
        e = cudaMemsetAsync(pl->cand_hist, 0,
                            (size_t)(B * H * EKV_CUDA_TAU_HIST_BINS) * sizeof(uint32_t), pl->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(pl->cand_done, 0, (size_t)(B * H) * sizeof(uint32_t), pl->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(pl->stream);
    if (e != cudaSuccess) {
        ekv_cuda_plan_free(pl);
        return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaMemset: %s", cudaGetErrorString(e));
    }
    *out = pl;
    return EKV_OK;
}

/* Host-side checks from static shapes only (no device reads: graph capture stays possible). */
static ekv_status check_step(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                             const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                             const float *out) {
    ekv_context *ctx = pl->ctx;
    if (!prm || !kv || !t || !q || !out || !kv->k || !kv->v || !t->indptr || !t->indices ||
        !t->last_page_len)
        return ekv_fail(
                ctx, EKV_ERR_NULL_POINTER,
                "params, kv (k, v), table (indptr, indices, last_page_len), q and out must not be NULL");
    if (prm->num_heads != pl->p.num_heads || kv->num_kv_heads != pl->p.num_kv_heads ||
        kv->head_dim != pl->p.head_dim || kv->page_size != pl->p.page_size)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_ARGUMENT,
                "step shape (heads %d, kv heads %d, dim %d, page %d) differs from the plan's (%d, %d, %d, %d)",
                prm->num_heads, kv->num_kv_heads, kv->head_dim, kv->page_size, pl->p.num_heads,
                pl->p.num_kv_heads, pl->p.head_dim, pl->p.page_size);
    if (t->batch < 1 || t->batch > pl->p.max_batch)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "batch=%d must be in [1, max_batch=%d]",
                        t->batch, pl->p.max_batch);
    if (!ekv_dtype_valid(kv->dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE, "unknown K/V dtype %d", (int)kv->dtype);
    if (kv->stride_token % 8 || kv->stride_head % 8 || kv->stride_page % 8)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "K/V strides must be multiples of 8 elements (16-byte loads)");
    if (((uintptr_t)kv->k | (uintptr_t)kv->v) % 16)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "K and V must be 16-byte aligned");
    return ekv_check_kv_view(ctx, kv); /* the CPU's rules: offsets fit int64 */
}

/* Certified round 0 (docs/math.md §9.6, as src/cpu/methods/certified.c): tau over the last
 * recent_pages + 1 pages (4 without recent pages) is a lower bound of tau*, so the bound stage
 * can skip the summaries of every superpage already below it. 4 launches: the list (top-k with
 * no budget, only the recent pages), scores, tau. */
static ekv_status launch_round0(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_table *t, const float *q, int B) {
    const int32_t recent = sel->recent_pages > 0 ? sel->recent_pages : 3; /* + the last page */
    ekv_status s = ekv_cuda_launch_topk(pl, t, B, 0, 0.0, 0, recent, NULL, 0);
    if (!s) s = ekv_cuda_launch_scores(pl, prm, kv, t, q, B, 1, 1, 0);
    if (!s) s = ekv_cuda_launch_tau(pl, prm, kv, t, B, 1, 1, NULL);
    return s;
}

/* Whether a step's lists are per query head (topk, gaussian, certified's round 1): each
 * head's own list, then their union per KV head; certified lets every head attend the union
 * (its output is dense entmax whatever the lists), the lossy methods mask each head to its own
 * pages. */
static int per_head_lists(const ekv_select_params *sel, unsigned stages) {
    return (stages & EKV_STAGES_LIST) && sel && sel->per_query_head;
}

ekv_status ekv_cuda_step_begin(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               const float *out) {
    ekv_status s = check_step(pl, prm, kv, t, q, out);
    if (s) return s;
    const ekv_method_info *mi = ekv_method_info_of(ekv_step_method(sel));
    const unsigned stg = mi->stages;
    const int certified = (stg & EKV_STAGE_ROUND2) != 0;
    const int with_ball = certified || (sel && sel->use_ball);
    s = ekv_check_stats(pl->ctx, mi, with_ball, kv, st);
    if (s) return s;
    pl->launches = 0;
    pl->last_batch = t->batch;
    pl->last_screened = (stg & EKV_STAGE_SCREEN) != 0;
    pl->last_one_pass = 0;
    pl->last_masked = per_head_lists(sel, stg) && !certified;
    pl->last_sp_counted = 0;
    return EKV_OK;
}

ekv_status ekv_cuda_step_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_table *t, const float *q, float *out) {
    const unsigned stg = ekv_method_info_of(ekv_step_method(sel))->stages;
    const int listed = (stg & EKV_STAGES_LIST) != 0, certified = (stg & EKV_STAGE_ROUND2) != 0;
    const int B = t->batch;
    ekv_status s;
    if (per_head_lists(sel, stg) && (s = ekv_cuda_launch_union(pl, t, B))) return s;
    const int masked = pl->last_masked;
    if (prm->alpha == 1.0 && !certified && !masked &&
        ekv_cuda_softmax_one_pass_applies(pl, kv->dtype)) {
        pl->last_one_pass = 1; /* docs/math.md §3.9 */
        return ekv_cuda_launch_softmax_one_pass(pl, prm, kv, t, q, B, listed, out);
    }
    if ((s = ekv_cuda_launch_scores(pl, prm, kv, t, q, B, listed, 1, masked))) return s;
    if ((s = ekv_cuda_launch_tau(pl, prm, kv, t, B, listed, 1, certified ? NULL : out))) return s;
    if (certified) { /* round 2 on the kept scores (docs/math.md §9.3) */
        if ((s = ekv_cuda_launch_round2(pl, t, B))) return s;
        if ((s = ekv_cuda_launch_scores(pl, prm, kv, t, q, B, 1, 2, 0))) return s;
        if ((s = ekv_cuda_launch_tau(pl, prm, kv, t, B, 1, 2, out))) return s;
    }
    if (pl->skip_values) return EKV_OK; /* a shard: values at the agreed tau (sharded.cu) */
    return ekv_cuda_launch_values(pl, prm, kv, t, B, listed, out);
}

/* The launches of one step, in the order the method table's stages give them. */
static ekv_status run_step(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                           const ekv_select_params *sel, const ekv_paged_kv *kv,
                           const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                           float *out) {
    ekv_status s = ekv_cuda_step_begin(pl, prm, sel, kv, st, t, q, out);
    if (s) return s;
    const unsigned stg = ekv_method_info_of(ekv_step_method(sel))->stages;
    const int certified = (stg & EKV_STAGE_ROUND2) != 0;
    const int with_ball = certified || (sel && sel->use_ball);
    const int B = t->batch, per_head = per_head_lists(sel, stg);
    if (stg & EKV_STAGE_SCREEN) /* token rows, not page lists: its own launches (screen.cu) */
        return ekv_cuda_launch_screened(pl, prm, kv, st, t, q, B, out);
    if ((stg & EKV_STAGE_GAUSS) &&
        (s = ekv_cuda_launch_gaussian(pl, prm, sel, kv, st, t, q, B, per_head)))
        return s;
    const double *tau_lb = sel ? sel->tau_lb : NULL;
    if (certified && !tau_lb && st->smin && st->superpage_pages > 0) {
        if ((s = launch_round0(pl, prm, sel, kv, t, q, B))) return s;
        tau_lb = pl->tau; /* read by the bound stage before round 1 writes tau again */
    }
    if ((stg & EKV_STAGE_BOUND) &&
        (s = ekv_cuda_launch_bound(pl, prm, kv, st, t, q, with_ball, tau_lb, B)))
        return s;
    if ((stg & EKV_STAGE_TOPK) &&
        (s = ekv_cuda_launch_topk(pl, t, B, sel->budget_tokens, sel->budget_fraction,
                                  certified ? sel->sink_pages : 0,
                                  certified ? sel->recent_pages : 0,
                                  certified ? sel->tau_hint : NULL, per_head)))
        return s;
    return ekv_cuda_step_attend(pl, prm, sel, kv, t, q, out);
}

extern "C" ekv_status ekv_cuda_decode(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                      const ekv_select_params *sel, const ekv_paged_kv *kv,
                                      const ekv_page_stats *st, const ekv_page_table *t,
                                      const float *q, float *out) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    ekv_status s = ekv_decode_supported(pl->ctx, EKV_BACKEND_CUDA, prm, sel);
    if (!s) s = run_step(pl, prm, sel, kv, st, t, q, out);
    if (!s) ekv_clear_error(pl->ctx);
    return s;
}

extern "C" ekv_status ekv_cuda_decode_certified(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                                const ekv_select_params *sel,
                                                const ekv_paged_kv *kv, const ekv_page_stats *st,
                                                const ekv_page_table *t, const float *q,
                                                float *out) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    if (!sel) return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "select params must not be NULL");
    ekv_select_params cs = *sel;
    cs.method = EKV_SELECT_CERTIFIED;
    return ekv_cuda_decode(pl, prm, &cs, kv, st, t, q, out);
}

/* The report's head masks: the device's when the last step masked heads to their own lists,
 * else every head of the group. */
static ekv_status read_list_heads(ekv_cuda_plan *pl, int64_t nl, uint16_t *heads) {
    if (!heads) return EKV_OK;
    const int64_t n = nl * pl->cap_pages;
    if (pl->last_masked) {
        EKV_CUDA_TRY(pl, cudaMemcpy(heads, pl->list_heads, (size_t)n * sizeof(uint16_t),
                                    cudaMemcpyDeviceToHost));
        return EKV_OK;
    }
    const uint16_t all = (uint16_t)((1u << (pl->p.num_heads / pl->p.num_kv_heads)) - 1u);
    for (int64_t i = 0; i < n; i++) heads[i] = all;
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_read_report(ekv_cuda_plan *pl, int32_t batch, ekv_cuda_report *r) {
    const ekv_status cs = ekv_cuda_check_readout(pl, r, "report", batch);
    if (cs) return cs;
    EKV_CUDA_TRY(pl, cudaStreamSynchronize(pl->stream));
    const int64_t nh = (int64_t)batch * pl->p.num_heads, nl = (int64_t)batch * pl->p.num_kv_heads;
    if (r->tau)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->tau, pl->tau, (size_t)nh * sizeof(double),
                                    cudaMemcpyDeviceToHost));
    if (r->support)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->support, pl->support, (size_t)nh * sizeof(int64_t),
                                    cudaMemcpyDeviceToHost));
    if (r->v_rows)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->v_rows, pl->v_rows, (size_t)nl * sizeof(int64_t),
                                    cudaMemcpyDeviceToHost));
    int32_t *cnt = (int32_t *)malloc((size_t)nl * 2 * sizeof(int32_t));
    if (!cnt) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    cudaError_t e = cudaMemcpy(cnt, pl->list_count, (size_t)nl * 2 * sizeof(int32_t),
                               cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        free(cnt);
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
    }
    if (r->list_pages) {
        e = cudaMemcpy(r->list_pages, pl->list_pages,
                       (size_t)(nl * pl->cap_pages) * sizeof(int32_t), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
        }
    }
    r->slow_rows = 0;
    r->compacted_rows = 0;
    {
        int32_t *fl = (int32_t *)malloc((size_t)nh * sizeof(int32_t));
        if (!fl) {
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
        }
        e = cudaMemcpy(fl, pl->flags, (size_t)nh * sizeof(int32_t), cudaMemcpyDeviceToHost);
        /* on the plan's stream: the next step's kernels (which may set flags) come after it */
        if (e == cudaSuccess)
            e = cudaMemsetAsync(pl->flags, 0, (size_t)nh * sizeof(int32_t), pl->stream);
        if (e != cudaSuccess) {
            free(fl);
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
        }
        for (int64_t i = 0; i < nh; i++) {
            r->slow_rows += (fl[i] & EKV_TAU_FLAG_WHOLE_ROW) != 0;
            r->compacted_rows += (fl[i] & EKV_TAU_FLAG_COMPACTED) != 0;
        }
        free(fl);
    }
    r->lists_round2 = 0;
    for (int64_t l = 0; l < nl; l++) {
        if (r->pages_round1) r->pages_round1[l] = cnt[2 * l];
        if (r->pages_round2) r->pages_round2[l] = cnt[2 * l + 1] - cnt[2 * l];
        r->lists_round2 += cnt[2 * l + 1] > cnt[2 * l];
    }
    free(cnt);
    r->survivors = 0;
    if (pl->last_screened) {
        int64_t *sv = (int64_t *)malloc((size_t)nl * sizeof(int64_t));
        if (!sv) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
        e = cudaMemcpy(sv, pl->survivors, (size_t)nl * sizeof(int64_t), cudaMemcpyDeviceToHost);
        for (int64_t l = 0; e == cudaSuccess && l < nl; l++) r->survivors += sv[l];
        free(sv);
        if (e != cudaSuccess)
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
    }
    r->launches = pl->launches;
    r->softmax_one_pass = pl->last_one_pass;
    r->score_splits = pl->last_score_splits;
    r->superpage_skipped = r->superpage_boxes = 0;
    if (pl->last_sp_counted) {
        unsigned long long sc[2];
        EKV_CUDA_TRY(pl, cudaMemcpy(sc, pl->sp_count, sizeof sc, cudaMemcpyDeviceToHost));
        r->superpage_skipped = (int64_t)sc[0];
        r->superpage_boxes = (int64_t)sc[1];
    }
    return read_list_heads(pl, nl, r->list_heads);
}
