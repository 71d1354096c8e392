/*
 * The model's attention through the library's decode stages. A block of T tokens is appended
 * to the layer's cache at once; token t then attends as the newest token of a *prefix view*
 * of the sequence: a page table whose entry t lists the first pages of the sequence up to the
 * page holding position pos0 + t, with last_page_len cut at that position. The T views form
 * one batch, so a block is one call of each stage, and every token sees exactly the keys a
 * token-by-token run would see (the query position, and so the ALiBi bias, is the last token
 * of its view). Pages before a view's last page are full and their statistics final, so the
 * page bounds are those of a token-by-token run too.
 *
 *   dense      ekv_decode_dense
 *   topk       ekv_select_pages (entmax top-k by box bound, budget = fraction of each view's
 *              length) + ekv_decode_pages
 *   gaussian   ekv_select_pages (Gaussian-aware selector, exact tau) + ekv_decode_pages
 *   certified  ekv_decode_certified (round 1 sized by the budget; the output equals dense)
 */
#include "model_internal.h"
#include <stdlib.h>

/* Grows *p to hold n elements of size es. */
static int grow(void *pp, int64_t *cap, int64_t n, size_t es) {
    if (n <= *cap) return 0;
    int64_t c = *cap ? *cap : 256;
    while (c < n) c *= 2;
    void *np = realloc(*(void **)pp, (size_t)c * es);
    if (!np) return -1;
    *(void **)pp = np;
    *cap = c;
    return 0;
}

/* The CSR of the T prefix views ending at positions pos0 .. pos0+T-1. */
static ekv_status build_views(ekv_model *m, model_layer *L, int64_t pos0, int64_t T, ekv_page_table *tab) {
    attn_scratch *a = &m->as;
    const int64_t ps = m->prm.page_size, len = pos0 + T, P = (len + ps - 1) / ps;
    int64_t ip[2], needed = 0, total = 0;
    int32_t lpl;
    if (grow(&a->full, &a->full_cap, P, sizeof(int32_t)))
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory (page table)");
    ekv_status s = ekv_cache_page_table(L->cache, &L->seq, 1, ip, a->full, a->full_cap, &lpl, &needed);
    if (s) return s;
    if (needed != P) return ekv_fail(m->ctx, EKV_ERR_INTERNAL, "model: layer cache holds %lld pages, expected %lld",
                                     (long long)needed, (long long)P);
    for (int64_t t = 0; t < T; t++) total += (pos0 + t) / ps + 1;
    int64_t cap1 = T + 1;
    if (!a->indptr) a->indptr = malloc(sizeof(int64_t) * (EKV_MODEL_BLOCK + 1));
    if (!a->last_len) a->last_len = malloc(sizeof(int32_t) * EKV_MODEL_BLOCK);
    if (!a->indptr || !a->last_len || cap1 > EKV_MODEL_BLOCK + 1 || grow(&a->indices, &a->indices_cap, total, sizeof(int32_t)))
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory (prefix views)");
    int64_t w = 0;
    a->indptr[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t np = (pos0 + t) / ps + 1;
        memcpy(a->indices + w, a->full, sizeof(int32_t) * (size_t)np);
        w += np;
        a->indptr[t + 1] = w;
        a->last_len[t] = (int32_t)(pos0 + t - (np - 1) * ps + 1);
    }
    *tab = (ekv_page_table){(int32_t)T, a->indptr, a->indices, a->last_len};
    return EKV_OK;
}

/* Top-k lists for every view, each with its own budget (a fraction of its length). Views whose
 * budgets select the same number of pages share one ekv_select_pages call. */
static ekv_status select_topk(ekv_model *m, const ekv_decode_params *dp, const ekv_paged_kv *kv, const ekv_page_stats *pst,
                              const ekv_page_table *tab, const float *q, ekv_page_list *list) {
    attn_scratch *a = &m->as;
    const int64_t T = tab->batch, Hk = kv->num_kv_heads, ps = kv->page_size, qrow = (int64_t)dp->num_heads * kv->head_dim;
    int64_t local_ip[EKV_MODEL_BLOCK + 1], w = 0;
    list->indptr[0] = 0;
    list->bytes_summary = 0;
    for (int64_t t0 = 0; t0 < T;) {
        /* the run of views t0..t1-1 with the same number of scored pages; its first (shortest)
         * view's budget is valid for all of them and selects as many pages as each one's own */
        int64_t budget0 = 0, t1 = t0;
        for (; t1 < T; t1++) {
            const int64_t N = (tab->indptr[t1 + 1] - tab->indptr[t1] - 1) * ps + tab->last_page_len[t1];
            int64_t b = (int64_t)(m->prm.budget * (double)N);
            b = b < 1 ? 1 : b > N ? N : b;
            if (t1 == t0) budget0 = b;
            else if (b / ps != budget0 / ps) break;
        }
        for (int64_t t = t0; t <= t1; t++) local_ip[t - t0] = tab->indptr[t] - tab->indptr[t0];
        ekv_page_table sub = {(int32_t)(t1 - t0), local_ip, tab->indices + tab->indptr[t0], tab->last_page_len + t0};
        ekv_select_params sp = ekv_select_default_params();
        sp.method = EKV_SELECT_TOPK;
        sp.budget_tokens = budget0;
        ekv_page_list sl = {.indptr = a->list_indptr + t0 * Hk, .pages = list->pages + w, .capacity = list->capacity - w};
        /* the run's lists land at their place in the block's list (indptr shifted below) */
        const int64_t before = a->list_indptr[t0 * Hk];
        ekv_status s = ekv_select_pages(m->ctx, dp, &sp, kv, pst, &sub, q + t0 * qrow, &sl);
        if (s) return s;
        a->list_indptr[t0 * Hk] = before;
        for (int64_t i = 1; i <= (t1 - t0) * Hk; i++) a->list_indptr[t0 * Hk + i] += w;
        w = a->list_indptr[t1 * Hk];
        list->bytes_summary += sl.bytes_summary;
        t0 = t1;
    }
    list->heads = (int32_t)Hk;
    list->tau_mode = EKV_TAU_EXACT;
    list->correction_iters = 0;
    return EKV_OK;
}

ekv_status ekv_model_attention(ekv_model *m, model_layer *L, int64_t pos0, int64_t T, const float *q, const float *k,
                               const float *v, float *out) {
    const ekv_model_config *c = &m->cfg;
    attn_scratch *a = &m->as;
    ekv_status s = ekv_cache_append(L->cache, L->seq, T, k, v, EKV_DTYPE_F32);
    if (s) return s;
    ekv_page_table tab;
    if ((s = build_views(m, L, pos0, T, &tab))) return s;
    ekv_paged_kv kv;
    ekv_page_stats pst;
    if ((s = ekv_cache_kv_view(L->cache, &kv, &pst))) return s;
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = c->n_heads;
    dp.alpha = c->alpha;
    dp.alibi_slopes = m->slopes;
    const int64_t Hk = c->n_kv_heads, nl = T * Hk, cap = ekv_page_list_capacity(&tab, (int32_t)Hk);
    if (grow(&a->list_pages, &a->list_cap, cap, sizeof(int32_t)) ||
        (!a->list_indptr && !(a->list_indptr = malloc(sizeof(int64_t) * (size_t)(EKV_MODEL_BLOCK * Hk + 1)))) ||
        (!a->round1 && !(a->round1 = malloc(sizeof(int32_t) * (size_t)(EKV_MODEL_BLOCK * Hk)))) ||
        (!a->round2 && !(a->round2 = malloc(sizeof(int32_t) * (size_t)(EKV_MODEL_BLOCK * Hk)))))
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory (page lists)");
    ekv_decode_info info = {NULL, NULL, 0, 0};
    ekv_page_list list = {.indptr = a->list_indptr, .pages = a->list_pages, .capacity = a->list_cap};
    int64_t summary = 0;
    switch (m->prm.method) {
    case EKV_ATTN_DENSE:
        s = ekv_decode_dense(m->ctx, &dp, &kv, &tab, q, out, &info);
        break;
    case EKV_ATTN_TOPK:
    case EKV_ATTN_GAUSSIAN:
        if (m->prm.method == EKV_ATTN_TOPK) {
            s = select_topk(m, &dp, &kv, &pst, &tab, q, &list);
        } else {
            ekv_select_params sp = ekv_select_default_params();
            sp.method = EKV_SELECT_GAUSSIAN;
            s = ekv_select_pages(m->ctx, &dp, &sp, &kv, &pst, &tab, q, &list);
        }
        if (!s) s = ekv_decode_pages(m->ctx, &dp, &kv, &tab, &list, q, out, &info);
        summary = list.bytes_summary;
        break;
    case EKV_ATTN_CERTIFIED: {
        ekv_select_params sp = ekv_select_default_params();
        int64_t b = (int64_t)(m->prm.budget * (double)(pos0 + 1)); /* the shortest view's budget */
        sp.budget_tokens = b < 1 ? 1 : b;
        ekv_certified_info ci = {a->round1, a->round2, 0, 0, 0};
        s = ekv_decode_certified(m->ctx, &dp, &sp, &kv, &pst, &tab, q, out, &info, &ci);
        summary = ci.bytes_summary;
        L->stats.lists_round2 += ci.lists_round2;
        L->stats.lists += nl;
        break;
    }
    }
    if (s) return s;
    const int64_t row = Hk * c->head_dim * ekv_dtype_size(kv.dtype);
    for (int64_t t = 0; t < T; t++) L->stats.bytes_kv += 2 * (pos0 + t + 1) * row;
    L->stats.bytes_read += info.bytes_k + info.bytes_v + summary;
    L->stats.steps += T;
    return EKV_OK;
}
