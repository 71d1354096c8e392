/* The attend stage of the CPU backend: dense attention and attention over page lists or token
 * rows. The public entry points validate their arguments once and then call these, which only
 * assume. */
#ifndef EKV_CPU_ATTEND_H
#define EKV_CPU_ATTEND_H
#include "../../core/internal.h"

/* What attention over lists produces (attend_pages.c). */
typedef enum ekv_lists_mode {
    EKV_LISTS_OUTPUT = 0, /* the attention output (ekv_decode_pages)                            */
    EKV_LISTS_PROBS = 1,  /* the probabilities of every token (evaluation; list NULL = dense)   */
    EKV_LISTS_CERTIFY = 2 /* certified round 2 on the kept scores, then the output (§9.3)        */
} ekv_lists_mode;

/* Token rows per list (screened decode, docs/math.md §10.3): list i = b * heads + l attends
 * over rows[start[i] .. start[i] + count[i]), token positions in sequence b, ascending. */
typedef struct ekv_row_lists {
    int64_t heads; /* lists per sequence: num_kv_heads or num_heads */
    const int64_t *start, *count, *rows;
} ekv_row_lists;

typedef struct ekv_lists_args {
    ekv_lists_mode mode;
    const ekv_page_list *list; /* PROBS: NULL = every page, one list per query head          */
    const ekv_row_lists *rows; /* OUTPUT, entmax only: token rows instead of the page list    */
    float *out;                /* OUTPUT, CERTIFY: [B][H][D]                                 */
    ekv_decode_info *info;     /* OUTPUT, CERTIFY (may be NULL)                              */
    float *probs;              /* PROBS: [B*H][pstride]                                      */
    int64_t pstride;
    double *tau;         /* PROBS: tau per head (may be NULL)                          */
    const float *bounds; /* CERTIFY: certified page bounds [B*H][bstride]              */
    int64_t bstride;
    int64_t *round2; /* CERTIFY: pages added per list                              */
} ekv_lists_args;

/* Validates a page list against a validated table (heads, CSR, page numbers, tau mode). */
ekv_status ekv_validate_list(ekv_context *ctx, const ekv_page_table *t, const ekv_page_list *list,
                             int64_t num_heads, int64_t num_kv_heads);

/* The stages' runners: arguments already validated (ekv_validate_decode, ekv_decode_supported).
 * Dense attention over every token (decode_dense.c), and attention over page lists or token
 * rows (attend_pages.c). */
ekv_status ekv_cpu_dense_run(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                             const ekv_page_table *tab, const float *q, float *out,
                             ekv_decode_info *info);
ekv_status ekv_cpu_attend_lists(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_paged_kv *kv, const ekv_page_table *tab, const float *q,
                                const ekv_lists_args *args);
#endif
