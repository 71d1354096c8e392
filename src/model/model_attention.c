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
 * Each block is one ekv_decode call with the model's select method (the stages come from the
 * method table, docs/architecture.md):
 *   topk       entmax top-k by box bound, budget = a fraction of each view's length
 *   gaussian   the Gaussian-aware selector, exact tau
 *   certified  round 1 sized by the budget of the shortest view; the output equals dense
 *   screened   the key codes of the layer's cache screen every token of every view (the
 *              codes are relative to the page's current range, which bounds the tokens a
 *              shorter view sees too: docs/math.md §10); the output equals dense
 */
#include "model_internal.h"
#include "../core/method.h"
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
static ekv_status build_views(ekv_model *m, model_layer *L, int64_t pos0, int64_t T,
                              ekv_page_table *tab) {
    attn_scratch *a = &m->as;
    const int64_t ps = m->prm.page_size, len = pos0 + T, P = (len + ps - 1) / ps;
    int64_t ip[2], needed = 0, total = 0;
    int32_t lpl;
    if (grow(&a->full, &a->full_cap, P, sizeof(int32_t)))
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory (page table)");
    ekv_status s =
            ekv_cache_page_table(L->cache, &L->seq, 1, ip, a->full, a->full_cap, &lpl, &needed);
    if (s) return s;
    if (needed != P)
        return ekv_fail(m->ctx, EKV_ERR_INTERNAL,
                        "model: layer cache holds %lld pages, expected %lld", (long long)needed,
                        (long long)P);
    for (int64_t t = 0; t < T; t++) total += (pos0 + t) / ps + 1;
    int64_t cap1 = T + 1;
    if (!a->indptr) a->indptr = malloc(sizeof(int64_t) * (EKV_MODEL_BLOCK + 1));
    if (!a->last_len) a->last_len = malloc(sizeof(int32_t) * EKV_MODEL_BLOCK);
    if (!a->indptr || !a->last_len || cap1 > EKV_MODEL_BLOCK + 1 ||
        grow(&a->indices, &a->indices_cap, total, sizeof(int32_t)))
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

ekv_decode_params ekv_model_decode_params(const ekv_model_config *c, const float *slopes) {
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = c->n_heads;
    dp.alpha = c->alpha;
    dp.alibi_slopes = slopes;
    return dp;
}

ekv_select_params ekv_model_select_params(ekv_select_method method, double budget,
                                          int64_t view_len) {
    ekv_select_params sp = ekv_select_default_params();
    sp.method = method;
    if (method == EKV_SELECT_TOPK) sp.budget_fraction = budget;
    const int64_t b = (int64_t)(budget * (double)view_len);
    sp.budget_tokens = b < 1 ? 1 : b;
    return sp;
}

ekv_status ekv_model_attention(ekv_model *m, model_layer *L, int64_t pos0, int64_t T,
                               const float *q, const float *k, const float *v, float *out) {
    ekv_status s = ekv_cache_append(L->cache, L->seq, T, k, v, EKV_DTYPE_F32);
    if (s) return s;
    ekv_page_table tab;
    if ((s = build_views(m, L, pos0, T, &tab))) return s;
    ekv_paged_kv kv;
    ekv_page_stats pst;
    if ((s = ekv_cache_kv_view(L->cache, &kv, &pst))) return s;
    const ekv_decode_params dp = ekv_model_decode_params(&m->cfg, m->slopes);
    const ekv_select_params sp = ekv_model_select_params(m->prm.method, m->prm.budget, pos0 + 1);
    ekv_decode_info info = {0};
    if ((s = ekv_decode(m->ctx, &dp, &sp, &kv, &pst, &tab, q, out, &info))) return s;
    if (ekv_method_info_of(sp.method)->stages & EKV_STAGE_ROUND2) {
        L->stats.lists_round2 += info.lists_round2;
        L->stats.lists += T * m->cfg.n_kv_heads;
    }
    ekv_model_count_steps(m, L, pos0, T);
    L->stats.bytes_read += info.bytes_k + info.bytes_v + info.bytes_summary;
    L->stats.survivors += info.survivors;
    return EKV_OK;
}

void ekv_model_count_steps(const ekv_model *m, model_layer *L, int64_t pos0, int64_t T) {
    const int64_t row =
            (int64_t)m->cfg.n_kv_heads * m->cfg.head_dim * ekv_dtype_size(m->prm.kv_dtype);
    for (int64_t t = 0; t < T; t++) L->stats.bytes_kv += 2 * (pos0 + t + 1) * row;
    L->stats.steps += T;
}
