/*
 * The selection policies of the CPU backend (docs/math.md §2, §4): each writes the page lists
 * of a step from the page statistics (the oracle, evaluation only, from the dense
 * distribution), never reading K or V. ekv_cpu_select_run (select.c) dispatches to the one
 * the method table names; ekv_select_pages (select.c) and ekv_decode's list methods call it.
 */
#ifndef EKV_CPU_SELECT_H
#define EKV_CPU_SELECT_H
#include "../../core/internal.h"
#include "../stages/screen_rows.h"

/* A page-list policy: writes list for the step (arguments validated). Every list method
 * has this shape. */
typedef ekv_status ekv_list_policy(ekv_context *ctx, const ekv_decode_params *prm,
                                   const ekv_select_params *sel, const ekv_paged_kv *kv,
                                   const ekv_page_stats *st, const ekv_page_table *t,
                                   const float *q, ekv_page_list *list);
ekv_list_policy ekv_cpu_select_run;
ekv_list_policy ekv_select_screened;   /* screened.c: pages with a token the codes keep */
ekv_list_policy ekv_select_oracle_run; /* oracle.c: the dense support's pages (evaluation) */
/* The rows the screen keeps for the step (screened.c), in the step arena: what the screened
 * runner attends over, and what ekv_select_screened turns into pages. */
ekv_status ekv_select_screened_rows(ekv_context *ctx, const ekv_decode_params *prm,
                                    const ekv_select_params *sel, const ekv_paged_kv *kv,
                                    const ekv_page_stats *st, const ekv_page_table *t,
                                    const float *q, ekv_screen_rows *r);
/* The checks ekv_select_pages makes beyond the step's (select.c): stats, budgets, list. */
ekv_status ekv_validate_select(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t,
                               const ekv_page_list *list);
#endif
