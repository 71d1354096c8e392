/* ekv_cache_truncate: a sequence keeps its first n tokens (docs/architecture.md, "Cache layout").
 * The pages past them go back to the free list and leave their superpages' boxes; a last page
 * kept in part gets its summaries and key codes rebuilt from the keys it keeps
 * (ekv_summary_rebuild_page, as adoption builds them), so the cache holds what appending those
 * n tokens would have built. K and V rows are not moved. */
#include "cache_internal.h"
#include <stdlib.h>

/* Pages [keep, npages) back to the free list, the last one pushed first so that the next
 * appends take them again in their old order; their superpage boxes drop them. */
static void release_pages(ekv_cache *c, ekv_seq *s, int64_t keep) {
    for (int64_t i = s->npages - 1; i >= keep; i--) {
        const int32_t page = s->pages[i];
        c->count[page] = 0;
        c->free_pages[c->n_free++] = page;
        if (c->in_super && c->in_super[page]) ekv_summary_rebuild_superpage(c, page);
    }
    s->npages = keep;
}

static ekv_status truncate_run(ekv_cache *c, int32_t seq, int64_t n_tokens) {
    const ekv_seq *cs;
    ekv_status st = ekv_cache_lookup_seq(c, seq, &cs);
    if (st) return st;
    if (n_tokens < 0 || n_tokens > cs->len)
        return ekv_fail(c->ctx, EKV_ERR_INVALID_SIZE,
                        "n_tokens=%lld must be in [0, %lld] (the sequence's length)",
                        (long long)n_tokens, (long long)cs->len);
    ekv_seq *s = &c->seqs[seq];
    const int64_t ps = c->p.page_size, tail = n_tokens % ps;
    const int64_t keep = n_tokens / ps + (tail != 0);
    float *row = NULL;
    if (tail && n_tokens < s->len && (row = malloc((size_t)c->p.head_dim * sizeof(float))) == NULL)
        return ekv_fail(c->ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for a key row");
    /* From here on nothing can fail. */
    release_pages(c, s, keep);
    if (row) /* n_tokens < length: the page held more than tail tokens */
        ekv_summary_rebuild_page(c, s->pages[keep - 1], (int32_t)tail, row);
    free(row);
    s->len = n_tokens;
    ekv_seq_touch(c, s);
    ekv_clear_error(c->ctx);
    return EKV_OK;
}

/* The truncation runs on the context's thread: one call at a time (ekv_ctx_enter). */
ekv_status ekv_cache_truncate(ekv_cache *c, int32_t seq, int64_t n_tokens) {
    if (!c) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_ctx_enter(c->ctx);
    if (st) return st;
    st = truncate_run(c, seq, n_tokens);
    ekv_ctx_leave(c->ctx);
    return st;
}
