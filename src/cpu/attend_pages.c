/*
 * attend (SPEC 3, mode `exact`) over page lists, on the CPU: for each list (one KV head and
 * its G query heads, or one query head), score the listed pages' keys once, solve tau
 * exactly on the kept scores (entmax: candidates z > max - 1 only), then read V for the
 * support rows only. alpha = 1 is softmax over the listed tokens (the softmax top-k
 * baseline). Also ekv_dense_probs, the dense reference distribution for evaluation.
 */
#include "../core/internal.h"
#include "kernels.h"
#include "support.h"
#include <stdlib.h>

typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_table *tab;
    const ekv_page_list *list;
    ekv_step_shape sh;
    int64_t heads, Gl; /* lists per sequence; query heads per list */
    const float *qs;
    int64_t nmax;
    float *w_z;       /* per worker [Gl][nmax] */
    int64_t *w_tok;   /* per worker [nmax] absolute token of each kept score */
    int64_t *w_idx;
    double *w_y, *w_y2;
    uint8_t *w_mark;
    int64_t *w_union;
    float *out;
    double *tau;
    int64_t *support;
    int64_t *bytes_k, *bytes_v; /* per list */
    /* dense_probs mode */
    float *probs;
    int64_t pstride;
    /* certified mode: bounds [B*H][bstride]; pages added in round 2 per list */
    const float *bounds;
    int64_t bstride;
    int64_t *round2;
    int32_t *w_rp;    /* per worker [nmax] round-2 page numbers */
} pages_job;

static const char *page_ptr(const ekv_paged_kv *kv, const void *base, int32_t page, int64_t head, int64_t es) {
    return (const char *)base + ((int64_t)page * kv->stride_page + head * kv->stride_head) * es;
}

/* Scores pages plist[0..np) (logical page numbers) for the Gl query heads into
 * z[g*nmax + c ...] from slot c on, raising M; returns the new slot count. */
static int64_t score_pages(const pages_job *j, int64_t b, int64_t kvh, int64_t h0, const int32_t *plist, int64_t np,
                           float *z, int64_t *tok, int64_t c, float *M) {
    const int64_t N = (j->tab->indptr[b + 1] - j->tab->indptr[b] - 1) * j->sh.ps + j->tab->last_page_len[b];
    const int64_t P = j->tab->indptr[b + 1] - j->tab->indptr[b];
    const int32_t *pages = j->tab->indices + j->tab->indptr[b];
    float b0[256], bs[256];
    for (int64_t r = 0; r < np; r++) {
        const int64_t p = plist[r], ntok = p == P - 1 ? j->tab->last_page_len[b] : j->sh.ps;
        const char *pf = r + 2 < np ? page_ptr(j->kv, j->kv->k, pages[plist[r + 2]], kvh, j->sh.esize) : NULL;
        const float *pb0 = NULL, *pbs = NULL;
        if (j->prm->alibi_slopes) {
            for (int64_t g = 0; g < j->Gl; g++) {
                double m = j->sh.a * j->prm->alibi_slopes[h0 + g];
                b0[g] = (float)(m * (double)(p * j->sh.ps - (N - 1)));
                bs[g] = (float)m;
            }
            pb0 = b0;
            pbs = bs;
        }
        j->kern->score(page_ptr(j->kv, j->kv->k, pages[p], kvh, j->sh.esize), j->kv->stride_token, ntok, j->kv->dtype,
                       j->sh.D, j->qs + (b * j->sh.H + h0) * j->sh.D, j->sh.D, (int)j->Gl, pb0, pbs, z + c, j->nmax, M, pf);
        for (int64_t t = 0; t < ntok; t++) tok[c + t] = p * j->sh.ps + t;
        c += ntok;
    }
    return c;
}

/* Scores the list's pages for its Gl query heads into z[g*nmax + c]; returns the count. */
static int64_t score_list(const pages_job *j, int64_t b, int64_t l, float *z, int64_t *tok, float *M) {
    const int64_t h0 = j->Gl == 1 && j->heads == j->sh.H ? l : l * j->sh.G, kvh = h0 / j->sh.G;
    const int64_t lo = j->list->indptr[b * j->heads + l], hi = j->list->indptr[b * j->heads + l + 1];
    for (int64_t g = 0; g < j->Gl; g++) M[g] = -INFINITY;
    return score_pages(j, b, kvh, h0, j->list->pages + lo, hi - lo, z, tok, 0, M);
}

/* Certified round 2 (SPEC 9.3) for one list whose round-1 scores are in z: tau_C per head on
 * them, then the pages outside the list whose certified bound exceeds tau_C for a head of the
 * list are scored too, appended to the kept scores (round-1 K is not read again). Returns the
 * new slot count; *added = the round-2 pages. */
static int64_t certify_list(pages_job *j, int64_t b, int64_t l, int64_t L, float *z, int64_t *tok, float *M,
                            int worker, int64_t *added) {
    const int64_t h0 = j->Gl == 1 && j->heads == j->sh.H ? l : l * j->sh.G, kvh = h0 / j->sh.G;
    const int64_t P = j->tab->indptr[b + 1] - j->tab->indptr[b];
    int64_t *idx = j->w_idx + worker * j->nmax;
    double *y = j->w_y + worker * j->nmax, *y2 = j->w_y2 + worker * j->nmax;
    uint8_t *in = j->w_mark + worker * j->nmax; /* page flags; the token marks are clear here */
    int32_t *rpages = j->w_rp + worker * j->nmax;
    double tauc[256];
    for (int64_t g = 0; g < j->Gl; g++) {
        double tr, ws;
        ekv_cpu_entmax_support(j->kern, z + g * j->nmax, L, M[g], j->sh.alpha, idx, y, y2, &tr, &ws);
        tauc[g] = (double)M[g] + tr;
    }
    for (int64_t i = j->list->indptr[b * j->heads + l]; i < j->list->indptr[b * j->heads + l + 1]; i++)
        in[j->list->pages[i]] = 1;
    int64_t nr = 0;
    for (int64_t p = 0; p + 1 < P; p++) {
        if (in[p]) continue;
        for (int64_t g = 0; g < j->Gl; g++)
            if ((double)j->bounds[(b * j->sh.H + h0 + g) * j->bstride + p] > tauc[g]) { rpages[nr++] = (int32_t)p; break; }
    }
    for (int64_t i = j->list->indptr[b * j->heads + l]; i < j->list->indptr[b * j->heads + l + 1]; i++)
        in[j->list->pages[i]] = 0;
    *added = nr;
    return nr ? score_pages(j, b, kvh, h0, rpages, nr, z, tok, L, M) : L;
}

static const char *v_row(const pages_job *j, int64_t b, int64_t kvh, int64_t t) {
    int32_t page = j->tab->indices[j->tab->indptr[b] + t / j->sh.ps];
    return page_ptr(j->kv, j->kv->v, page, kvh, j->sh.esize) + (t % j->sh.ps) * j->kv->stride_token * j->sh.esize;
}

static void attend_list(void *vp, int64_t task, int worker) {
    pages_job *j = vp;
    const int64_t b = task / j->heads, l = task % j->heads;
    const int64_t h0 = j->Gl == 1 && j->heads == j->sh.H ? l : l * j->sh.G, kvh = h0 / j->sh.G, D = j->sh.D;
    float *z = j->w_z + worker * j->Gl * j->nmax;
    int64_t *tok = j->w_tok + worker * j->nmax, *idx = j->w_idx + worker * j->nmax;
    double *y = j->w_y + worker * j->nmax, *y2 = j->w_y2 + worker * j->nmax;
    uint8_t *mark = j->w_mark + worker * j->nmax;
    int64_t *uni = j->w_union + worker * j->nmax;
    float M[256];
    int64_t L = score_list(j, b, l, z, tok, M);
    if (j->bounds) { /* certified: round 2 on the kept scores */
        int64_t added = 0;
        L = certify_list(j, b, l, L, z, tok, M, worker, &added);
        j->round2[task] = added;
    }
    const int64_t N = (j->tab->indptr[b + 1] - j->tab->indptr[b] - 1) * j->sh.ps + j->tab->last_page_len[b];
    int64_t rows = 0;
    for (int64_t g = 0; g < j->Gl; g++) {
        const int64_t h = h0 + g;
        float *zg = z + g * j->nmax;
        float *og = j->out ? j->out + (b * j->sh.H + h) * D : NULL;
        if (og) memset(og, 0, sizeof(float) * (size_t)D);
        if (j->sh.alpha == 1.0) {
            double s = j->kern->exp_shift(zg, L, M[g], zg);
            if (j->probs) {
                float *pr = j->probs + (b * j->sh.H + h) * j->pstride;
                memset(pr, 0, sizeof(float) * (size_t)N);
                for (int64_t c = 0; c < L; c++) pr[tok[c]] = (float)(zg[c] / s);
            } else { /* weights now; V once for the whole group after the loop */
                const float inv = (float)(1.0 / s);
                for (int64_t c = 0; c < L; c++) zg[c] *= inv;
            }
            if (j->tau) j->tau[b * j->sh.H + h] = (double)M[g] + log(s);
            if (j->support) j->support[b * j->sh.H + h] = L;
            continue;
        }
        int64_t sup;
        double ty, wsum = 0;
        const int given = j->list->tau_mode != EKV_TAU_EXACT && j->list->tau;
        if (given) {
            /* fixed / corrected (SPEC 3.10): the selector's tau, then unbounded Halley steps on
             * the listed tokens; weights are not renormalised */
            double tau = j->list->tau[b * j->sh.H + h];
            const double beta = 1.0 / j->sh.a;
            for (int it = 0; j->list->tau_mode == EKV_TAU_CORRECTED && it < j->list->correction_iters; it++) {
                double S0 = 0, S1 = 0, S2 = 0;
                for (int64_t c = 0; c < L; c++) {
                    double d = (double)zg[c] - tau;
                    if (d <= 0) continue;
                    double pb = ekv_entmax_pow(d, j->sh.alpha);
                    S0 += pb;
                    S1 += pb / d;
                    S2 += pb / (d * d);
                }
                double F = S0 - 1, F1 = -beta * S1, F2 = beta * (beta - 1) * S2, den = 2 * F1 * F1 - F * F2, nt = tau;
                if (fabs(den) > 1e-12) nt = tau - 2 * F * F1 / den;
                else if (fabs(F1) > 1e-12) nt = tau - F / F1;
                if (!isfinite(nt) || fabs(nt) >= 1e20) nt = tau;
                tau = nt;
            }
            ty = tau - (double)M[g];
            int64_t k = 0;
            for (int64_t c = 0; c < L; c++) {
                double yc = (double)zg[c] - (double)M[g];
                if (yc > ty) { idx[k] = c; y[k] = yc; k++; }
            }
            sup = ekv_cpu_support_weights(idx, y, k, ty, j->sh.alpha, &wsum);
        } else {
            sup = ekv_cpu_entmax_support(j->kern, zg, L, M[g], j->sh.alpha, idx, y, y2, &ty, &wsum);
        }
        for (int64_t i = 0; i < sup; i++) idx[i] = tok[idx[i]]; /* positions in the list -> tokens */
        const double norm = given ? 1.0 : wsum; /* fixed/corrected: no renormalisation */
        if (j->probs) {
            float *pr = j->probs + (b * j->sh.H + h) * j->pstride;
            memset(pr, 0, sizeof(float) * (size_t)N);
            for (int64_t i = 0; i < sup; i++) pr[idx[i]] = (float)(y[i] / norm);
        } else {
            for (int64_t i = 0; i < sup; i++) {
                float w = (float)(y[i] / norm);
                j->kern->accum(v_row(j, b, kvh, idx[i]), j->kv->stride_token, 1, j->kv->dtype, D, &w, 1, 1, og, D);
                if (!mark[idx[i]]) { mark[idx[i]] = 1; uni[rows++] = idx[i]; }
            }
        }
        if (j->tau) j->tau[b * j->sh.H + h] = (double)M[g] + ty;
        if (j->support) j->support[b * j->sh.H + h] = sup;
    }
    if (j->sh.alpha == 1.0 && !j->probs) {
        /* softmax reads every listed V row once, page run by page run, for the whole group */
        const int32_t *pages = j->tab->indices + j->tab->indptr[b];
        const int64_t P = j->tab->indptr[b + 1] - j->tab->indptr[b];
        int64_t c = 0;
        for (int64_t r = j->list->indptr[b * j->heads + l]; r < j->list->indptr[b * j->heads + l + 1]; r++) {
            const int64_t p = j->list->pages[r], ntok = p == P - 1 ? j->tab->last_page_len[b] : j->sh.ps;
            j->kern->accum(page_ptr(j->kv, j->kv->v, pages[p], kvh, j->sh.esize), j->kv->stride_token, ntok,
                           j->kv->dtype, D, z + c, j->nmax, (int)j->Gl, j->out + (b * j->sh.H + h0) * D, D);
            c += ntok;
        }
        rows = L;
    }
    for (int64_t i = 0; i < rows && j->sh.alpha != 1.0; i++) mark[uni[i]] = 0;
    j->bytes_k[task] = L * D * j->sh.esize;
    j->bytes_v[task] = rows * D * j->sh.esize;
}

static ekv_status validate_list(ekv_context *ctx, const ekv_page_table *t, const ekv_page_list *list, int64_t H,
                                int64_t Hk) {
    if (!list || !list->indptr || !list->pages) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "list or its arrays are NULL");
    if (list->heads != H && list->heads != Hk)
        return ekv_fail(ctx, EKV_ERR_HEAD_MISMATCH, "list->heads=%d is neither num_heads=%lld nor num_kv_heads=%lld",
                        list->heads, (long long)H, (long long)Hk);
    if (list->indptr[0] != 0) return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "list->indptr[0] must be 0");
    for (int64_t b = 0; b < t->batch; b++) {
        const int64_t P = t->indptr[b + 1] - t->indptr[b];
        for (int64_t l = 0; l < list->heads; l++) {
            int64_t i0 = list->indptr[b * list->heads + l], i1 = list->indptr[b * list->heads + l + 1];
            if (i1 <= i0)
                return ekv_fail(ctx, EKV_ERR_EMPTY_INPUT, "list %lld of sequence %lld is empty", (long long)l, (long long)b);
            if (i1 - i0 > P)
                return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "list %lld of sequence %lld has %lld pages, more than %lld",
                                (long long)l, (long long)b, (long long)(i1 - i0), (long long)P);
            for (int64_t i = i0; i < i1; i++)
                if (list->pages[i] < 0 || list->pages[i] >= P)
                    return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "list page %d outside [0, %lld) in sequence %lld",
                                    list->pages[i], (long long)P, (long long)b);
        }
    }
    return EKV_OK;
}

static ekv_status run_lists(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                            const ekv_page_table *tab, const ekv_page_list *list, const float *q, float *out,
                            ekv_decode_info *info, float *probs, int64_t pstride, double *tau_out, const float *bounds,
                            int64_t bstride, int64_t *round2) {
    pages_job j;
    memset(&j, 0, sizeof j);
    j.kern = ekv_cpu_kernels_for(ctx->isa);
    j.prm = prm;
    j.kv = kv;
    j.tab = tab;
    j.list = list;
    j.sh = ekv_step_shape_of(prm, kv, tab);
    j.heads = list->heads;
    j.Gl = list->heads == j.sh.H ? 1 : j.sh.G;
    if (j.Gl > 256) return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "GQA group size %lld > 256 is not supported", (long long)j.Gl);
    int64_t nmax = 1;
    for (int64_t b = 0; b < j.sh.B; b++) {
        int64_t n = (tab->indptr[b + 1] - tab->indptr[b] - 1) * j.sh.ps + tab->last_page_len[b];
        if (n > nmax) nmax = n;
    }
    if (probs && pstride < nmax)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "stride=%lld is below the longest sequence (%lld)", (long long)pstride,
                        (long long)nmax);
    const int64_t W = ctx->n_threads, ntask = j.sh.B * j.heads;
    int64_t sz[11] = {j.sh.B * j.sh.H * j.sh.D * 4, W * j.Gl * nmax * 4, W * nmax * 8, W * nmax * 8, W * nmax * 8,
                      W * nmax * 8, W * nmax, W * nmax * 8, ntask * 8, ntask * 8, bounds ? W * nmax * 4 : 0};
    int64_t off[11];
    ekv_status wst;
    char *ws = ekv_workspace_blocks(ctx, sz, 11, off, "attention over pages", &wst);
    if (!ws) return wst;
    float *qs = (float *)(ws + off[0]);
    j.w_z = (float *)(ws + off[1]);
    j.w_tok = (int64_t *)(ws + off[2]);
    j.w_idx = (int64_t *)(ws + off[3]);
    j.w_y = (double *)(ws + off[4]);
    j.w_y2 = (double *)(ws + off[5]);
    j.w_mark = (uint8_t *)(ws + off[6]);
    j.w_union = (int64_t *)(ws + off[7]);
    j.bytes_k = (int64_t *)(ws + off[8]);
    j.bytes_v = (int64_t *)(ws + off[9]);
    j.w_rp = (int32_t *)(ws + off[10]);
    j.bounds = bounds;
    j.bstride = bstride;
    j.round2 = round2;
    memset(j.w_mark, 0, (size_t)(W * nmax));
    j.nmax = nmax;
    const float scale = prm->scale > 0 ? prm->scale : (float)(1.0 / sqrt((double)j.sh.D));
    const float qscale = (float)(j.sh.a * scale);
    for (int64_t i = 0; i < j.sh.B * j.sh.H * j.sh.D; i++) qs[i] = q[i] * qscale;
    j.qs = qs;
    j.out = out;
    j.tau = tau_out ? tau_out : info ? info->tau : NULL;
    j.support = info ? info->support : NULL;
    j.probs = probs;
    j.pstride = pstride;
    ekv_pool_run(ctx->pool, ntask, attend_list, &j);
    if (info) {
        info->bytes_k = info->bytes_v = 0;
        for (int64_t t = 0; t < ntask; t++) {
            info->bytes_k += j.bytes_k[t];
            info->bytes_v += j.bytes_v[t];
        }
    }
    ekv_clear_error(ctx);
    return EKV_OK;
}

ekv_status ekv_decode_pages(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                            const ekv_page_table *tab, const ekv_page_list *list, const float *q, float *out,
                            ekv_decode_info *info) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_validate_decode(ctx, prm, kv, tab, q, out);
    if (st) return st;
    st = validate_list(ctx, tab, list, prm->num_heads, kv->num_kv_heads);
    if (st) return st;
    return run_lists(ctx, prm, kv, tab, list, q, out, info, NULL, 0, NULL, NULL, 0, NULL);
}

ekv_status ekv_dense_probs(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                           const ekv_page_table *tab, const float *q, int64_t stride, float *p, double *tau) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!q || !p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !q ? "q" : "p");
    ekv_status st = ekv_validate_step(ctx, prm, kv, tab, q);
    if (st) return st;
    /* a dense list per query head: every page, in order */
    const int64_t H = prm->num_heads, total = tab->indptr[tab->batch];
    int64_t *indptr = malloc(sizeof(int64_t) * (size_t)(tab->batch * H + 1));
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)(total * H + 1));
    if (!indptr || !pages) {
        free(indptr);
        free(pages);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for the dense list");
    }
    int64_t w = 0;
    indptr[0] = 0;
    for (int64_t b = 0; b < tab->batch; b++)
        for (int64_t h = 0; h < H; h++) {
            for (int64_t pg = 0; pg < tab->indptr[b + 1] - tab->indptr[b]; pg++) pages[w++] = (int32_t)pg;
            indptr[b * H + h + 1] = w;
        }
    ekv_page_list list = {.heads = (int32_t)H, .indptr = indptr, .pages = pages, .capacity = w};
    st = run_lists(ctx, prm, kv, tab, &list, q, NULL, NULL, p, stride, tau, NULL, 0, NULL);
    free(indptr);
    free(pages);
    return st;
}

ekv_status ekv_delta_bound(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                           const ekv_page_table *tab, const ekv_page_list *list, const double *tau, double *delta_bar) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!prm || !kv || !tab || !list || !tau || !delta_bar)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params, kv, table, list, tau and delta_bar must not be NULL");
    if (!list->bounds) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "list->bounds is NULL (ask ekv_select_pages for them)");
    ekv_status st = ekv_validate_step(ctx, prm, kv, tab, NULL);
    if (st) return st;
    if (!(prm->alpha > 1.0)) return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA, "delta_bar needs entmax (alpha > 1)");
    st = validate_list(ctx, tab, list, prm->num_heads, kv->num_kv_heads);
    if (st) return st;
    for (int64_t b = 0; b < tab->batch; b++)
        if (tab->indptr[b + 1] - tab->indptr[b] - 1 > list->bounds_stride)
            return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "list->bounds_stride=%lld is below sequence %lld's %lld scored pages",
                            (long long)list->bounds_stride, (long long)b, (long long)(tab->indptr[b + 1] - tab->indptr[b] - 1));
    const int64_t H = prm->num_heads, G = H / kv->num_kv_heads, ps = kv->page_size;
    for (int64_t b = 0; b < tab->batch; b++) {
        const int64_t P = tab->indptr[b + 1] - tab->indptr[b];
        uint8_t *in = calloc((size_t)P, 1);
        if (!in) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory");
        for (int64_t h = 0; h < H; h++) {
            const int64_t l = list->heads == H ? h : h / G;
            if (list->heads == H || h % G == 0) {
                memset(in, 0, (size_t)P);
                for (int64_t i = list->indptr[b * list->heads + l]; i < list->indptr[b * list->heads + l + 1]; i++)
                    in[list->pages[i]] = 1;
            }
            const float *u = list->bounds + (b * H + h) * list->bounds_stride;
            const double t = tau[b * H + h];
            double s = 0;
            for (int64_t p = 0; p + 1 < P; p++) {
                if (in[p]) continue;
                double d = (double)u[p] - t;
                if (d > 0) s += (double)ps * ekv_entmax_pow(d, prm->alpha);
            }
            delta_bar[b * H + h] = s;
        }
        free(in);
    }
    ekv_clear_error(ctx);
    return EKV_OK;
}

ekv_status ekv_cpu_attend_certified(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                                    const ekv_page_table *tab, const ekv_page_list *list, const float *bounds,
                                    int64_t bstride, const float *q, float *out, ekv_decode_info *info,
                                    int64_t *round2) {
    ekv_status st = validate_list(ctx, tab, list, prm->num_heads, kv->num_kv_heads);
    if (st) return st;
    return run_lists(ctx, prm, kv, tab, list, q, out, info, NULL, 0, NULL, bounds, bstride, round2);
}
