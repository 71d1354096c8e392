/*
 * Screened decode (docs/math.md §10), the runner: the rows the screen keeps from the key codes
 * (../select/screened.c, in the step arena), then attention over those rows alone
 * (../stages/attend_pages.c), which reads K of the surviving rows only and solves tau exactly on
 * them: dense entmax (§10.3).
 */
#include "../../core/method.h"
#include "../select/select.h"
#include "methods.h"

ekv_status ekv_cpu_screened_run(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                float *out, ekv_decode_info *info) {
    ekv_screen_rows r;
    ekv_status s = ekv_check_stats(ctx, ekv_method_info_of(sel->method), 0, kv, st);
    if (!s) s = ekv_select_screened_rows(ctx, prm, sel, kv, st, t, q, &r);
    if (s) return s;
    const ekv_lists_args a = {.mode = EKV_LISTS_OUTPUT, .rows = &r.rl, .out = out, .info = info};
    s = ekv_cpu_attend_lists(ctx, prm, kv, t, q, &a);
    if (!s && info) {
        info->bytes_summary = r.bytes_summary;
        info->survivors = r.survivors;
        info->pages_touched = ekv_cpu_screen_row_pages(&r.rl, t->batch * r.rl.heads, kv->page_size);
    }
    return s;
}
