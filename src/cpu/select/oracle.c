/*
 * The oracle selection policy (evaluation only): for each list, every page holding a token
 * of positive dense entmax probability for a query head of the list, then the last page.
 * It needs the dense distribution of the whole step, [B*H][N] floats, which it allocates
 * per call instead of taking it from the context: the oracle runs only in evaluations, and
 * keeping a buffer that size in the context would pin it for the context's lifetime.
 */
#include "../stages/attend.h"
#include "select.h"
#include <stdlib.h>

static void oracle_list(const float *pr, int64_t nmax, int64_t ps, int64_t P, int64_t h0,
                        int64_t hn, int32_t *out, int64_t *w) {
    for (int64_t p = 0; p + 1 < P; p++) {
        int hit = 0;
        for (int64_t h = h0; h < h0 + hn && !hit; h++)
            for (int64_t jt = p * ps; jt < (p + 1) * ps && !hit; jt++) hit = pr[h * nmax + jt] > 0;
        if (hit) out[(*w)++] = (int32_t)p;
    }
    out[(*w)++] = (int32_t)(P - 1);
}

ekv_status ekv_select_oracle_run(ekv_context *ctx, const ekv_decode_params *prm,
                                 const ekv_select_params *sel, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                 ekv_page_list *list) {
    (void)st; /* the oracle reads the keys themselves, not their statistics */
    const int64_t B = t->batch, H = prm->num_heads, G = H / kv->num_kv_heads, ps = kv->page_size;
    const int64_t heads = sel->per_query_head ? H : kv->num_kv_heads;
    const int64_t maxP = ekv_table_max_pages(t->indptr, B);
    const int64_t nmax = maxP * ps;
    float *pr = malloc(sizeof(float) * (size_t)(B * H * nmax));
    if (!pr)
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "oracle: no memory for the dense distribution");
    const ekv_lists_args a = {.mode = EKV_LISTS_PROBS, .probs = pr, .pstride = nmax};
    ekv_status s = ekv_cpu_attend_lists(ctx, prm, kv, t, q, &a);
    int64_t w = 0;
    list->indptr[0] = 0;
    for (int64_t b = 0; !s && b < B; b++)
        for (int64_t l = 0; l < heads; l++) {
            oracle_list(pr + b * H * nmax, nmax, ps, ekv_seq_pages(t->indptr, b),
                        ekv_list_head0(l, heads, H, G), ekv_list_nheads(heads, H, G), list->pages,
                        &w);
            list->indptr[b * heads + l + 1] = w;
        }
    free(pr);
    list->bytes_summary = 0;
    return s;
}
