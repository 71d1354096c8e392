/*
 * The screen of screened decode (docs/math.md §10): the key codes of every page give per-token
 * bounds lo <= z <= hi on the scores the attention computes (src/cpu/kernels/screen_page.h);
 * tau(lo) is a lower bound of tau*, so a token with hi <= tau(lo) for every head of its list is
 * outside the support (a NaN bound keeps its token). Attention then reads K for the surviving
 * rows only and solves tau exactly on them, which is dense entmax (§10.3; the runner is
 * src/cpu/methods/screened.c).
 *
 *   phase 1  the screen, page-major as dense scoring is (tasks = sequence x chunk of pages, all
 *            lists of a page together: the ranges and codes stream in address order). Each
 *            (task, list) keeps the running maximum M of its lower bounds and only the tokens
 *            with hi > M - 1 for a head: tau(lo) >= max lo - 1, so the rest cannot survive.
 *   phase 2  per list: tau(lo) per head on the kept lower bounds above max lo - 1, then the
 *            rows whose hi exceeds it, ascending, into the caller's rows (screen_rows.h).
 *
 * The candidates are kept per (list, token slot): the workspace holds one slot per token of
 * the longest sequence per list, touched only as far as tokens are kept.
 */
#include "../../core/codes.h"
#include "../kernels/kernels.h"
#include "attend_tail.h"
#include "ranges.h"
#include "screen.h"
#include "screen_rows.h"
#include "support.h"
#include <stdlib.h>

enum { CHUNK_TOKENS = 2048 };

typedef struct {
    ekv_cpu_step s;
    const ekv_page_stats *st;
    int64_t heads, Gl, nmax, chunk_pages, ntask;
    const float *qs;    /* scaled queries [B][H][D] */
    int64_t *task_off;  /* [B + 1] first phase-1 task of each sequence */
    float *tmax;        /* [ntask][heads][Gl] running maxima of lo */
    int64_t *tcount;    /* [ntask][heads] candidates kept */
    float *tthr;        /* [ntask][heads][Gl] thresholds: a kept token's hi beats one */
    int64_t *tnext;     /* [ntask][heads] the count that triggers tightening */
    uint32_t *pub;      /* [B * heads][Gl] the best threshold of each list (float bits) */
    int64_t *c_tok;     /* [B * heads][nmax] candidate tokens, by chunk */
    float *c_lo, *c_hi; /* [B * heads][nmax][Gl] their bounds */
    float *w_lo, *w_hi; /* per worker [Gl][page_size] */
    char *w_scratch;    /* per worker and list, ekv_screen_scratch_bytes(D, Gl) */
    int64_t *w_idx;     /* per worker [nmax] */
    double *w_y, *w_y2; /* per worker [nmax] */
    float *w_l;         /* per worker [nmax] */
    float *w_range;     /* per worker [2 D]: a compact range as fp32 */
    int64_t *tskip;     /* [ntask] code bytes of the pages the page box dropped (not read) */
    int64_t skipped;    /* their sum, kept past the workspace (the attention reuses it) */
    int64_t *rows, *start, *count, *pairs; /* the caller's rows (screen_rows.h) */
} screen_job;

static int64_t find_seq(const screen_job *j, int64_t task) {
    int64_t lo = 0, hi = j->s.sh.B - 1;
    while (lo < hi) { /* last b with task_off[b] <= task */
        const int64_t mid = (lo + hi + 1) / 2;
        if (j->task_off[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* What the screen keeps per worker and list (ekv_cpu_screen_prepare, once per chunk). */
static char *list_scratch(const screen_job *j, int worker, int64_t l) {
    return j->w_scratch + (worker * j->heads + l) * ekv_screen_scratch_bytes(j->s.sh.D, j->Gl);
}

/* Raises a threshold shared by the tasks of one list to v (a lock-free maximum on its bits). */
static void publish_max(uint32_t *p, float v) {
    uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED), nv;
    memcpy(&nv, &v, 4);
    for (;;) {
        float f;
        memcpy(&f, &old, 4);
        if (!(v > f)) return;
        if (__atomic_compare_exchange_n(p, &old, nv, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
    }
}

static float shared_thr(const screen_job *j, int64_t li, int64_t g) {
    const uint32_t u = __atomic_load_n(j->pub + li * j->Gl + g, __ATOMIC_RELAXED);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Page p of sequence b as list l's screen sees it: its range, codes and ALiBi terms (into the
 * caller's b0, bs, slack [Gl]). */
static ekv_screen_page page_view(screen_job *j, int64_t b, int64_t l, int64_t p, int worker,
                                 float *b0, float *bs, double *slack) {
    const ekv_page_table *t = j->s.t;
    const int64_t P = ekv_seq_pages(t->indptr, b), ps = j->s.sh.ps, D = j->s.sh.D, Hk = j->s.sh.Hk;
    const int64_t N = ekv_seq_len(t->indptr, t->last_page_len, b, ps);
    const int64_t h0 = ekv_list_head0(l, j->heads, j->s.sh.H, j->s.sh.G), kvh = h0 / j->s.sh.G;
    const int32_t page = t->indices[t->indptr[b] + p];
    const int64_t so = ((int64_t)page * Hk + kvh) * D;
    const int biased =
            ekv_cpu_alibi_page(j->s.prm->alibi_slopes, j->s.sh.a, h0, j->Gl, p * ps, N, b0, bs);
    for (int64_t g = 0; biased && g < j->Gl; g++)
        slack[g] = 16.0 * 0x1p-24 * fabs((double)bs[g]) *
                   ((double)llabs(p * ps - (N - 1)) + (double)ps);
    const float *mn, *mx;
    ekv_cpu_page_range(j->s.kern, j->st, so, D, j->w_range + worker * 2 * D, &mn, &mx);
    const ekv_screen_page pg = {mn,
                                mx,
                                j->st->codes + ((int64_t)page * Hk + kvh) * ps *
                                                       ekv_code_row_bytes(D, j->st->code_bits),
                                j->st->code_bits,
                                D,
                                ps,
                                ekv_page_tokens(p, P, t->last_page_len[b], ps),
                                biased ? b0 : NULL,
                                biased ? bs : NULL,
                                biased ? slack : NULL};
    return pg;
}

/* The page box against the list's thresholds (the task's, or a higher one another task
 * shared; docs/math.md §10.4): 1 when no token of the page can beat any head's, so its codes
 * need not be read. */
static int page_below(screen_job *j, const ekv_screen_page *pg, int64_t task, int64_t b, int64_t l,
                      int worker) {
    double u[EKV_CPU_MAX_GROUP];
    ekv_cpu_screen_page_box(j->s.kern, pg, (int)j->Gl, list_scratch(j, worker, l), u);
    const float *thr = j->tthr + (task * j->heads + l) * j->Gl;
    for (int64_t g = 0; g < j->Gl; g++) {
        const float s = shared_thr(j, b * j->heads + l, g), t = s > thr[g] ? s : thr[g];
        if (!(u[g] <= (double)t)) return 0;
    }
    return 1;
}

/* The bounds of the page's tokens for list l's heads into lo/hi [Gl][ps]. */
static void screen_page(screen_job *j, const ekv_screen_page *pg, int64_t b, int64_t l, int worker,
                        float *lo, float *hi) {
    const int64_t h0 = ekv_list_head0(l, j->heads, j->s.sh.H, j->s.sh.G), D = j->s.sh.D;
    ekv_cpu_screen_page(j->s.kern, pg, j->qs + (b * j->s.sh.H + h0) * D, D, (int)j->Gl,
                        &ekv_screen_exact, list_scratch(j, worker, l), lo, hi, j->s.sh.ps);
}

enum { SCREEN_PF_PAGES = 2 }; /* prefetch distance, in pages */

/* Brings page p's range and code block for list l's KV head towards the core: the screen does
 * little compute per byte, so the memory latency is what it must hide. */
static void prefetch_page(const screen_job *j, int64_t b, int64_t l, int64_t p) {
    const ekv_page_table *t = j->s.t;
    const int64_t D = j->s.sh.D, Hk = j->s.sh.Hk, ps = j->s.sh.ps;
    const int64_t kvh = ekv_list_head0(l, j->heads, j->s.sh.H, j->s.sh.G) / j->s.sh.G;
    const int64_t ph = (int64_t)t->indices[t->indptr[b] + p] * Hk + kvh;
    const int64_t cb = ps * ekv_code_row_bytes(D, j->st->code_bits);
    const char *mn = ekv_cpu_range_addr(j->st, 0, ph * D);
    const char *mx = ekv_cpu_range_addr(j->st, 1, ph * D);
    const char *codes = (const char *)(j->st->codes + ph * cb);
    for (int64_t o = 0; o < ekv_range_bytes(j->st->range_dtype, D) / 2; o += 64) {
        __builtin_prefetch(mn + o, 0, 2);
        __builtin_prefetch(mx + o, 0, 2);
    }
    for (int64_t o = 0; o < cb; o += 64) __builtin_prefetch(codes + o, 0, 2);
}

/* t rounded down to a float (a threshold must not rise); below(x): x - 1e-12 (1 + |x|) rounded
 * down, for a tau solved in double, which may exceed the exact one by its rounding (docs/math.md
 * §10.3). */
static float round_down(double t) {
    float f = (float)t;
    if ((double)f > t) f = nextafterf(f, -INFINITY);
    return f;
}
static float below(double x) { return round_down(x - 1e-12 * (1.0 + fabs(x))); }

/* tau of head g over the kept lower bounds above M - 1 (docs/math.md §10.3: only they can be in
 * the support of entmax over them), for candidates[0..n) from base; -inf without a finite M. */
static double kept_tau(screen_job *j, int64_t base, int64_t n, float M, int64_t g, int worker) {
    if (!isfinite(M)) return -INFINITY;
    float *v = j->w_l + worker * j->nmax;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const float x = j->c_lo[(base + i) * j->Gl + g];
        if ((double)x > (double)M - 1.0) v[k++] = x;
    }
    double tr, ws;
    ekv_cpu_entmax_support(j->s.kern, v, k, M, j->s.sh.alpha, j->w_idx + worker * j->nmax,
                           j->w_y + worker * j->nmax, j->w_y2 + worker * j->nmax, &tr, &ws);
    return (double)M + tr;
}

/* Keeps the candidates[0..n) from base whose hi beats thr for a head (NaN keeps); returns
 * how many. */
static int64_t compact_kept(screen_job *j, int64_t base, int64_t n, const float *thr) {
    const int64_t Gl = j->Gl;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        int keep = 0;
        for (int64_t g = 0; g < Gl; g++) keep |= !(j->c_hi[(base + i) * Gl + g] <= thr[g]);
        if (!keep) continue;
        j->c_tok[base + k] = j->c_tok[base + i];
        memmove(j->c_lo + (base + k) * Gl, j->c_lo + (base + i) * Gl, sizeof(float) * (size_t)Gl);
        memmove(j->c_hi + (base + k) * Gl, j->c_hi + (base + i) * Gl, sizeof(float) * (size_t)Gl);
        k++;
    }
    return k;
}

/* Raises the (task, list) thresholds to tau of its kept lower bounds (a subset's tau is a lower
 * bound of tau(lo), docs/math.md §10.3 Claim 3), shares them with the list's other tasks, and
 * drops the candidates at or below them. */
static void tighten(screen_job *j, int64_t task, int64_t li, int64_t base, int worker) {
    const int64_t tl = task * j->heads + li % j->heads;
    float *thr = j->tthr + tl * j->Gl;
    for (int64_t g = 0; g < j->Gl; g++) {
        const float t = below(kept_tau(j, base, j->tcount[tl], j->tmax[tl * j->Gl + g], g, worker));
        thr[g] = t > thr[g] ? t : thr[g];
        publish_max(j->pub + li * j->Gl + g, thr[g]);
        const float s = shared_thr(j, li, g);
        thr[g] = s > thr[g] ? s : thr[g];
    }
    const int64_t before = j->tcount[tl];
    j->tcount[tl] = compact_kept(j, base, before, thr);
    /* a tightening that dropped less than half is not repeated in this task (iid keys) */
    j->tnext[tl] = 2 * j->tcount[tl] > before ? INT64_MAX : 4 * j->tcount[tl] + 1024;
}

/* max(m, x[0..n)), NaN ignored; eight independent lanes, so that it vectorises. */
static float page_max(const float *x, int64_t n, float m) {
    float r[8] = {m, m, m, m, m, m, m, m};
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int k = 0; k < 8; k++) r[k] = x[t + k] > r[k] ? x[t + k] : r[k];
    for (; t < n; t++) r[0] = x[t] > r[0] ? x[t] : r[0];
    for (int k = 1; k < 8; k++) r[0] = r[k] > r[0] ? r[k] : r[0];
    return r[0];
}

/* Raises the (task, list) maxima with the page's lower bounds, then keeps the tokens whose hi
 * beats the threshold (at least M - 1 rounded down, Claim 3) for a head; tightens the
 * threshold when the kept tokens have doubled. */
static void keep_candidates(screen_job *j, int64_t task, int64_t b, int64_t l, int64_t first,
                            int64_t ntok, int64_t chunk_first, const float *lo, const float *hi,
                            int worker) {
    const int64_t ps = j->s.sh.ps, Gl = j->Gl, li = b * j->heads + l, tl = task * j->heads + l;
    float *M = j->tmax + tl * Gl, *thr = j->tthr + tl * Gl;
    uint8_t keep[256] = {0}; /* a page holds at most 256 tokens */
    for (int64_t g = 0; g < Gl; g++) {
        const float m = page_max(lo + g * ps, ntok, M[g]);
        if (m > M[g]) { /* the threshold follows a new maximum (Claim 3) */
            M[g] = m;
            const float t1 = round_down((double)m - 1.0); /* M - 1 needs no tolerance */
            thr[g] = t1 > thr[g] ? t1 : thr[g];
        }
        for (int64_t t = 0; t < ntok; t++) keep[t] |= !(hi[g * ps + t] <= thr[g]);
    }
    int64_t *n = j->tcount + tl;
    const int64_t base = li * j->nmax + chunk_first;
    for (int64_t t = 0; t < ntok; t++) {
        if (!keep[t]) continue;
        const int64_t c = base + *n;
        j->c_tok[c] = first + t;
        for (int64_t g = 0; g < Gl; g++) {
            j->c_lo[c * Gl + g] = lo[g * ps + t];
            j->c_hi[c * Gl + g] = hi[g * ps + t];
        }
        (*n)++;
    }
    if (*n >= j->tnext[tl]) tighten(j, task, li, base, worker);
}

/* Whether a task still tries the page box: it stops once the box has dropped fewer than one
 * page in eight of its first 64 tries (keys without a position bias rarely fall below it). */
typedef struct {
    int on;
    int64_t tried, skipped;
} box_gate;

static int gate_skips(box_gate *g, int below) {
    g->tried++;
    g->skipped += below;
    if (g->tried >= 64 && 8 * g->skipped < g->tried) g->on = 0;
    return below;
}

/* The chunk (0 = the oldest) of sequence b that a task screens, or the task of a chunk: the map
 * is its own inverse. The newest chunk goes first, so that on ALiBi heads the thresholds rise
 * before the old pages come, and their page box can drop them unread. */
static int64_t chunk_task(const screen_job *j, int64_t b, int64_t task_or_chunk) {
    return j->task_off[b + 1] - 1 - task_or_chunk;
}

/* Shares the task's thresholds with the list's other tasks (each is a lower bound of tau(l),
 * docs/math.md §10.3). */
static void publish_task(screen_job *j, int64_t task, int64_t b) {
    for (int64_t l = 0; l < j->heads; l++)
        for (int64_t g = 0; g < j->Gl; g++)
            publish_max(j->pub + (b * j->heads + l) * j->Gl + g,
                        j->tthr[(task * j->heads + l) * j->Gl + g]);
}

static void screen_chunk(void *vp, int64_t task, int worker) {
    screen_job *j = vp;
    const int64_t b = find_seq(j, task), c = chunk_task(j, b, task), ps = j->s.sh.ps;
    const int64_t P = ekv_seq_pages(j->s.t->indptr, b), p0 = c * j->chunk_pages;
    const int64_t p1 = p0 + j->chunk_pages < P ? p0 + j->chunk_pages : P;
    float *lo = j->w_lo + worker * j->Gl * ps, *hi = j->w_hi + worker * j->Gl * ps;
    for (int64_t l = 0; l < j->heads; l++) {
        const int64_t h0 = ekv_list_head0(l, j->heads, j->s.sh.H, j->s.sh.G), D = j->s.sh.D;
        ekv_cpu_screen_prepare(j->qs + (b * j->s.sh.H + h0) * D, D, (int)j->Gl, D,
                               list_scratch(j, worker, l));
        const int64_t tl = task * j->heads + l;
        j->tcount[tl] = 0;
        j->tnext[tl] = 256;
        for (int64_t g = 0; g < j->Gl; g++) {
            j->tmax[tl * j->Gl + g] = -INFINITY;
            j->tthr[tl * j->Gl + g] = shared_thr(j, b * j->heads + l, g);
        }
    }
    box_gate gate = {1, 0, 0};
    j->tskip[task] = 0;
    for (int64_t p = p0; p < p1; p++) {
        for (int64_t l = 0; l < j->heads; l++) {
            if (p + SCREEN_PF_PAGES < P) prefetch_page(j, b, l, p + SCREEN_PF_PAGES);
            float b0[EKV_CPU_MAX_GROUP], bs[EKV_CPU_MAX_GROUP];
            double slack[EKV_CPU_MAX_GROUP];
            const ekv_screen_page pg = page_view(j, b, l, p, worker, b0, bs, slack);
            if (pg.bias0 && gate.on && gate_skips(&gate, page_below(j, &pg, task, b, l, worker))) {
                j->tskip[task] += pg.ntok * ekv_code_row_bytes(pg.D, pg.bits);
                continue;
            }
            screen_page(j, &pg, b, l, worker, lo, hi);
            keep_candidates(j, task, b, l, p * ps, pg.ntok, p0 * ps, lo, hi, worker);
        }
    }
    publish_task(j, task, b);
}

/* Moves the kept candidates of every task of list li (sequence b) to the front of its slots,
 * in token order (each task's region starts at or after what precedes it), and the maxima of
 * their lower bounds into M; returns how many. */
static int64_t gather_kept(screen_job *j, int64_t b, int64_t l, float *M) {
    const int64_t li = b * j->heads + l, Gl = j->Gl, dst = li * j->nmax;
    int64_t n = 0;
    for (int64_t g = 0; g < Gl; g++) M[g] = -INFINITY;
    for (int64_t c = 0; c < j->task_off[b + 1] - j->task_off[b]; c++) { /* in token order */
        const int64_t task = chunk_task(j, b, c), tl = task * j->heads + l;
        const int64_t src = dst + c * j->chunk_pages * j->s.sh.ps;
        for (int64_t g = 0; g < Gl; g++)
            M[g] = j->tmax[tl * Gl + g] > M[g] ? j->tmax[tl * Gl + g] : M[g];
        memmove(j->c_tok + dst + n, j->c_tok + src, sizeof(int64_t) * (size_t)j->tcount[tl]);
        memmove(j->c_lo + (dst + n) * Gl, j->c_lo + src * Gl,
                sizeof(float) * (size_t)(j->tcount[tl] * Gl));
        memmove(j->c_hi + (dst + n) * Gl, j->c_hi + src * Gl,
                sizeof(float) * (size_t)(j->tcount[tl] * Gl));
        n += j->tcount[tl];
    }
    return n;
}

/* Phase 2 for list li: tau(lo) per head over the kept candidates (exact: the dropped ones are
 * at or below a lower bound of it, docs/math.md §10.3), lowered by the solve's tolerance, then
 * the rows whose hi beats it for a head. */
static void screen_survivors(void *vp, int64_t li, int worker) {
    screen_job *j = vp;
    const int64_t b = li / j->heads, l = li % j->heads, Gl = j->Gl, base = li * j->nmax;
    float M[EKV_CPU_MAX_GROUP], tauL[EKV_CPU_MAX_GROUP];
    const int64_t n = gather_kept(j, b, l, M);
    for (int64_t g = 0; g < Gl; g++) tauL[g] = below(kept_tau(j, base, n, M[g], g, worker));
    int64_t k = 0, pairs = 0, *out = j->rows + base;
    for (int64_t i = 0; i < n; i++) {
        int64_t kept = 0;
        for (int64_t g = 0; g < Gl; g++) kept += !(j->c_hi[(base + i) * Gl + g] <= tauL[g]);
        if (kept) out[k++] = j->c_tok[base + i];
        pairs += kept;
    }
    j->start[li] = base;
    j->count[li] = k;
    j->pairs[li] = pairs;
}

/* Phase-1 tasks per sequence and the workspace (scratch, candidates, scaled queries). */
static ekv_status screen_setup(ekv_context *ctx, screen_job *j, const float *q) {
    const ekv_page_table *t = j->s.t;
    const int64_t B = j->s.sh.B, W = ctx->n_threads, nl = B * j->heads, nmax = j->nmax;
    const int64_t D = j->s.sh.D, Gl = j->Gl, ps = j->s.sh.ps;
    j->chunk_pages = (CHUNK_TOKENS + ps - 1) / ps;
    j->ntask = 0;
    for (int64_t b = 0; b < B; b++)
        j->ntask += (ekv_seq_pages(t->indptr, b) + j->chunk_pages - 1) / j->chunk_pages;
    enum {
        QS,
        TOFF,
        TMAX,
        TCNT,
        TTHR,
        TNEXT,
        PUB,
        CTOK,
        CLO,
        CHI,
        WLO,
        WHI,
        SCR,
        IDX,
        Y,
        Y2,
        WL,
        WRNG,
        TSKIP,
        NB
    };
    const int64_t sz[NB] = {B * j->s.sh.H * D * 4,
                            (B + 1) * 8,
                            j->ntask * j->heads * Gl * 4,
                            j->ntask * j->heads * 8,
                            j->ntask * j->heads * Gl * 4,
                            j->ntask * j->heads * 8,
                            nl * Gl * 4,
                            nl * nmax * 8,
                            nl * nmax * Gl * 4,
                            nl * nmax * Gl * 4,
                            W * Gl * ps * 4,
                            W * Gl * ps * 4,
                            W * j->heads * ekv_screen_scratch_bytes(D, Gl),
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax * 8,
                            W * nmax * 4,
                            W * 2 * D * 4,
                            j->ntask * 8};
    int64_t off[NB];
    ekv_status st;
    char *ws = ekv_workspace_blocks(ctx, sz, NB, off, "screen", &st);
    if (!ws) return st;
    float *qs = (float *)(ws + off[QS]);
    j->task_off = (int64_t *)(ws + off[TOFF]);
    j->tmax = (float *)(ws + off[TMAX]);
    j->tcount = (int64_t *)(ws + off[TCNT]);
    j->tthr = (float *)(ws + off[TTHR]);
    j->tnext = (int64_t *)(ws + off[TNEXT]);
    j->pub = (uint32_t *)(ws + off[PUB]);
    const float ninf = -INFINITY;
    uint32_t ninf_bits;
    memcpy(&ninf_bits, &ninf, 4);
    for (int64_t i = 0; i < nl * Gl; i++) j->pub[i] = ninf_bits;
    j->c_tok = (int64_t *)(ws + off[CTOK]);
    j->c_lo = (float *)(ws + off[CLO]);
    j->c_hi = (float *)(ws + off[CHI]);
    j->w_lo = (float *)(ws + off[WLO]);
    j->w_hi = (float *)(ws + off[WHI]);
    j->w_scratch = ws + off[SCR];
    j->w_idx = (int64_t *)(ws + off[IDX]);
    j->w_y = (double *)(ws + off[Y]);
    j->w_y2 = (double *)(ws + off[Y2]);
    j->w_l = (float *)(ws + off[WL]);
    j->w_range = (float *)(ws + off[WRNG]);
    j->tskip = (int64_t *)(ws + off[TSKIP]);
    j->task_off[0] = 0;
    for (int64_t b = 0; b < B; b++)
        j->task_off[b + 1] = j->task_off[b] +
                             (ekv_seq_pages(t->indptr, b) + j->chunk_pages - 1) / j->chunk_pages;
    ekv_cpu_scale_queries(j->s.prm, &j->s.sh, q, qs);
    j->qs = qs;
    return EKV_OK;
}

/* The lists of the step (one per KV head, or per query head) and the longest sequence: what
 * the rows are sized by. */
static void rows_shape(const ekv_select_params *sel, const ekv_step_shape *sh,
                       const ekv_page_table *t, int64_t *heads, int64_t *nmax) {
    *heads = sel->per_query_head ? sh->H : sh->Hk;
    *nmax = ekv_table_max_len(t->indptr, t->last_page_len, t->batch, sh->ps);
}

/* The screen of the step into the job's rows. */
static ekv_status screen_rows(ekv_context *ctx, screen_job *j, const ekv_select_params *sel,
                              const float *q) {
    rows_shape(sel, &j->s.sh, j->s.t, &j->heads, &j->nmax);
    j->Gl = ekv_list_nheads(j->heads, j->s.sh.H, j->s.sh.G);
    ekv_status s = ekv_cpu_check_group(ctx, j->Gl);
    if (s) return s;
    if ((s = screen_setup(ctx, j, q))) return s;
    ekv_pool_run(ctx->pool, j->ntask, screen_chunk, j);
    for (int64_t t = 0; t < j->ntask; t++) j->skipped += j->tskip[t];
    ekv_pool_run(ctx->pool, j->s.sh.B * j->heads, screen_survivors, j);
    return EKV_OK;
}

/* Bytes the screen read: per list, the page ranges (2 D values per page) and the codes, but
 * for the pages the page box dropped. */
static int64_t screen_bytes(const screen_job *j) {
    int64_t bytes = 0;
    for (int64_t b = 0; b < j->s.sh.B; b++) {
        const int64_t P = ekv_seq_pages(j->s.t->indptr, b);
        const int64_t N = ekv_seq_len(j->s.t->indptr, j->s.t->last_page_len, b, j->s.sh.ps);
        bytes += j->heads * (P * ekv_range_bytes(j->st->range_dtype, j->s.sh.D) +
                             N * ekv_code_row_bytes(j->s.sh.D, j->st->code_bits));
    }
    return bytes - j->skipped;
}

static int64_t screen_pairs(const screen_job *j) {
    int64_t n = 0;
    for (int64_t li = 0; li < j->s.sh.B * j->heads; li++) n += j->pairs[li];
    return n;
}

void ekv_cpu_screen_rows_sizes(const ekv_decode_params *prm, const ekv_select_params *sel,
                               const ekv_paged_kv *kv, const ekv_page_table *t, int64_t *sz) {
    const ekv_step_shape sh = ekv_step_shape_of(prm, kv, t);
    int64_t heads, nmax;
    rows_shape(sel, &sh, t, &heads, &nmax);
    sz[0] = t->batch * heads * nmax * 8;          /* rows */
    sz[1] = sz[2] = sz[3] = t->batch * heads * 8; /* start, count, pairs */
}

ekv_status ekv_cpu_screen_rows(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_screen_rows *r) {
    screen_job j = {.s = ekv_cpu_step_of(ctx, prm, kv, t),
                    .st = st,
                    .rows = r->rows,
                    .start = r->start,
                    .count = r->count,
                    .pairs = r->pairs};
    ekv_status s = screen_rows(ctx, &j, sel, q);
    if (s) return s;
    r->rl = (ekv_row_lists){j.heads, j.start, j.count, j.rows};
    r->bytes_summary = screen_bytes(&j);
    r->survivors = screen_pairs(&j);
    return EKV_OK;
}

int64_t ekv_cpu_screen_row_pages(const ekv_row_lists *rl, int64_t lists, int64_t page_size) {
    int64_t n = 0;
    for (int64_t li = 0; li < lists; li++) {
        const int64_t *r = rl->rows + rl->start[li];
        for (int64_t i = 0; i < rl->count[li]; i++)
            n += i == 0 || r[i] / page_size != r[i - 1] / page_size;
    }
    return n;
}
