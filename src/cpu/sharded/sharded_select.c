/*
 * The page lists of context-parallel top-k and gaussian steps, simulated on the CPU
 * (docs/math.md §11): shard j holds the contiguous pages [j P / S, (j + 1) P / S) of every
 * sequence and sees only their bounds (top-k) or score moments (gaussian); what it learns of
 * the other shards comes through the collectives of sharded.h.
 *   topk:     the global k-th largest bound by 4 rounds of 256-bin histograms, summed over the
 *             shards (src/math/shard_select.h), and one round of tie counts when a list must
 *             split ties: the single-device lists exactly.
 *   gaussian: the sums of the mixture's moments (one allreduce-sum), with ALiBi the maxima of the
 *             mixture's bracket (one allreduce-max) and a round per evaluation of its F; each
 *             shard then applies the page rule to its own pages (and, for the clamp of the
 *             fixed/corrected modes, one allreduce-max of the largest clamp term).
 * The page bounds and moments are per page, each from its page's statistics alone, so the
 * simulation computes them once for all pages: what shard j reads of them is its own pages'.
 */
#include "../../core/method.h"
#include "../../math/gaussian.h"
#include "../../math/gaussian_core.h"
#include "../../math/shard_select.h"
#include "../select/gaussian_select.h"
#include "../stages/bound.h"
#include "sharded.h"
#include <stdlib.h>

/* The pages of sequence b's shard j: [*p0, *p1). */
static void shard_span(const ekv_page_table *t, int64_t b, int S, int j, int64_t *p0, int64_t *p1) {
    int64_t first, count;
    ekv_shard_range(ekv_seq_pages(t->indptr, b), S, j, &first, &count);
    *p0 = first;
    *p1 = first + count;
}

static void add_rounds(int32_t *rounds, int64_t n, int32_t r) {
    for (int64_t i = 0; i < n; i++) rounds[i] += r;
}

/* ---------------------------------- top-k ---------------------------------- */

typedef struct {
    const ekv_page_table *t;
    int S;
    int64_t L, heads, kstride; /* lists; lists per sequence; keys per list */
    const uint32_t *key;       /* [L][kstride]: the list's bound keys of its ranked pages */
    ekv_topk_agree *ag;        /* [L] */
    double *loc, *red;         /* [S][L][256] and [L][256] (the tie round: [S][L][S], [L][S]) */
    ekv_shard_comm c;
} topk_sim;

/* Sequence b's ranked pages: every page but the last. */
static int64_t ranked_pages(const ekv_page_table *t, int64_t b) {
    const int64_t P = ekv_seq_pages(t->indptr, b);
    return P > 1 ? P - 1 : 0;
}

/* One level: each shard's histogram over its ranked pages, the allreduce, the same update. */
static void topk_level(topk_sim *m) {
    const int64_t W = m->L * EKV_TOPK_BINS;
    memset(m->loc, 0, sizeof(double) * (size_t)(m->S * W));
    for (int j = 0; j < m->S; j++)
        for (int64_t l = 0; l < m->L; l++) {
            const int64_t b = l / m->heads, np = ranked_pages(m->t, b);
            int64_t p0, p1;
            shard_span(m->t, b, m->S, j, &p0, &p1);
            for (int64_t p = p0; p < p1 && p < np; p++) {
                const int bin = ekv_topk_bin(&m->ag[l], m->key[l * m->kstride + p]);
                if (bin >= 0) m->loc[j * W + l * EKV_TOPK_BINS + bin] += 1;
            }
        }
    ekv_shard_allreduce_sum(m->loc, m->S, W, m->red, &m->c);
    for (int64_t l = 0; l < m->L; l++) ekv_topk_agree_step(&m->ag[l], m->red + l * EKV_TOPK_BINS);
}

/* The tie round: shard j's count of ties at T in slot j; red[l * S + i] = shard i's. */
static void topk_ties(topk_sim *m) {
    const int S = m->S;
    const int64_t W = m->L * S;
    memset(m->loc, 0, sizeof(double) * (size_t)(S * W));
    for (int j = 0; j < S; j++)
        for (int64_t l = 0; l < m->L; l++) {
            const int64_t b = l / m->heads, np = ranked_pages(m->t, b);
            int64_t p0, p1;
            shard_span(m->t, b, S, j, &p0, &p1);
            for (int64_t p = p0; p < p1 && p < np; p++)
                m->loc[j * W + l * S + j] +=
                        ekv_topk_take(&m->ag[l], m->key[l * m->kstride + p]) < 0;
        }
    ekv_shard_allreduce_sum(m->loc, S, W, m->red, &m->c);
}

/* List l as its shards write it: each its taken pages in order (ties: those with fewer than
 * need ties before them), then the last page. ties: the tie round's counts or NULL. */
static int64_t topk_write(const topk_sim *m, int64_t l, const double *ties, int32_t *out) {
    const int64_t b = l / m->heads, np = ranked_pages(m->t, b);
    int64_t n = 0, before = 0;
    for (int j = 0; j < m->S; j++) {
        int64_t p0, p1;
        shard_span(m->t, b, m->S, j, &p0, &p1);
        for (int64_t p = p0; p < p1 && p < np; p++) {
            const int tk = ekv_topk_take(&m->ag[l], m->key[l * m->kstride + p]);
            if (tk > 0 || (tk < 0 && ekv_topk_tie_taken(&m->ag[l], before++)))
                out[n++] = (int32_t)p;
        }
        if (ties) before = 0;
        for (int i = 0; ties && i <= j; i++) before += (int64_t)ties[l * m->S + i];
    }
    out[n++] = (int32_t)(ekv_seq_pages(m->t->indptr, b) - 1);
    return n;
}

/* Every list's bound keys (the max over its query heads, as the single-device select ranks)
 * and its start: k = the budget's pages (at least 1, at most the ranked ones; the rule the CUDA
 * plan shares, ekv_topk_page_count). */
static void topk_keys(const ekv_select_params *sel, const ekv_step_shape *sh,
                      const ekv_page_table *t, const float *u, int64_t ustride, topk_sim *m,
                      uint32_t *key) {
    for (int64_t l = 0; l < m->L; l++) {
        const int64_t b = l / m->heads, h = l % m->heads, np = ranked_pages(t, b);
        const int64_t h0 = ekv_list_head0(h, m->heads, sh->H, sh->G),
                      hn = ekv_list_nheads(m->heads, sh->H, sh->G);
        for (int64_t p = 0; p < np; p++)
            key[l * m->kstride + p] =
                    ekv_bound_key(ekv_cpu_list_bound(u, ustride, b, sh->H, h0, hn, p));
        const int64_t N = ekv_seq_len(t->indptr, t->last_page_len, b, sh->ps);
        ekv_topk_agree_start(&m->ag[l], np, ekv_topk_page_count(ekv_seq_budget(sel, N), sh->ps, np));
    }
}

/* The bounds of every page (ekv_cpu_bound_pages, as the single-device top-k computes them). */
static ekv_status topk_bounds(ekv_context *ctx, const ekv_decode_params *prm,
                              const ekv_select_params *sel, const ekv_paged_kv *kv,
                              const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                              float *u, int64_t ustride, int64_t *read_bytes) {
    int64_t sz[EKV_BOUND_BLOCKS], off[EKV_BOUND_BLOCKS];
    ekv_cpu_bound_scratch_sizes(ctx, kv, st, t->batch, prm->num_heads, ustride, sz);
    ekv_status s;
    char *ws = ekv_workspace_blocks(ctx, sz, EKV_BOUND_BLOCKS, off, "sharded bounds", &s);
    if (!ws) return s;
    const ekv_cpu_bound_scratch scr = ekv_cpu_bound_scratch_at(ws, off);
    return ekv_cpu_bound_pages(ctx, prm, kv, st, t, q, u, ustride, &scr, sel->use_ball, sel->tau_lb,
                               read_bytes);
}

static ekv_status shard_topk(ekv_context *ctx, const ekv_decode_params *prm,
                             const ekv_select_params *sel, const ekv_paged_kv *kv,
                             const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                             int S, ekv_page_list *list, int32_t *rounds, int64_t *bytes) {
    const ekv_step_shape sh = ekv_step_shape_of(prm, kv, t);
    const int64_t heads = list->heads, L = sh.B * heads,
                  maxP = ekv_table_max_pages(t->indptr, sh.B);
    const int64_t W = L * (EKV_TOPK_BINS > S ? EKV_TOPK_BINS : S);
    float *u = malloc(sizeof(float) * (size_t)(sh.B * sh.H * maxP));
    uint32_t *key = malloc(sizeof(uint32_t) * (size_t)(L * maxP));
    ekv_topk_agree *ag = malloc(sizeof(ekv_topk_agree) * (size_t)L);
    double *loc = malloc(sizeof(double) * (size_t)(S * W)),
           *red = malloc(sizeof(double) * (size_t)W);
    ekv_status s = EKV_OK;
    int64_t read_bytes = 0;
    if (!u || !key || !ag || !loc || !red)
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for the sharded top-k");
    if (!s) s = topk_bounds(ctx, prm, sel, kv, st, t, q, u, maxP, &read_bytes);
    if (!s) {
        topk_sim m = {t, S, L, heads, maxP, key, ag, loc, red, {0, 0}};
        topk_keys(sel, &sh, t, u, maxP, &m, key);
        int running = 1, split = 0;
        for (int lev = 0; lev < EKV_TOPK_LEVELS && running; lev++) {
            topk_level(&m);
            running = 0;
            for (int64_t l = 0; l < L; l++) running |= ag[l].phase == EKV_TOPK_RUNNING;
        }
        for (int64_t l = 0; l < L; l++) split |= ag[l].phase == EKV_TOPK_TIES;
        if (split) topk_ties(&m); /* red then holds the tie counts */
        list->indptr[0] = 0;
        for (int64_t l = 0; l < L; l++)
            list->indptr[l + 1] = list->indptr[l] + topk_write(&m, l, split ? red : NULL,
                                                               list->pages + list->indptr[l]);
        list->bytes_summary = read_bytes;
        add_rounds(rounds, sh.B * sh.H, m.c.rounds);
        *bytes += m.c.bytes;
    }
    free(u);
    free(key);
    free(ag);
    free(loc);
    free(red);
    return s;
}

/* --------------------------------- gaussian --------------------------------- */

typedef struct {
    const ekv_select_params *sel;
    const ekv_page_table *t;
    ekv_step_shape sh;
    int S;
    int64_t pstride;
    double *mu, *sig;  /* [B*H][pstride] page moments (with ALiBi: the shifted means) */
    double *g;         /* [B*H][5]: mu_g, sigma_g, u_avg, tau-hat, the rule's floor */
    double *loc, *red; /* [S][B*H][4], [B*H][4] */
} gauss_sim;

/* Each page's moments (by its owner). */
static void gauss_pages(gauss_sim *m, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                        const ekv_page_stats *st, const float *q, float *qs) {
    const double scale = ekv_effective_scale(prm->scale, m->sh.D);
    for (int64_t b = 0; b < m->sh.B; b++) {
        const int64_t Ps = ekv_gauss_stats_pages(ekv_seq_pages(m->t->indptr, b));
        for (int64_t kvh = 0; kvh < m->sh.Hk; kvh++) {
            const int64_t bh0 = b * m->sh.H + kvh * m->sh.G;
            ekv_gauss_group_query(q, scale, b, m->sh.H, kvh, m->sh.G, m->sh.D, qs);
            for (int64_t p = 0; p < Ps; p++)
                ekv_gauss_page_moments(kv, st, m->t->indices[m->t->indptr[b] + p], kvh, qs, m->sh.G,
                                       m->mu + bh0 * m->pstride + p, m->sig + bh0 * m->pstride + p,
                                       m->pstride);
        }
    }
}

/* ALiBi: every page mean moved to its centre's bias (positions are global offsets, §4.4). */
static void gauss_shift(gauss_sim *m, const float *slopes) {
    for (int64_t b = 0; b < m->sh.B; b++) {
        const int64_t P = ekv_seq_pages(m->t->indptr, b), Ps = ekv_gauss_stats_pages(P);
        const int64_t N = ekv_seq_len(m->t->indptr, m->t->last_page_len, b, m->sh.ps),
                      n = P > 1 ? Ps * m->sh.ps : N;
        for (int64_t h = 0; h < m->sh.H; h++)
            for (int64_t p = 0; p < Ps; p++) {
                double *mu = m->mu + (b * m->sh.H + h) * m->pstride + p;
                *mu = ekv_gauss_alibi_mean(*mu, p, m->sh.ps, n, N, slopes[h]);
            }
    }
}

/* Shard j's stats pages of sequence b: its pages below Ps. */
static void stats_span(const gauss_sim *m, int64_t b, int j, int64_t *p0, int64_t *p1) {
    shard_span(m->t, b, m->S, j, p0, p1);
    const int64_t Ps = ekv_gauss_stats_pages(ekv_seq_pages(m->t->indptr, b));
    *p1 = *p1 < Ps ? *p1 : Ps;
    *p0 = *p0 < *p1 ? *p0 : *p1;
}

/* Round 1: per head the sums of mu, sigma^2, mu^2 (the unshifted means: ALiBi shifts them
 * after, §4.4) and of mu + 1.5 sigma (shifted); mu_g, sigma_g and u_avg from them. mu0: the
 * unshifted means. */
static void gauss_sums(gauss_sim *m, const double *mu0, ekv_shard_comm *c) {
    const int64_t BH = m->sh.B * m->sh.H;
    for (int j = 0; j < m->S; j++)
        for (int64_t bh = 0; bh < BH; bh++) {
            int64_t p0, p1;
            stats_span(m, bh / m->sh.H, j, &p0, &p1);
            const double *mu = mu0 + bh * m->pstride, *ms = m->mu + bh * m->pstride,
                         *sg = m->sig + bh * m->pstride;
            double *o = m->loc + (j * BH + bh) * 4;
            o[0] = o[1] = o[2] = o[3] = 0;
            for (int64_t p = p0; p < p1; p++) {
                o[0] += mu[p];
                o[1] += sg[p] * sg[p];
                o[2] += mu[p] * mu[p];
                o[3] += ms[p] + 1.5 * sg[p];
            }
        }
    ekv_shard_allreduce_sum(m->loc, m->S, 4 * BH, m->red, c);
    for (int64_t bh = 0; bh < BH; bh++) {
        const double Ps = (double)ekv_gauss_stats_pages(ekv_seq_pages(m->t->indptr, bh / m->sh.H));
        const double *r = m->red + bh * 4;
        ekv_gauss_global_moments(r[0], r[1], r[2], Ps, &m->g[bh * 5], &m->g[bh * 5 + 1]);
        m->g[bh * 5 + 2] = r[3] / Ps;
    }
}

/* The ALiBi mixture of one head, its F summed over the shards (a round per evaluation). */
typedef struct {
    const gauss_sim *m;
    int64_t bh;
    double alpha;
    ekv_shard_comm *c;
} mixture_sim;

static double mixture_F_sharded(void *vp, double tau, double *F1, double *F2) {
    const mixture_sim *x = vp;
    const gauss_sim *m = x->m;
    const double *mu = m->mu + x->bh * m->pstride, *sg = m->sig + x->bh * m->pstride;
    for (int j = 0; j < m->S; j++) {
        int64_t p0, p1;
        stats_span(m, x->bh / m->sh.H, j, &p0, &p1);
        double *o = m->loc + j * 3;
        o[0] = j == 0 ? -1.0 : 0.0; /* F = sum - 1: shard 0 starts there, as one device does */
        o[1] = o[2] = 0;
        for (int64_t p = p0; p < p1; p++) {
            double f, f1, f2;
            ekv_gauss_term_core(x->alpha, mu[p], fmax(sg[p], 1e-6), tau, m->sel->reference_m3, &f,
                                &f1, &f2);
            o[0] += (double)m->sh.ps * f;
            o[1] += (double)m->sh.ps * f1;
            o[2] += (double)m->sh.ps * f2;
        }
    }
    ekv_shard_allreduce_sum(m->loc, m->S, 3, m->red, x->c);
    if (F1) *F1 = m->red[1];
    if (F2) *F2 = m->red[2];
    return m->red[0];
}

/* ALiBi: the bracket's maxima (one allreduce-max for every head), then each head's mixture. */
static void gauss_mixture(gauss_sim *m, double alpha, int32_t *rounds, ekv_shard_comm *c) {
    const int64_t BH = m->sh.B * m->sh.H;
    for (int j = 0; j < m->S; j++)
        for (int64_t bh = 0; bh < BH; bh++) {
            int64_t p0, p1;
            stats_span(m, bh / m->sh.H, j, &p0, &p1);
            double *o = m->loc + (j * BH + bh) * 2;
            o[0] = -INFINITY;
            o[1] = 1e-6;
            for (int64_t p = p0; p < p1; p++) {
                o[0] = fmax(o[0], m->sh.a * m->mu[bh * m->pstride + p]);
                o[1] = fmax(o[1], m->sh.a * fmax(m->sig[bh * m->pstride + p], 1e-6));
            }
        }
    ekv_shard_allreduce_max(m->loc, m->S, 2 * BH, m->red, c);
    double *ext = malloc(sizeof(double) * (size_t)(2 * BH)); /* red is the rounds' buffer */
    if (ext) memcpy(ext, m->red, sizeof(double) * (size_t)(2 * BH));
    for (int64_t bh = 0; ext && bh < BH; bh++) {
        ekv_shard_comm ch = {0, 0};
        mixture_sim x = {m, bh, alpha, &ch};
        const double Ps = (double)ekv_gauss_stats_pages(ekv_seq_pages(m->t->indptr, bh / m->sh.H));
        m->g[bh * 5 + 3] =
                ekv_gauss_tau_mixture_core(ext[2 * bh], ext[2 * bh + 1],
                                           fmax(Ps * (double)m->sh.ps, 1.0), mixture_F_sharded, &x);
        rounds[bh] += ch.rounds;
        c->bytes += ch.bytes;
    }
    free(ext);
}

/* The page rule on each shard's pages for every list (each head's floor first, the same on
 * every shard), the clamp's maxima, the lists. */
static void gauss_rule(gauss_sim *m, double margin_z, double q_max, ekv_page_list *list,
                       double *tau, ekv_shard_comm *c) {
    const int64_t BH = m->sh.B * m->sh.H, heads = list->heads, ps = m->sh.ps;
    const int64_t hn = ekv_list_nheads(heads, m->sh.H, m->sh.G);
    const double zpage = ekv_normal_quantile(pow(q_max, 1.0 / (double)ps));
    const double zc = ekv_normal_quantile(pow(m->sel->clamp_quantile, 1.0 / (double)ps));
    const int clamp = m->sel->tau_mode != EKV_TAU_EXACT && m->sel->clamp_tau;
    for (int64_t bh = 0; bh < BH; bh++) {
        double *g = m->g + bh * 5;
        g[4] = ekv_gauss_floor(g[3], m->sh.a, g[2], margin_z, g[1], m->sel->excess_fraction);
    }
    for (int64_t i = 0; i < m->S * BH; i++) m->loc[i] = -INFINITY;
    list->indptr[0] = 0;
    for (int64_t l = 0; l < m->sh.B * heads; l++) {
        const int64_t b = l / heads,
                      h0 = b * m->sh.H + ekv_list_head0(l % heads, heads, m->sh.H, m->sh.G);
        const int64_t P = ekv_seq_pages(m->t->indptr, b);
        int32_t *out = list->pages + list->indptr[l];
        int64_t n = 0;
        for (int j = 0; j < m->S; j++) {
            int64_t p0, p1;
            stats_span(m, b, j, &p0, &p1);
            for (int64_t p = p0; P > 1 && p < p1; p++) {
                int any = 0;
                for (int64_t bh = h0; bh < h0 + hn; bh++) {
                    const double mu = m->mu[bh * m->pstride + p], sg = m->sig[bh * m->pstride + p];
                    if (!ekv_gauss_page_taken(m->sh.a, mu, sg, zpage, m->g[bh * 5 + 4])) continue;
                    any = 1;
                    m->loc[j * BH + bh] = fmax(m->loc[j * BH + bh], mu + zc * sg / 3.0);
                }
                if (any) out[n++] = (int32_t)p;
            }
        }
        if (P > 1 || n == 0) out[n++] = (int32_t)(P - 1);
        list->indptr[l + 1] = list->indptr[l] + n;
    }
    if (clamp) ekv_shard_allreduce_max(m->loc, m->S, BH, m->red, c);
    for (int64_t bh = 0; tau && bh < BH; bh++) {
        const double *g = m->g + bh * 5;
        tau[bh] = clamp ? ekv_gauss_clamp(g[3], m->sh.a, m->red[bh], g[4]) : g[3];
    }
}

/* tau-hat of every head: the single Gaussian from the reduced moments (every shard the same),
 * or with ALiBi the mixture by rounds. */
static void gauss_tau(gauss_sim *m, const ekv_decode_params *prm, const int64_t *ns,
                      int32_t *rounds, ekv_shard_comm *c) {
    if (prm->alibi_slopes) {
        gauss_mixture(m, prm->alpha, rounds, c);
        return;
    }
    for (int64_t bh = 0; bh < m->sh.B * m->sh.H; bh++)
        m->g[bh * 5 + 3] = ekv_gauss_tau_single(prm->alpha, m->g[bh * 5], m->g[bh * 5 + 1],
                                                (double)ns[bh / m->sh.H], m->sel->reference_m3);
}

static ekv_status shard_gaussian(ekv_context *ctx, const ekv_decode_params *prm,
                                 const ekv_select_params *sel, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                 int S, ekv_page_list *list, double *tau, int32_t *rounds,
                                 int64_t *bytes) {
    gauss_sim m;
    memset(&m, 0, sizeof m);
    m.sel = sel;
    m.t = t;
    m.sh = ekv_step_shape_of(prm, kv, t);
    m.S = S;
    m.pstride = ekv_table_max_pages(t->indptr, t->batch);
    const int64_t BH = m.sh.B * m.sh.H, cells = BH * m.pstride;
    m.mu = malloc(sizeof(double) * (size_t)cells);
    m.sig = malloc(sizeof(double) * (size_t)cells);
    double *mu0 = malloc(sizeof(double) * (size_t)cells);
    m.g = malloc(sizeof(double) * (size_t)(5 * BH));
    m.loc = malloc(sizeof(double) * (size_t)(4 * S * BH + 3 * S));
    m.red = malloc(sizeof(double) * (size_t)(4 * BH + 3));
    float *qs = malloc(sizeof(float) * (size_t)(m.sh.G * m.sh.D));
    int64_t *ns = malloc(sizeof(int64_t) * (size_t)m.sh.B);
    ekv_status s = EKV_OK;
    if (!m.mu || !m.sig || !mu0 || !m.g || !m.loc || !m.red || !qs || !ns) {
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for the sharded gaussian");
    } else {
        ekv_shard_comm c = {0, 0};
        for (int64_t b = 0; b < m.sh.B; b++) { /* the tokens the single Gaussian models */
            const int64_t P = ekv_seq_pages(t->indptr, b);
            ns[b] = P > 1 ? (P - 1) * m.sh.ps
                          : ekv_seq_len(t->indptr, t->last_page_len, b, m.sh.ps);
        }
        gauss_pages(&m, prm, kv, st, q, qs);
        memcpy(mu0, m.mu, sizeof(double) * (size_t)cells);
        if (prm->alibi_slopes) gauss_shift(&m, prm->alibi_slopes);
        gauss_sums(&m, mu0, &c);
        double margin_z = sel->margin_z, q_max = sel->max_quantile;
        if (sel->auto_margin) { /* sigma-bar of the batch: every shard has every sigma_g */
            double sbar = 0;
            for (int64_t bh = 0; bh < BH; bh++) sbar += m.g[bh * 5 + 1];
            ekv_gauss_auto_margin(sbar / (double)BH, &margin_z, &q_max);
        }
        gauss_tau(&m, prm, ns, rounds, &c);
        gauss_rule(&m, margin_z, q_max, list, tau, &c);
        list->bytes_summary = 0;
        for (int64_t b = 0; b < m.sh.B; b++) /* kmean + km2 per (stats page, KV head) */
            list->bytes_summary += ekv_gauss_stats_pages(ekv_seq_pages(t->indptr, b)) * m.sh.Hk *
                                   m.sh.D * 2 * (int64_t)sizeof(float);
        add_rounds(rounds, BH, c.rounds);
        *bytes += c.bytes;
    }
    free(m.mu);
    free(m.sig);
    free(mu0);
    free(m.g);
    free(m.loc);
    free(m.red);
    free(qs);
    free(ns);
    return s;
}

ekv_status ekv_shard_select(ekv_context *ctx, const ekv_decode_params *prm,
                            const ekv_select_params *sel, const ekv_paged_kv *kv,
                            const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                            int S, ekv_page_list *list, double *tau, int32_t *rounds,
                            int64_t *bytes) {
    list->heads = (int32_t)(sel->per_query_head ? prm->num_heads : kv->num_kv_heads);
    list->tau_mode = EKV_TAU_EXACT;
    list->correction_iters = 0;
    list->survivors = 0;
    if (sel->method == EKV_SELECT_TOPK)
        return shard_topk(ctx, prm, sel, kv, st, t, q, S, list, rounds, bytes);
    const ekv_status s = shard_gaussian(ctx, prm, sel, kv, st, t, q, S, list, tau, rounds, bytes);
    list->tau_mode = sel->tau_mode;
    list->correction_iters = sel->correction_iters >= 0 ? sel->correction_iters
                             : prm->alibi_slopes        ? 2
                                                        : 1;
    return s;
}
