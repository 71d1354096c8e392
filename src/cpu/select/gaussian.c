/*
 * The Gaussian-aware selector (docs/math.md §4.1-4.12), paper-faithful except where docs/math.md §6
 * marks a bug: the user's margin and quantile take effect unless auto_margin asks for the rule of
 * 4.5 (6.1-2), the alpha = 4/3 moment is the correct one unless reference_m3 (6.1-1), GQA
 * works (6.1-3: one list per KV head is the union of its query heads' pages), and a single
 * page (P = 1) is simply the last page (6.1-5).
 *
 * Per sequence b and query head h, with the pages p < Ps (the last page excluded when
 * P > 1) and q' = scale * q:
 *   mu_p = <q', kmean_p>, sigma_p^2 = sum_d q'_d^2 kstd_pd^2, the global moments mu_g,
 *   sigma_g of the equal-weight mixture, tau-hat from the single Gaussian (no ALiBi) or the
 *   mixture of page Gaussians with ALiBi-shifted means, then the page rule
 *   a (mu_p + z_page sigma_p) > tau_floor and, for the fixed/corrected modes, the clamp.
 */
#include "../../core/internal.h"
#include "../../math/gaussian.h"
#include "../../math/gaussian_core.h" /* ekv_gauss_auto_margin */
#include "gaussian_select.h"
#include <stdlib.h>

typedef struct {
    const ekv_decode_params *prm;
    const ekv_select_params *sel;
    const ekv_paged_kv *kv;
    const ekv_page_stats *st;
    const ekv_page_table *t;
    const float *q;
    ekv_step_shape sh;
    int64_t pstride;
    double scale;
    double *mu, *sig;   /* [B*H][pstride] page moments (mu ALiBi-shifted later) */
    double *mug, *sigg; /* [B*H] global moments */
    double margin_z, q_max;
    int32_t *sel_pages; /* [B*heads][pstride] selected stats pages per list, ascending */
    int64_t *sel_count; /* [B*heads] */
    int64_t heads;
    double *w_buf;   /* per worker [pstride] mixture weights */
    double *tau_out; /* [B*H] tau-hat (clamped in the fixed/corrected modes), or NULL */
    float *w_q;      /* per worker [G][D] scaled queries */
} gauss_job;

void ekv_gauss_group_query(const float *q, double scale, int64_t b, int64_t H, int64_t kvh,
                           int64_t G, int64_t D, float *qs) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++)
            qs[g * D + d] = (float)(scale * q[(b * H + kvh * G + g) * D + d]);
}

void ekv_gauss_page_moments(const ekv_paged_kv *kv, const ekv_page_stats *st, int32_t page,
                            int64_t kvh, const float *qs, int64_t G, double *mu, double *sig,
                            int64_t hstride) {
    const int64_t D = kv->head_dim, off = ((int64_t)page * kv->num_kv_heads + kvh) * D;
    const float *mean = st->kmean + off, *m2 = st->km2 + off;
    const int32_t cnt = st->count[page];
    const float finv = cnt > 0 ? 1.0f / (float)cnt : 0.0f;
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qs + g * D;
        float mf[8] = {0}, vf[8] = {0}; /* fp32 like the reference, 8 lanes so it vectorises */
        int64_t d = 0;
        for (; d + 8 <= D; d += 8)
            for (int l = 0; l < 8; l++) {
                float var = m2[d + l] * finv;
                var = var > 1e-12f ? var : 1e-12f; /* population std clamped at 1e-6, §1.2 */
                mf[l] += qg[d + l] * mean[d + l];
                vf[l] += qg[d + l] * qg[d + l] * var;
            }
        for (; d < D; d++) {
            float var = m2[d] * finv;
            var = var > 1e-12f ? var : 1e-12f;
            mf[0] += qg[d] * mean[d];
            vf[0] += qg[d] * qg[d] * var;
        }
        double m = 0, v = 0;
        for (int l = 0; l < 8; l++) {
            m += mf[l];
            v += vf[l];
        }
        mu[g * hstride] = m;
        sig[g * hstride] = sqrt(v);
    }
}

/* Pass 1, task (b, KV head): page moments for the G query heads of the group (each page's
 * statistics are read once for the group), then the global moments of the mixture per head. */
static void moments_task(void *vp, int64_t task, int worker) {
    gauss_job *j = vp;
    const int64_t b = task / j->kv->num_kv_heads, kvh = task % j->kv->num_kv_heads, D = j->sh.D,
                  G = j->sh.G;
    const int64_t P = ekv_seq_pages(j->t->indptr, b), Ps = ekv_gauss_stats_pages(P);
    float *qs = j->w_q + (int64_t)worker * G * D; /* q' = scale * q for the group */
    ekv_gauss_group_query(j->q, j->scale, b, j->sh.H, kvh, G, D, qs);
    const int64_t bh0 = b * j->sh.H + kvh * G;
    for (int64_t p = 0; p < Ps; p++)
        ekv_gauss_page_moments(j->kv, j->st, j->t->indices[j->t->indptr[b] + p], kvh, qs, G,
                               j->mu + bh0 * j->pstride + p, j->sig + bh0 * j->pstride + p,
                               j->pstride);
    for (int64_t g = 0; g < G; g++) {
        const int64_t bh = bh0 + g;
        const double *mu = j->mu + bh * j->pstride, *sg = j->sig + bh * j->pstride;
        double s_mu = 0, s_var = 0, s_mu2 = 0;
        for (int64_t p = 0; p < Ps; p++) {
            s_mu += mu[p];
            s_var += sg[p] * sg[p];
            s_mu2 += mu[p] * mu[p];
        }
        ekv_gauss_global_moments(s_mu, s_var, s_mu2, (double)Ps, &j->mug[bh], &j->sigg[bh]);
    }
}

/* Pass 2, task (b, list): tau-hat and the page rule for each query head of the list; the
 * list is the union of its heads' pages. */
static void rule_task(void *vp, int64_t task, int worker) {
    gauss_job *j = vp;
    const int64_t b = task / j->heads, l = task % j->heads;
    const int64_t h0 = j->sel->per_query_head ? l : l * j->sh.G,
                  hn = j->sel->per_query_head ? 1 : j->sh.G;
    const int64_t P = ekv_seq_pages(j->t->indptr, b), Ps = ekv_gauss_stats_pages(P), ps = j->sh.ps;
    const int64_t N = ekv_seq_len(j->t->indptr, j->t->last_page_len, b, ps),
                  n = P > 1 ? Ps * ps : N;
    const double zpage = ekv_normal_quantile(pow(j->q_max, 1.0 / (double)ps));
    const double zc = ekv_normal_quantile(pow(j->sel->clamp_quantile, 1.0 / (double)ps));
    int32_t *out = j->sel_pages + task * j->pstride;
    double *w = j->w_buf + worker * j->pstride;
    int64_t cnt = 0;
    /* out[] first holds a flag per stats page (the union over the list's heads) */
    for (int64_t p = 0; p < Ps; p++) out[p] = 0;
    for (int64_t h = h0; h < h0 + hn; h++) {
        const int64_t bh = b * j->sh.H + h;
        double *mu = j->mu + bh * j->pstride;
        const double *sg = j->sig + bh * j->pstride;
        const double m_h = j->prm->alibi_slopes ? j->prm->alibi_slopes[h] : 0.0;
        double tau;
        if (j->prm->alibi_slopes) { /* ALiBi: shift the page means to their centres (4.4) */
            for (int64_t p = 0; p < Ps; p++) {
                mu[p] = ekv_gauss_alibi_mean(mu[p], p, ps, n, N, m_h);
                w[p] = (double)ps;
            }
            tau = ekv_gauss_tau_mixture(j->prm->alpha, mu, sg, w, Ps, j->sel->reference_m3);
        } else {
            tau = ekv_gauss_tau_single(j->prm->alpha, j->mug[bh], j->sigg[bh], (double)n,
                                       j->sel->reference_m3);
        }
        /* page rule (4.9) */
        double uavg = 0;
        for (int64_t p = 0; p < Ps; p++) uavg += mu[p] + 1.5 * sg[p];
        uavg /= (double)Ps;
        const double tfloor = ekv_gauss_floor(tau, j->sh.a, uavg, j->margin_z, j->sigg[bh],
                                              j->sel->excess_fraction);
        double capmax = -INFINITY;
        for (int64_t p = 0; p < Ps; p++) {
            if (P > 1 && ekv_gauss_page_taken(j->sh.a, mu[p], sg[p], zpage, tfloor)) {
                out[p] = 1;
                capmax = fmax(capmax, mu[p] + zc * sg[p] / 3.0);
            }
        }
        /* clamp (4.10) for the fixed/corrected modes */
        if (j->sel->tau_mode != EKV_TAU_EXACT && j->sel->clamp_tau)
            tau = ekv_gauss_clamp(tau, j->sh.a, capmax, tfloor);
        if (j->tau_out) j->tau_out[bh] = tau;
    }
    for (int64_t p = 0; p < Ps; p++)
        if (out[p]) out[cnt++] = (int32_t)p;              /* in place: cnt <= p */
    if (P > 1 || cnt == 0) out[cnt++] = (int32_t)(P - 1); /* the last page, always */
    j->sel_count[task] = cnt;
}

ekv_status ekv_select_gaussian(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               ekv_page_list *list) {
    gauss_job j;
    memset(&j, 0, sizeof j);
    j.prm = prm;
    j.sel = sel;
    j.kv = kv;
    j.st = st;
    j.t = t;
    j.sh = ekv_step_shape_of(prm, kv, t); /* alpha > 1 here: a = alpha - 1 */
    j.q = q;
    j.scale = ekv_effective_scale(prm->scale, j.sh.D);
    j.heads = sel->per_query_head ? j.sh.H : kv->num_kv_heads;
    const int64_t maxP = ekv_table_max_pages(t->indptr, j.sh.B);
    j.pstride = maxP;
    const int64_t BH = j.sh.B * j.sh.H, W = ctx->n_threads;
    int64_t sz[8] = {BH * maxP * 8,
                     BH * maxP * 8,
                     BH * 8,
                     BH * 8,
                     j.sh.B * j.heads * maxP * 4,
                     j.sh.B * j.heads * 8,
                     W * maxP * 8,
                     W * j.sh.G * j.sh.D * 4};
    int64_t off[8];
    ekv_status s;
    char *ws = ekv_workspace_blocks(ctx, sz, 8, off, "gaussian selector", &s);
    if (!ws) return s;
    j.mu = (double *)(ws + off[0]);
    j.sig = (double *)(ws + off[1]);
    j.mug = (double *)(ws + off[2]);
    j.sigg = (double *)(ws + off[3]);
    j.sel_pages = (int32_t *)(ws + off[4]);
    j.sel_count = (int64_t *)(ws + off[5]);
    j.w_buf = (double *)(ws + off[6]);
    j.w_q = (float *)(ws + off[7]);
    j.tau_out = list->tau;
    ekv_pool_run(ctx->pool, j.sh.B * kv->num_kv_heads, moments_task, &j);
    j.margin_z = sel->margin_z;
    j.q_max = sel->max_quantile;
    if (sel->auto_margin) { /* docs/math.md §4.5: one sigma-bar for the whole batch */
        double sbar = 0;
        for (int64_t i = 0; i < BH; i++) sbar += j.sigg[i];
        sbar /= (double)BH;
        ekv_gauss_auto_margin(sbar, &j.margin_z, &j.q_max);
    }
    ekv_pool_run(ctx->pool, j.sh.B * j.heads, rule_task, &j);
    int64_t w = 0, bytes = 0;
    list->indptr[0] = 0;
    for (int64_t l = 0; l < j.sh.B * j.heads; l++) {
        memcpy(list->pages + w, j.sel_pages + l * maxP, sizeof(int32_t) * (size_t)j.sel_count[l]);
        w += j.sel_count[l];
        list->indptr[l + 1] = w;
    }
    for (int64_t b = 0; b < j.sh.B; b++) /* kmean + km2 per (stats page, KV head) */
        bytes += ekv_gauss_stats_pages(ekv_seq_pages(t->indptr, b)) * kv->num_kv_heads * j.sh.D *
                 2 * (int64_t)sizeof(float);
    list->bytes_summary = bytes;
    list->tau_mode = sel->tau_mode;
    list->correction_iters = sel->correction_iters >= 0 ? sel->correction_iters
                             : prm->alibi_slopes        ? 2
                                                        : 1;
    return EKV_OK;
}
