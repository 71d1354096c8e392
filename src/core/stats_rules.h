/*
 * Which page summaries the bounds read, written once for the CPU and the CUDA backends (host
 * code): the compact ball (docs/math.md §9.5) and the bytes of a page's ball.
 */
#ifndef EKV_STATS_RULES_H
#define EKV_STATS_RULES_H
#include "entmaxkv.h"

/* Whether the ball bounds read the compact ball: compact ranges and the centres kmean16 with
 * their radii radius16 kept; else the fp32 kmean and radius. */
static inline int ekv_compact_ball(const ekv_page_stats *st) {
    return st->range_dtype != EKV_DTYPE_F32 && st->kmean16 && st->radius16;
}

/* Bytes of one page's ball (centre and radius, one KV head) as the bounds read it. */
static inline int64_t ekv_ball_bytes(const ekv_page_stats *st, int64_t D) {
    return D * (ekv_compact_ball(st) ? 2 : 4) + 4;
}
#endif
