/*
 * bound stage on the CPU (SPEC 2.3, 9.5 later): the Quest box bound of every page but the
 * last, for every query head, in z-space:
 *   U[b][h][p] = a*scale*sum_d max(q_d kmin_pd, q_d kmax_pd) + a*m_h*(last token of p - (N-1)).
 * Tasks are (sequence, chunk of pages), and within a page every KV head is bounded in turn, so
 * the page statistics stream in address order; each page summary is read once for the G
 * query heads that share it.
 */
#include "../core/internal.h"
#include "bound.h"
#include "kernels.h"

enum { BOUND_CHUNK_PAGES = 256 };

typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_stats *st;
    const ekv_page_table *tab;
    const float *qpos, *qneg; /* [B][H][D] */
    float *u;                 /* [B][H][ustride] */
    int64_t ustride, H, G, D, B;
    double a;
    int64_t *task_off;        /* [B+1] */
} bound_job;

static void bound_task(void *vp, int64_t task, int worker) {
    (void)worker;
    bound_job *j = vp;
    int64_t b = 0;
    while (j->task_off[b + 1] <= task) b++;
    const int64_t P = j->tab->indptr[b + 1] - j->tab->indptr[b], ps = j->kv->page_size;
    const int64_t N = (P - 1) * ps + j->tab->last_page_len[b];
    const int64_t p0 = (task - j->task_off[b]) * BOUND_CHUNK_PAGES;
    const int64_t p1 = p0 + BOUND_CHUNK_PAGES < P - 1 ? p0 + BOUND_CHUNK_PAGES : P - 1;
    const int64_t Hk = j->kv->num_kv_heads, G = j->G, D = j->D, H = j->H;
    enum { STEP = 8, PF_BLOCKS = 2 }; /* pages per kernel call; prefetch distance in calls */
    for (int64_t pb = p0; pb < p1; pb += STEP) {
        const int np = (int)(p1 - pb < STEP ? p1 - pb : STEP);
        for (int64_t kvh = 0; kvh < Hk; kvh++) {
            const float *mn[STEP], *mx[STEP];
            for (int i = 0; i < np; i++) {
                const int64_t so = ((int64_t)j->tab->indices[j->tab->indptr[b] + pb + i] * Hk + kvh) * D;
                mn[i] = j->st->kmin + so;
                mx[i] = j->st->kmax + so;
            }
            /* prefetch the same head's summaries PF_BLOCKS calls ahead (the pass is short on
             * compute per byte, so memory latency is the thing to hide) */
            if (pb + PF_BLOCKS * STEP < p1)
                for (int i = 0; i < STEP && pb + PF_BLOCKS * STEP + i < p1; i++) {
                    const int64_t so = ((int64_t)j->tab->indices[j->tab->indptr[b] + pb + PF_BLOCKS * STEP + i] * Hk + kvh) * D;
                    for (int64_t d = 0; d < D; d += 16) {
                        __builtin_prefetch(j->st->kmin + so + d, 0, 2);
                        __builtin_prefetch(j->st->kmax + so + d, 0, 2);
                    }
                }
            const int64_t qo = (b * H + kvh * G) * D;
            float *uo = j->u + (b * H + kvh * G) * j->ustride + pb;
            j->kern->bound_box(j->qpos + qo, j->qneg + qo, D, (int)G, mn, mx, np, D, uo, j->ustride);
            if (j->prm->alibi_slopes)
                for (int64_t g = 0; g < G; g++) {
                    const double am = j->a * j->prm->alibi_slopes[kvh * G + g];
                    for (int i = 0; i < np; i++) {
                        const int64_t p = pb + i, last = (p + 1) * ps - 1 < N - 1 ? (p + 1) * ps - 1 : N - 1;
                        uo[g * j->ustride + i] += (float)(am * (double)(last - (N - 1)));
                    }
                }
        }
    }
}

ekv_status ekv_cpu_bound_pages(ekv_context *ctx, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *tab, const float *q, float *u,
                               int64_t ustride, float *qsplit, int64_t *task_off) {
    bound_job j;
    j.kern = ekv_cpu_kernels_for(ctx->isa);
    j.prm = prm;
    j.kv = kv;
    j.st = st;
    j.tab = tab;
    j.B = tab->batch;
    j.H = prm->num_heads;
    j.G = j.H / kv->num_kv_heads;
    j.D = kv->head_dim;
    j.u = u;
    j.ustride = ustride;
    j.a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    if (j.G > 256) return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "GQA group size %lld > 256 is not supported", (long long)j.G);
    const double scale = prm->scale > 0 ? prm->scale : 1.0 / sqrt((double)j.D);
    const int64_t nq = j.B * j.H * j.D;
    float *qp = qsplit, *qn = qsplit + nq;
    for (int64_t i = 0; i < nq; i++) {
        float x = (float)(j.a * scale * q[i]);
        qp[i] = x > 0 ? x : 0.f;
        qn[i] = x < 0 ? x : 0.f;
    }
    j.qpos = qp;
    j.qneg = qn;
    task_off[0] = 0;
    for (int64_t b = 0; b < j.B; b++) {
        int64_t P = tab->indptr[b + 1] - tab->indptr[b];
        task_off[b + 1] = task_off[b] + (P - 1 + BOUND_CHUNK_PAGES - 1) / BOUND_CHUNK_PAGES;
    }
    j.task_off = task_off;
    ekv_pool_run(ctx->pool, task_off[j.B], bound_task, &j);
    return EKV_OK;
}
