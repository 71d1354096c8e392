/*
 * The CPU backend's method runners (docs/architecture.md, "Methods and the stage table"): what
 * ekv_decode (decode.c) runs for each select method once the step is validated. Dense calls the
 * dense stage itself; topk, gaussian and oracle select page lists (../select) and attend over
 * them (decode.c); certified and screened are runners of their own. The step arena holds what
 * one stage leaves for the next (page lists, bounds, rows).
 */
#ifndef EKV_CPU_METHODS_H
#define EKV_CPU_METHODS_H
#include "../../core/internal.h"

/* A page list for the list methods (per KV head, or per query head), in the step arena. */
ekv_status ekv_cpu_step_list(ekv_context *ctx, const ekv_decode_params *prm,
                             const ekv_select_params *sel, const ekv_paged_kv *kv,
                             const ekv_page_table *t, ekv_page_list *list);

/* Screened decode (screened.c): the screen's surviving rows (in the step arena), then
 * attention over them. */
ekv_status ekv_cpu_screened_run(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                float *out, ekv_decode_info *info);
/* Certified decode (certified.c); its lists and bounds live in the step arena. */
ekv_status ekv_cpu_certified_run(ekv_context *ctx, const ekv_decode_params *prm,
                                 const ekv_select_params *sel, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                 float *out, ekv_decode_info *info, ekv_certified_info *ci);
#endif
