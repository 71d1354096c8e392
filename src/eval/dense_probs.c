/*
 * Evaluation helpers outside the decode path: the dense reference distribution
 * (ekv_dense_probs) and the certified bound on a budgeted step's dropped mass
 * (ekv_delta_bound, docs/math.md §9.4).
 */
#include "../core/method.h"
#include "../cpu/stages/attend.h"
#include "../math/entmax_tau.h"

ekv_status ekv_dense_probs(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                           const ekv_page_table *tab, const float *q, int64_t stride, float *p,
                           double *tau) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!q || !p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !q ? "q" : "p");
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, NULL);
    if (!st) st = ekv_validate_step(ctx, prm, kv, tab, q);
    if (st) return st;
    /* list NULL: every page of every sequence, one list per query head */
    const ekv_lists_args a = {.mode = EKV_LISTS_PROBS, .probs = p, .pstride = stride, .tau = tau};
    EKV_GUARDED(ctx, st, ekv_cpu_attend_lists(ctx, prm, kv, tab, q, &a));
    if (!st) ekv_clear_error(ctx);
    return st;
}

/* The pages of list l marked in in[0..P) (cleared first). */
static void mark_list(const ekv_page_list *list, int64_t li, uint8_t *in, int64_t P) {
    memset(in, 0, (size_t)P);
    for (int64_t i = list->indptr[li]; i < list->indptr[li + 1]; i++) in[list->pages[i]] = 1;
}

static ekv_status validate_delta(ekv_context *ctx, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_table *tab,
                                 const ekv_page_list *list, const double *tau,
                                 const double *delta_bar) {
    if (!prm || !kv || !tab || !list || !tau || !delta_bar)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "params, kv, table, list, tau and delta_bar must not be NULL");
    if (!list->bounds)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "list->bounds is NULL (ask ekv_select_pages for them)");
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, NULL);
    if (!st) st = ekv_validate_step(ctx, prm, kv, tab, NULL);
    if (st) return st;
    if (!(prm->alpha > 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA, "delta_bar needs entmax (alpha > 1)");
    st = ekv_validate_list(ctx, tab, list, prm->num_heads, kv->num_kv_heads);
    if (st) return st;
    for (int64_t b = 0; b < tab->batch; b++)
        if (ekv_seq_pages(tab->indptr, b) - 1 > list->bounds_stride)
            return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                            "list->bounds_stride=%lld is below sequence %lld's %lld scored pages",
                            (long long)list->bounds_stride, (long long)b,
                            (long long)(ekv_seq_pages(tab->indptr, b) - 1));
    return EKV_OK;
}

/* delta_bar per query head (docs/math.md §9.4), arguments validated. */
static ekv_status delta_run(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                            const ekv_page_table *tab, const ekv_page_list *list, const double *tau,
                            double *delta_bar) {
    ekv_status st;
    const int64_t H = prm->num_heads, G = H / kv->num_kv_heads, ps = kv->page_size;
    int64_t maxP = ekv_table_max_pages(tab->indptr, tab->batch), off;
    uint8_t *in = (uint8_t *)ekv_workspace_blocks(ctx, &maxP, 1, &off, "delta bound", &st);
    if (!in) return st;
    for (int64_t b = 0; b < tab->batch; b++) {
        const int64_t P = ekv_seq_pages(tab->indptr, b);
        for (int64_t h = 0; h < H; h++) {
            const int64_t l = list->heads == H ? h : h / G;
            if (list->heads == H || h % G == 0) mark_list(list, b * list->heads + l, in, P);
            const float *u = list->bounds + (b * H + h) * list->bounds_stride;
            const double t = tau[b * H + h];
            double s = 0;
            for (int64_t p = 0; p + 1 < P; p++) {
                const double d = (double)u[p] - t;
                if (!in[p] && d > 0) s += (double)ps * ekv_entmax_pow(d, prm->alpha);
            }
            delta_bar[b * H + h] = s;
        }
    }
    return EKV_OK;
}

ekv_status ekv_delta_bound(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                           const ekv_page_table *tab, const ekv_page_list *list, const double *tau,
                           double *delta_bar) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status st = validate_delta(ctx, prm, kv, tab, list, tau, delta_bar);
    EKV_GUARDED(ctx, st, delta_run(ctx, prm, kv, tab, list, tau, delta_bar));
    if (!st) ekv_clear_error(ctx);
    return st;
}
