/*
 * ekv_decode, the CPU backend's one decode entry point (docs/architecture.md, "Methods and
 * the stage table"): validate once, then run the stages the method table lists for the
 * select method. Page lists live in the context's step arena; each stage takes its scratch
 * from the workspace.
 */
#include "../../core/method.h"
#include "../select/select.h"
#include "../stages/attend.h"
#include "methods.h"

/* A page list for the list methods, in the step arena (methods.h). */
ekv_status ekv_cpu_step_list(ekv_context *ctx, const ekv_decode_params *prm,
                             const ekv_select_params *sel, const ekv_paged_kv *kv,
                             const ekv_page_table *t, ekv_page_list *list) {
    const int64_t heads = sel->per_query_head ? prm->num_heads : kv->num_kv_heads;
    const int64_t cap = ekv_page_list_capacity(t, (int32_t)heads);
    if (cap < 0) return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "page list size overflows");
    const int64_t sz[2] = {(t->batch * heads + 1) * 8, cap * 4};
    int64_t off[2];
    ekv_status s;
    char *m = ekv_step_blocks(ctx, sz, 2, off, "page lists", &s);
    if (!m) return s;
    *list = (ekv_page_list){
            .indptr = (int64_t *)(m + off[0]), .pages = (int32_t *)(m + off[1]), .capacity = cap};
    return EKV_OK;
}

/* Selection then attention over the lists (topk, gaussian, oracle). */
static ekv_status run_listed(ekv_context *ctx, const ekv_decode_params *prm,
                             const ekv_select_params *sel, const ekv_paged_kv *kv,
                             const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                             float *out, ekv_decode_info *info) {
    ekv_page_list list;
    ekv_status s = ekv_cpu_step_list(ctx, prm, sel, kv, t, &list);
    if (!s) s = ekv_validate_select(ctx, prm, sel, kv, st, t, &list);
    if (!s) s = ekv_cpu_select_run(ctx, prm, sel, kv, st, t, q, &list);
    if (s) return s;
    const ekv_lists_args a = {.mode = EKV_LISTS_OUTPUT, .list = &list, .out = out, .info = info};
    s = ekv_cpu_attend_lists(ctx, prm, kv, t, q, &a);
    if (!s && info) {
        info->bytes_summary = list.bytes_summary;
        info->survivors = list.survivors;
    }
    return s;
}

static ekv_status run_certified(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                float *out, ekv_decode_info *info) {
    ekv_certified_info ci = {info ? info->pages_round1 : NULL, info ? info->pages_round2 : NULL, 0,
                             0, 0};
    ekv_status s = ekv_check_stats(ctx, ekv_method_info_of(sel->method), 1, kv, st);
    return s ? s : ekv_cpu_certified_run(ctx, prm, sel, kv, st, t, q, out, info, &ci);
}

/* The stages of the step's method, as the method table lists them. */
static ekv_status run_method(ekv_context *ctx, const ekv_decode_params *prm,
                             const ekv_select_params *sel, const ekv_paged_kv *kv,
                             const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                             float *out, ekv_decode_info *info) {
    const unsigned stages = ekv_method_info_of(ekv_step_method(sel))->stages;
    if (info) info->bytes_summary = info->lists_round2 = info->survivors = info->pages_touched = 0;
    if (stages & EKV_STAGE_ROUND2) return run_certified(ctx, prm, sel, kv, st, t, q, out, info);
    if (stages & EKV_STAGE_SCREEN)
        return ekv_cpu_screened_run(ctx, prm, sel, kv, st, t, q, out, info);
    if (stages & EKV_STAGES_LIST) return run_listed(ctx, prm, sel, kv, st, t, q, out, info);
    return ekv_cpu_dense_run(ctx, prm, kv, t, q, out, info);
}

ekv_status ekv_decode(ekv_context *ctx, const ekv_decode_params *prm, const ekv_select_params *sel,
                      const ekv_paged_kv *kv, const ekv_page_stats *st, const ekv_page_table *t,
                      const float *q, float *out, ekv_decode_info *info) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status s = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, sel);
    if (!s) s = ekv_validate_decode(ctx, prm, kv, t, q, out);
    if (s) return s;
    EKV_GUARDED(ctx, s, run_method(ctx, prm, sel, kv, st, t, q, out, info));
    if (!s) ekv_clear_error(ctx);
    return s;
}
