/* ekv_cache_append: validate, reserve pages, write K/V in the storage dtype, update the
 * summaries. Either everything is appended or nothing changes. */
#include "cache_internal.h"
#include "../cpu/kernels/kernels.h"
#include <stdlib.h>

typedef struct {
    ekv_cache *c;
    ekv_seq *s;
    int64_t n_tokens, first_token; /* absolute position of the first appended token */
    const void *k, *v;
    ekv_dtype src;
    float *rows; /* one key row of scratch per worker */
} append_job;

/* One task per KV head: write this head's rows and fold them into the summaries. */
static void append_head(void *vp, int64_t head, int worker) {
    append_job *j = vp;
    ekv_cache *c = j->c;
    const int64_t D = c->p.head_dim, Hk = c->p.num_kv_heads, ps = c->p.page_size;
    float *krow = j->rows + (int64_t)worker * D;
    const ekv_cpu_kernels *kern = ekv_cpu_kernels_for(c->ctx->isa);
    const int64_t es = ekv_dtype_size(c->p.dtype), ses = ekv_dtype_size(j->src);
    int32_t last_page = -1;
    for (int64_t t = 0; t < j->n_tokens; t++) {
        int64_t pos = j->first_token + t;
        int32_t page = j->s->pages[pos / ps];
        int64_t slot = pos % ps;
        int64_t dst = ekv_cache_row(c, page, head, slot);
        int64_t src = (t * Hk + head) * D;
        /* K and V in the storage dtype; krow = K as stored, for the summaries */
        kern->convert((const char *)j->k + src * ses, j->src, (char *)c->k + dst * es, c->p.dtype,
                      D, krow);
        kern->convert((const char *)j->v + src * ses, j->src, (char *)c->v + dst * es, c->p.dtype,
                      D, NULL);
        ekv_summary_add_row(c, page, (int32_t)head, krow, (int32_t)slot + 1);
        if (page != last_page && last_page >= 0) ekv_summary_page_done(c, last_page, (int32_t)head);
        last_page = page;
    }
    if (last_page >= 0) ekv_summary_page_done(c, last_page, (int32_t)head);
}

/* Also rejects finite inputs that overflow to inf in the storage dtype `store`: with round
 * to nearest even, f16 overflows from |x| >= 65520 and bf16 from |x| >= 0x1.ffp127. */
static int all_finite(const void *x, ekv_dtype dt, ekv_dtype store, int64_t n, int64_t *bad) {
    const float lim = store == EKV_DTYPE_F16    ? 65520.0f
                      : store == EKV_DTYPE_BF16 ? 0x1.ffp127f
                                                : INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float f = ekv_load_f32(x, dt, i);
        if (!(fabsf(f) < lim)) {
            *bad = i;
            return 0;
        } /* NaN, inf, or overflows `store` */
    }
    return 1;
}

/* The status of an element that the cache cannot store: NaN or infinite, or finite but beyond
 * the cache dtype's range (1e6 in an f16 cache rounds to infinity), said as such. */
static ekv_status not_storable(const ekv_cache *c, const char *name, float x, int64_t at) {
    const char *dt = ekv_dtype_name(c->p.dtype);
    if (isfinite(x))
        return ekv_fail(c->ctx, EKV_ERR_NAN_INPUT,
                        "%s[%lld] = %g is outside the range of the %s cache", name, (long long)at,
                        (double)x, dt);
    return ekv_fail(c->ctx, EKV_ERR_NAN_INPUT, "%s[%lld] = %g is NaN or infinite", name,
                    (long long)at, (double)x);
}

static ekv_status append_run(ekv_cache *c, int32_t seq, int64_t n_tokens, const void *k,
                             const void *v, ekv_dtype src_dtype) {
    ekv_context *ctx = c->ctx;
    if (!k || !v) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !k ? "k" : "v");
    const ekv_seq *cs;
    ekv_status st = ekv_cache_lookup_seq(c, seq, &cs);
    if (st) return st;
    ekv_seq *s = &c->seqs[seq];
    if (n_tokens <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "n_tokens=%lld must be >= 1",
                        (long long)n_tokens);
    if (!ekv_dtype_valid(src_dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE, "src_dtype=%d is not f32, f16 or bf16",
                        (int)src_dtype);
    const int64_t ps = c->p.page_size, D = c->p.head_dim, Hk = c->p.num_kv_heads;
    int64_t new_len, n_elems;
    if (ekv_add_i64(s->len, n_tokens, &new_len) || ekv_mul_i64(n_tokens, Hk * D, &n_elems))
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "n_tokens=%lld overflows the sequence length",
                        (long long)n_tokens);
    int64_t pages_after = new_len / ps + (new_len % ps != 0);
    int64_t new_pages = pages_after - s->npages;
    if (new_pages > c->n_free)
        return ekv_fail(ctx, EKV_ERR_CACHE_FULL,
                        "appending %lld tokens needs %lld new pages but only %lld of %lld are free",
                        (long long)n_tokens, (long long)new_pages, (long long)c->n_free,
                        (long long)c->p.num_pages);
    int64_t bad;
    if (!all_finite(k, src_dtype, c->p.dtype, n_elems, &bad))
        return not_storable(c, "k", ekv_load_f32(k, src_dtype, bad), bad);
    if (!all_finite(v, src_dtype, c->p.dtype, n_elems, &bad))
        return not_storable(c, "v", ekv_load_f32(v, src_dtype, bad), bad);
    if (pages_after > s->cap) {
        int64_t cap = s->cap ? s->cap : 16;
        while (cap < pages_after) cap *= 2;
        int32_t *np = realloc(s->pages, (size_t)cap * sizeof(int32_t));
        if (!np) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for the page list");
        s->pages = np;
        s->cap = cap;
    }
    float *rows = malloc((size_t)ctx->n_threads * (size_t)D * sizeof(float));
    if (!rows) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for key rows");
    /* From here on nothing can fail. */
    for (int64_t i = 0; i < new_pages; i++) {
        int32_t page = c->free_pages[--c->n_free];
        ekv_summary_reset_page(c, page);
        if (c->in_super && c->in_super[page]) /* a reused page: drop its old keys from the box */
            ekv_summary_rebuild_superpage(c, page);
        s->pages[s->npages++] = page;
    }
    /* Token counts are per page (shared by heads); the radius pass reads them. */
    for (int64_t pos = s->len; pos < new_len; pos++)
        c->count[s->pages[pos / ps]] = (int32_t)(pos % ps) + 1;
    if (c->in_super)
        for (int64_t pi = s->len / ps; pi <= (new_len - 1) / ps; pi++)
            c->in_super[s->pages[pi]] = 1;
    append_job job = {c, s, n_tokens, s->len, k, v, src_dtype, rows};
    ekv_pool_run(ctx->pool, Hk, append_head, &job);
    free(rows);
    s->len = new_len;
    ekv_seq_touch(c, s);
    ekv_clear_error(ctx);
    return EKV_OK;
}

/* The append runs on the context's thread pool: one thread at a time (ekv_ctx_enter). */
ekv_status ekv_cache_append(ekv_cache *c, int32_t seq, int64_t n_tokens, const void *k,
                            const void *v, ekv_dtype src_dtype) {
    if (!c) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_ctx_enter(c->ctx);
    if (st) return st;
    st = append_run(c, seq, n_tokens, k, v, src_dtype);
    ekv_ctx_leave(c->ctx);
    return st;
}
