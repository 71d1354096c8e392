/*
 * Dense decode on the CPU (docs/math.md §9.7): every query head attends over every token of its
 * sequence.
 *
 *   phase 1  scores: one pass over K. Tasks are (sequence, KV head, chunk of pages); each
 *            key row is converted once and dotted with the G query heads of its group. The
 *            fp32 scores z = a*s (a = alpha - 1; softmax a = 1) and per-task maxima are kept.
 *   phase 2  per (sequence, KV head): for each of its G query heads, solve tau exactly on
 *            the kept scores (entmax: only the candidates z > max - 1 can be in the support),
 *            then read V for the support rows only. Softmax turns the scores into weights in
 *            place and reads all of V once for the whole group.
 *
 * Workspace lives in the context and is reused across steps.
 */
#include "../../core/internal.h"
#include "../kernels/kernels.h"
#include "support.h"
#include "attend_tail.h"
#include <stdlib.h>

enum { CHUNK_TOKENS = 2048, PREFETCH_PAGES = 2 };

typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_table *tab;
    ekv_step_shape sh;
    const float *qs; /* scaled queries [B][H][D] */
    float *z;        /* scores: sequence b at z + H*tok_off[b], [H][N_b] */
    int64_t *tok_off, *len, *chunks, *task_off; /* per sequence */
    float *cmax;                                /* [task][G] */
    int64_t ntasks;
    /* per worker scratch */
    int64_t nmax;
    int64_t *w_idx;
    double *w_y, *w_y2;
    uint8_t *w_mark;
    int64_t *w_union;
    float *out;
    double *tau;
    int64_t *support;
    int64_t *bytes_v;      /* [B*Hk] */
    volatile int overflow; /* set by any task whose scores overflowed */
} dense_job;

/* Phase 1 task = (sequence, chunk of pages). All KV heads of a page are scored together so
 * that K is streamed in address order (page-major layout): walking one head across pages
 * would jump by a page stride every few KB and defeat the hardware prefetchers. */
static int64_t find_seq(const dense_job *j, int64_t task) {
    int64_t lo = 0, hi = j->sh.B - 1;
    while (lo < hi) { /* last b with task_off[b] <= task */
        int64_t mid = (lo + hi + 1) / 2;
        if (j->task_off[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static void phase_scores(void *vp, int64_t task, int worker) {
    (void)worker;
    dense_job *j = vp;
    const int64_t b = find_seq(j, task), chunk = task - j->task_off[b];
    const int64_t N = j->len[b], ps = j->sh.ps, G = j->sh.G, H = j->sh.H;
    const int64_t pages_per_chunk = (CHUNK_TOKENS + ps - 1) / ps;
    const int64_t p0 = chunk * pages_per_chunk;
    const int64_t npages = ekv_seq_pages(j->tab->indptr, b);
    const int64_t p1 = p0 + pages_per_chunk < npages ? p0 + pages_per_chunk : npages;
    float *zb = j->z + H * j->tok_off[b];
    float *mx = j->cmax + task * H;
    float b0[EKV_CPU_MAX_GROUP], bs[EKV_CPU_MAX_GROUP];
    const float *slopes = j->prm->alibi_slopes;
    for (int64_t h = 0; h < H; h++) mx[h] = -INFINITY;
    for (int64_t p = p0; p < p1; p++) {
        int32_t page = j->tab->indices[j->tab->indptr[b] + p];
        const int64_t ntok = ekv_page_tokens(p, npages, j->tab->last_page_len[b], ps);
        /* The score kernel prefetches the same head PREFETCH_PAGES ahead, a tile at a time:
         * on one thread the core does not overlap scoring with DRAM latency by itself. */
        const int32_t ahead = p + PREFETCH_PAGES < npages
                                      ? j->tab->indices[j->tab->indptr[b] + p + PREFETCH_PAGES]
                                      : -1;
        for (int64_t kvh = 0; kvh < j->sh.Hk; kvh++) {
            const char *k = ekv_cpu_page_ptr(j->kv, j->kv->k, page, kvh);
            const char *pf = ahead >= 0 ? ekv_cpu_page_ptr(j->kv, j->kv->k, ahead, kvh) : NULL;
            const int bias = ekv_cpu_alibi_page(slopes, j->sh.a, kvh * G, G, p * ps, N, b0, bs);
            const float *bias0 = bias ? b0 : NULL, *bstep = bias ? bs : NULL;
            j->kern->score(k, j->kv->stride_token, ntok, j->kv->dtype, j->sh.D,
                           j->qs + (b * H + kvh * G) * j->sh.D, j->sh.D, (int)G, bias0, bstep, 0,
                           zb + kvh * G * N + p * ps, N, mx + kvh * G, pf);
        }
    }
}

static void phase_attend(void *vp, int64_t task, int worker) {
    dense_job *j = vp;
    const int64_t b = task / j->sh.Hk, kvh = task % j->sh.Hk, G = j->sh.G, D = j->sh.D,
                  N = j->len[b];
    float *zb = j->z + j->sh.H * j->tok_off[b] + kvh * G * N;
    float *ob = j->out + (b * j->sh.H + kvh * G) * D;
    memset(ob, 0, sizeof(float) * (size_t)(G * D));
    /* group maxima from the per-task maxima of phase 1 */
    float M[EKV_CPU_MAX_GROUP];
    for (int64_t g = 0; g < G; g++) M[g] = -INFINITY;
    for (int64_t c = 0; c < j->chunks[b]; c++) {
        const float *cm = j->cmax + (j->task_off[b] + c) * j->sh.H + kvh * G;
        for (int64_t g = 0; g < G; g++)
            if (cm[g] > M[g]) M[g] = cm[g];
    }
    if (!ekv_cpu_scores_ok(M, G)) {
        j->overflow = 1;
        return;
    }
    if (j->sh.alpha == 1.0) {
        for (int64_t g = 0; g < G; g++) {
            const double tau = ekv_cpu_softmax_weights(j->kern, zb + g * N, N, M[g]);
            const int64_t bh = b * j->sh.H + kvh * G + g;
            if (j->tau) j->tau[bh] = tau;
            if (j->support) j->support[bh] = N;
        }
        const int64_t npages = ekv_seq_pages(j->tab->indptr, b);
        for (int64_t p = 0; p < npages; p++) {
            const int32_t page = j->tab->indices[j->tab->indptr[b] + p];
            const int64_t ntok = ekv_page_tokens(p, npages, j->tab->last_page_len[b], j->sh.ps);
            j->kern->accum(ekv_cpu_page_ptr(j->kv, j->kv->v, page, kvh), j->kv->stride_token, ntok,
                           j->kv->dtype, D, zb + p * j->sh.ps, N, (int)G, ob, D);
        }
        j->bytes_v[task] = N * D * j->sh.esize;
        return;
    }
    int64_t *idx = j->w_idx + worker * j->nmax;
    double *y = j->w_y + worker * j->nmax, *y2 = j->w_y2 + worker * j->nmax;
    ekv_cpu_rows rows = {j->w_mark + worker * j->nmax, j->w_union + worker * j->nmax, 0};
    for (int64_t g = 0; g < G; g++) {
        double ty, wsum;
        const int64_t sup = ekv_cpu_entmax_support(j->kern, zb + g * N, N, M[g], j->sh.alpha, idx,
                                                   y, y2, &ty, &wsum);
        ekv_cpu_accum_support(j->kern, j->kv, j->tab, b, kvh, idx, y, sup, wsum, ob + g * D, &rows);
        const int64_t bh = b * j->sh.H + kvh * G + g;
        if (j->tau) j->tau[bh] = (double)M[g] + ty;
        if (j->support) j->support[bh] = sup;
    }
    /* V rows read = the union of the group's supports */
    j->bytes_v[task] = ekv_cpu_rows_clear(&rows) * D * j->sh.esize;
}

ekv_status ekv_cpu_dense_run(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                             const ekv_page_table *tab, const float *q, float *out,
                             ekv_decode_info *info) {
    dense_job j = {.kern = ekv_cpu_kernels_for(ctx->isa),
                   .prm = prm,
                   .kv = kv,
                   .tab = tab,
                   .sh = ekv_step_shape_of(prm, kv, tab)};
    ekv_status st = ekv_cpu_check_group(ctx, j.sh.G);
    if (st) return st;
    /* sizes */
    int64_t total_tok = 0, nmax = 0, ntasks = 0;
    const int64_t pages_per_chunk = (CHUNK_TOKENS + j.sh.ps - 1) / j.sh.ps;
    for (int64_t b = 0; b < j.sh.B; b++) {
        const int64_t np = ekv_seq_pages(tab->indptr, b),
                      n = ekv_seq_len(tab->indptr, tab->last_page_len, b, j.sh.ps);
        total_tok += n;
        if (n > nmax) nmax = n;
        ntasks += (np + pages_per_chunk - 1) / pages_per_chunk;
    }
    const int64_t W = ctx->n_threads;
    int64_t t1;
    if (ekv_mul_i64(total_tok, j.sh.H * 4, &t1))
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "score buffer overflows");
    enum { QS, Z, SEQ, CMAX, IDX, Y, Y2, MARK, UNI, BV, NBLOCKS };
    const int64_t sz[NBLOCKS] = {j.sh.B * j.sh.H * j.sh.D * 4,
                                 t1,
                                 j.sh.B * 4 * 8,
                                 ntasks * j.sh.H * 4,
                                 W * nmax * 8,
                                 W * nmax * 8,
                                 W * nmax * 8,
                                 W * nmax,
                                 W * nmax * 8,
                                 j.sh.B * j.sh.Hk * 8};
    int64_t off[NBLOCKS];
    char *ws = ekv_workspace_blocks(ctx, sz, NBLOCKS, off, "dense decode", &st);
    if (!ws) return st;
    float *qs = (float *)(ws + off[QS]);
    j.z = (float *)(ws + off[Z]);
    j.tok_off = (int64_t *)(ws + off[SEQ]);
    j.len = j.tok_off + j.sh.B;
    j.chunks = j.len + j.sh.B;
    j.task_off = j.chunks + j.sh.B;
    j.cmax = (float *)(ws + off[CMAX]);
    j.nmax = nmax;
    j.w_idx = (int64_t *)(ws + off[IDX]);
    j.w_y = (double *)(ws + off[Y]);
    j.w_y2 = (double *)(ws + off[Y2]);
    j.w_mark = (uint8_t *)(ws + off[MARK]);
    j.w_union = (int64_t *)(ws + off[UNI]);
    j.bytes_v = (int64_t *)(ws + off[BV]);
    memset(j.w_mark, 0, (size_t)(W * nmax));
    int64_t tok = 0, toff = 0;
    for (int64_t b = 0; b < j.sh.B; b++) {
        const int64_t np = ekv_seq_pages(tab->indptr, b);
        j.len[b] = ekv_seq_len(tab->indptr, tab->last_page_len, b, j.sh.ps);
        j.tok_off[b] = tok;
        j.chunks[b] = (np + pages_per_chunk - 1) / pages_per_chunk;
        j.task_off[b] = toff;
        tok += j.len[b];
        toff += j.chunks[b];
    }
    j.ntasks = ntasks;
    ekv_cpu_scale_queries(prm, &j.sh, q, qs); /* so that the kernels produce z directly */
    j.qs = qs;
    j.out = out;
    j.tau = info ? info->tau : NULL;
    j.support = info ? info->support : NULL;
    ekv_pool_run(ctx->pool, ntasks, phase_scores, &j);
    ekv_pool_run(ctx->pool, j.sh.B * j.sh.Hk, phase_attend, &j);
    if (j.overflow)
        return ekv_fail(ctx, EKV_ERR_NAN_INPUT, "dense decode: " EKV_SCORES_OVERFLOW_MSG);
    if (info) {
        info->bytes_k = total_tok * j.sh.Hk * j.sh.D * j.sh.esize;
        info->bytes_v = 0;
        for (int64_t t = 0; t < j.sh.B * j.sh.Hk; t++) info->bytes_v += j.bytes_v[t];
    }
    ekv_clear_error(ctx);
    return EKV_OK;
}

ekv_status ekv_decode_dense(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                            const ekv_page_table *tab, const float *q, float *out,
                            ekv_decode_info *info) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, NULL);
    if (!st) st = ekv_validate_decode(ctx, prm, kv, tab, q, out);
    EKV_GUARDED(ctx, st, ekv_cpu_dense_run(ctx, prm, kv, tab, q, out, info));
    return st;
}
