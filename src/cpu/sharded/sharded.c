/*
 * Context-parallel decode, simulated on one CPU (docs/math.md §11): each sequence's pages are
 * split into n_shards contiguous ranges, as GPUs would hold them. A shard sees only its own
 * scores; the shards agree on tau through the collectives of sharded.h (an allreduce-max of
 * their own thresholds, then rounds of allreduce-sums of a few moments per head), and their
 * partial outputs are summed. The scores are the dense path's own (the same kernel and bias),
 * so the result is dense entmax up to the rounding of tau. Top-k and gaussian steps first agree
 * on the page lists (sharded_select.c); each shard then attends the tokens of its listed pages.
 * The collectives count their rounds and the bytes each shard contributes: the communication a
 * multi-GPU step would need.
 */
#include "../../core/method.h"
#include "../methods/methods.h"
#include "../select/select.h"
#include "../stages/attend.h"
#include "../stages/attend_tail.h"
#include "sharded.h"
#include "../../math/entmax_tau.h"
#include <float.h>
#include <stdlib.h>
#include <string.h>

enum { SHARD_MAX = EKV_SHARD_MAX, SHARD_ROUNDS = 200 };

/* ---- what one shard computes from its own scores z[0..n): its moments at st's x ---- */
static void shard_moments(const float *z, int64_t n, const ekv_agree_state *st, double alpha,
                          double *m) {
    memset(m, 0, EKV_AGREE_MOMENTS * sizeof(double));
    for (int64_t i = 0; i < n; i++) ekv_agree_add(m, (double)z[i], st->x, st->clo, st->chi, alpha);
}

/* Each shard's own threshold and maximum, then their allreduce-max: [0] a lower bound of tau
 * (a subset's threshold, docs/math.md §9.1), [1] the maximum (f there is -1 < 0). */
static void first_bracket(const float *z, const int64_t *off, int S, double alpha, double *scratch,
                          double *red, ekv_shard_comm *c) {
    double loc[2 * SHARD_MAX];
    for (int j = 0; j < S; j++) {
        const int64_t n = off[j + 1] - off[j];
        double t = -INFINITY, mx = -INFINITY;
        if (n > 0 && ekv_tau_exact_f32(z + off[j], n, alpha, scratch, &t, NULL)) t = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = z[off[j] + i] > mx ? z[off[j] + i] : mx;
        loc[2 * j] = t;
        loc[2 * j + 1] = mx;
    }
    ekv_shard_allreduce_max(loc, S, 2, red, c);
}

/* One query head of one sequence, as the shards see it: shard j holds the kept scores z[off[j]
 * .. off[j + 1]) (every token, or those of its listed pages), tok[i] the position of score i,
 * and the matching V rows. w: a weight per score, o: D floats (scratch). */
typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_step_shape *sh;
    const ekv_paged_kv *kv;
    const ekv_page_table *t;
    int64_t b, h;
    const float *z;
    const int64_t *tok;
    const int64_t *off;
    int S;
    float *w, *o;
    double given;  /* gaussian fixed/corrected: tau-hat (docs/math.md §3.10); NAN: exact */
    int32_t iters; /* corrected: Halley corrections of it */
} head_job;

/* Shard j's part of the merge at tau: sum p_i v_i (D values), sum p_i and the support count.
 * V is read run by run of consecutive tokens within a page. */
static void shard_partial(const head_job *hj, int j, double tau, double *pj) {
    const int64_t D = hj->sh->D, ps = hj->sh->ps, n = hj->off[hj->S];
    memset(pj, 0, sizeof(double) * (size_t)(D + 2));
    memset(hj->o, 0, sizeof(float) * (size_t)D);
    for (int64_t i = hj->off[j]; i < hj->off[j + 1]; i++) {
        const double p = ekv_entmax_weight(hj->z[i], tau, hj->sh->alpha);
        hj->w[i] = (float)p;
        pj[D] += p;
        pj[D + 1] += p > 0;
    }
    for (int64_t i = hj->off[j], r; i < hj->off[j + 1]; i += r) {
        const int64_t t0 = hj->tok[i];
        for (r = 1; i + r < hj->off[j + 1] && hj->tok[i + r] == t0 + r && (t0 + r) % ps; r++) {}
        hj->kern->accum(ekv_cpu_token_row(hj->kv, hj->t, hj->kv->v, hj->b, hj->h / hj->sh->G, t0),
                        hj->kv->stride_token, r, hj->kv->dtype, D, hj->w + i, n, 1, hj->o, D);
    }
    for (int64_t d = 0; d < D; d++) pj[d] = hj->o[d];
}

/* tau of the union of the shards' scores by the collectives of docs/math.md §11
 * (src/math/shard_agree.h): a bracket that each round of moments narrows, with the closed-form
 * root chi checked on the next round. That round also carries each shard's part of the merge
 * at chi (speculatively), so when the check passes the merge is done: *merged (D + 2 sums)
 * is then set and *merged_ok = 1. loc: S (8 + D) doubles of scratch. alpha > 1. */
static double agree_tau(const head_job *hj, double *scratch, double *loc, double *merged,
                        int *merged_ok, ekv_shard_comm *c) {
    const int S = hj->S, W0 = EKV_AGREE_MOMENTS;
    const int64_t D = hj->sh->D, *off = hj->off;
    const double alpha = hj->sh->alpha;
    double red[8];
    first_bracket(hj->z, off, S, alpha, scratch, red, c);
    ekv_agree_state st;
    ekv_agree_start(&st, red[0], red[1]);
    *merged_ok = 0;
    for (int r = 0; r < SHARD_ROUNDS; r++) {
        const int spec = !isnan(st.chi), W = W0 + (spec ? (int)D + 2 : 0);
        for (int j = 0; j < S; j++) {
            shard_moments(hj->z + off[j], off[j + 1] - off[j], &st, alpha, loc + W * j);
            if (spec) shard_partial(hj, j, st.chi, loc + W * j + W0);
        }
        double *sum = spec ? merged - W0 : red; /* merged is preceded by 6 free doubles */
        ekv_shard_allreduce_sum(loc, S, W, sum, c);
        const int done = ekv_agree_step(&st, sum, alpha);
        *merged_ok = done == 2;
        if (done) return st.tau;
    }
    return st.tau;
}

/* Softmax: the classic merge, a max then a sum (two allreduces). tau = log-sum-exp. */
static double agree_lse(const float *z, const int64_t *off, int S, ekv_shard_comm *c) {
    double loc[SHARD_MAX], M, s;
    for (int j = 0; j < S; j++) {
        loc[j] = -INFINITY;
        for (int64_t i = off[j]; i < off[j + 1]; i++) loc[j] = z[i] > loc[j] ? z[i] : loc[j];
    }
    ekv_shard_allreduce_max(loc, S, 1, &M, c);
    for (int j = 0; j < S; j++) {
        loc[j] = 0;
        for (int64_t i = off[j]; i < off[j + 1]; i++) loc[j] += exp((double)z[i] - M);
    }
    ekv_shard_allreduce_sum(loc, S, 1, &s, c);
    return M + log(s);
}

/* Scores of query head h for every token of sequence b into z[0..N): the dense path's kernel
 * and ALiBi bias, page by page (qs: the scaled queries, ekv_cpu_scale_queries). */
static void head_scores(const ekv_cpu_kernels *kern, const ekv_decode_params *prm,
                        const ekv_step_shape *sh, const ekv_paged_kv *kv, const ekv_page_table *t,
                        const float *qs, int64_t b, int64_t h, int64_t N, float *z) {
    const int64_t P = ekv_seq_pages(t->indptr, b), kvh = h / sh->G;
    for (int64_t p = 0; p < P; p++) {
        const int32_t page = t->indices[t->indptr[b] + p];
        const int64_t ntok = ekv_page_tokens(p, P, t->last_page_len[b], sh->ps);
        float b0, bs, mx = -INFINITY;
        const int bias =
                ekv_cpu_alibi_page(prm->alibi_slopes, sh->a, h, 1, p * sh->ps, N, &b0, &bs);
        kern->score(ekv_cpu_page_ptr(kv, kv->k, page, kvh), kv->stride_token, ntok, kv->dtype,
                    sh->D, qs + (b * sh->H + h) * sh->D, sh->D, 1, bias ? &b0 : NULL,
                    bias ? &bs : NULL, 0, z + p * sh->ps, N, &mx, NULL);
    }
}

ekv_status ekv_shard_pages(int64_t pages, int32_t num_shards, int32_t shard, int64_t *first,
                           int64_t *count) {
    if (!first || !count) return EKV_ERR_NULL_POINTER;
    if (num_shards < 1 || num_shards > SHARD_MAX || shard < 0 || shard >= num_shards || pages < 0)
        return EKV_ERR_INVALID_SIZE;
    ekv_shard_range(pages, num_shards, shard, first, count);
    return EKV_OK;
}

/* The scores head h keeps, shard by shard: those of its list's pages (ascending; NULL: every
 * page) copied from its score row zr into z, their positions into tok, and shard j's share
 * z[off[j] .. off[j + 1]) (the pages ekv_shard_range gives it). */
static void head_tokens(const ekv_page_table *t, int64_t b, int64_t ps, int S, const int32_t *pages,
                        int64_t np, const float *zr, float *z, int64_t *tok, int64_t *off) {
    const int64_t P = ekv_seq_pages(t->indptr, b);
    int64_t n = 0;
    int j = 0;
    off[0] = 0;
    for (int64_t r = 0; r < (pages ? np : P); r++) {
        const int64_t p = pages ? pages[r] : r,
                      ntok = ekv_page_tokens(p, P, t->last_page_len[b], ps);
        while (j < S && p >= ekv_shard_bound(P, S, j + 1)) off[++j] = n;
        for (int64_t i = 0; i < ntok; i++, n++) {
            z[n] = zr[p * ps + i];
            tok[n] = p * ps + i;
        }
    }
    while (j < S) off[++j] = n;
}

/* Fixed / corrected tau across the shards: each correction sums the shards' three terms. */
static double given_tau(const head_job *hj, ekv_shard_comm *c) {
    double tau = hj->given, loc[3 * SHARD_MAX], red[3];
    for (int it = 0; it < hj->iters; it++) {
        for (int j = 0; j < hj->S; j++) {
            double *S3 = loc + 3 * j;
            S3[0] = S3[1] = S3[2] = 0;
            for (int64_t i = hj->off[j]; i < hj->off[j + 1]; i++)
                ekv_tau_correction_add(S3, (double)hj->z[i], tau, hj->sh->alpha);
        }
        ekv_shard_allreduce_sum(loc, hj->S, 3, red, c);
        tau = ekv_tau_correction_step(tau, red, hj->sh->alpha);
    }
    return tau;
}

/* One head: tau agreed by the collectives (or given), then (unless the last round of the
 * agreement carried it) each shard's part of the merge and their allreduce-sum. part: S (8 + D)
 * + D + 8 doubles of scratch. Given tau: not renormalised (docs/math.md §3.10). */
static void sharded_head(const head_job *hj, double *part, double *scratch, float *out,
                         double *tau_out, int64_t *sup_out, ekv_shard_comm *c) {
    const int S = hj->S;
    const int64_t D = hj->sh->D;
    double *loc = part, *merged = part + S * (8 + D) + 6;
    int merged_ok = 0;
    const int given = !isnan(hj->given);
    const double tau = given                  ? given_tau(hj, c)
                       : hj->sh->alpha == 1.0 ? agree_lse(hj->z, hj->off, S, c)
                                              : agree_tau(hj, scratch, loc, merged, &merged_ok, c);
    if (!merged_ok) {
        for (int j = 0; j < S; j++) shard_partial(hj, j, tau, loc + j * (D + 2));
        ekv_shard_allreduce_sum(loc, S, (int)(D + 2), merged, c);
    }
    const double norm = given ? 1.0 : merged[D];
    for (int64_t d = 0; d < D; d++) out[d] = (float)(merged[d] / norm);
    *tau_out = tau;
    *sup_out = (int64_t)merged[D + 1];
}

/* A step's scratch: the scaled queries, a score row and the kept scores, their positions and
 * weights, the merge's partials, the tau solver's scratch. */
typedef struct {
    float *qs, *zr, *z, *w, *o;
    int64_t *tok;
    double *part, *scratch;
} sim_scratch;

static int sim_alloc(sim_scratch *m, const ekv_step_shape *sh, int64_t Nmax, int S) {
    m->qs = malloc(sizeof(float) * (size_t)(sh->B * sh->H * sh->D));
    m->zr = malloc(sizeof(float) * (size_t)Nmax);
    m->z = malloc(sizeof(float) * (size_t)Nmax);
    m->w = malloc(sizeof(float) * (size_t)Nmax);
    m->o = malloc(sizeof(float) * (size_t)sh->D);
    m->tok = malloc(sizeof(int64_t) * (size_t)Nmax);
    m->part = malloc(sizeof(double) * (size_t)((S + 1) * (sh->D + 8)));
    m->scratch = malloc(sizeof(double) * (size_t)ekv_tau_scratch_doubles(Nmax));
    return m->qs && m->zr && m->z && m->w && m->o && m->tok && m->part && m->scratch;
}
static void sim_free(sim_scratch *m) {
    free(m->qs);
    free(m->zr);
    free(m->z);
    free(m->w);
    free(m->o);
    free(m->tok);
    free(m->part);
    free(m->scratch);
}

/* The report of a step from each head's rounds and the payload of all. */
static void sim_report(const int32_t *rounds, int64_t BH, int32_t select_rounds, int64_t bytes,
                       ekv_shard_report *rep) {
    rep->rounds_max = 0;
    rep->rounds_mean = 0;
    for (int64_t i = 0; i < BH; i++) {
        rep->rounds_max = rounds[i] > rep->rounds_max ? rounds[i] : rep->rounds_max;
        rep->rounds_mean += (double)rounds[i] / (double)BH;
    }
    rep->select_rounds = select_rounds;
    rep->bytes = bytes;
}

/* Every head of the step: its kept scores shard by shard (its list's pages, or all), tau and
 * the merge. rounds[B*H] holds the selection's rounds per head on entry. */
static void sim_heads(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                      const ekv_page_table *t, const ekv_page_list *list, const double *given,
                      const float *q, float *out, int S, sim_scratch *m, ekv_decode_info *info,
                      int32_t *rounds, int64_t *bytes) {
    const ekv_step_shape sh = ekv_step_shape_of(prm, kv, t);
    const ekv_cpu_kernels *kern = ekv_cpu_kernels_for(ctx->isa);
    ekv_cpu_scale_queries(prm, &sh, q, m->qs);
    for (int64_t b = 0; b < sh.B; b++) {
        const int64_t N = ekv_seq_len(t->indptr, t->last_page_len, b, sh.ps);
        for (int64_t h = 0; h < sh.H; h++) {
            const int64_t bh = b * sh.H + h;
            const int64_t l = list ? b * list->heads + (list->heads == sh.H ? h : h / sh.G) : 0;
            int64_t off[SHARD_MAX + 1], sup;
            ekv_shard_comm c = {0, 0};
            double tau;
            head_scores(kern, prm, &sh, kv, t, m->qs, b, h, N, m->zr);
            head_tokens(t, b, sh.ps, S, list ? list->pages + list->indptr[l] : NULL,
                        list ? list->indptr[l + 1] - list->indptr[l] : 0, m->zr, m->z, m->tok, off);
            const head_job hj = {
                    kern,
                    &sh,
                    kv,
                    t,
                    b,
                    h,
                    m->z,
                    m->tok,
                    off,
                    S,
                    m->w,
                    m->o,
                    given ? given[bh] : NAN,
                    list && list->tau_mode == EKV_TAU_CORRECTED ? list->correction_iters : 0};
            sharded_head(&hj, m->part, m->scratch, out + bh * sh.D, &tau, &sup, &c);
            if (info && info->tau) info->tau[bh] = tau;
            if (info && info->support) info->support[bh] = sup;
            rounds[bh] += c.rounds;
            *bytes += c.bytes;
        }
    }
}

/* The page lists for topk and gaussian: the caller's, or from the step arena. */
static ekv_status sim_list(ekv_context *ctx, const ekv_decode_params *prm,
                           const ekv_select_params *sel, const ekv_paged_kv *kv,
                           const ekv_page_table *t, ekv_page_list *user, ekv_page_list *list) {
    if (user) {
        *list = *user;
        return EKV_OK;
    }
    return ekv_cpu_step_list(ctx, prm, sel, kv, t, list);
}

static int sim_listed(const ekv_select_params *sel) {
    const ekv_select_method m = ekv_step_method(sel);
    return m == EKV_SELECT_TOPK || m == EKV_SELECT_GAUSSIAN;
}

/* The most rounds a head's selection took (the batched ones count for every head). */
static int32_t most_rounds(const int32_t *rounds, int64_t n) {
    int32_t r = 0;
    for (int64_t i = 0; i < n; i++) r = rounds[i] > r ? rounds[i] : r;
    return r;
}

/* The step: the lists agreed first (topk, gaussian), then every head. given: tau-hat per
 * head for the fixed/corrected modes (the caller's list->tau, or the simulation's own). */
static ekv_status sim_run(ekv_context *ctx, const ekv_decode_params *prm,
                          const ekv_select_params *sel, const ekv_paged_kv *kv,
                          const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                          float *out, int S, ekv_page_list *user, ekv_decode_info *info,
                          ekv_shard_report *report) {
    const ekv_step_shape sh = ekv_step_shape_of(prm, kv, t);
    const int64_t BH = sh.B * sh.H;
    const int64_t Nmax = ekv_table_max_len(t->indptr, t->last_page_len, sh.B, sh.ps);
    const int listed = sim_listed(sel), gmode = listed && sel->tau_mode != EKV_TAU_EXACT;
    sim_scratch m;
    int32_t *rounds = calloc((size_t)BH, sizeof(int32_t));
    double *own_tau = gmode ? malloc(sizeof(double) * (size_t)BH) : NULL;
    ekv_page_list list;
    ekv_status s = EKV_OK;
    if (!sim_alloc(&m, &sh, Nmax, S) || !rounds || (gmode && !own_tau))
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for %lld scores", (long long)Nmax);
    if (!s && listed) s = sim_list(ctx, prm, sel, kv, t, user, &list);
    if (!s && gmode && !list.tau) list.tau = own_tau;
    if (!s && listed) s = ekv_validate_select(ctx, prm, sel, kv, st, t, &list);
    int64_t bytes = 0;
    if (!s && listed)
        s = ekv_shard_select(ctx, prm, sel, kv, st, t, q, S, &list, gmode ? list.tau : NULL, rounds,
                             &bytes);
    if (!s) {
        const int32_t select_rounds = most_rounds(rounds, BH);
        sim_heads(ctx, prm, kv, t, listed ? &list : NULL, gmode ? list.tau : NULL, q, out, S, &m,
                  info, rounds, &bytes);
        if (report) sim_report(rounds, BH, select_rounds, bytes, report);
        if (user) {
            if (list.tau == own_tau) list.tau = user->tau;
            *user = list;
        }
    }
    sim_free(&m);
    free(rounds);
    free(own_tau);
    return s;
}

ekv_status ekv_decode_sharded_sim(ekv_context *ctx, const ekv_decode_params *prm,
                                  const ekv_select_params *sel, const ekv_paged_kv *kv,
                                  const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                  float *out, int32_t n_shards, ekv_page_list *lists,
                                  ekv_decode_info *info, ekv_shard_report *report) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status s = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, sel);
    if (!s) s = ekv_validate_decode(ctx, prm, kv, t, q, out);
    if (!s && (n_shards < 1 || n_shards > SHARD_MAX))
        s = ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "n_shards=%d must be in [1, %d]", n_shards,
                     SHARD_MAX);
    if (!s && ekv_step_method(sel) == EKV_SELECT_ORACLE)
        s = ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "the sharded simulation has no oracle (evaluation)");
    if (s) return s;
    EKV_GUARDED(ctx, s, sim_run(ctx, prm, sel, kv, st, t, q, out, n_shards, lists, info, report));
    if (!s) ekv_clear_error(ctx);
    return s;
}
