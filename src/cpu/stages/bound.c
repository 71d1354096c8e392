/*
 * bound stage on the CPU (docs/math.md §2.3, 9.5): an upper bound of every page's scores but the
 * last, for every query head, in z-space (q' = a*scale*q, bonus = a*m_h*(last token of p - (N-1))):
 *   box  = sum_d max(q'_d kmin_pd, q'_d kmax_pd)                      (Quest)
 *   ball = <q', c_p> + ||q'|| r_p        (c_p = kmean, r_p = the exact radius around it)
 *   U    = min(box, ball) + bonus + slack      (with the ball; box + bonus without it)
 * The slack makes U a bound on the *computed* fp32 scores, not just the exact ones: it covers
 * the rounding of this pass and of the attention kernel's dot products,
 *   4 (D + 4) 2^-24 ||q'|| (||c_p|| + r_p) >= both errors, since |<q', k>| <= ||q'|| ||k||
 *   and ||k|| <= ||c_p|| + r_p for every key of the page,
 * plus the rounding of the ALiBi terms. Certified decode (docs/math.md §9.3) relies on it.
 * Tasks are (sequence, chunk of pages), and within a page every KV head is bounded in turn, so
 * the page statistics stream in address order; each page summary is read once for the G
 * query heads that share it.
 */
#include "../../core/internal.h"
#include "../../math/page_bound.h"
#include "bound.h"
#include "../kernels/kernels.h"
#include "ranges.h"
#include <stdlib.h> /* llabs */

typedef struct {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_stats *st;
    const ekv_page_table *tab;
    const float *qpos, *qneg;   /* [B][H][D] */
    const float *qfull, *zeros; /* [B][H][D] q', [G*D] zeros (ball dot through bound_box) */
    const double *qnorm;        /* [B][H] ||q'|| rounded up */
    int with_ball;
    const double *tau_lb; /* [B*H] lower bounds of tau (superpage skipping), or NULL */
    const double *qnorm1; /* [B*H] ||q'||_1 */
    int64_t *sp_sid;      /* per worker [Hk] superpage cached per KV head */
    float *sp_u;          /* per worker [H] its bound per query head */
    float *ranges;        /* per worker [STEP][2 D] compact ranges, then [STEP][D] centres, fp32 */
    int64_t *bytes;       /* [task] summary bytes read */
    float *u;             /* [B][H][ustride] */
    ekv_step_shape sh;
    int64_t ustride;
    int64_t *task_off; /* [B+1] */
} bound_job;

enum { STEP = EKV_BOUND_STEP, PF_BLOCKS = 2 }; /* prefetch distance in kernel calls */

/* Superpages (docs/math.md §9.6): a page whose superpage bound is already <= tau_lb for every
 * head of the group takes that bound (spu) and its own summaries are not read (skip). */
static void superpage_skip(bound_job *j, int64_t task, int worker, int64_t b, int64_t kvh,
                           int64_t pb, int np, int64_t N, int *skip,
                           float (*spu)[EKV_CPU_MAX_GROUP]) {
    const int64_t Hk = j->kv->num_kv_heads, G = j->sh.G, D = j->sh.D, H = j->sh.H,
                  ps = j->kv->page_size;
    const int64_t qo = (b * H + kvh * G) * D;
    int64_t *last_sid = j->sp_sid + (int64_t)worker * Hk;
    float *cur = j->sp_u + (int64_t)worker * H + kvh * G; /* cached per KV head */
    for (int i = 0; i < np; i++) {
        const int64_t page = j->tab->indices[j->tab->indptr[b] + pb + i],
                      sid = page / j->st->superpage_pages;
        if (sid != last_sid[kvh]) { /* a new superpage: its box bound, once */
            const int64_t so = (sid * Hk + kvh) * D;
            const float *smn = j->st->smin + so, *smx = j->st->smax + so;
            j->kern->bound_box(j->qpos + qo, j->qneg + qo, D, (int)G, &smn, &smx, 1, D, cur, 1);
            /* rounding slack 4(D+4)u ||q'||_1 max_d |k_d| >= 4(D+4)u sum |q'_d||k_d| */
            float amax = 0.f;
            for (int64_t d = 0; d < D; d++) {
                float x = fabsf(smn[d]) > fabsf(smx[d]) ? fabsf(smn[d]) : fabsf(smx[d]);
                amax = x > amax ? x : amax;
            }
            for (int64_t g = 0; g < G; g++)
                cur[g] = (float)((double)cur[g] +
                                 4.0 * (double)(D + 4) * 5.9604644775390625e-8 *
                                         j->qnorm1[b * H + kvh * G + g] * amax +
                                 1e-30);
            j->bytes[task] += 2 * D * (int64_t)sizeof(float);
            last_sid[kvh] = sid;
        }
        int all = 1;
        for (int64_t g = 0; g < G && all; g++) {
            const double am =
                    j->prm->alibi_slopes ? j->sh.a * j->prm->alibi_slopes[kvh * G + g] : 0.0;
            const int64_t p = pb + i, lastt = (p + 1) * ps - 1 < N - 1 ? (p + 1) * ps - 1 : N - 1;
            double u = ekv_page_bound_or_inf((double)cur[g] + am * (double)(lastt - (N - 1)) +
                                             8.0 * 5.9604644775390625e-8 * fabs(am) *
                                                     ((double)llabs(p * ps - (N - 1)) + (double)ps));
            float uf = (float)u;
            if ((double)uf < u) uf = nextafterf(uf, INFINITY);
            spu[i][g] = uf;
            all = (double)uf <= j->tau_lb[b * H + kvh * G + g];
        }
        skip[i] = all;
    }
}

/* The ball terms of the kept pages: <q', c_p> (through the box kernel with qpos = q', qneg =
 * 0) into ball, ||c_p|| (rounded up, only used inside the slack) and the radius. With a compact
 * ball the centre is kmean16 (converted into cbuf, [STEP][D]) and the radius radius16. */
static void ball_terms(bound_job *j, int64_t b, int64_t kvh, int64_t pb, const int *keep, int nk,
                       float *cbuf, float *ball, double *cn, double *rr) {
    const int64_t Hk = j->kv->num_kv_heads, G = j->sh.G, D = j->sh.D;
    const int compact = ekv_compact_ball(j->st);
    const float *mean[STEP];
    for (int i = 0; i < nk; i++) {
        const int64_t page = j->tab->indices[j->tab->indptr[b] + pb + keep[i]];
        if (compact) {
            j->kern->convert(j->st->kmean16 + (page * Hk + kvh) * D, j->st->range_dtype,
                             cbuf + i * D, EKV_DTYPE_F32, D, NULL);
            mean[i] = cbuf + i * D;
        } else
            mean[i] = j->st->kmean + (page * Hk + kvh) * D;
        float s8[8] = {0}; /* fp32 partial sums (vectorised) */
        int64_t d = 0;
        for (; d + 8 <= D; d += 8)
            for (int l = 0; l < 8; l++) s8[l] += mean[i][d + l] * mean[i][d + l];
        for (; d < D; d++) s8[0] += mean[i][d] * mean[i][d];
        double s2 = 0;
        for (int l = 0; l < 8; l++) s2 += s8[l];
        cn[i] = sqrt(s2) * (1 + 1e-5);
        rr[i] = (compact ? j->st->radius16 : j->st->radius)[page * Hk + kvh];
    }
    j->kern->bound_box(j->qfull + (b * j->sh.H + kvh * G) * D, j->zeros, D, (int)G, mean, mean, nk,
                       D, ball, STEP);
}

/* The page bounds of one step of pages for the group of kvh: min(box, ball) + slack, or the
 * superpage bound of a skipped page, plus the ALiBi term; rounded up to stay a bound. */
static void write_bounds(bound_job *j, int64_t b, int64_t kvh, int64_t pb, int np, int64_t N,
                         const int *skip, float (*spu)[EKV_CPU_MAX_GROUP], const int *keep, int nk,
                         const float *box, const float *ball, const double *cn, const double *rr) {
    const int64_t G = j->sh.G, D = j->sh.D, H = j->sh.H, ps = j->kv->page_size;
    float *uo = j->u + (b * H + kvh * G) * j->ustride + pb;
    for (int64_t g = 0; g < G; g++) {
        const double am = j->prm->alibi_slopes ? j->sh.a * j->prm->alibi_slopes[kvh * G + g] : 0.0;
        const double qn = j->qnorm ? j->qnorm[b * H + kvh * G + g] : 0.0;
        for (int i = 0; i < np; i++)
            if (skip[i]) uo[g * j->ustride + i] = spu[i][g];
        for (int k = 0; k < nk; k++) {
            const int i = keep[k];
            const int64_t p = pb + i, last = (p + 1) * ps - 1 < N - 1 ? (p + 1) * ps - 1 : N - 1;
            double u = box[g * STEP + k];
            if (j->with_ball) {
                double ub = (double)ball[g * STEP + k] + qn * rr[k];
                u = u < ub ? u : ub;
                u += 4.0 * (double)(D + 4) * 5.9604644775390625e-8 * qn * (cn[k] + rr[k]) + 1e-30;
                u += 8.0 * 5.9604644775390625e-8 * fabs(am) *
                     ((double)llabs(p * ps - (N - 1)) + (double)ps);
            }
            u += am * (double)(last - (N - 1));
            if (j->with_ball) u = ekv_page_bound_or_inf(u);
            float uf = (float)u;
            if (j->with_ball && (double)uf < u) uf = nextafterf(uf, INFINITY); /* keep it a bound */
            uo[g * j->ustride + i] = uf;
        }
    }
}

static void bound_task(void *vp, int64_t task, int worker) {
    bound_job *j = vp;
    int64_t b = 0;
    while (j->task_off[b + 1] <= task) b++;
    const int64_t P = ekv_seq_pages(j->tab->indptr, b), ps = j->kv->page_size;
    const int64_t N = ekv_seq_len(j->tab->indptr, j->tab->last_page_len, b, ps);
    const int64_t p0 = (task - j->task_off[b]) * EKV_BOUND_CHUNK_PAGES;
    const int64_t p1 = p0 + EKV_BOUND_CHUNK_PAGES < P - 1 ? p0 + EKV_BOUND_CHUNK_PAGES : P - 1;
    const int64_t Hk = j->kv->num_kv_heads, G = j->sh.G, D = j->sh.D, H = j->sh.H;
    if (j->sp_sid)
        for (int64_t k = 0; k < Hk; k++) j->sp_sid[(int64_t)worker * Hk + k] = -1;
    for (int64_t pb = p0; pb < p1; pb += STEP) {
        const int np = (int)(p1 - pb < STEP ? p1 - pb : STEP);
        for (int64_t kvh = 0; kvh < Hk; kvh++) {
            const int64_t qo = (b * H + kvh * G) * D;
            int skip[STEP] = {0}, keep[STEP], nk = 0;
            float spu[STEP][EKV_CPU_MAX_GROUP]; /* superpage bound (+ slack) per page and head */
            if (j->tau_lb && j->st->smin && G <= EKV_CPU_MAX_GROUP)
                superpage_skip(j, task, worker, b, kvh, pb, np, N, skip, spu);
            for (int i = 0; i < np; i++)
                if (!skip[i]) keep[nk++] = i;
            const float *mn[STEP], *mx[STEP];
            float *rbuf = j->ranges + (int64_t)worker * STEP * 3 * D;
            for (int k = 0; k < nk; k++) {
                const int64_t so =
                        ((int64_t)j->tab->indices[j->tab->indptr[b] + pb + keep[k]] * Hk + kvh) * D;
                ekv_cpu_page_range(j->kern, j->st, so, D, rbuf + k * 2 * D, mn + k, mx + k);
            }
            /* prefetch the same head's summaries PF_BLOCKS calls ahead (the pass is short on
             * compute per byte, so memory latency is the thing to hide) */
            if (pb + PF_BLOCKS * STEP < p1)
                for (int i = 0; i < STEP && pb + PF_BLOCKS * STEP + i < p1; i++) {
                    const int64_t so = ((int64_t)j->tab->indices[j->tab->indptr[b] + pb +
                                                                 PF_BLOCKS * STEP + i] *
                                                Hk +
                                        kvh) *
                                       D;
                    const int64_t rb = ekv_range_bytes(j->st->range_dtype, D) / 2;
                    for (int64_t o = 0; o < rb; o += 64) {
                        __builtin_prefetch(ekv_cpu_range_addr(j->st, 0, so) + o, 0, 2);
                        __builtin_prefetch(ekv_cpu_range_addr(j->st, 1, so) + o, 0, 2);
                    }
                }
            float box[STEP * EKV_CPU_MAX_GROUP], ball[STEP * EKV_CPU_MAX_GROUP];
            double cn[STEP], rr[STEP];
            if (nk)
                j->kern->bound_box(j->qpos + qo, j->qneg + qo, D, (int)G, mn, mx, nk, D, box, STEP);
            j->bytes[task] += nk * (ekv_range_bytes(j->st->range_dtype, D) +
                                    (j->with_ball ? ekv_ball_bytes(j->st, D) : 0));
            if (j->with_ball && nk)
                ball_terms(j, b, kvh, pb, keep, nk, rbuf + STEP * 2 * D, ball, cn, rr);
            write_bounds(j, b, kvh, pb, np, N, skip, spu, keep, nk, box, ball, cn, rr);
        }
    }
}

ekv_status ekv_cpu_bound_pages(ekv_context *ctx, const ekv_decode_params *prm,
                               const ekv_paged_kv *kv, const ekv_page_stats *st,
                               const ekv_page_table *tab, const float *q, float *u, int64_t ustride,
                               const ekv_cpu_bound_scratch *scr, int with_ball,
                               const double *tau_lb, int64_t *bytes_read) {
    bound_job j = {.kern = ekv_cpu_kernels_for(ctx->isa),
                   .prm = prm,
                   .kv = kv,
                   .st = st,
                   .tab = tab,
                   .sh = ekv_step_shape_of(prm, kv, tab),
                   .u = u,
                   .ustride = ustride};
    ekv_status s = ekv_cpu_check_group(ctx, j.sh.G);
    if (s) return s;
    const double scale = ekv_effective_scale(prm->scale, j.sh.D);
    const int64_t nq = j.sh.B * j.sh.H * j.sh.D;
    float *qsplit = scr->qsplit;
    int64_t *task_off = scr->task_off;
    float *qp = qsplit, *qn = qsplit + nq, *qf = qsplit + 2 * nq, *zeros = qsplit + 3 * nq;
    double *qnorm = (double *)(qsplit +
                               ((3 * nq + j.sh.G * j.sh.D + 1) & ~(int64_t)1)); /* 8-byte aligned */
    for (int64_t i = 0; i < nq; i++) {
        float x = (float)(j.sh.a * scale * q[i]);
        qp[i] = x > 0 ? x : 0.f;
        qn[i] = x < 0 ? x : 0.f;
        qf[i] = x;
    }
    for (int64_t i = 0; i < j.sh.G * j.sh.D; i++) zeros[i] = 0.f;
    for (int64_t bh = 0; bh < j.sh.B * j.sh.H; bh++) {
        double s2 = 0;
        for (int64_t d = 0; d < j.sh.D; d++)
            s2 += (double)qf[bh * j.sh.D + d] * qf[bh * j.sh.D + d];
        qnorm[bh] = sqrt(s2) * (1 + 1e-12);
    }
    j.qpos = qp;
    j.qneg = qn;
    j.qfull = qf;
    j.zeros = zeros;
    j.qnorm = qnorm;
    j.with_ball = with_ball && st->kmean && st->radius;
    task_off[0] = 0;
    for (int64_t b = 0; b < j.sh.B; b++) {
        int64_t P = ekv_seq_pages(tab->indptr, b);
        task_off[b + 1] = task_off[b] + (P - 1 + EKV_BOUND_CHUNK_PAGES - 1) / EKV_BOUND_CHUNK_PAGES;
    }
    j.task_off = task_off;
    j.tau_lb = j.with_ball && st->smin && st->superpage_pages > 0 ? tau_lb : NULL;
    int64_t *bytes = scr->bytes;
    memset(bytes, 0, sizeof(int64_t) * (size_t)task_off[j.sh.B]);
    double *qn1 = scr->qnorm1;
    for (int64_t bh = 0; bh < j.sh.B * j.sh.H; bh++) {
        double s1 = 0;
        for (int64_t d = 0; d < j.sh.D; d++) s1 += fabs((double)qf[bh * j.sh.D + d]);
        qn1[bh] = s1 * (1 + 1e-12);
    }
    j.bytes = bytes;
    j.qnorm1 = qn1;
    j.sp_sid = scr->sp_sid;
    j.sp_u = scr->sp_u;
    j.ranges = scr->ranges;
    ekv_pool_run(ctx->pool, task_off[j.sh.B], bound_task, &j);
    int64_t total = 0;
    for (int64_t t = 0; t < task_off[j.sh.B]; t++) total += bytes[t];
    if (bytes_read) *bytes_read = total;
    return EKV_OK;
}
