/* ekv_cache_seq_adopt: a sequence over pages the caller's engine has already filled (the pool
 * in the caller's memory, ekv_cache_params.k_pool). The pages leave the free list and their
 * summaries and key codes are built from the keys stored there, as appends would have built
 * them. Either the whole sequence is adopted or nothing changes. */
#include "cache_internal.h"
#include <stdlib.h>

/* Every stored K and V element of the page's first `count` slots is finite. */
static int page_finite(const ekv_cache *c, int32_t page, int32_t count) {
    for (int64_t h = 0; h < c->p.num_kv_heads; h++)
        for (int32_t t = 0; t < count; t++) {
            const int64_t row = ekv_cache_row(c, page, h, t);
            for (int64_t d = 0; d < c->p.head_dim; d++)
                if (!isfinite(ekv_load_f32(c->k, c->p.dtype, row + d)) ||
                    !isfinite(ekv_load_f32(c->v, c->p.dtype, row + d)))
                    return 0;
        }
    return 1;
}

/* The checks: an empty sequence, free and distinct pages in range, a valid last page, finite
 * keys and values. free_mark[p]: 1 free, 2 asked for. */
static ekv_status adopt_check(ekv_cache *c, const ekv_seq *s, int32_t seq, const int32_t *pages,
                              int64_t n, int32_t last, uint8_t *free_mark) {
    ekv_context *ctx = c->ctx;
    if (s->len) return ekv_fail(ctx, EKV_ERR_INVALID_SEQUENCE, "sequence %d is not empty", seq);
    if (last < 1 || last > c->p.page_size)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "last_page_len=%d must be in [1, %d]", last,
                        c->p.page_size);
    for (int64_t i = 0; i < c->n_free; i++) free_mark[c->free_pages[i]] = 1;
    for (int64_t i = 0; i < n; i++) {
        const int32_t p = pages[i];
        if (p < 0 || p >= c->p.num_pages)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "pages[%lld]=%d is not in [0, %lld)",
                            (long long)i, p, (long long)c->p.num_pages);
        if (free_mark[p] != 1)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "pages[%lld]=%d is %s", (long long)i, p,
                            free_mark[p] == 2 ? "listed twice" : "held by another sequence");
        free_mark[p] = 2;
        if (!page_finite(c, p, i + 1 == n ? last : c->p.page_size))
            return ekv_fail(ctx, EKV_ERR_NAN_INPUT, "page %d holds a NaN or infinite K or V", p);
    }
    return EKV_OK;
}

static ekv_status adopt_run(ekv_cache *c, int32_t seq, const int32_t *pages, int64_t n_pages,
                            int32_t last_page_len) {
    const ekv_seq *cs;
    ekv_status st = ekv_cache_lookup_seq(c, seq, &cs);
    if (st) return st;
    ekv_seq *s = &c->seqs[seq];
    uint8_t *mark = calloc((size_t)c->p.num_pages, 1);
    float *row = malloc((size_t)c->p.head_dim * sizeof(float));
    int32_t *list = s->cap >= n_pages ? s->pages : malloc((size_t)n_pages * sizeof(int32_t));
    if (!mark || !row || !list)
        st = ekv_fail(c->ctx, EKV_ERR_OUT_OF_MEMORY, "no memory to adopt %lld pages",
                      (long long)n_pages);
    if (!st) st = adopt_check(c, s, seq, pages, n_pages, last_page_len, mark);
    if (!st) { /* from here on nothing can fail */
        int64_t w = 0;
        for (int64_t i = 0; i < c->n_free; i++)
            if (mark[c->free_pages[i]] != 2) c->free_pages[w++] = c->free_pages[i];
        c->n_free = w;
        if (list != s->pages) {
            free(s->pages);
            s->pages = list;
            s->cap = n_pages;
        }
        for (int64_t i = 0; i < n_pages; i++) {
            s->pages[i] = pages[i];
            ekv_summary_rebuild_page(c, pages[i], i + 1 == n_pages ? last_page_len : c->p.page_size,
                                     row);
        }
        s->npages = n_pages;
        s->len = (n_pages - 1) * c->p.page_size + last_page_len;
        ekv_seq_touch(c, s);
        ekv_clear_error(c->ctx);
    } else if (list != s->pages)
        free(list);
    free(mark);
    free(row);
    return st;
}

/* The adoption runs on the context's thread: one call at a time (ekv_ctx_enter). */
ekv_status ekv_cache_seq_adopt(ekv_cache *c, int32_t seq, const int32_t *pages, int64_t n_pages,
                               int32_t last_page_len) {
    if (!c) return EKV_ERR_NULL_POINTER;
    if (!pages) return ekv_fail(c->ctx, EKV_ERR_NULL_POINTER, "pages is NULL");
    if (n_pages < 1 || n_pages > c->p.num_pages)
        return ekv_fail(c->ctx, EKV_ERR_INVALID_SIZE, "n_pages=%lld must be in [1, %lld]",
                        (long long)n_pages, (long long)c->p.num_pages);
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st, adopt_run(c, seq, pages, n_pages, last_page_len));
    return st;
}
