/*
 * The method table (docs/architecture.md, "Methods and the stage table"): which stages each
 * select method runs, which backends serve it, and what it needs. The CPU entry point
 * (src/cpu/methods/decode.c), the CUDA step (src/cuda/plan/decode.cu), the model engine and the
 * tools all read this one table, and ekv_decode_supported (method.c) is the one check they all
 * run.
 */
#ifndef EKV_METHOD_H
#define EKV_METHOD_H
#include "internal.h"

enum {
    EKV_STAGE_BOUND = 1u << 0,  /* a bound on every page's scores (box, or min(box, ball))   */
    EKV_STAGE_TOPK = 1u << 1,   /* page lists: the best pages by bound within the budget      */
    EKV_STAGE_GAUSS = 1u << 2,  /* page lists: score moments + the Gaussian page rule         */
    EKV_STAGE_ORACLE = 1u << 3, /* page lists: the pages of the dense support (evaluation)    */
    EKV_STAGE_ROUND2 = 1u << 4, /* certified: add the pages whose bound beats round 1's tau   */
    EKV_STAGE_SCREEN = 1u << 5, /* page lists: the pages with a token the key codes keep       */
    EKV_STAGES_LIST = EKV_STAGE_TOPK | EKV_STAGE_GAUSS | EKV_STAGE_ORACLE | EKV_STAGE_SCREEN
};

enum {
    EKV_NEEDS_MINMAX = 1u << 0,
    EKV_NEEDS_BALL = 1u << 1,
    EKV_NEEDS_MOMENTS = 1u << 2,
    EKV_NEEDS_CODES = 1u << 3
};

typedef struct ekv_method_info {
    const char *name;
    unsigned stages;   /* EKV_STAGE_* run before attention (attention always runs)         */
    unsigned backends; /* bit (1u << ekv_backend) per backend that serves it              */
    unsigned needs;    /* EKV_NEEDS_*: the page statistics it reads                       */
    int entmax_only;   /* 1: needs exact zeros (alpha > 1)                                 */
    int budgeted;      /* 1: reads budget_tokens / budget_fraction                        */
} ekv_method_info;

/* The row of a method, or NULL for a value outside the enum. */
const ekv_method_info *ekv_method_info_of(ekv_select_method method);
/* The select method of a step (select NULL = dense). */
static inline ekv_select_method ekv_step_method(const ekv_select_params *select) {
    return select ? select->method : EKV_SELECT_DENSE;
}
/* Certified round 0's pages (docs/math.md §9.6): the last page and the recent_pages before it,
 * 4 without recent pages; int64: recent_pages + 1 overflows int32 at INT32_MAX. */
static inline int64_t ekv_round0_pages(const ekv_select_params *s) {
    return s->recent_pages > 0 ? (int64_t)s->recent_pages + 1 : 4;
}
/* The token budget of a sequence of n tokens (the rule is ekv_seq_budget_tokens's). */
static inline int64_t ekv_seq_budget(const ekv_select_params *s, int64_t n) {
    return ekv_seq_budget_tokens(s->budget_fraction, s->budget_tokens, n);
}
/* The page statistics a method reads are present (host-side pointer checks only), and for a
 * bound stage, the superpage summaries (if any) cover every physical page of kv. */
ekv_status ekv_check_stats(ekv_context *ctx, const ekv_method_info *mi, int use_ball,
                           const ekv_paged_kv *kv, const ekv_page_stats *st);
/* The statistics describe kv's pool (ekv_page_stats' counts): every physical page kv
 * addresses, its KV heads, head dim and page size. The one check of every entry point that
 * takes a view and statistics (ekv_check_stats runs it; the CUDA append too). */
ekv_status ekv_check_stats_shape(ekv_context *ctx, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st);
/* Superpage summaries (smin set) cover every physical page of kv (the bound indexes them by
 * physical page / superpage_pages); smin = NULL: none, fine. */
ekv_status ekv_check_superpages(ekv_context *ctx, const ekv_paged_kv *kv,
                                const ekv_page_stats *st);
#endif
