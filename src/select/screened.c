/*
 * The screened policy (docs/math.md §10): for each list (a KV head and its G query heads, or
 * one query head), the key codes of every page give per-token bounds lo <= z <= hi on the
 * scores the attention will compute (src/cpu/screen.c). tau(lo) is a lower bound of tau*,
 * so a token with hi <= tau(lo) is outside the support (a NaN bound keeps its token). The
 * list is every page holding a surviving token of a head of the list, the last page
 * always; attention over it solves tau exactly on a superset of the support, which is
 * dense entmax. K is read for the listed pages only; the screen reads the page ranges and
 * the codes.
 */
#include "../core/codes.h"
#include "../cpu/attend.h"
#include "../cpu/attend_tail.h"
#include "../cpu/kernels.h"
#include "../cpu/screen.h"
#include "../cpu/support.h"
#include <stdlib.h>

typedef struct {
    ekv_cpu_step s; /* kernels, parameters, views, table and shape of the step */
    const ekv_page_stats *st;
    int64_t heads, Gl, nmax, maxP;
    const float *qs;                        /* scaled queries [B][H][D] */
    float *w_lo, *w_hi;                     /* per worker [Gl][nmax] */
    int64_t *w_idx;                         /* per worker [nmax] */
    double *w_y, *w_y2;                     /* per worker [nmax] */
    char *w_scratch;                        /* per worker, ekv_screen_scratch_bytes(D, Gl) */
    int32_t *sel_pages;                     /* [B*heads][maxP] the pages each list keeps */
    int64_t *sel_count, *survivors, *bytes; /* per list */
} screen_job;

/* Brings a page's range and codes towards the core two pages ahead: the screen is short on
 * compute per byte, so memory latency is what to hide (as the bound stage does). */
static void prefetch_page(const screen_job *j, int32_t page, int64_t kvh, int64_t rb) {
    const int64_t so = ((int64_t)page * j->s.sh.Hk + kvh) * j->s.sh.D;
    const uint8_t *codes = j->st->codes + ((int64_t)page * j->s.sh.Hk + kvh) * j->s.sh.ps * rb;
    for (int64_t d = 0; d < j->s.sh.D; d += 16) {
        __builtin_prefetch(j->st->kmin + so + d, 0, 2);
        __builtin_prefetch(j->st->kmax + so + d, 0, 2);
    }
    for (int64_t o = 0; o < j->s.sh.ps * rb; o += 64) __builtin_prefetch(codes + o, 0, 2);
}

/* The screen bounds of every token of sequence b for the list's heads. */
static void screen_sequence(screen_job *j, int64_t b, int64_t h0, int64_t kvh, int worker,
                            float *lo, float *hi) {
    const ekv_page_table *t = j->s.t;
    const int64_t P = ekv_seq_pages(t->indptr, b), ps = j->s.sh.ps, D = j->s.sh.D, Hk = j->s.sh.Hk;
    const int64_t N = ekv_seq_len(t->indptr, t->last_page_len, b, ps);
    const int64_t rb = ekv_code_row_bytes(D, j->st->code_bits);
    float b0[EKV_CPU_MAX_GROUP], bs[EKV_CPU_MAX_GROUP];
    double slack[EKV_CPU_MAX_GROUP];
    char *scratch = j->w_scratch + worker * ekv_screen_scratch_bytes(D, j->Gl);
    ekv_cpu_screen_prepare(j->qs + (b * j->s.sh.H + h0) * D, D, (int)j->Gl, D, scratch);
    for (int64_t p = 0; p < P; p++) {
        const int32_t page = t->indices[t->indptr[b] + p];
        const int64_t so = ((int64_t)page * Hk + kvh) * D;
        if (p + 2 < P) prefetch_page(j, t->indices[t->indptr[b] + p + 2], kvh, rb);
        const int biased =
                ekv_cpu_alibi_page(j->s.prm->alibi_slopes, j->s.sh.a, h0, j->Gl, p * ps, N, b0, bs);
        for (int64_t g = 0; biased && g < j->Gl; g++)
            slack[g] = 16.0 * 0x1p-24 * fabs((double)bs[g]) *
                       ((double)llabs(p * ps - (N - 1)) + (double)ps);
        const ekv_screen_page pg = {j->st->kmin + so,
                                    j->st->kmax + so,
                                    j->st->codes + ((int64_t)page * Hk + kvh) * ps * rb,
                                    j->st->code_bits,
                                    D,
                                    ekv_page_tokens(p, P, t->last_page_len[b], ps),
                                    biased ? b0 : NULL,
                                    biased ? bs : NULL,
                                    biased ? slack : NULL};
        ekv_cpu_screen_page(j->s.kern, &pg, j->qs + (b * j->s.sh.H + h0) * D, D, (int)j->Gl,
                            &ekv_screen_exact, scratch, lo + p * ps, hi + p * ps, j->nmax);
    }
}

/* tau of the lower bounds: a lower bound of tau* (docs/math.md §10.3); -inf when no token
 * could be bounded. */
static double lower_tau(screen_job *j, const float *lo, int64_t N, int worker) {
    float M = -INFINITY;
    for (int64_t i = 0; i < N; i++) M = lo[i] > M ? lo[i] : M;
    if (!isfinite(M)) return -INFINITY;
    double tr, ws;
    ekv_cpu_entmax_support(j->s.kern, lo, N, M, j->s.sh.alpha, j->w_idx + worker * j->nmax,
                           j->w_y + worker * j->nmax, j->w_y2 + worker * j->nmax, &tr, &ws);
    return (double)M + tr;
}

static void screen_list(void *vp, int64_t task, int worker) {
    screen_job *j = vp;
    const int64_t b = task / j->heads, l = task % j->heads;
    const int64_t h0 = ekv_list_head0(l, j->heads, j->s.sh.H, j->s.sh.G), kvh = h0 / j->s.sh.G;
    const int64_t P = ekv_seq_pages(j->s.t->indptr, b), ps = j->s.sh.ps;
    const int64_t N = ekv_seq_len(j->s.t->indptr, j->s.t->last_page_len, b, ps);
    float *lo = j->w_lo + worker * j->Gl * j->nmax, *hi = j->w_hi + worker * j->Gl * j->nmax;
    screen_sequence(j, b, h0, kvh, worker, lo, hi);
    double tauL[EKV_CPU_MAX_GROUP];
    for (int64_t g = 0; g < j->Gl; g++) tauL[g] = lower_tau(j, lo + g * j->nmax, N, worker);
    int32_t *out = j->sel_pages + task * j->maxP;
    int64_t n = 0, kept = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t ntok = ekv_page_tokens(p, P, j->s.t->last_page_len[b], ps);
        int64_t page_kept = 0;
        for (int64_t g = 0; g < j->Gl; g++)
            for (int64_t i = p * ps; i < p * ps + ntok; i++)
                page_kept += !((double)hi[g * j->nmax + i] <= tauL[g]); /* NaN keeps the token */
        kept += page_kept;
        if (page_kept || p == P - 1) out[n++] = (int32_t)p;
    }
    j->sel_count[task] = n;
    j->survivors[task] = kept;
    j->bytes[task] = P * 2 * j->s.sh.D * (int64_t)sizeof(float) +
                     N * ekv_code_row_bytes(j->s.sh.D, j->st->code_bits);
}

/* Per-worker scratch, the scaled queries and the per-list outputs, from the workspace. */
static ekv_status screen_workspace(ekv_context *ctx, screen_job *j, const float *q) {
    const int64_t W = ctx->n_threads, nl = j->s.sh.B * j->heads, nmax = j->nmax, D = j->s.sh.D;
    enum { QS, LO, HI, IDX, Y, Y2, SCR, SEL, CNT, SURV, BYTES, NB };
    const int64_t sz[NB] = {j->s.sh.B * j->s.sh.H * D * 4,
                            W * j->Gl * nmax * 4,
                            W * j->Gl * nmax * 4,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * ekv_screen_scratch_bytes(D, j->Gl),
                            nl * j->maxP * 4,
                            nl * 8,
                            nl * 8,
                            nl * 8};
    int64_t off[NB];
    ekv_status st;
    char *ws = ekv_workspace_blocks(ctx, sz, NB, off, "screen", &st);
    if (!ws) return st;
    float *qs = (float *)(ws + off[QS]);
    j->w_lo = (float *)(ws + off[LO]);
    j->w_hi = (float *)(ws + off[HI]);
    j->w_idx = (int64_t *)(ws + off[IDX]);
    j->w_y = (double *)(ws + off[Y]);
    j->w_y2 = (double *)(ws + off[Y2]);
    j->w_scratch = ws + off[SCR];
    j->sel_pages = (int32_t *)(ws + off[SEL]);
    j->sel_count = (int64_t *)(ws + off[CNT]);
    j->survivors = (int64_t *)(ws + off[SURV]);
    j->bytes = (int64_t *)(ws + off[BYTES]);
    const float qscale = (float)(j->s.sh.a * (float)ekv_effective_scale(j->s.prm->scale, D));
    for (int64_t i = 0; i < j->s.sh.B * j->s.sh.H * D; i++) qs[i] = q[i] * qscale;
    j->qs = qs;
    return EKV_OK;
}

ekv_status ekv_select_screened(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_page_list *list) {
    screen_job j = {.s = ekv_cpu_step_of(ctx, prm, kv, t), .st = st};
    j.heads = sel->per_query_head ? j.s.sh.H : j.s.sh.Hk;
    j.Gl = ekv_list_nheads(j.heads, j.s.sh.H, j.s.sh.G);
    ekv_status s = ekv_cpu_check_group(ctx, j.Gl);
    if (s) return s;
    j.nmax = ekv_table_max_len(t->indptr, t->last_page_len, t->batch, j.s.sh.ps);
    j.maxP = ekv_table_max_pages(t->indptr, t->batch);
    if ((s = screen_workspace(ctx, &j, q))) return s;
    const int64_t nl = j.s.sh.B * j.heads;
    ekv_pool_run(ctx->pool, nl, screen_list, &j);
    int64_t w = 0;
    list->indptr[0] = 0;
    list->bytes_summary = list->survivors = 0;
    for (int64_t l = 0; l < nl; l++) {
        memcpy(list->pages + w, j.sel_pages + l * j.maxP, sizeof(int32_t) * (size_t)j.sel_count[l]);
        w += j.sel_count[l];
        list->indptr[l + 1] = w;
        list->bytes_summary += j.bytes[l];
        list->survivors += j.survivors[l];
    }
    return EKV_OK;
}
