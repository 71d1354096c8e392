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

/* Pages of sequence b. */
/* The token budget of a sequence of n tokens: fraction of it (at least one token, at most n)
 * when fraction > 0, else budget_tokens (the select params' budget_fraction / budget_tokens). */
EKV_GEOM int64_t ekv_seq_budget_tokens(double fraction, int64_t budget_tokens, int64_t n) {
    if (!(fraction > 0.0)) return budget_tokens;
    const int64_t b = (int64_t)(fraction * (double)n);
    return b < 1 ? 1 : b > n ? n : b;
}

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

/* The score scale: the caller's, or 1/sqrt(head_dim) when it is 0 (in double; the CPU
 * attention kernels round it to float before use). */
EKV_GEOM double ekv_effective_scale(float scale, int64_t head_dim) {
    return scale > 0.f ? (double)scale : 1.0 / sqrt((double)head_dim);
}
#endif
