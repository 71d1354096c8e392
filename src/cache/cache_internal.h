/* Internal layout of ekv_cache, shared by cache.c (pool) and summaries.c (statistics). */
#ifndef EKV_CACHE_INTERNAL_H
#define EKV_CACHE_INTERNAL_H
#include "../core/internal.h"
#include "../core/codes.h"

typedef struct ekv_seq {
    int alive;
    int64_t len;
    int32_t *pages;
    int64_t npages, cap;
    uint64_t version; /* ekv_cache_seq_version: the cache's clock at the sequence's last change */
} ekv_seq;

struct ekv_cache {
    ekv_context *ctx;
    ekv_cache_params p;
    int64_t elems_per_page;            /* num_kv_heads * page_size * head_dim */
    int64_t stride_head, stride_token; /* in elements, by the layout (ekv_cache_row) */
    void *k, *v;                       /* the pool's, or the caller's (params.k_pool) */
    float *kmin, *kmax, *kmean, *km2;  /* [page][head][dim] */
    float *radius;                     /* [page][head] */
    float *smin, *smax;                /* [superpage][head][dim], NULL without superpages */
    uint16_t *kmin16, *kmax16; /* kmin/kmax rounded outward to range_dtype (docs/math.md §1.2),
                                * NULL with fp32 ranges */
    uint16_t *kmean16;         /* compact ball (docs/math.md §9.5): kmean rounded to the nearest */
    float *radius16;           /* finite range_dtype value, and the radius around that centre */
    uint8_t *codes;            /* [page][head][slot][code row], NULL without codes (codes.c) */
    uint8_t *in_super;         /* [page] 1 if the page's keys may still be in its superpage box */
    int32_t *count;            /* [page] tokens in the page */
    int32_t *free_pages;       /* stack of free page ids */
    int64_t n_free;
    ekv_seq *seqs; /* [max_seqs] */
    uint64_t clock; /* counts the changes to sequences: versions never repeat (2^64 changes) */
};

/* Every change to a sequence (new, append, truncate, adopt, free) gives it a new version, so a
 * page table built before the change is known to be stale (ekv_cache_seq_version). */
static inline void ekv_seq_touch(ekv_cache *c, ekv_seq *s) { s->version = ++c->clock; }

/* The range decode reads at flat index i ((page * num_kv_heads + head) * D + d), as fp32: the
 * compact copy when the cache keeps one (the key codes follow it), else kmin/kmax. */
static inline void ekv_cache_range_at(const ekv_cache *c, int64_t i, float *mn, float *mx) {
    *mn = c->kmin16 ? ekv_load_f32(c->kmin16, c->p.range_dtype, i) : c->kmin[i];
    *mx = c->kmin16 ? ekv_load_f32(c->kmax16, c->p.range_dtype, i) : c->kmax[i];
}

/* Element offset of (page, head, slot) in K and V: the page layout, written once. */
static inline int64_t ekv_cache_row(const ekv_cache *c, int64_t page, int64_t head, int64_t slot) {
    return page * c->elems_per_page + head * c->stride_head + slot * c->stride_token;
}

ekv_status ekv_cache_lookup_seq(const ekv_cache *c, int32_t seq, const ekv_seq **out);

/* summaries.c */
void ekv_summary_reset_page(ekv_cache *c, int32_t page);
/* Adds one stored key row (already in storage precision, as floats) to the running
 * statistics of (page, head); `n` is the token count after adding it. */
void ekv_summary_add_row(ekv_cache *c, int32_t page, int32_t head, const float *row, int32_t n);
/* The page's summaries, codes and superpage box from its first `count` stored keys, as appends
 * build them (row: head_dim floats of scratch). */
void ekv_summary_rebuild_page(ekv_cache *c, int32_t page, int32_t count, float *row);
/* Writes the compact copy of (page, head)'s range (rounded outward), if the cache keeps one. */
void ekv_summary_round_ranges(ekv_cache *c, int32_t page, int32_t head);
/* Recomputes the superpage box of the superpage holding `page` from its pages (all heads). */
void ekv_summary_rebuild_superpage(ekv_cache *c, int32_t page);
/* Bytes of the key codes of a pool (cache.c). */
int64_t ekv_cache_code_bytes(const ekv_cache_params *p);
/* Re-derives the codes of every token of (page, head) from the stored keys and the page's
 * current range (codes.c): after an append widened a range, no code is stale. */
void ekv_codes_update_page(ekv_cache *c, int32_t page, int32_t head);
/* The summaries that depend on the whole page, once its new rows are in: the radius (around
 * the moved mean), the compact range and the key codes (against the widened range as decode
 * reads it). */
void ekv_summary_page_done(ekv_cache *c, int32_t page, int32_t head);
/* Recomputes the exact radius of (page, head) from the stored keys and stored mean. */
void ekv_summary_update_radius(ekv_cache *c, int32_t page, int32_t head);
#endif
