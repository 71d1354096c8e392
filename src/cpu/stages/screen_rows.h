/*
 * The screen of a step (screen_rows.c, docs/math.md §10.3): every list's rows whose upper
 * bound beats tau of the lower bounds, from the key codes, without reading K. The rows must
 * outlive the stage (attention reads them after the screen's workspace is gone), so they live
 * in the caller's memory, laid out with ekv_cpu_screen_rows_sizes and ekv_cpu_screen_rows_at.
 */
#ifndef EKV_CPU_SCREEN_ROWS_H
#define EKV_CPU_SCREEN_ROWS_H
#include "attend.h"

typedef struct ekv_screen_rows {
    int64_t *rows, *start, *count; /* the caller's memory; filled as ekv_row_lists describes */
    int64_t *pairs;                /* [lists] surviving (token, query head) pairs per list */
    ekv_row_lists rl;              /* out: the lists (heads, start, count, rows)           */
    int64_t bytes_summary;         /* out: range and code bytes read (not the pages dropped) */
    int64_t survivors;             /* out: surviving (token, query head) pairs in all      */
} ekv_screen_rows;

/* The rows' blocks for the step: their sizes in bytes (into sz[0 .. EKV_SCREEN_ROWS_BLOCKS)),
 * then the rows at the offsets the caller's arena gave them. */
enum { EKV_SCREEN_ROWS_BLOCKS = 4 };
void ekv_cpu_screen_rows_sizes(const ekv_decode_params *prm, const ekv_select_params *sel,
                               const ekv_paged_kv *kv, const ekv_page_table *t, int64_t *sz);
static inline ekv_screen_rows ekv_cpu_screen_rows_at(char *m, const int64_t *off) {
    ekv_screen_rows r = {0};
    r.rows = (int64_t *)(m + off[0]);
    r.start = (int64_t *)(m + off[1]);
    r.count = (int64_t *)(m + off[2]);
    r.pairs = (int64_t *)(m + off[3]);
    return r;
}
/* Screens the step (arguments validated, the statistics checked) into r's rows. */
ekv_status ekv_cpu_screen_rows(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_screen_rows *r);
/* (page, list) pairs holding a surviving row of lists rl [0, lists): the pages whose K the
 * attention touches. */
int64_t ekv_cpu_screen_row_pages(const ekv_row_lists *rl, int64_t lists, int64_t page_size);
#endif
