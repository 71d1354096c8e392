/*
 * Step geometry, written once for the CPU and the CUDA backends (docs/architecture.md,
 * "Page table and page lists"): a sequence's pages and tokens from the CSR page table, the
 * query heads a page list serves, and the default score scale.
 */
#ifndef EKV_GEOMETRY_H
#define EKV_GEOMETRY_H
#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define EKV_GEOM static __host__ __device__ __forceinline__
#else
#define EKV_GEOM static inline
#endif

/* The token budget of a sequence of n tokens: fraction of it (at least one token) when
 * fraction > 0, else budget_tokens (the select params' budget_fraction / budget_tokens); never
 * more than n. The one rule of every budgeted method and backend: a budget past a short
 * sequence's length reads all of it, in a batch too (each sequence its own). */
EKV_GEOM int64_t ekv_seq_budget_tokens(double fraction, int64_t budget_tokens, int64_t n) {
    const int64_t b = fraction > 0.0 ? (int64_t)(fraction * (double)n) : budget_tokens;
    return b > n ? n : fraction > 0.0 && b < 1 ? 1 : b;
}

/* Pages of sequence b. */
EKV_GEOM int64_t ekv_seq_pages(const int64_t *indptr, int64_t b) {
    return indptr[b + 1] - indptr[b];
}

/* Tokens of sequence b: every page but the last is full. */
EKV_GEOM int64_t ekv_seq_len(const int64_t *indptr, const int32_t *last_page_len, int64_t b,
                             int64_t page_size) {
    return (indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b];
}

/* The most pages, and the most tokens, of a sequence of the table (at least 1). */
EKV_GEOM int64_t ekv_table_max_pages(const int64_t *indptr, int64_t batch) {
    int64_t m = 1;
    for (int64_t b = 0; b < batch; b++)
        m = ekv_seq_pages(indptr, b) > m ? ekv_seq_pages(indptr, b) : m;
    return m;
}
EKV_GEOM int64_t ekv_table_max_len(const int64_t *indptr, const int32_t *last_page_len,
                                   int64_t batch, int64_t page_size) {
    int64_t m = 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = ekv_seq_len(indptr, last_page_len, b, page_size);
        m = n > m ? n : m;
    }
    return m;
}

/* Tokens in logical page p of a sequence with P pages. */
EKV_GEOM int64_t ekv_page_tokens(int64_t p, int64_t P, int32_t last_page_len, int64_t page_size) {
    return p == P - 1 ? last_page_len : page_size;
}

/* A page list serves one query head (heads == num_heads: per-query-head lists) or the G
 * query heads of one KV head. First query head of list l, and how many it serves. */
EKV_GEOM int64_t ekv_list_head0(int64_t l, int64_t heads, int64_t num_heads, int64_t group) {
    return heads == num_heads ? l : l * group;
}
EKV_GEOM int64_t ekv_list_nheads(int64_t heads, int64_t num_heads, int64_t group) {
    return heads == num_heads ? 1 : group;
}

/* Split-KV (docs/architecture.md, CUDA split-KV): the splits of a sequence of `pages` pages in
 * a batch of `batch` sequences holding `all` pages, with `base` splits per sequence in a uniform
 * batch: its share of S shares (ekv_split_shares), ceil(S pages / all), at least 1 and at most
 * cap. Rounded up, so no split holds more than all / S pages unless the cap binds (a floor left
 * a row of just under two splits' worth one block). The counts of a batch sum to less than
 * S + batch (a share rounded up gains less than 1, an empty sequence's 0 raised to 1 gains 1,
 * and the shares sum to S): the flat grid of ekv_split_grid. A uniform batch gets base each. */
enum { EKV_SPLIT_ONE_WAVE_MIN = 3 };
/* S: from base = 3 on, base * batch - batch + 1, so the grid is base * batch, the one wave the
 * plan sized base for (shares of base * batch rounded up overflowed it by up to batch - 1
 * blocks, a second wave as long as the first: 286 score blocks for 264 slots on a batch of 16
 * from 8K to 64K tokens); below, base * batch: shrunk shares would make the splits up to twice
 * (base 2) or batch times (base 1: one split a sequence) as long, where the batch's rows
 * overfill a wave anyway (base 1: H 32, KV 32, batch 16, 19% slower). */
EKV_GEOM int64_t ekv_split_shares(int64_t base, int64_t batch) {
    return base >= EKV_SPLIT_ONE_WAVE_MIN ? base * batch - batch + 1 : base * batch;
}
EKV_GEOM int64_t ekv_split_count(int64_t base, int64_t batch, int64_t pages, int64_t all,
                                 int64_t cap) {
    const int64_t shares = ekv_split_shares(base, batch);
    int64_t n = all > 0 ? (shares * pages + all - 1) / all : 1;
    return n < 1 ? 1 : n > cap ? cap : n;
}
EKV_GEOM int64_t ekv_split_grid(int64_t base, int64_t batch) {
    return ekv_split_shares(base, batch) + batch - 1;
}

/* The score scale: the caller's, or 1/sqrt(head_dim) when it is 0 (in double; the CPU
 * attention kernels round it to float before use). */
EKV_GEOM double ekv_effective_scale(float scale, int64_t head_dim) {
    return scale > 0.f ? (double)scale : 1.0 / sqrt((double)head_dim);
}
#endif
