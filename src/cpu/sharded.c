/*
 * Context-parallel decode, simulated on one CPU (docs/math.md §11): each sequence's pages are
 * split into n_shards contiguous ranges, as GPUs would hold them. A shard sees only its own
 * scores; the shards agree on tau through the collectives below (an allreduce-max of their own
 * thresholds, then rounds of allreduce-sums of a few moments per head), and their partial
 * outputs are summed. The scores are the dense path's own (the same kernel and bias), so the
 * result is dense entmax up to the rounding of tau. The collectives count their rounds and the
 * bytes each shard contributes: the communication a multi-GPU step would need.
 */
#include "attend_tail.h"
#include <float.h>
#include <stdlib.h>
#include <string.h>

enum { SHARD_MAX = 64, SHARD_ROUNDS = 200 };

typedef struct {
    int32_t rounds; /* allreduce calls */
    int64_t bytes;  /* payload bytes each shard sends, summed over the calls */
} comm_count;

/* ---- the collectives: every shard holds vals[j * n .. + n); all get the reduction ---- */
static void allreduce_sum(const double *vals, int S, int n, double *out, comm_count *c) {
    for (int i = 0; i < n; i++) {
        out[i] = 0;
        for (int j = 0; j < S; j++) out[i] += vals[j * n + i];
    }
    c->rounds++;
    c->bytes += 8 * n;
}
static void allreduce_max(const double *vals, int S, int n, double *out, comm_count *c) {
    for (int i = 0; i < n; i++) {
        out[i] = -INFINITY;
        for (int j = 0; j < S; j++) out[i] = vals[j * n + i] > out[i] ? vals[j * n + i] : out[i];
    }
    c->rounds++;
    c->bytes += 8 * n;
}

/* ---- what one shard computes from its own scores z[0..n): its moments at st's x ---- */
static void shard_moments(const float *z, int64_t n, const ekv_agree_state *st, double alpha,
                          double *m) {
    memset(m, 0, EKV_AGREE_MOMENTS * sizeof(double));
    for (int64_t i = 0; i < n; i++) ekv_agree_add(m, (double)z[i], st->x, st->clo, st->chi, alpha);
}

/* Each shard's own threshold and maximum, then their allreduce-max: [0] a lower bound of tau
 * (a subset's threshold, docs/math.md §9.1), [1] the maximum (f there is -1 < 0). */
static void first_bracket(const float *z, const int64_t *off, int S, double alpha, double *scratch,
                          double *red, comm_count *c) {
    double loc[2 * SHARD_MAX];
    for (int j = 0; j < S; j++) {
        const int64_t n = off[j + 1] - off[j];
        double t = -INFINITY, mx = -INFINITY;
        if (n > 0 && ekv_tau_exact_f32(z + off[j], n, alpha, scratch, &t, NULL)) t = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = z[off[j] + i] > mx ? z[off[j] + i] : mx;
        loc[2 * j] = t;
        loc[2 * j + 1] = mx;
    }
    allreduce_max(loc, S, 2, red, c);
}

/* One query head of one sequence, as the shards see it: shard j holds scores z[off[j] ..
 * off[j + 1]) and the matching V rows. w: a weight per token, o: D floats (scratch). */
typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_step_shape *sh;
    const ekv_paged_kv *kv;
    const ekv_page_table *t;
    int64_t b, h;
    const float *z;
    const int64_t *off;
    int S;
    float *w, *o;
} head_job;

/* Shard j's part of the merge at tau: sum p_i v_i (D values), sum p_i and the support count. */
static void shard_partial(const head_job *hj, int j, double tau, double *pj) {
    const int64_t D = hj->sh->D, ps = hj->sh->ps, N = hj->off[hj->S];
    memset(pj, 0, sizeof(double) * (size_t)(D + 2));
    memset(hj->o, 0, sizeof(float) * (size_t)D);
    for (int64_t i = hj->off[j]; i < hj->off[j + 1]; i++) {
        const double p = ekv_entmax_weight(hj->z[i], tau, hj->sh->alpha);
        hj->w[i] = (float)p;
        pj[D] += p;
        pj[D + 1] += p > 0;
    }
    for (int64_t p0 = hj->off[j]; p0 < hj->off[j + 1]; p0 += ps) {
        const int32_t page = hj->t->indices[hj->t->indptr[hj->b] + p0 / ps];
        const int64_t ntok = hj->off[j + 1] - p0 < ps ? hj->off[j + 1] - p0 : ps;
        hj->kern->accum(ekv_cpu_page_ptr(hj->kv, hj->kv->v, page, hj->h / hj->sh->G),
                        hj->kv->stride_token, ntok, hj->kv->dtype, D, hj->w + p0, N, 1, hj->o, D);
    }
    for (int64_t d = 0; d < D; d++) pj[d] = hj->o[d];
}

/* tau of the union of the shards' scores by the collectives of docs/math.md §11
 * (../math/shard_agree.h): a bracket that each round of moments narrows, with the closed-form
 * root chi checked on the next round. That round also carries each shard's part of the merge
 * at chi (speculatively), so when the check passes the merge is done: *merged (D + 2 sums)
 * is then set and *merged_ok = 1. loc: S (8 + D) doubles of scratch. alpha > 1. */
static double agree_tau(const head_job *hj, double *scratch, double *loc, double *merged,
                        int *merged_ok, comm_count *c) {
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
        allreduce_sum(loc, S, W, sum, c);
        const int done = ekv_agree_step(&st, sum, alpha);
        *merged_ok = done == 2;
        if (done) return st.tau;
    }
    return st.tau;
}

/* Softmax: the classic merge, a max then a sum (two allreduces). tau = log-sum-exp. */
static double agree_lse(const float *z, const int64_t *off, int S, comm_count *c) {
    double loc[SHARD_MAX], M, s;
    for (int j = 0; j < S; j++) {
        loc[j] = -INFINITY;
        for (int64_t i = off[j]; i < off[j + 1]; i++) loc[j] = z[i] > loc[j] ? z[i] : loc[j];
    }
    allreduce_max(loc, S, 1, &M, c);
    for (int j = 0; j < S; j++) {
        loc[j] = 0;
        for (int64_t i = off[j]; i < off[j + 1]; i++) loc[j] += exp((double)z[i] - M);
    }
    allreduce_sum(loc, S, 1, &s, c);
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

/* Shard j's token range in off[j .. j + 1] (ekv_shard_range's pages). */
static void shard_offsets(int64_t P, int64_t ps, int64_t N, int S, int64_t *off) {
    for (int j = 0; j <= S; j++) {
        int64_t first = P, count = 0;
        if (j < S) ekv_shard_range(P, S, j, &first, &count);
        const int64_t tok = first * ps;
        off[j] = tok < N ? tok : N;
    }
}

/* One head: tau agreed by the collectives, then (unless the last round of the agreement
 * carried it) each shard's part of the merge and their allreduce-sum. part: S (8 + D) + D + 8
 * doubles of scratch. */
static void sharded_head(const head_job *hj, double *part, double *scratch, float *out,
                         double *tau_out, int64_t *sup_out, comm_count *c) {
    const int S = hj->S;
    const int64_t D = hj->sh->D;
    double *loc = part, *merged = part + S * (8 + D) + 6;
    int merged_ok = 0;
    const double tau = hj->sh->alpha == 1.0 ? agree_lse(hj->z, hj->off, S, c)
                                            : agree_tau(hj, scratch, loc, merged, &merged_ok, c);
    if (!merged_ok) {
        for (int j = 0; j < S; j++) shard_partial(hj, j, tau, loc + j * (D + 2));
        allreduce_sum(loc, S, (int)(D + 2), merged, c);
    }
    for (int64_t d = 0; d < D; d++) out[d] = (float)(merged[d] / merged[D]);
    *tau_out = tau;
    *sup_out = (int64_t)merged[D + 1];
}

ekv_status ekv_decode_sharded_sim(ekv_context *ctx, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  float *out, int32_t n_shards, ekv_decode_info *info,
                                  ekv_shard_report *report) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, NULL);
    if (!st) st = ekv_validate_decode(ctx, prm, kv, t, q, out);
    if (!st && (n_shards < 1 || n_shards > SHARD_MAX))
        st = ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "n_shards=%d must be in [1, %d]", n_shards,
                      SHARD_MAX);
    if (st) return st;
    const ekv_step_shape sh = ekv_step_shape_of(prm, kv, t);
    const int64_t Nmax = ekv_table_max_len(t->indptr, t->last_page_len, t->batch, sh.ps);
    float *qs = malloc(sizeof(float) * (size_t)(sh.B * sh.H * sh.D));
    float *z = malloc(sizeof(float) * (size_t)Nmax), *w = malloc(sizeof(float) * (size_t)Nmax);
    double *part = malloc(sizeof(double) * (size_t)((n_shards + 1) * (sh.D + 8)));
    float *o = malloc(sizeof(float) * (size_t)sh.D);
    double *scratch = malloc(sizeof(double) * (size_t)ekv_tau_scratch_doubles(Nmax));
    if (!qs || !z || !w || !part || !o || !scratch) {
        st = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for %lld scores", (long long)Nmax);
    } else {
        const ekv_cpu_kernels *kern = ekv_cpu_kernels_for(ctx->isa);
        ekv_cpu_scale_queries(prm, &sh, q, qs);
        ekv_shard_report rep = {0, 0.0, 0};
        for (int64_t b = 0; b < sh.B && !st; b++) {
            const int64_t N = ekv_seq_len(t->indptr, t->last_page_len, b, sh.ps);
            int64_t off[SHARD_MAX + 1];
            shard_offsets(ekv_seq_pages(t->indptr, b), sh.ps, N, n_shards, off);
            for (int64_t h = 0; h < sh.H; h++) {
                comm_count c = {0, 0};
                double tau;
                int64_t sup;
                head_scores(kern, prm, &sh, kv, t, qs, b, h, N, z);
                const head_job hj = {kern, &sh, kv, t, b, h, z, off, n_shards, w, o};
                sharded_head(&hj, part, scratch, out + (b * sh.H + h) * sh.D, &tau, &sup, &c);
                if (info && info->tau) info->tau[b * sh.H + h] = tau;
                if (info && info->support) info->support[b * sh.H + h] = sup;
                rep.rounds_max = c.rounds > rep.rounds_max ? c.rounds : rep.rounds_max;
                rep.rounds_mean += (double)c.rounds / (double)(sh.B * sh.H);
                rep.bytes += c.bytes;
            }
        }
        if (report) *report = rep;
        ekv_clear_error(ctx);
    }
    free(qs);
    free(z);
    free(w);
    free(part);
    free(o);
    free(scratch);
    return st;
}
