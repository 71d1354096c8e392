/*
 * attend (docs/math.md §3, mode `exact`) over page lists, on the CPU: for each list (one KV
 * head and its G query heads, or one query head), score the listed pages' keys once, solve
 * tau exactly on the kept scores (entmax: candidates z > max - 1 only), then read V for the
 * support rows only. alpha = 1 is softmax over the listed tokens (the softmax top-k
 * baseline). The same pass serves the evaluation probabilities (mode PROBS) and certified
 * round 2 (mode CERTIFY, docs/math.md §9.3), chosen by ekv_lists_args.mode.
 */
#include "attend.h"
#include "attend_tail.h"
#include "../kernels/kernels.h"
#include "support.h"

typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_table *tab;
    const ekv_lists_args *a;
    ekv_step_shape sh;
    int64_t heads, Gl; /* lists per sequence; query heads per list */
    const float *qs;
    const int32_t *iota; /* 0, 1, 2, ...: the page list of the implicit dense lists */
    int64_t nmax;
    float *w_z;     /* per worker [Gl][nmax] */
    int64_t *w_tok; /* per worker [nmax] absolute token of each kept score */
    int64_t *w_idx;
    double *w_y, *w_y2;
    uint8_t *w_mark;
    int64_t *w_union;
    int32_t *w_rp;              /* per worker [nmax] round-2 page numbers */
    int64_t *bytes_k, *bytes_v; /* per list */
    volatile int overflow;      /* set by any list whose scores overflowed */
} pages_job;

/* The pages of list l of sequence b: plist[0..*np). */
static const int32_t *list_pages(const pages_job *j, int64_t b, int64_t l, int64_t *np) {
    const ekv_page_list *list = j->a->list;
    if (!list) {
        *np = ekv_seq_pages(j->tab->indptr, b);
        return j->iota;
    }
    const int64_t lo = list->indptr[b * j->heads + l];
    *np = list->indptr[b * j->heads + l + 1] - lo;
    return list->pages + lo;
}

/* Scores pages plist[0..np) (logical page numbers) for the Gl query heads into
 * z[g*nmax + c ...] from slot c on, raising M; returns the new slot count. */
static int64_t score_pages(const pages_job *j, int64_t b, int64_t kvh, int64_t h0,
                           const int32_t *plist, int64_t np, float *z, int64_t *tok, int64_t c,
                           float *M) {
    const int64_t N = ekv_seq_len(j->tab->indptr, j->tab->last_page_len, b, j->sh.ps);
    const int64_t P = ekv_seq_pages(j->tab->indptr, b);
    const int32_t *pages = j->tab->indices + j->tab->indptr[b];
    float b0[EKV_CPU_MAX_GROUP], bs[EKV_CPU_MAX_GROUP];
    for (int64_t r = 0; r < np; r++) {
        const int64_t p = plist[r],
                      ntok = ekv_page_tokens(p, P, j->tab->last_page_len[b], j->sh.ps);
        const char *pf =
                r + 2 < np ? ekv_cpu_page_ptr(j->kv, j->kv->k, pages[plist[r + 2]], kvh) : NULL;
        const int bias = ekv_cpu_alibi_page(j->prm->alibi_slopes, j->sh.a, h0, j->Gl, p * j->sh.ps,
                                            N, b0, bs);
        j->kern->score(ekv_cpu_page_ptr(j->kv, j->kv->k, pages[p], kvh), j->kv->stride_token, ntok,
                       j->kv->dtype, j->sh.D, j->qs + (b * j->sh.H + h0) * j->sh.D, j->sh.D,
                       (int)j->Gl, bias ? b0 : NULL, bias ? bs : NULL, 0, z + c, j->nmax, M, pf);
        for (int64_t t = 0; t < ntok; t++) tok[c + t] = p * j->sh.ps + t;
        c += ntok;
    }
    return c;
}

/* Scores the token rows rows[0..n) (ascending positions in sequence b) into z from slot 0,
 * raising M; returns n. Consecutive rows of a page are scored in one call; each row's score
 * has the bits its page's dense scoring gives it (the score kernel's pos0 contract). */
static int64_t score_rows(const pages_job *j, int64_t b, int64_t kvh, int64_t h0,
                          const int64_t *rows, int64_t n, float *z, int64_t *tok, float *M) {
    const int64_t N = ekv_seq_len(j->tab->indptr, j->tab->last_page_len, b, j->sh.ps);
    const int64_t ps = j->sh.ps, esz = j->sh.esize;
    const int32_t *pages = j->tab->indices + j->tab->indptr[b];
    float b0[EKV_CPU_MAX_GROUP], bs[EKV_CPU_MAX_GROUP];
    for (int64_t i = 0, r; i < n; i += r) {
        const int64_t p = rows[i] / ps, s0 = rows[i] % ps;
        for (r = 1; i + r < n && rows[i + r] == rows[i] + r && s0 + r < ps; r++) {}
        const int bias =
                ekv_cpu_alibi_page(j->prm->alibi_slopes, j->sh.a, h0, j->Gl, p * ps, N, b0, bs);
        j->kern->score(ekv_cpu_page_ptr(j->kv, j->kv->k, pages[p], kvh) +
                               s0 * j->kv->stride_token * esz,
                       j->kv->stride_token, r, j->kv->dtype, j->sh.D,
                       j->qs + (b * j->sh.H + h0) * j->sh.D, j->sh.D, (int)j->Gl, bias ? b0 : NULL,
                       bias ? bs : NULL, s0, z + i, j->nmax, M, NULL);
        for (int64_t t = 0; t < r; t++) tok[i + t] = rows[i] + t;
    }
    return n;
}

/* Certified round 2 (docs/math.md §9.3) for one list whose round-1 scores are in z: tau_C
 * per head on them, then the pages outside the list whose certified bound exceeds tau_C for
 * a head of the list are scored too, appended to the kept scores (round-1 K is not read
 * again). Returns the new slot count; *added = the round-2 pages. */
static int64_t certify_list(pages_job *j, int64_t b, int64_t l, int64_t L, float *z, int64_t *tok,
                            float *M, int worker, int64_t *added) {
    const int64_t h0 = ekv_list_head0(l, j->heads, j->sh.H, j->sh.G), kvh = h0 / j->sh.G;
    const int64_t P = ekv_seq_pages(j->tab->indptr, b);
    int64_t *idx = j->w_idx + worker * j->nmax, np;
    double *y = j->w_y + worker * j->nmax, *y2 = j->w_y2 + worker * j->nmax;
    uint8_t *in = j->w_mark + worker * j->nmax; /* page flags; the token marks are clear here */
    int32_t *rpages = j->w_rp + worker * j->nmax;
    const int32_t *plist = list_pages(j, b, l, &np);
    double tauc[EKV_CPU_MAX_GROUP];
    for (int64_t g = 0; g < j->Gl; g++) {
        double tr, ws;
        ekv_cpu_entmax_support(j->kern, z + g * j->nmax, L, M[g], j->sh.alpha, idx, y, y2, &tr,
                               &ws);
        tauc[g] = (double)M[g] + tr;
    }
    for (int64_t i = 0; i < np; i++) in[plist[i]] = 1;
    int64_t nr = 0;
    for (int64_t p = 0; p + 1 < P; p++) {
        if (in[p]) continue;
        for (int64_t g = 0; g < j->Gl; g++)
            if ((double)j->a->bounds[(b * j->sh.H + h0 + g) * j->a->bstride + p] > tauc[g]) {
                rpages[nr++] = (int32_t)p;
                break;
            }
    }
    for (int64_t i = 0; i < np; i++) in[plist[i]] = 0;
    *added = nr;
    return nr ? score_pages(j, b, kvh, h0, rpages, nr, z, tok, L, M) : L;
}

/* Fixed / corrected tau (docs/math.md §3.10): the selector's tau, then unbounded Halley
 * steps on the listed tokens. Returns tau - M. */
static double given_tau_rel(const pages_job *j, const float *zg, int64_t L, float M, int64_t bh) {
    const ekv_page_list *list = j->a->list;
    double tau = list->tau[bh];
    for (int it = 0; list->tau_mode == EKV_TAU_CORRECTED && it < list->correction_iters; it++) {
        double S[3] = {0, 0, 0};
        for (int64_t c = 0; c < L; c++) ekv_tau_correction_add(S, (double)zg[c], tau, j->sh.alpha);
        tau = ekv_tau_correction_step(tau, S, j->sh.alpha);
    }
    return tau - (double)M;
}

/* Writes one head's probabilities over every token of its sequence (mode PROBS). */
static void write_probs(const pages_job *j, int64_t b, int64_t h, const int64_t *tokens,
                        const double *y, const float *w, int64_t n, double norm) {
    float *pr = j->a->probs + (b * j->sh.H + h) * j->a->pstride;
    memset(pr, 0,
           sizeof(float) * (size_t)ekv_seq_len(j->tab->indptr, j->tab->last_page_len, b, j->sh.ps));
    for (int64_t i = 0; i < n; i++) pr[tokens[i]] = w ? w[i] : (float)(y[i] / norm);
}

/* Entmax for query head h of the list whose kept scores are zg[0..L): support, then V rows
 * (or probabilities). Records tau and the support size. */
static void entmax_head(pages_job *j, int64_t b, int64_t h, int64_t kvh, float *zg, int64_t L,
                        float M, const int64_t *tok, int worker, ekv_cpu_rows *rows) {
    int64_t *idx = j->w_idx + worker * j->nmax;
    double *y = j->w_y + worker * j->nmax, *y2 = j->w_y2 + worker * j->nmax;
    const ekv_page_list *list = j->a->list;
    const int given = list && list->tau_mode != EKV_TAU_EXACT && list->tau;
    int64_t sup;
    double ty, wsum = 0;
    if (given) {
        ty = given_tau_rel(j, zg, L, M, b * j->sh.H + h);
        int64_t k = 0;
        for (int64_t c = 0; c < L; c++) {
            const double yc = (double)zg[c] - (double)M;
            if (yc > ty) {
                idx[k] = c;
                y[k] = yc;
                k++;
            }
        }
        sup = ekv_cpu_support_weights(idx, y, k, ty, j->sh.alpha, &wsum);
    } else {
        sup = ekv_cpu_entmax_support(j->kern, zg, L, M, j->sh.alpha, idx, y, y2, &ty, &wsum);
    }
    for (int64_t i = 0; i < sup; i++) idx[i] = tok[idx[i]]; /* positions in the list -> tokens */
    const double norm = given ? 1.0 : wsum; /* fixed/corrected: no renormalisation */
    if (j->a->mode == EKV_LISTS_PROBS)
        write_probs(j, b, h, idx, y, NULL, sup, norm);
    else
        ekv_cpu_accum_support(j->kern, j->kv, j->tab, b, kvh, idx, y, sup, norm,
                              j->a->out + (b * j->sh.H + h) * j->sh.D, rows);
    double *tau = j->a->mode == EKV_LISTS_PROBS ? j->a->tau : j->a->info ? j->a->info->tau : NULL;
    if (tau) tau[b * j->sh.H + h] = (double)M + ty;
    if (j->a->info && j->a->info->support) j->a->info->support[b * j->sh.H + h] = sup;
}

/* Softmax over the list: weights for every query head of the list, then every listed V row
 * once, page run by page run, for the whole group. Returns the V rows read. */
static int64_t softmax_list(pages_job *j, int64_t b, int64_t l, int64_t h0, int64_t kvh, float *z,
                            int64_t L, const float *M, const int64_t *tok) {
    double *tau = j->a->mode == EKV_LISTS_PROBS ? j->a->tau : j->a->info ? j->a->info->tau : NULL;
    for (int64_t g = 0; g < j->Gl; g++) {
        const double t = ekv_cpu_softmax_weights(j->kern, z + g * j->nmax, L, M[g]);
        if (j->a->mode == EKV_LISTS_PROBS)
            write_probs(j, b, h0 + g, tok, NULL, z + g * j->nmax, L, 1.0);
        if (tau) tau[b * j->sh.H + h0 + g] = t;
        if (j->a->info && j->a->info->support) j->a->info->support[b * j->sh.H + h0 + g] = L;
    }
    if (j->a->mode == EKV_LISTS_PROBS) return 0;
    const int32_t *pages = j->tab->indices + j->tab->indptr[b];
    const int64_t P = ekv_seq_pages(j->tab->indptr, b);
    int64_t np, c = 0;
    const int32_t *plist = list_pages(j, b, l, &np);
    for (int64_t r = 0; r < np; r++) {
        const int64_t p = plist[r],
                      ntok = ekv_page_tokens(p, P, j->tab->last_page_len[b], j->sh.ps);
        j->kern->accum(ekv_cpu_page_ptr(j->kv, j->kv->v, pages[p], kvh), j->kv->stride_token, ntok,
                       j->kv->dtype, j->sh.D, z + c, j->nmax, (int)j->Gl,
                       j->a->out + (b * j->sh.H + h0) * j->sh.D, j->sh.D);
        c += ntok;
    }
    return L;
}

static void attend_list(void *vp, int64_t task, int worker) {
    pages_job *j = vp;
    const int64_t b = task / j->heads, l = task % j->heads, D = j->sh.D;
    const int64_t h0 = ekv_list_head0(l, j->heads, j->sh.H, j->sh.G), kvh = h0 / j->sh.G;
    float *z = j->w_z + worker * j->Gl * j->nmax;
    int64_t *tok = j->w_tok + worker * j->nmax, np;
    float M[EKV_CPU_MAX_GROUP];
    for (int64_t g = 0; g < j->Gl; g++) M[g] = -INFINITY;
    const ekv_row_lists *rl = j->a->rows;
    int64_t L;
    if (rl) {
        L = score_rows(j, b, kvh, h0, rl->rows + rl->start[task], rl->count[task], z, tok, M);
    } else {
        const int32_t *plist = list_pages(j, b, l, &np);
        L = score_pages(j, b, kvh, h0, plist, np, z, tok, 0, M);
    }
    if (!ekv_cpu_scores_ok(M, j->Gl)) {
        j->overflow = 1;
        return;
    }
    if (j->a->mode == EKV_LISTS_CERTIFY) { /* round 2 on the kept scores */
        int64_t added = 0;
        L = certify_list(j, b, l, L, z, tok, M, worker, &added);
        j->a->round2[task] = added;
    }
    if (j->a->mode != EKV_LISTS_PROBS)
        memset(j->a->out + (b * j->sh.H + h0) * D, 0, sizeof(float) * (size_t)(j->Gl * D));
    int64_t rows;
    if (j->sh.alpha == 1.0) {
        rows = softmax_list(j, b, l, h0, kvh, z, L, M, tok);
    } else {
        ekv_cpu_rows rw = {j->w_mark + worker * j->nmax, j->w_union + worker * j->nmax, 0};
        for (int64_t g = 0; g < j->Gl; g++)
            entmax_head(j, b, h0 + g, kvh, z + g * j->nmax, L, M[g], tok, worker, &rw);
        rows = ekv_cpu_rows_clear(&rw);
    }
    j->bytes_k[task] = L * D * j->sh.esize;
    j->bytes_v[task] = rows * D * j->sh.esize;
}

ekv_status ekv_validate_list(ekv_context *ctx, const ekv_page_table *t, const ekv_page_list *list,
                             int64_t H, int64_t Hk) {
    if (!list || !list->indptr || !list->pages)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "list or its arrays are NULL");
    if (list->heads != H && list->heads != Hk)
        return ekv_fail(ctx, EKV_ERR_HEAD_MISMATCH,
                        "list->heads=%d is neither num_heads=%lld nor num_kv_heads=%lld",
                        list->heads, (long long)H, (long long)Hk);
    if (list->tau_mode != EKV_TAU_EXACT && list->tau_mode != EKV_TAU_FIXED &&
        list->tau_mode != EKV_TAU_CORRECTED)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "list->tau_mode=%d is not exact (0), fixed (1) or corrected (2)",
                        list->tau_mode);
    if (list->indptr[0] != 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "list->indptr[0] must be 0");
    for (int64_t b = 0; b < t->batch; b++) {
        const int64_t P = ekv_seq_pages(t->indptr, b);
        for (int64_t l = 0; l < list->heads; l++) {
            int64_t i0 = list->indptr[b * list->heads + l],
                    i1 = list->indptr[b * list->heads + l + 1];
            if (i1 <= i0)
                return ekv_fail(ctx, EKV_ERR_EMPTY_INPUT, "list %lld of sequence %lld is empty",
                                (long long)l, (long long)b);
            if (i1 - i0 > P)
                return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                                "list %lld of sequence %lld has %lld pages, more than %lld",
                                (long long)l, (long long)b, (long long)(i1 - i0), (long long)P);
            for (int64_t i = i0; i < i1; i++)
                if (list->pages[i] < 0 || list->pages[i] >= P)
                    return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                                    "list page %d outside [0, %lld) in sequence %lld",
                                    list->pages[i], (long long)P, (long long)b);
        }
    }
    return EKV_OK;
}

/* Per-worker scratch and the scaled queries, from the context workspace. */
static ekv_status lists_workspace(ekv_context *ctx, pages_job *j, const float *q, int64_t maxP) {
    const int64_t W = ctx->n_threads, ntask = j->sh.B * j->heads, nmax = j->nmax;
    enum { QS, Z, TOK, IDX, Y, Y2, MARK, UNI, BK, BV, RP, IOTA, NB };
    const int64_t sz[NB] = {j->sh.B * j->sh.H * j->sh.D * 4,
                            W * j->Gl * nmax * 4,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax,
                            W * nmax * 8,
                            ntask * 8,
                            ntask * 8,
                            j->a->mode == EKV_LISTS_CERTIFY ? W * nmax * 4 : 0,
                            j->a->list ? 0 : maxP * 4};
    int64_t off[NB];
    ekv_status st;
    char *ws = ekv_workspace_blocks(ctx, sz, NB, off, "attention over pages", &st);
    if (!ws) return st;
    float *qs = (float *)(ws + off[QS]);
    j->w_z = (float *)(ws + off[Z]);
    j->w_tok = (int64_t *)(ws + off[TOK]);
    j->w_idx = (int64_t *)(ws + off[IDX]);
    j->w_y = (double *)(ws + off[Y]);
    j->w_y2 = (double *)(ws + off[Y2]);
    j->w_mark = (uint8_t *)(ws + off[MARK]);
    j->w_union = (int64_t *)(ws + off[UNI]);
    j->bytes_k = (int64_t *)(ws + off[BK]);
    j->bytes_v = (int64_t *)(ws + off[BV]);
    j->w_rp = (int32_t *)(ws + off[RP]);
    int32_t *iota = (int32_t *)(ws + off[IOTA]);
    for (int64_t p = 0; !j->a->list && p < maxP; p++) iota[p] = (int32_t)p;
    j->iota = iota;
    memset(j->w_mark, 0, (size_t)(W * nmax));
    ekv_cpu_scale_queries(j->prm, &j->sh, q, qs);
    j->qs = qs;
    return EKV_OK;
}

ekv_status ekv_cpu_attend_lists(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_paged_kv *kv, const ekv_page_table *tab, const float *q,
                                const ekv_lists_args *a) {
    pages_job j = {.kern = ekv_cpu_kernels_for(ctx->isa),
                   .prm = prm,
                   .kv = kv,
                   .tab = tab,
                   .a = a,
                   .sh = ekv_step_shape_of(prm, kv, tab)};
    j.heads = a->rows ? a->rows->heads : a->list ? a->list->heads : j.sh.H;
    j.Gl = ekv_list_nheads(j.heads, j.sh.H, j.sh.G);
    ekv_status st = ekv_cpu_check_group(ctx, j.Gl);
    if (st) return st;
    const int64_t nmax = ekv_table_max_len(tab->indptr, tab->last_page_len, j.sh.B, j.sh.ps);
    const int64_t maxP = ekv_table_max_pages(tab->indptr, j.sh.B);
    if (a->mode == EKV_LISTS_PROBS && a->pstride < nmax)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "stride=%lld is below the longest sequence (%lld)", (long long)a->pstride,
                        (long long)nmax);
    j.nmax = nmax;
    st = lists_workspace(ctx, &j, q, maxP);
    if (st) return st;
    const int64_t ntask = j.sh.B * j.heads;
    ekv_pool_run(ctx->pool, ntask, attend_list, &j);
    if (j.overflow)
        return ekv_fail(ctx, EKV_ERR_NAN_INPUT, "attention over pages: " EKV_SCORES_OVERFLOW_MSG);
    if (a->info) {
        a->info->bytes_k = a->info->bytes_v = 0;
        for (int64_t t = 0; t < ntask; t++) {
            a->info->bytes_k += j.bytes_k[t];
            a->info->bytes_v += j.bytes_v[t];
        }
    }
    return EKV_OK;
}

ekv_status ekv_decode_pages(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                            const ekv_page_table *tab, const ekv_page_list *list, const float *q,
                            float *out, ekv_decode_info *info) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, NULL);
    if (!st) st = ekv_validate_decode(ctx, prm, kv, tab, q, out);
    if (!st) st = ekv_validate_list(ctx, tab, list, prm->num_heads, kv->num_kv_heads);
    if (st) return st;
    const ekv_lists_args a = {.mode = EKV_LISTS_OUTPUT, .list = list, .out = out, .info = info};
    EKV_GUARDED(ctx, st, ekv_cpu_attend_lists(ctx, prm, kv, tab, q, &a));
    if (!st) ekv_clear_error(ctx);
    return st;
}
