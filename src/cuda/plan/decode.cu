/*
 * The CUDA decode step (mirrors src/cpu/methods/decode.c): validation on the host from static
 * shapes only (ekv_decode_supported, the check every backend runs, then the plan's shapes), and
 * the launches of the stages the method table (src/core/method.c) lists for the select method:
 *   dense:     scores -> tau -> values                                   (5 launches;
 *              2 where the fused attend applies: scores -> fused, stages/attend_fused.cu)
 *   topk:      bound -> topk -> scores -> tau -> values                  (7 launches)
 *   gaussian:  moments -> stats -> rule -> scores -> tau -> values       (8 launches)
 *   certified: bound -> topk -> scores -> tau bound -> round2 -> scores -> tau -> values
 *              (11; a tau bound is 2 launches, the histogram bound of tau the round gives,
 *              docs/math.md §9.3 "On the GPU"); with superpage boxes, round 0 (a lower bound
 *              of tau from the recent tokens, stages/round0.cu) -> bound, which also lists
 *              every page round 0's bound cannot rule out -> scores -> tau -> values (7), no
 *              round 2
 *   screened:  screen -> tau(l) -> mark -> rows -> row scores -> tau -> values
 *              (12 kernels and a memset, 14 with the retry of lists shorter than the
 *              tokens; screen/screen.cuh)
 * (per_query_head lists: one more, the union of the heads' lists after the select), where
 * tau is three launches for entmax (candidates, the refine pass of a long list, which also
 * hands each row's max and bound to the solve, then the solve; stages/tau.cu) and one for
 * softmax;
 * softmax on tensor cores replaces scores -> tau -> values by one pass over K and V and the
 * merge of its splits (2 launches, stages/softmax_mma.cu).
 * Nothing here reads device memory or synchronises, so a step can be captured in a graph.
 */
#include "step.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../screen/screen.cuh"
#include "../select/gaussian.cuh"
#include "../select/select.cuh"
#include "../stages/attend_fused.cuh"
#include "../stages/bound.cuh"
#include "../stages/round0.cuh"
#include "../stages/scores.cuh"
#include "../stages/softmax.cuh"
#include "../stages/tau.cuh"
#include "../stages/values.cuh"
extern "C" {
#include "../../core/method.h" /* the method table and the checks every backend shares (C) */
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

/* ekv_cuda_step_attend; round2: certified's round 2 follows round 1 (not when round 1 already
 * holds every page round 0's bound cannot rule out, run_step). */
static ekv_status attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                         const ekv_select_params *sel, const ekv_paged_kv *kv,
                         const ekv_page_table *t, const float *q, float *out, int round2) {
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
    if (!listed && ekv_cuda_fused_attend_applies(pl, prm, kv->dtype, B))
        return ekv_cuda_launch_fused_attend(pl, prm, kv, t, B, out);
    if (round2) { /* round 1's bound of tau, round 2 on the kept scores (docs/math.md §9.3) */
        if ((s = ekv_cuda_launch_tau_bound(pl, prm, t, B))) return s;
        if ((s = ekv_cuda_launch_round2(pl, t, B))) return s;
        if ((s = ekv_cuda_launch_scores(pl, prm, kv, t, q, B, 1, 2, 0))) return s;
        if ((s = ekv_cuda_launch_tau(pl, prm, kv, t, B, 1, 2, out))) return s;
    } else if ((s = ekv_cuda_launch_tau(pl, prm, kv, t, B, listed, 1, out)))
        return s;
    return ekv_cuda_launch_values(pl, prm, kv, t, B, listed, out); /* none on a shard */
}

ekv_status ekv_cuda_step_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_table *t, const float *q, float *out) {
    const unsigned stg = ekv_method_info_of(ekv_step_method(sel))->stages;
    return attend(pl, prm, sel, kv, t, q, out, (stg & EKV_STAGE_ROUND2) != 0);
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
    const double *tau_lb = sel ? sel->tau_lb : NULL, *hint = certified ? sel->tau_hint : NULL;
    int round2 = certified;
    const ekv_select_params *hinted = NULL; /* the bound stage lists round 1 */
    if (certified && !tau_lb && st->smin && st->superpage_pages > 0) {
        /* round 0 (docs/math.md §9.3, "Round 0 on the GPU"): tau over its last pages bounds
         * tau*, for the bound stage's superpage skip; without a caller's hint, round 1 is every
         * page it cannot rule out, listed by the bound stage, and there is no round 2 ("Round 1
         * from round 0's bound") */
        const int recent = (int)(ekv_round0_pages(sel) - 1);
        hinted = !hint && !per_head ? sel : NULL;
        if ((s = ekv_cuda_launch_round0(pl, prm, kv, t, q, B, recent, hinted != NULL))) return s;
        tau_lb = pl->round0_tau;
        if (!hint) {
            hint = pl->round0_tau;
            round2 = 0;
        }
    }
    if ((stg & EKV_STAGE_BOUND) &&
        (s = ekv_cuda_launch_bound(pl, prm, kv, st, t, q, with_ball, tau_lb, hinted, B)))
        return s;
    if ((stg & EKV_STAGE_TOPK) && !hinted &&
        (s = ekv_cuda_launch_topk(pl, t, B, sel->budget_tokens, sel->budget_fraction,
                                  certified ? sel->sink_pages : 0,
                                  certified ? sel->recent_pages : 0, hint, per_head)))
        return s;
    return attend(pl, prm, sel, kv, t, q, out, round2);
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
