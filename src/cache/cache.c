/*
 * ekv_cache: a pool of physical pages, sequences that own lists of pages, append, and the
 * CSR page-table view (docs/architecture.md, "Layers"). Page layout, per physical page:
 * [num_kv_heads][page_size][head_dim] (token-major inside a head, as FlashInfer's HND).
 * Summaries are kept per physical page and KV head (src/cache/summaries.c).
 */
#define _GNU_SOURCE /* madvise(MADV_HUGEPAGE) */
#include "cache_internal.h"
#include <stdlib.h>
#include <sys/mman.h>

/* Large pool blocks are 2 MiB aligned and marked for transparent huge pages: a decode
 * step streams the whole K pool, and with 4 KiB pages every 4 KiB of K costs a TLB miss.
 * The OS still commits memory lazily, as pages are written. */
static void *pool_alloc(size_t bytes) {
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge) return malloc(bytes);
    void *p = NULL;
    if (posix_memalign(&p, huge, (bytes + huge - 1) / huge * huge) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, (bytes + huge - 1) / huge * huge, MADV_HUGEPAGE); /* a hint: failure is harmless */
#endif
    return p;
}

ekv_cache_params ekv_cache_default_params(void) {
    ekv_cache_params p;
    p.num_pages = 0;
    p.page_size = 16;
    p.num_kv_heads = 8;
    p.head_dim = 128;
    p.dtype = EKV_DTYPE_F16;
    p.max_seqs = 64;
    p.superpage_pages = 16;
    p.code_bits = 0;
    p.range_dtype = EKV_DTYPE_F32;
    p.layout = EKV_LAYOUT_HND;
    p.k_pool = p.v_pool = NULL;
    return p;
}

ekv_dtype ekv_cache_compact_ranges(ekv_dtype dtype) {
    return dtype == EKV_DTYPE_F16 || dtype == EKV_DTYPE_BF16 ? dtype : EKV_DTYPE_F32;
}

int64_t ekv_cache_pages_for(int64_t tokens, int64_t seqs, int32_t page_size) {
    if (tokens < 0 || seqs < 0 || page_size < 1) return -1;
    int64_t per = tokens / page_size + (tokens % page_size != 0), total;
    if (ekv_mul_i64(per, seqs, &total)) return -1;
    return total;
}

/* Bytes of the key codes: one row per (page, KV head, slot); 0 without codes. Called after
 * the sizes of K and V are known not to overflow, which bounds this (a row is at most D bytes). */
int64_t ekv_cache_code_bytes(const ekv_cache_params *p) {
    return p->num_pages * p->num_kv_heads * p->page_size *
           ekv_code_row_bytes(p->head_dim, p->code_bits);
}

/* Computes every byte count of the pool, with overflow checks. */
static ekv_status pool_sizes(ekv_context *ctx, const ekv_cache_params *p, int64_t *elems_per_page,
                             int64_t *kv_bytes, int64_t *stat_floats, int64_t *total) {
    ekv_status st = ekv_check_pool_geometry(ctx, p);
    if (st) return st;
    if (!p->k_pool != !p->v_pool)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "k_pool and v_pool: give both (the caller's memory) or neither");
    if (((uintptr_t)p->k_pool | (uintptr_t)p->v_pool) % 16)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "k_pool and v_pool must be 16-byte aligned");
    if (p->max_seqs <= 0 || p->max_seqs > (1 << 24))
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "max_seqs=%d must be in [1, 16777216]",
                        p->max_seqs);
    int64_t epp = (int64_t)p->num_kv_heads * p->page_size * p->head_dim, kvb, sf, sb, t;
    if (ekv_mul_i64(epp, p->num_pages, &kvb) ||
        ekv_mul_i64(kvb, 2 * ekv_dtype_size(p->dtype), &kvb) ||
        ekv_mul_i64((int64_t)p->num_kv_heads * p->head_dim, p->num_pages, &sf) ||
        ekv_mul_i64(sf, 4 * (int64_t)sizeof(float), &sb) || ekv_add_i64(kvb, sb, &t) ||
        (uint64_t)t > (uint64_t)SIZE_MAX / 2)
        return ekv_fail(
                ctx, EKV_ERR_SIZE_OVERFLOW,
                "pool of %lld pages x %d heads x %d tokens x %d dims overflows the address space",
                (long long)p->num_pages, p->num_kv_heads, p->page_size, p->head_dim);
    /* an append writes K and V of a slot one after the other: pools that share a byte would
     * overwrite one with the other */
    if (p->k_pool && (uintptr_t)p->k_pool < (uintptr_t)p->v_pool + (uint64_t)kvb / 2 &&
        (uintptr_t)p->v_pool < (uintptr_t)p->k_pool + (uint64_t)kvb / 2)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "k_pool and v_pool overlap (each holds %lld bytes from its address): K "
                        "and V need their own memory",
                        (long long)(kvb / 2));
    *elems_per_page = epp;
    *kv_bytes = kvb / 2;
    *stat_floats = sf;
    if (p->k_pool) t -= kvb; /* the caller's */
    *total = t + p->num_pages * (int64_t)(sizeof(int32_t) * 2 + sizeof(float) * p->num_kv_heads);
    *total += ekv_cache_code_bytes(p);
    if (p->range_dtype != EKV_DTYPE_F32) /* kmin16, kmax16, kmean16 and radius16 */
        *total += sf * 6 + p->num_pages * (int64_t)sizeof(float) * p->num_kv_heads;
    if (p->superpage_pages > 0) /* two fp32 arrays per (superpage, head, dim) */
        *total += ((p->num_pages + p->superpage_pages - 1) / p->superpage_pages) * p->num_kv_heads *
                  p->head_dim * 8;
    return EKV_OK;
}

int64_t ekv_cache_bytes_needed(const ekv_cache_params *params) {
    if (!params) return -1;
    int64_t epp = 0, kvb = 0, sf = 0, total = 0;
    if (pool_sizes(NULL, params, &epp, &kvb, &sf, &total)) return -1;
    return total;
}

void ekv_cache_free(ekv_cache *c) {
    if (!c) return;
    if (!c->p.k_pool) { /* not the caller's */
        free(c->k);
        free(c->v);
    }
    free(c->kmin);
    free(c->kmax);
    free(c->kmin16);
    free(c->kmax16);
    free(c->kmean16);
    free(c->radius16);
    free(c->kmean);
    free(c->km2);
    free(c->radius);
    free(c->codes);
    free(c->smin);
    free(c->smax);
    free(c->in_super);
    free(c->count);
    free(c->free_pages);
    if (c->seqs)
        for (int32_t i = 0; i < c->p.max_seqs; i++) free(c->seqs[i].pages);
    free(c->seqs);
    free(c);
}

ekv_status ekv_cache_create(ekv_context *ctx, const ekv_cache_params *params, ekv_cache **out) {
    if (!ctx || !params || !out)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL",
                        !ctx      ? "ctx"
                        : !params ? "params"
                                  : "out");
    int64_t epp = 0, kvb = 0, sf = 0, total = 0;
    ekv_status st = pool_sizes(ctx, params, &epp, &kvb, &sf, &total);
    if (st) return st;
    /* Under overcommit a pool larger than RAM is granted and only fails when its pages are
     * touched, by the OOM killer, long into the work: refuse it here instead. */
    const int64_t phys = ekv_phys_mem_bytes();
    if (total > phys)
        return ekv_fail(
                ctx, EKV_ERR_OUT_OF_MEMORY,
                "the cache needs %lld bytes (%.2f GiB) for %lld pages, more than the physical memory "
                "(%lld bytes, %.2f GiB)",
                (long long)total, (double)total / (1 << 30), (long long)params->num_pages,
                (long long)phys, (double)phys / (1 << 30));
    ekv_cache *c = calloc(1, sizeof *c);
    if (!c) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for the cache header");
    c->ctx = ctx;
    c->p = *params;
    c->elems_per_page = epp;
    ekv_layout_strides(params->layout, params->num_kv_heads, params->page_size, params->head_dim,
                       &c->stride_head, &c->stride_token);
    /* Large blocks come from mmap and are committed lazily by the OS: a big pool costs
     * memory only as pages are written. */
    c->k = params->k_pool ? params->k_pool : pool_alloc((size_t)kvb);
    c->v = params->v_pool ? params->v_pool : pool_alloc((size_t)kvb);
    c->kmin = malloc((size_t)sf * sizeof(float));
    c->kmax = malloc((size_t)sf * sizeof(float));
    const int compact = params->range_dtype != EKV_DTYPE_F32;
    if (compact) {
        c->kmin16 = malloc((size_t)sf * sizeof(uint16_t));
        c->kmax16 = malloc((size_t)sf * sizeof(uint16_t));
        c->kmean16 = malloc((size_t)sf * sizeof(uint16_t));
        c->radius16 = calloc((size_t)params->num_pages * params->num_kv_heads, sizeof(float));
    }
    c->kmean = malloc((size_t)sf * sizeof(float));
    c->km2 = malloc((size_t)sf * sizeof(float));
    c->radius = calloc((size_t)params->num_pages * params->num_kv_heads, sizeof(float));
    c->count = calloc((size_t)params->num_pages, sizeof(int32_t));
    const int64_t nsp =
            params->superpage_pages > 0
                    ? (params->num_pages + params->superpage_pages - 1) / params->superpage_pages
                    : 0;
    if (nsp) {
        c->smin = malloc((size_t)(nsp * params->num_kv_heads * params->head_dim) * sizeof(float));
        c->smax = malloc((size_t)(nsp * params->num_kv_heads * params->head_dim) * sizeof(float));
        c->in_super = calloc((size_t)params->num_pages, 1);
    }
    const int64_t code_bytes = ekv_cache_code_bytes(params);
    if (code_bytes) c->codes = pool_alloc((size_t)code_bytes);
    c->free_pages = malloc((size_t)params->num_pages * sizeof(int32_t));
    c->seqs = calloc((size_t)params->max_seqs, sizeof *c->seqs);
    if (!c->k || !c->v || !c->kmin || !c->kmax ||
        (compact && (!c->kmin16 || !c->kmax16 || !c->kmean16 || !c->radius16)) || !c->kmean ||
        !c->km2 || !c->radius || (nsp && (!c->smin || !c->smax || !c->in_super)) ||
        (code_bytes && !c->codes) || !c->count || !c->free_pages || !c->seqs) {
        ekv_cache_free(c);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY,
                        "cannot allocate %.2f GiB for %lld pages (K, V and summaries)",
                        (double)total / (1 << 30), (long long)params->num_pages);
    }
    for (int64_t i = 0; i < nsp * params->num_kv_heads * params->head_dim;
         i++) { /* empty: neutral */
        c->smin[i] = INFINITY;
        c->smax[i] = -INFINITY;
    }
    /* Free list as a stack, lowest page id on top. */
    for (int64_t i = 0; i < params->num_pages; i++)
        c->free_pages[i] = (int32_t)(params->num_pages - 1 - i);
    c->n_free = params->num_pages;
    *out = c;
    ekv_clear_error(ctx);
    return EKV_OK;
}

/* Every call on a cache runs inside ekv_ctx_enter/leave of its context, the readers too: an
 * append or a truncation in another thread moves and frees the page lists they read. */
int64_t ekv_cache_free_pages(const ekv_cache *c) {
    if (!c) return 0;
    if (ekv_ctx_enter(c->ctx)) return -1;
    const int64_t n = c->n_free;
    ekv_ctx_leave(c->ctx);
    return n;
}

static ekv_status seq_new_run(ekv_cache *c, int32_t *seq_out) {
    for (int32_t i = 0; i < c->p.max_seqs; i++) {
        if (!c->seqs[i].alive) {
            c->seqs[i].alive = 1;
            c->seqs[i].len = 0;
            c->seqs[i].npages = 0;
            ekv_seq_touch(c, &c->seqs[i]);
            *seq_out = i;
            return EKV_OK;
        }
    }
    return ekv_fail(c->ctx, EKV_ERR_INVALID_SEQUENCE, "all %d sequence slots are in use (max_seqs)",
                    c->p.max_seqs);
}

ekv_status ekv_cache_seq_new(ekv_cache *c, int32_t *seq_out) {
    if (!c || !seq_out)
        return ekv_fail(c ? c->ctx : NULL, EKV_ERR_NULL_POINTER, "%s is NULL",
                        !c ? "cache" : "seq_out");
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st, seq_new_run(c, seq_out));
    return st;
}

ekv_status ekv_cache_lookup_seq(const ekv_cache *c, int32_t seq, const ekv_seq **out) {
    if (seq < 0 || seq >= c->p.max_seqs || !c->seqs[seq].alive)
        return ekv_fail(c->ctx, EKV_ERR_INVALID_SEQUENCE, "sequence %d does not exist", seq);
    *out = &c->seqs[seq];
    return EKV_OK;
}

static ekv_status seq_free_run(ekv_cache *c, int32_t seq) {
    const ekv_seq *cs;
    ekv_status st = ekv_cache_lookup_seq(c, seq, &cs);
    if (st) return st;
    ekv_seq *s = &c->seqs[seq];
    for (int64_t i = s->npages - 1; i >= 0; i--) {
        c->count[s->pages[i]] = 0;
        c->free_pages[c->n_free++] = s->pages[i];
    }
    s->npages = 0;
    s->len = 0;
    s->alive = 0;
    ekv_seq_touch(c, s);
    return EKV_OK;
}

ekv_status ekv_cache_seq_free(ekv_cache *c, int32_t seq) {
    if (!c) return EKV_ERR_NULL_POINTER;
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st, seq_free_run(c, seq));
    return st;
}

/* The length (or the version) of a live sequence: one reader for both public calls. */
static ekv_status seq_read_run(const ekv_cache *c, int32_t seq, int64_t *len_out,
                               uint64_t *version_out) {
    const ekv_seq *s = NULL;
    ekv_status st = ekv_cache_lookup_seq(c, seq, &s);
    if (st) return st;
    if (len_out) *len_out = s->len;
    if (version_out) *version_out = s->version;
    return EKV_OK;
}

/* The checks and the guard of the two sequence reads (out names the caller's output). */
static ekv_status seq_read(const ekv_cache *c, int32_t seq, int64_t *len_out, uint64_t *version_out,
                           const char *out) {
    if (!c || (!len_out && !version_out))
        return ekv_fail(c ? c->ctx : NULL, EKV_ERR_NULL_POINTER, "%s is NULL", !c ? "cache" : out);
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st, seq_read_run(c, seq, len_out, version_out));
    return st;
}

ekv_status ekv_cache_seq_length(const ekv_cache *c, int32_t seq, int64_t *len_out) {
    return seq_read(c, seq, len_out, NULL, "len_out");
}

ekv_status ekv_cache_seq_version(const ekv_cache *c, int32_t seq, uint64_t *version_out) {
    return seq_read(c, seq, NULL, version_out, "version_out");
}

static ekv_status kv_view_run(const ekv_cache *c, ekv_paged_kv *kv, ekv_page_stats *stats) {
    if (kv) {
        kv->k = c->k;
        kv->v = c->v;
        kv->dtype = c->p.dtype;
        kv->page_size = c->p.page_size;
        kv->num_kv_heads = c->p.num_kv_heads;
        kv->head_dim = c->p.head_dim;
        kv->num_pages = c->p.num_pages;
        kv->stride_token = c->stride_token;
        kv->stride_head = c->stride_head;
        kv->stride_page = c->elems_per_page;
    }
    if (stats) {
        stats->kmin = c->kmin;
        stats->kmax = c->kmax;
        stats->kmean = c->kmean;
        stats->km2 = c->km2;
        stats->radius = c->radius;
        stats->count = c->count;
        stats->superpage_pages = c->smin ? c->p.superpage_pages : 0;
        stats->smin = c->smin;
        stats->smax = c->smax;
        stats->codes = c->codes;
        stats->code_bits = c->codes ? c->p.code_bits : 0;
        stats->range_dtype = c->kmin16 ? c->p.range_dtype : EKV_DTYPE_F32;
        stats->kmin16 = c->kmin16;
        stats->kmax16 = c->kmax16;
        stats->kmean16 = c->kmean16;
        stats->radius16 = c->radius16;
        stats->num_superpages =
                c->smin ? (c->p.num_pages + c->p.superpage_pages - 1) / c->p.superpage_pages : 0;
        stats->num_pages = c->p.num_pages;
        stats->num_kv_heads = c->p.num_kv_heads;
        stats->head_dim = c->p.head_dim;
        stats->page_size = c->p.page_size;
    }
    return EKV_OK;
}

ekv_status ekv_cache_kv_view(const ekv_cache *c, ekv_paged_kv *kv, ekv_page_stats *stats) {
    if (!c || (!kv && !stats))
        return ekv_fail(c ? c->ctx : NULL, EKV_ERR_NULL_POINTER, "%s",
                        !c ? "cache is NULL" : "kv_out and stats_out are both NULL");
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st, kv_view_run(c, kv, stats));
    return st;
}

/* Builds the table once the arguments are checked (inside the context's guard). */
static ekv_status page_table_run(const ekv_cache *c, const int32_t *seqs, int32_t n_seqs,
                                 int64_t *indptr, int32_t *indices, int64_t indices_capacity,
                                 int32_t *last_page_len, int64_t *needed) {
    int64_t total = 0;
    for (int32_t b = 0; b < n_seqs; b++) {
        const ekv_seq *s = NULL;
        ekv_status st = ekv_cache_lookup_seq(c, seqs[b], &s);
        if (st) return st;
        total += s->npages;
    }
    if (indices_capacity < total && indices)
        return ekv_fail(c->ctx, EKV_ERR_INVALID_SIZE,
                        "indices has room for %lld page ids, %lld needed",
                        (long long)indices_capacity, (long long)total);
    if (needed) *needed = total; /* after the checks: outputs are untouched on error */
    if (!indices) return EKV_OK;
    int64_t off = 0;
    indptr[0] = 0;
    for (int32_t b = 0; b < n_seqs; b++) {
        const ekv_seq *s = &c->seqs[seqs[b]];
        if (s->npages)
            memcpy(indices + off, s->pages,
                   (size_t)s->npages * sizeof(int32_t)); /* pages may be NULL */
        off += s->npages;
        indptr[b + 1] = off;
        last_page_len[b] = s->npages ? (int32_t)(s->len - (s->npages - 1) * c->p.page_size) : 0;
    }
    return EKV_OK;
}

ekv_status ekv_cache_page_table(const ekv_cache *c, const int32_t *seqs, int32_t n_seqs,
                                int64_t *indptr, int32_t *indices, int64_t indices_capacity,
                                int32_t *last_page_len, int64_t *needed) {
    if (!c || !seqs || (indices && (!indptr || !last_page_len)))
        return ekv_fail(c ? c->ctx : NULL, EKV_ERR_NULL_POINTER,
                        "cache, seqs, indptr and last_page_len must not be NULL");
    if (!indices && !needed)
        return ekv_fail(c->ctx, EKV_ERR_NULL_POINTER,
                        "indices and needed are both NULL: nothing to return");
    if (n_seqs <= 0)
        return ekv_fail(c->ctx, EKV_ERR_INVALID_SIZE, "n_seqs=%d must be >= 1", n_seqs);
    ekv_status st = EKV_OK;
    EKV_GUARDED(c->ctx, st,
                page_table_run(c, seqs, n_seqs, indptr, indices, indices_capacity, last_page_len,
                               needed));
    return st;
}
