/*
 * Certified decode (SPEC 9.1-9.3). tau of any subset C is a lower bound of the full tau*
 * (9.1), so a page whose bound U_p satisfies U_p <= tau_C holds no support token (9.2).
 *   round 1: C = the top pages by certified bound within the budget, the last page, and the
 *            optional sink and recent pages; attend exactly over C, giving tau_C per head;
 *   round 2: R = the pages outside C with U_p > tau_C for some query head of the list; if R is
 *            empty the round-1 output *is* dense entmax; otherwise attend over C + R, whose
 *            tau is again a lower bound, so every page left out still has U_p <= tau: done.
 * Round 2 scores only the added pages and solves on the round-1 scores it kept, so K is read
 * once and V once (for the final support) (src/cpu/attend_pages.c). Bounds include the
 * rounding slack of bound.c, so the proof holds for the fp32 scores the kernel computes.
 */
#include "../core/internal.h"
#include "../cpu/attend.h"
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
    const int64_t B = t->batch, H = prm->num_heads, Hk = kv->num_kv_heads;
    const int64_t heads = sel->per_query_head ? H : Hk, nl = B * heads;
    int64_t maxP = 1;
    for (int64_t b = 0; b < B; b++) maxP = t->indptr[b + 1] - t->indptr[b] > maxP ? t->indptr[b + 1] - t->indptr[b] : maxP;
    const int64_t cap = ekv_page_list_capacity(t, (int32_t)heads);
    csr l1 = {malloc(sizeof(int64_t) * (size_t)(nl + 1)), malloc(sizeof(int32_t) * (size_t)cap)};
    csr l2 = {malloc(sizeof(int64_t) * (size_t)(nl + 1)), malloc(sizeof(int32_t) * (size_t)cap)};
    float *bounds = malloc(sizeof(float) * (size_t)(B * H * maxP));
    uint8_t *in = malloc((size_t)maxP);
    int64_t *added = malloc(sizeof(int64_t) * (size_t)nl); /* round-2 pages per list */
    if (!l1.indptr || !l1.pages || !l2.indptr || !l2.pages || !bounds || !in || !added) {
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
        if (ts.budget_tokens < 1 || sel->tau_hint) ts.budget_tokens = 1; /* a hint: only the bounds are needed */
        /* round 0 (superpages, SPEC 9.6): tau over the last pages is a lower bound of tau*, so
         * the bound stage can skip the summaries of every superpage already below it */
        double *tau0 = NULL;
        if (st->smin && st->superpage_pages > 0 && !ts.tau_lb) {
            const int64_t R0 = sel->recent_pages > 0 ? sel->recent_pages + 1 : 4;
            tau0 = malloc(sizeof(double) * (size_t)(B * H));
            if (!tau0) { s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "certified: out of memory"); goto done; }
            int64_t w0 = 0;
            l1.indptr[0] = 0;
            for (int64_t b = 0; b < B; b++) {
                const int64_t P = t->indptr[b + 1] - t->indptr[b];
                for (int64_t l = 0; l < heads; l++) {
                    for (int64_t p = P - R0 > 0 ? P - R0 : 0; p < P; p++) l1.pages[w0++] = (int32_t)p;
                    l1.indptr[b * heads + l + 1] = w0;
                }
            }
            ekv_page_list list0 = {.heads = (int32_t)heads, .indptr = l1.indptr, .pages = l1.pages, .capacity = cap};
            ekv_decode_info i0 = {tau0, NULL, 0, 0};
            float *o0 = malloc(sizeof(float) * (size_t)(B * H * kv->head_dim));
            if (!o0) { free(tau0); s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "certified: out of memory"); goto done; }
            s = ekv_decode_pages(ctx, prm, kv, t, &list0, q, o0, &i0);
            free(o0);
            if (s) { free(tau0); goto done; }
            ts.tau_lb = tau0;
        }
        ekv_page_list sl = {.indptr = l2.indptr, .pages = l2.pages, .capacity = cap, .bounds = bounds, .bounds_stride = maxP};
        s = ekv_select_pages(ctx, prm, &ts, kv, st, t, q, &sl);
        free(tau0);
        if (s) goto done;
        if (ci) ci->bytes_summary = sl.bytes_summary;
        /* adaptive round 1: the pages a hint of tau cannot rule out (replaces the top-k pages) */
        if (sel->tau_hint) {
            const int64_t G = H / Hk;
            int64_t w2 = 0;
            for (int64_t b = 0; b < B; b++) {
                const int64_t P = t->indptr[b + 1] - t->indptr[b];
                for (int64_t l = 0; l < heads; l++) {
                    const int64_t li = b * heads + l, h0 = sel->per_query_head ? l : l * G, hn = sel->per_query_head ? 1 : G;
                    for (int64_t p = 0; p + 1 < P; p++)
                        for (int64_t h = h0; h < h0 + hn; h++)
                            if ((double)bounds[(b * H + h) * maxP + p] > sel->tau_hint[b * H + h]) {
                                l2.pages[w2++] = (int32_t)p;
                                break;
                            }
                    l2.pages[w2++] = (int32_t)(P - 1);
                    l2.indptr[li + 1] = w2;
                }
            }
        }
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
        s = ekv_cpu_attend_certified(ctx, prm, kv, t, &list1, bounds, maxP, q, out, info, added);
        if (s) goto done;
        int64_t need = 0;
        for (int64_t li = 0; li < nl; li++) {
            need += added[li] > 0;
            if (ci && ci->pages_round2) ci->pages_round2[li] = (int32_t)added[li];
        }
        if (ci) {
            ci->lists_round2 = need;
            ci->certified = 1;
        }
        ekv_clear_error(ctx);
    }
done:
    free(l1.indptr); free(l1.pages); free(l2.indptr); free(l2.pages);
    free(bounds); free(in); free(added);
    return s;
}
