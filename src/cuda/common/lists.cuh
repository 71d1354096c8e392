/*
 * The page lists the selectors write (select/select.cu, select/gaussian.cu,
 * sharded/sharded_select.cu, and certified's hinted round 1 in stages/bound.cu): the plan's
 * lists per KV head or per query head, and the device steps that write a list in page order.
 */
#pragma once
#include "entmaxkv.h"
#include <stdint.h>
#include "plan.cuh"
#include "reduce.cuh"
#include "../../math/shard_select.h"

/* The page lists a select kernel writes: one per KV head (the group's max decides), or with
 * per_query_head one per query head (then ekv_cuda_launch_union merges them per KV head). */
struct ekv_cuda_lists {
    int lps, lh; /* lists per sequence (Hk or H), query heads per list (G or 1) */
    int32_t *pages, *count;
    uint8_t *in;
};
inline ekv_cuda_lists ekv_cuda_lists_of(const ekv_cuda_plan *pl, int per_head) {
    ekv_cuda_lists l;
    l.lps = per_head ? pl->p.num_heads : pl->p.num_kv_heads;
    l.lh = per_head ? 1 : pl->p.num_heads / pl->p.num_kv_heads;
    l.pages = per_head ? pl->hlist_pages : pl->list_pages;
    l.count = per_head ? pl->hlist_count : pl->list_count;
    l.in = per_head ? pl->hlist_in : pl->in_list;
    return l;
}

/* Whether a round-1 list must hold page p of a sequence of P pages whatever its rank: one of the
 * first `sink` pages or of the `recent` before the last (the last page itself is closed in by
 * the list's writer: ekv_close_list, or the bound stage's hinted list). */
__device__ __forceinline__ bool ekv_list_forces_page(int64_t p, int64_t P, int sink, int recent) {
    return p < sink || p >= P - 1 - recent;
}

/* Ordered compaction of one tile of a page list (top-k select, gaussian rule, round 2): each
 * thread holds UNROLL consecutive pages from lo, take[u] says whether page lo + u (< n) is kept.
 * The kept pages go to out[*written ...] in page order, in[] (unless NULL) records membership,
 * and *written advances by the tile's total (the same in every thread). One block scan per
 * tile. With mask_out, each kept page's mask[u] goes to mask_out at its list position. */
template <int UNROLL>
__device__ __forceinline__ void ekv_compact_tile(const bool *take, int64_t lo, int64_t n,
                                                 int32_t *out, uint8_t *in, int *written,
                                                 int *wsum, const uint16_t *mask = nullptr,
                                                 uint16_t *mask_out = nullptr) {
    int cnt = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) cnt += lo + u < n && take[u];
    int tile_taken;
    int pos = *written + ekv_block_exclusive_scan(cnt, wsum, &tile_taken);
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        if (lo + u < n) {
            if (take[u]) {
                if (mask_out) mask_out[pos] = mask[u];
                out[pos++] = (int32_t)(lo + u);
            }
            if (in) in[lo + u] = take[u];
        }
    }
    *written += tile_taken;
}

/* ekv_compact_tile's count alone: *written advances by the tile's pages taken (take[u] false
 * past the end), nothing is written (a part's count before its pages, select_parts.cuh). */
template <int UNROLL>
__device__ __forceinline__ void ekv_count_tile(const bool *take, int *written, int *wsum) {
    int cnt = 0, tile_taken;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) cnt += take[u];
    ekv_block_exclusive_scan(cnt, wsum, &tile_taken);
    *written += tile_taken;
}

/* Closes a round-1 page list of `written` pages: the last page (P - 1) is always read and
 * always last (its membership flag in in[]). One thread. */
__device__ __forceinline__ void ekv_close_list(int32_t *out, uint8_t *in, int written, int64_t P,
                                               int32_t *list_count, int row) {
    out[written] = (int32_t)(P - 1);
    if (P >= 1) in[P - 1] = 1;
    list_count[2 * row] = written + 1;
    list_count[2 * row + 1] = written + 1;
}

/* Closes a selector's round-1 list of `written` pages of a table at `pos` in its sequence
 * (EKV_SHARD_*, src/math/shard_select.h): ekv_close_list, except that a shard before the last
 * forces no page (its last page was ranked like the others; its list may be empty). */
__device__ __forceinline__ void ekv_close_shard_list(int32_t *out, uint8_t *in, int written,
                                                     int64_t P, int32_t *list_count, int row,
                                                     int pos) {
    if (pos != EKV_SHARD_INNER) {
        ekv_close_list(out, in, written, P, list_count, row);
        return;
    }
    list_count[2 * row] = written;
    list_count[2 * row + 1] = written;
}
