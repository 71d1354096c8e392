/* The CPU bound stage (bound.c), used by the selection policies (../select). */
#ifndef EKV_CPU_BOUND_H
#define EKV_CPU_BOUND_H
#include "../../core/internal.h"

/*
 * Page bounds u[(b*H + h)*ustride + p] for pages p in [0, P_b - 1) of every sequence and
 * query head (z-space, ALiBi bonus included): the box bound, or with with_ball the certified
 * min(box, ball) + rounding slack (bound.c); with tau_lb (certified bounds and a cache with
 * superpages) pages of superpages already below tau_lb get the superpage bound and their
 * summaries are not read. *bytes_read = summary bytes read. Arguments must already be
 * validated.
 */
/* Pages per bound task (a task is a chunk of one sequence's pages); pages per kernel call. */
enum { EKV_BOUND_CHUNK_PAGES = 256, EKV_BOUND_STEP = 8 };
/* The stage's scratch. The caller lays it out in its own workspace blocks: the stage runs
 * inside the selection's use of the workspace (docs/architecture.md, "Scratch memory"), so
 * taking a workspace of its own would invalidate the caller's. */
typedef struct ekv_cpu_bound_scratch {
    float *qsplit;     /* ekv_cpu_bound_scratch_floats(B, H, G, D) */
    int64_t *task_off; /* [B + 1] */
    int64_t *bytes;    /* [ekv_cpu_bound_max_tasks(B, maxP)] summary bytes read per task */
    double *qnorm1;    /* [B*H] */
    int64_t *sp_sid;   /* [n_threads * Hk] */
    float *sp_u;       /* [n_threads * H] */
    float *ranges;     /* [n_threads * EKV_BOUND_STEP * 3 D]: compact ranges and ball
                        * centres as fp32 (ekv_cpu_bound_ranges_floats) */
} ekv_cpu_bound_scratch;
static inline int64_t ekv_cpu_bound_scratch_floats(int64_t B, int64_t H, int64_t G, int64_t D) {
    return 3 * B * H * D + G * D + 2 * B * H + 16;
}
/* Floats of the compact scratch (ranges and centres converted to fp32; 0 with fp32 ranges). */
static inline int64_t ekv_cpu_bound_ranges_floats(ekv_dtype range_dtype, int64_t n_threads,
                                                  int64_t D) {
    return range_dtype == EKV_DTYPE_F32 ? 0 : n_threads * EKV_BOUND_STEP * 3 * D;
}
static inline int64_t ekv_cpu_bound_max_tasks(int64_t B, int64_t max_pages) {
    return B * ((max_pages + EKV_BOUND_CHUNK_PAGES - 1) / EKV_BOUND_CHUNK_PAGES);
}
/* The scratch's blocks, for the caller's ekv_workspace_blocks: their sizes in bytes (into
 * sz[0 .. EKV_BOUND_BLOCKS)), then the scratch at the offsets the workspace gave them. */
enum { EKV_BOUND_BLOCKS = 7 };
static inline void ekv_cpu_bound_scratch_sizes(const ekv_context *ctx, const ekv_paged_kv *kv,
                                               const ekv_page_stats *st, int64_t B, int64_t H,
                                               int64_t max_pages, int64_t *sz) {
    const int64_t W = ctx->n_threads, G = H / kv->num_kv_heads, D = kv->head_dim;
    sz[0] = ekv_cpu_bound_scratch_floats(B, H, G, D) * 4;
    sz[1] = (B + 1) * 8;
    sz[2] = ekv_cpu_bound_max_tasks(B, max_pages) * 8;
    sz[3] = B * H * 8;
    sz[4] = W * kv->num_kv_heads * 8;
    sz[5] = W * H * 4;
    sz[6] = ekv_cpu_bound_ranges_floats(st->range_dtype, W, D) * 4;
}
static inline ekv_cpu_bound_scratch ekv_cpu_bound_scratch_at(char *ws, const int64_t *off) {
    const ekv_cpu_bound_scratch s = {(float *)(ws + off[0]),   (int64_t *)(ws + off[1]),
                                     (int64_t *)(ws + off[2]), (double *)(ws + off[3]),
                                     (int64_t *)(ws + off[4]), (float *)(ws + off[5]),
                                     (float *)(ws + off[6])};
    return s;
}
/* The bound of page p for a list of query heads h0 .. h0 + hn of sequence b: the largest of
 * theirs (u as ekv_cpu_bound_pages writes it). */
static inline float ekv_cpu_list_bound(const float *u, int64_t ustride, int64_t b, int64_t H,
                                       int64_t h0, int64_t hn, int64_t p) {
    float m = -INFINITY;
    for (int64_t h = h0; h < h0 + hn; h++) {
        const float v = u[(b * H + h) * ustride + p];
        m = v > m ? v : m;
    }
    return m;
}
ekv_status ekv_cpu_bound_pages(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_paged_kv *kv, const ekv_page_stats *st,
                               const ekv_page_table *tab, const float *q, float *u, int64_t ustride,
                               const ekv_cpu_bound_scratch *scr, int with_ball,
                               const double *tau_lb, int64_t *bytes_read);
#endif
