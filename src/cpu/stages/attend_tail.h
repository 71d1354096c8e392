/*
 * The attention tail shared by dense attention (decode_dense.c) and attention over page lists
 * (attend_pages.c): where a K/V row lives, the ALiBi bias of a page, softmax weights, and
 * the support-only V accumulation of entmax (docs/math.md §9.7). Written once so that the
 * dense path and the list paths cannot drift apart.
 */
#ifndef EKV_CPU_ATTEND_TAIL_H
#define EKV_CPU_ATTEND_TAIL_H
#include "../../core/internal.h"
#include "../../math/entmax_tau.h"
#include "../kernels/kernels.h"

/* The first element of (physical page, KV head) in K or V. */
static inline const char *ekv_cpu_page_ptr(const ekv_paged_kv *kv, const void *base, int32_t page,
                                           int64_t head) {
    return (const char *)base +
           ((int64_t)page * kv->stride_page + head * kv->stride_head) * ekv_dtype_size(kv->dtype);
}

/* Row of token `tok` (logical position in sequence b) of KV head kvh, in K or V. */
static inline const char *ekv_cpu_token_row(const ekv_paged_kv *kv, const ekv_page_table *t,
                                            const void *base, int64_t b, int64_t kvh, int64_t tok) {
    const int32_t page = t->indices[t->indptr[b] + tok / kv->page_size];
    return ekv_cpu_page_ptr(kv, base, page, kvh) +
           (tok % kv->page_size) * kv->stride_token * ekv_dtype_size(kv->dtype);
}

/*
 * ALiBi in z-space for the n query heads from h0 over a page whose first token is
 * `first_tok` in a sequence of N tokens (the query is the last token, docs/math.md §1.6):
 * bias of slot t = b0[g] + t * bs[g]. Returns 0 (no bias) when there are no slopes.
 */
static inline int ekv_cpu_alibi_page(const float *slopes, double a, int64_t h0, int64_t n,
                                     int64_t first_tok, int64_t N, float *b0, float *bs) {
    if (!slopes) return 0;
    for (int64_t g = 0; g < n; g++) {
        const double m = a * slopes[h0 + g];
        b0[g] = (float)(m * (double)(first_tok - (N - 1)));
        bs[g] = (float)m;
    }
    return 1;
}

/* The kept scores of a group are usable: their maxima are finite. A maximum of +inf (or none)
 * means |scale * q.k| overflowed fp32; the step then fails with a status instead of giving
 * NaN or zeros (docs/math.md §6.2). */
static inline int ekv_cpu_scores_ok(const float *M, int64_t n) {
    for (int64_t g = 0; g < n; g++)
        if (!isfinite(M[g])) return 0; /* +inf, or -inf when every score is NaN */
    return 1;
}

#define EKV_SCORES_OVERFLOW_MSG                                                                    \
    "the scores overflow fp32 (|scale * q.k| > 3.4e38): q or K is too large"

/* Softmax: turns the scores z[0..n) (maximum M) into weights in place; returns tau, the
 * log-sum-exp in z-space. */
static inline double ekv_cpu_softmax_weights(const ekv_cpu_kernels *kern, float *z, int64_t n,
                                             float M) {
    const double s = kern->exp_shift(z, n, M, z);
    const float inv = (float)(1.0 / s);
    for (int64_t c = 0; c < n; c++) z[c] *= inv;
    return (double)M + log(s);
}

/* Fixed / corrected tau (docs/math.md §3.10): one unbounded Halley step of a given tau from the
 * sums S[0..3) of d^beta, d^(beta-1) and d^(beta-2) over the tokens with d = z - tau > 0
 * (ekv_tau_correction_add); a step that is not finite keeps tau. */
static inline void ekv_tau_correction_add(double *S, double z, double tau, double alpha) {
    const double d = z - tau;
    if (d <= 0) return;
    const double pb = ekv_entmax_pow(d, alpha);
    S[0] += pb;
    S[1] += pb / d;
    S[2] += pb / (d * d);
}
static inline double ekv_tau_correction_step(double tau, const double *S, double alpha) {
    const double beta = 1.0 / (alpha - 1.0);
    const double F = S[0] - 1, F1 = -beta * S[1], F2 = beta * (beta - 1) * S[2],
                 den = 2 * F1 * F1 - F * F2;
    double nt = tau;
    if (fabs(den) > 1e-12)
        nt = tau - 2 * F * F1 / den;
    else if (fabs(F1) > 1e-12)
        nt = tau - F / F1;
    return !isfinite(nt) || fabs(nt) >= 1e20 ? tau : nt;
}

/* The V rows a group of heads has read, once each (docs/math.md §9.7): mark[] is per token
 * and left clear by ekv_cpu_rows_clear; uni[] lists the marked tokens. */
typedef struct ekv_cpu_rows {
    uint8_t *mark;
    int64_t *uni;
    int64_t n;
} ekv_cpu_rows;

/* out += sum_i (y[i] / norm) * V[tokens[i]] for one query head; records the rows read. */
static inline void ekv_cpu_accum_support(const ekv_cpu_kernels *kern, const ekv_paged_kv *kv,
                                         const ekv_page_table *t, int64_t b, int64_t kvh,
                                         const int64_t *tokens, const double *y, int64_t sup,
                                         double norm, float *out, ekv_cpu_rows *rows) {
    for (int64_t i = 0; i < sup; i++) {
        const float w = (float)(y[i] / norm);
        kern->accum(ekv_cpu_token_row(kv, t, kv->v, b, kvh, tokens[i]), kv->stride_token, 1,
                    kv->dtype, kv->head_dim, &w, 1, 1, out, kv->head_dim);
        if (!rows->mark[tokens[i]]) {
            rows->mark[tokens[i]] = 1;
            rows->uni[rows->n++] = tokens[i];
        }
    }
}

/* Clears the marks of the rows read (so the per-worker scratch stays clean) and returns how
 * many distinct rows there were. */
static inline int64_t ekv_cpu_rows_clear(ekv_cpu_rows *rows) {
    for (int64_t i = 0; i < rows->n; i++) rows->mark[rows->uni[i]] = 0;
    const int64_t n = rows->n;
    rows->n = 0;
    return n;
}
#endif
