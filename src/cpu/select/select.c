/*
 * bound + select (docs/math.md §2): the Quest box bound of every page, then a page list per KV head
 * (or per query head) for the chosen policy. A policy only writes page numbers; it never
 * touches K or V. The last page of a sequence is always listed, last.
 *
 * The bound is in z-space, consistent with the attention scores (docs/math.md §6.1 item 7 fixed):
 *   U_p = a*scale*sum_d max(q_d kmin_pd, q_d kmax_pd) + a*m_h*(last token of p - (N-1)),
 * an upper bound on z_j = a*(scale*<q,k_j> + m_h (j - (N-1))) for every token j of page p
 * (m_h >= 0; a = alpha - 1, or 1 for softmax). With GQA the per-KV-head ranking uses the
 * max of U over the group's query heads.
 */
#include "../../core/method.h"
#include "select.h"
#include "../stages/bound.h"
#include "gaussian_select.h"
#include <stdlib.h>

ekv_select_params ekv_select_default_params(void) {
    ekv_select_params p;
    p.method = EKV_SELECT_TOPK;
    p.budget_tokens = 2048;
    p.budget_fraction = 0.0;
    p.per_query_head = 0;
    p.margin_z = 0.0;
    p.max_quantile = 0.995;
    p.auto_margin = 0;
    p.reference_m3 = 0;
    p.excess_fraction = 0.2;
    p.clamp_tau = 1;
    p.clamp_quantile = 0.5;
    p.tau_mode = EKV_TAU_EXACT;
    p.correction_iters = -1;
    p.use_ball = 0;
    p.sink_pages = 0;
    p.recent_pages = 0;
    p.tau_hint = NULL;
    p.tau_lb = NULL;
    return p;
}

int64_t ekv_page_list_capacity(const ekv_page_table *t, int32_t heads) {
    if (!t || !t->indptr || t->batch <= 0 || heads <= 0) return -1;
    int64_t total = t->indptr[t->batch], out;
    if (ekv_mul_i64(total, heads, &out)) return -1;
    return out;
}

typedef struct {
    float u;
    int32_t p;
} scored_page;

/* a before b: larger bound first, then the lower page number (deterministic ties; the sharded
 * top-k, src/math/shard_select.h, resolves ties by the same rule). */
static int before(scored_page a, scored_page b) { return a.u > b.u || (a.u == b.u && a.p < b.p); }

static int cmp_scored(const void *x, const void *y) {
    scored_page a = *(const scored_page *)x, b = *(const scored_page *)y;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* Moves the k best (by `before`) to the front of v[0..n) in O(n) expected (quickselect). */
static void select_best(scored_page *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    while (lo < hi) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        scored_page pivot = v[lo + (int64_t)((seed >> 33) % (uint64_t)(hi - lo + 1))];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(v[i], pivot)) i++;
            while (before(pivot, v[j])) j--;
            if (i <= j) {
                scored_page t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
}

typedef struct {
    const ekv_select_params *sel;
    const ekv_page_table *t;
    ekv_page_list *list;
    const float *u; /* [B][H][ustride] */
    int64_t ustride, H, G, heads, ps;
    float *w_ug;          /* per worker [ustride] */
    scored_page *w_pairs; /* per worker [ustride] */
} topk_job;

/* One list: the group's bounds (max over its query heads), the n best pages in descending
 * order, then the last page. Its slots in the CSR were reserved by the caller. */
static void topk_list(void *vp, int64_t task, int worker) {
    topk_job *j = vp;
    const int64_t b = task / j->heads, l = task % j->heads;
    const int64_t P = ekv_seq_pages(j->t->indptr, b);
    const int64_t h0 = ekv_list_head0(l, j->heads, j->H, j->G),
                  hn = ekv_list_nheads(j->heads, j->H, j->G);
    float *ug = j->w_ug + worker * j->ustride;
    scored_page *pairs = j->w_pairs + worker * j->ustride;
    for (int64_t p = 0; p + 1 < P; p++)
        ug[p] = ekv_cpu_list_bound(j->u, j->ustride, b, j->H, h0, hn, p);
    const int64_t w0 = j->list->indptr[task], nsel = j->list->indptr[task + 1] - w0 - 1;
    for (int64_t p = 0; p + 1 < P; p++) pairs[p] = (scored_page){ug[p], (int32_t)p};
    if (nsel > 0 && nsel < P - 1) select_best(pairs, P - 1, nsel);
    qsort(pairs, (size_t)nsel, sizeof *pairs, cmp_scored);
    for (int64_t i = 0; i < nsel; i++) j->list->pages[w0 + i] = pairs[i].p;
    j->list->pages[w0 + nsel] = (int32_t)(P - 1);
}

ekv_status ekv_validate_select(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t,
                               const ekv_page_list *list) {
    const ekv_method_info *mi = ekv_method_info_of(sel->method);
    if (!list->indptr || !list->pages)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "list->indptr/pages is NULL");
    const int with_ball = (mi->stages & EKV_STAGE_BOUND) && (sel->use_ball || list->bounds);
    ekv_status s = ekv_check_stats(ctx, mi, with_ball, kv, st);
    if (s) return s;
    const int64_t cap =
            ekv_page_list_capacity(t, sel->per_query_head ? prm->num_heads : kv->num_kv_heads);
    if (list->capacity < cap)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "list capacity %lld < %lld (ekv_page_list_capacity)",
                        (long long)list->capacity, (long long)cap);
    const int64_t maxP = ekv_table_max_pages(t->indptr, t->batch);
    if (list->bounds && list->bounds_stride < maxP)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "list->bounds_stride=%lld is below the most pages (%lld)",
                        (long long)list->bounds_stride, (long long)maxP);
    if ((mi->stages & EKV_STAGE_GAUSS) && sel->tau_mode != EKV_TAU_EXACT && !list->tau)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "list->tau must hold batch*num_heads values for the %s mode",
                        sel->tau_mode == EKV_TAU_FIXED ? "fixed" : "corrected");
    return EKV_OK;
}

/* Dense lists: every page, in order. */
static void select_dense(const ekv_page_table *t, int64_t heads, ekv_page_list *list) {
    int64_t w = 0;
    list->indptr[0] = 0;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t l = 0; l < heads; l++) {
            for (int64_t p = 0; p < ekv_seq_pages(t->indptr, b); p++) list->pages[w++] = (int32_t)p;
            list->indptr[b * heads + l + 1] = w;
        }
    list->bytes_summary = 0;
}

/* Top-k: bound every page, reserve each list's slots (budget / page size scored pages, at
 * least one, at most all but the last), then select per list in parallel. */
static ekv_status select_topk(ekv_context *ctx, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                              ekv_page_list *list) {
    const int64_t B = t->batch, H = prm->num_heads, G = H / kv->num_kv_heads, ps = kv->page_size;
    const int64_t heads = sel->per_query_head ? H : kv->num_kv_heads, W = ctx->n_threads;
    const int64_t maxP = ekv_table_max_pages(t->indptr, B);
    const int64_t ustride = maxP;
    int64_t sz[3 + EKV_BOUND_BLOCKS] = {B * H * ustride * 4, W * ustride * 4,
                                        W * ustride * (int64_t)sizeof(scored_page)};
    ekv_cpu_bound_scratch_sizes(ctx, kv, st, B, H, maxP, sz + 3);
    int64_t off[3 + EKV_BOUND_BLOCKS], read_bytes = 0, w = 0;
    ekv_status s;
    char *ws = ekv_workspace_blocks(ctx, sz, 3 + EKV_BOUND_BLOCKS, off, "page selection", &s);
    if (!ws) return s;
    const int with_ball = sel->use_ball || list->bounds != NULL;
    float *u = (float *)(ws + off[0]);
    const ekv_cpu_bound_scratch scr = ekv_cpu_bound_scratch_at(ws, off + 3);
    s = ekv_cpu_bound_pages(ctx, prm, kv, st, t, q, u, ustride, &scr, with_ball, sel->tau_lb,
                            &read_bytes);
    if (s) return s;
    if (list->bounds)
        for (int64_t bh = 0; bh < B * H; bh++)
            memcpy(list->bounds + bh * list->bounds_stride, u + bh * ustride,
                   sizeof(float) * (size_t)ustride);
    list->indptr[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t P = ekv_seq_pages(t->indptr, b);
        int64_t nsel = ekv_seq_budget(sel, ekv_seq_len(t->indptr, t->last_page_len, b, ps)) / ps;
        nsel = nsel < 1 ? 1 : nsel;
        nsel = nsel > P - 1 ? P - 1 : nsel; /* a one-page sequence lists its last page only */
        for (int64_t l = 0; l < heads; l++) {
            w += nsel + 1;
            list->indptr[b * heads + l + 1] = w;
        }
    }
    list->bytes_summary = read_bytes; /* kmin + kmax (+ kmean and the radius), superpages skipped */
    topk_job j = {sel,
                  t,
                  list,
                  u,
                  ustride,
                  H,
                  G,
                  heads,
                  ps,
                  (float *)(ws + off[1]),
                  (scored_page *)(ws + off[2])};
    ekv_pool_run(ctx->pool, B * heads, topk_list, &j);
    return EKV_OK;
}

ekv_status ekv_cpu_select_run(ekv_context *ctx, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                              ekv_page_list *list) {
    const unsigned stages = ekv_method_info_of(sel->method)->stages;
    const int64_t heads = sel->per_query_head ? prm->num_heads : kv->num_kv_heads;
    ekv_status s = EKV_OK;
    list->tau_mode = EKV_TAU_EXACT;
    list->correction_iters = 0;
    list->survivors = 0;
    if (stages & EKV_STAGE_SCREEN)
        s = ekv_select_screened(ctx, prm, sel, kv, st, t, q, list);
    else if (stages & EKV_STAGE_GAUSS)
        s = ekv_select_gaussian(ctx, prm, sel, kv, st, t, q, list);
    else if (stages & EKV_STAGE_ORACLE)
        s = ekv_select_oracle_run(ctx, prm, sel, kv, st, t, q, list);
    else if (stages & EKV_STAGE_TOPK)
        s = select_topk(ctx, prm, sel, kv, st, t, q, list);
    else
        select_dense(t, heads, list);
    list->heads = (int32_t)heads;
    return s;
}

ekv_status ekv_select_pages(ekv_context *ctx, const ekv_decode_params *prm,
                            const ekv_select_params *sel, const ekv_paged_kv *kv,
                            const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                            ekv_page_list *list) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!sel || !list)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !sel ? "select" : "list");
    if (!q) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "q is NULL");
    if (sel->method == EKV_SELECT_CERTIFIED)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_ARGUMENT,
                "certified is a decode method, not a page list: use ekv_decode or ekv_decode_certified");
    ekv_status s = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, sel);
    if (!s) s = ekv_validate_step(ctx, prm, kv, t, q);
    if (!s) s = ekv_validate_select(ctx, prm, sel, kv, st, t, list);
    EKV_GUARDED(ctx, s, ekv_cpu_select_run(ctx, prm, sel, kv, st, t, q, list));
    if (!s) ekv_clear_error(ctx);
    return s;
}
