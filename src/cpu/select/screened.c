/*
 * Screened selection (docs/math.md §10): the rows the screen keeps (../stages/screen_rows.c),
 * laid out in the step arena, since attention reads them after the screen; and their page-list
 * form for ekv_select_pages. ekv_decode's screened runner (../methods/screened.c) takes the rows
 * and attends over them alone. Only an entry point calls these: the step arena is theirs, and
 * no runner keeps a list of its own there while they run.
 */
#include "select.h"

ekv_status ekv_select_screened_rows(ekv_context *ctx, const ekv_decode_params *prm,
                                    const ekv_select_params *sel, const ekv_paged_kv *kv,
                                    const ekv_page_stats *st, const ekv_page_table *t,
                                    const float *q, ekv_screen_rows *r) {
    int64_t sz[EKV_SCREEN_ROWS_BLOCKS], off[EKV_SCREEN_ROWS_BLOCKS];
    ekv_cpu_screen_rows_sizes(prm, sel, kv, t, sz);
    ekv_status s;
    char *m = ekv_step_blocks(ctx, sz, EKV_SCREEN_ROWS_BLOCKS, off, "screened rows", &s);
    if (!m) return s;
    *r = ekv_cpu_screen_rows_at(m, off);
    return ekv_cpu_screen_rows(ctx, prm, sel, kv, st, t, q, r);
}

/* The page-list form (ekv_select_pages): every page holding a surviving row, the last page
 * always. Attention over these pages is exact too; the decode path reads the rows only. */
ekv_status ekv_select_screened(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_page_list *list) {
    ekv_screen_rows r;
    ekv_status s = ekv_select_screened_rows(ctx, prm, sel, kv, st, t, q, &r);
    if (s) return s;
    const int64_t ps = kv->page_size, heads = r.rl.heads;
    int64_t w = 0;
    list->indptr[0] = 0;
    for (int64_t li = 0; li < t->batch * heads; li++) {
        const int64_t P = ekv_seq_pages(t->indptr, li / heads), *rows = r.rl.rows + r.rl.start[li];
        int64_t last = -1;
        for (int64_t i = 0; i < r.rl.count[li]; i++)
            if (rows[i] / ps != last) list->pages[w++] = (int32_t)(last = rows[i] / ps);
        if (last != P - 1) list->pages[w++] = (int32_t)(P - 1);
        list->indptr[li + 1] = w;
    }
    list->bytes_summary = r.bytes_summary;
    list->survivors = r.survivors;
    return EKV_OK;
}
