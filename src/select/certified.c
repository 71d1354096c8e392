/*
 * Certified decode (SPEC 9.1-9.3). tau of any subset C is a lower bound of the full tau*
 * (9.1), so a page whose bound U_p satisfies U_p <= tau_C holds no support token (9.2).
 *   round 1: C = the top pages by certified bound within the budget, the last page, and the
 *            optional sink and recent pages; attend exactly over C, giving tau_C per head;
 *   round 2: R = the pages outside C with U_p > tau_C for some query head of the list; if R is
 *            empty the round-1 output *is* dense entmax; otherwise attend over C + R, whose
 *            tau is again a lower bound, so every page left out still has U_p <= tau: done.
 * Only the lists that need round 2 are attended again. Bounds include the rounding slack of
 * bound.c, so the proof holds for the fp32 scores the attention kernel computes.
 */
#include "../core/internal.h"
#include <stdlib.h>

typedef struct {
    int64_t *indptr;
    int32_t *pages;
} csr;

ekv_status ekv_decode_certified(ekv_context *ctx, const ekv_decode_params *prm, const ekv_select_params *sel,
                                const ekv_paged_kv *kv, const ekv_page_stats *st, const ekv_page_table *t,
                                const float *q, float *out, ekv_decode_info *info, ekv_certified_info *ci) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!sel || !st || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "select, stats and out must not be NULL");
    if (!(prm && prm->alpha > 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA, "certified decode is for entmax (alpha > 1): softmax has no zeros");
    if (sel->sink_pages < 0 || sel->recent_pages < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "sink_pages and recent_pages must be >= 0");
    ekv_status s = ekv_validate_decode(ctx, prm, kv, t, q, out);
    if (s) return s;
    const int64_t B = t->batch, H = prm->num_heads, Hk = kv->num_kv_heads, G = H / Hk;
    const int64_t heads = sel->per_query_head ? H : Hk, nl = B * heads;
    int64_t maxP = 1;
    for (int64_t b = 0; b < B; b++) maxP = t->indptr[b + 1] - t->indptr[b] > maxP ? t->indptr[b + 1] - t->indptr[b] : maxP;
    const int64_t cap = ekv_page_list_capacity(t, (int32_t)heads);
    csr l1 = {malloc(sizeof(int64_t) * (size_t)(nl + 1)), malloc(sizeof(int32_t) * (size_t)cap)};
    csr l2 = {malloc(sizeof(int64_t) * (size_t)(nl + 1)), malloc(sizeof(int32_t) * (size_t)cap)};
    float *bounds = malloc(sizeof(float) * (size_t)(B * H * maxP));
    double *tau = malloc(sizeof(double) * (size_t)(B * H));
    uint8_t *in = malloc((size_t)maxP), *active = calloc((size_t)nl, 1);
    if (!l1.indptr || !l1.pages || !l2.indptr || !l2.pages || !bounds || !tau || !in || !active) {
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "certified decode: out of memory");
        goto done;
    }
    {
        /* round 1 candidates: top-k by the certified bounds (budget clamped to each length) */
        ekv_select_params ts = *sel;
        ts.method = EKV_SELECT_TOPK;
        ts.use_ball = 1;
        int64_t minN = INT64_MAX;
        for (int64_t b = 0; b < B; b++) {
            int64_t N = (t->indptr[b + 1] - t->indptr[b] - 1) * kv->page_size + t->last_page_len[b];
            minN = N < minN ? N : minN;
        }
        if (ts.budget_tokens > minN) ts.budget_tokens = minN;
        if (ts.budget_tokens < 1) ts.budget_tokens = 1;
        ekv_page_list sl = {.indptr = l2.indptr, .pages = l2.pages, .capacity = cap, .bounds = bounds, .bounds_stride = maxP};
        s = ekv_select_pages(ctx, prm, &ts, kv, st, t, q, &sl);
        if (s) goto done;
        if (ci) ci->bytes_summary = sl.bytes_summary;
        /* add sink and recent pages (deduplicated; the last page stays last) */
        int64_t w = 0;
        l1.indptr[0] = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t P = t->indptr[b + 1] - t->indptr[b];
            for (int64_t l = 0; l < heads; l++) {
                const int64_t li = b * heads + l;
                memset(in, 0, (size_t)P);
                for (int64_t i = l2.indptr[li]; i < l2.indptr[li + 1]; i++) in[l2.pages[i]] = 1;
                for (int64_t p = 0; p < sel->sink_pages && p < P; p++) in[p] = 1;
                for (int64_t p = P - 1 - sel->recent_pages; p < P; p++) if (p >= 0) in[p] = 1;
                for (int64_t p = 0; p < P; p++) if (in[p]) l1.pages[w++] = (int32_t)p;
                l1.indptr[li + 1] = w;
                if (ci && ci->pages_round1) ci->pages_round1[li] = (int32_t)(l1.indptr[li + 1] - l1.indptr[li]);
            }
        }
        ekv_page_list list1 = {.heads = (int32_t)heads, .indptr = l1.indptr, .pages = l1.pages, .capacity = cap};
        ekv_decode_info i1 = {tau, info ? info->support : NULL, 0, 0};
        s = ekv_decode_pages(ctx, prm, kv, t, &list1, q, out, &i1);
        if (s) goto done;
        /* round 2: the pages whose bound still exceeds tau_C for a head of the list */
        int64_t need = 0;
        w = 0;
        l2.indptr[0] = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t P = t->indptr[b + 1] - t->indptr[b];
            for (int64_t l = 0; l < heads; l++) {
                const int64_t li = b * heads + l, h0 = sel->per_query_head ? l : l * G, hn = sel->per_query_head ? 1 : G;
                memset(in, 0, (size_t)P);
                for (int64_t i = l1.indptr[li]; i < l1.indptr[li + 1]; i++) in[l1.pages[i]] = 1;
                int64_t added = 0;
                for (int64_t p = 0; p + 1 < P; p++) {
                    if (in[p]) continue;
                    for (int64_t h = h0; h < h0 + hn; h++)
                        if ((double)bounds[(b * H + h) * maxP + p] > tau[b * H + h]) { in[p] = 2; added++; break; }
                }
                for (int64_t p = 0; p < P; p++) if (in[p]) l2.pages[w++] = (int32_t)p;
                l2.indptr[li + 1] = w;
                active[li] = added > 0;
                need += added > 0;
                if (ci && ci->pages_round2) ci->pages_round2[li] = (int32_t)added;
            }
        }
        int64_t bytes_k = i1.bytes_k, bytes_v = i1.bytes_v;
        if (need) {
            ekv_page_list list2 = {.heads = (int32_t)heads, .indptr = l2.indptr, .pages = l2.pages, .capacity = cap,
                                   .active = active};
            double *tau2 = malloc(sizeof(double) * (size_t)(B * H));
            int64_t *sup2 = malloc(sizeof(int64_t) * (size_t)(B * H));
            if (!tau2 || !sup2) { free(tau2); free(sup2); s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "certified: out of memory"); goto done; }
            ekv_decode_info i2 = {tau2, sup2, 0, 0};
            s = ekv_decode_pages(ctx, prm, kv, t, &list2, q, out, &i2);
            if (!s)
                for (int64_t b = 0; b < B; b++)
                    for (int64_t h = 0; h < H; h++) {
                        const int64_t li = b * heads + (sel->per_query_head ? h : h / G);
                        if (!active[li]) continue;
                        tau[b * H + h] = tau2[b * H + h];
                        if (info && info->support) info->support[b * H + h] = sup2[b * H + h];
                    }
            bytes_k += i2.bytes_k;
            bytes_v += i2.bytes_v;
            free(tau2);
            free(sup2);
            if (s) goto done;
        }
        if (info) {
            if (info->tau) memcpy(info->tau, tau, sizeof(double) * (size_t)(B * H));
            info->bytes_k = bytes_k;
            info->bytes_v = bytes_v;
        }
        if (ci) {
            ci->lists_round2 = need;
            ci->certified = 1;
        }
        ekv_clear_error(ctx);
    }
done:
    free(l1.indptr); free(l1.pages); free(l2.indptr); free(l2.pages);
    free(bounds); free(tau); free(in); free(active);
    return s;
}
