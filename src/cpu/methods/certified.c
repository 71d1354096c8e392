/*
 * Certified decode (docs/math.md §9.1-9.3). tau of any subset C is a lower bound of the full
 * tau* (§9.1), so a page whose bound U_p satisfies U_p <= tau_C holds no support token (§9.2).
 *   round 1: C = the top pages by certified bound within the budget, the last page, and the
 *            optional sink and recent pages; attend exactly over C, giving tau_C per head;
 *   round 2: R = the pages outside C with U_p > tau_C for some query head of the list; if R is
 *            empty the round-1 output *is* dense entmax; otherwise attend over C + R, whose
 *            tau is again a lower bound, so every page left out still has U_p <= tau: done.
 * Round 2 scores only the added pages and solves on the round-1 scores it kept, so K is read
 * once and V once (for the final support) (src/cpu/stages/attend_pages.c, mode CERTIFY).
 * Bounds include the rounding slack of ../stages/bound.c, so the proof holds for the fp32 scores
 * the kernel computes. Lists, bounds and counters live in the step arena (the stages it runs
 * use the workspace).
 */
#include "../../core/method.h"
#include "../select/select.h"
#include "../stages/attend.h"
#include "methods.h"

typedef struct {
    int64_t B, H, heads, maxP, cap;
    int64_t *ip1, *ip2; /* CSR of round 1 and of the top-k candidates */
    int32_t *pg1, *pg2;
    float *bounds;  /* [B*H][maxP] certified page bounds */
    uint8_t *in;    /* [maxP] page flags */
    int64_t *added; /* [B*heads] round-2 pages */
    double *tau0;   /* [B*H] round 0's tau (superpage skipping) */
    float *o0;      /* [B*H*D] round 0's (unused) output */
} cert_bufs;

static ekv_status cert_alloc(ekv_context *ctx, const ekv_select_params *sel,
                             const ekv_decode_params *prm, const ekv_paged_kv *kv,
                             const ekv_page_table *t, cert_bufs *c) {
    c->B = t->batch;
    c->H = prm->num_heads;
    c->heads = sel->per_query_head ? c->H : kv->num_kv_heads;
    c->maxP = ekv_table_max_pages(t->indptr, c->B);
    c->cap = ekv_page_list_capacity(t, (int32_t)c->heads);
    const int64_t nl = c->B * c->heads, BH = c->B * c->H;
    enum { IP1, IP2, PG1, PG2, BND, IN, ADD, TAU0, O0, NB };
    const int64_t sz[NB] = {(nl + 1) * 8, (nl + 1) * 8,     c->cap * 4,
                            c->cap * 4,   BH * c->maxP * 4, c->maxP,
                            nl * 8,       BH * 8,           BH * kv->head_dim * 4};
    int64_t off[NB];
    ekv_status s;
    char *m = ekv_step_blocks(ctx, sz, NB, off, "certified decode", &s);
    if (!m) return s;
    c->ip1 = (int64_t *)(m + off[IP1]);
    c->ip2 = (int64_t *)(m + off[IP2]);
    c->pg1 = (int32_t *)(m + off[PG1]);
    c->pg2 = (int32_t *)(m + off[PG2]);
    c->bounds = (float *)(m + off[BND]);
    c->in = (uint8_t *)(m + off[IN]);
    c->added = (int64_t *)(m + off[ADD]);
    c->tau0 = (double *)(m + off[TAU0]);
    c->o0 = (float *)(m + off[O0]);
    return EKV_OK;
}

/* Round 0 (superpages, docs/math.md §9.6): tau over the last pages is a lower bound of tau*,
 * so the bound stage can skip the summaries of every superpage already below it. */
static ekv_status round0(ekv_context *ctx, const ekv_decode_params *prm,
                         const ekv_select_params *sel, const ekv_paged_kv *kv,
                         const ekv_page_table *t, const float *q, cert_bufs *c) {
    const int64_t R0 = ekv_round0_pages(sel);
    int64_t w = 0;
    c->ip1[0] = 0;
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t P = ekv_seq_pages(t->indptr, b);
        for (int64_t l = 0; l < c->heads; l++) {
            for (int64_t p = P - R0 > 0 ? P - R0 : 0; p < P; p++) c->pg1[w++] = (int32_t)p;
            c->ip1[b * c->heads + l + 1] = w;
        }
    }
    const ekv_page_list list0 = {
            .heads = (int32_t)c->heads, .indptr = c->ip1, .pages = c->pg1, .capacity = c->cap};
    ekv_decode_info i0 = {.tau = c->tau0};
    const ekv_lists_args a = {.mode = EKV_LISTS_OUTPUT, .list = &list0, .out = c->o0, .info = &i0};
    return ekv_cpu_attend_lists(ctx, prm, kv, t, q, &a);
}

/* Adaptive round 1: the pages a hint of tau cannot rule out (replaces the top-k pages). */
static void hint_lists(const ekv_select_params *sel, const ekv_page_table *t, int64_t G,
                       cert_bufs *c) {
    int64_t w = 0;
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t P = ekv_seq_pages(t->indptr, b);
        for (int64_t l = 0; l < c->heads; l++) {
            const int64_t h0 = ekv_list_head0(l, c->heads, c->H, G),
                          hn = ekv_list_nheads(c->heads, c->H, G);
            for (int64_t p = 0; p + 1 < P; p++)
                for (int64_t h = h0; h < h0 + hn; h++)
                    if ((double)c->bounds[(b * c->H + h) * c->maxP + p] >
                        sel->tau_hint[b * c->H + h]) {
                        c->pg2[w++] = (int32_t)p;
                        break;
                    }
            c->pg2[w++] = (int32_t)(P - 1);
            c->ip2[b * c->heads + l + 1] = w;
        }
    }
}

/* Round 1 = the candidates plus the sink and recent pages (deduplicated, in page order). */
static void round1_lists(const ekv_select_params *sel, const ekv_page_table *t, cert_bufs *c,
                         int32_t *pages_round1) {
    int64_t w = 0;
    c->ip1[0] = 0;
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t P = ekv_seq_pages(t->indptr, b);
        for (int64_t l = 0; l < c->heads; l++) {
            const int64_t li = b * c->heads + l;
            memset(c->in, 0, (size_t)P);
            for (int64_t i = c->ip2[li]; i < c->ip2[li + 1]; i++) c->in[c->pg2[i]] = 1;
            for (int64_t p = 0; p < sel->sink_pages && p < P; p++) c->in[p] = 1;
            for (int64_t p = P - 1 - sel->recent_pages; p < P; p++)
                if (p >= 0) c->in[p] = 1;
            for (int64_t p = 0; p < P; p++)
                if (c->in[p]) c->pg1[w++] = (int32_t)p;
            c->ip1[li + 1] = w;
            if (pages_round1) pages_round1[li] = (int32_t)(c->ip1[li + 1] - c->ip1[li]);
        }
    }
}

/* The round-1 candidate select: top-k by the certified bounds (each sequence's budget clamped
 * to its length, ekv_seq_budget_tokens), or only the bounds when a tau hint picks the pages. */
static ekv_select_params candidate_select(const ekv_select_params *sel, const double *tau_lb) {
    ekv_select_params ts = *sel;
    ts.method = EKV_SELECT_TOPK;
    ts.use_ball = 1;
    ts.tau_lb = tau_lb;
    if (ts.budget_tokens < 1 || sel->tau_hint)
        ts.budget_tokens = 1; /* a hint: only the bounds are needed */
    if (sel->tau_hint) ts.budget_fraction = 0.0;
    return ts;
}

ekv_status ekv_cpu_certified_run(ekv_context *ctx, const ekv_decode_params *prm,
                                 const ekv_select_params *sel, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                 float *out, ekv_decode_info *info, ekv_certified_info *ci) {
    cert_bufs c = {0};
    ekv_status s = cert_alloc(ctx, sel, prm, kv, t, &c);
    const int superpages = st->smin && st->superpage_pages > 0 && !sel->tau_lb;
    if (!s && superpages) s = round0(ctx, prm, sel, kv, t, q, &c);
    if (s) return s;
    const ekv_select_params ts = candidate_select(sel, superpages ? c.tau0 : sel->tau_lb);
    ekv_page_list sl = {.indptr = c.ip2,
                        .pages = c.pg2,
                        .capacity = c.cap,
                        .bounds = c.bounds,
                        .bounds_stride = c.maxP};
    if ((s = ekv_cpu_select_run(ctx, prm, &ts, kv, st, t, q, &sl))) return s;
    if (sel->tau_hint) hint_lists(sel, t, c.H / kv->num_kv_heads, &c);
    round1_lists(sel, t, &c, ci ? ci->pages_round1 : NULL);
    const ekv_page_list list1 = {
            .heads = (int32_t)c.heads, .indptr = c.ip1, .pages = c.pg1, .capacity = c.cap};
    const ekv_lists_args a = {.mode = EKV_LISTS_CERTIFY,
                              .list = &list1,
                              .out = out,
                              .info = info,
                              .bounds = c.bounds,
                              .bstride = c.maxP,
                              .round2 = c.added};
    if ((s = ekv_cpu_attend_lists(ctx, prm, kv, t, q, &a))) return s;
    if (info) {
        info->bytes_summary = sl.bytes_summary;
        info->lists_round2 = 0;
        for (int64_t li = 0; li < c.B * c.heads; li++) info->lists_round2 += c.added[li] > 0;
    }
    if (ci) {
        ci->bytes_summary = sl.bytes_summary;
        ci->lists_round2 = 0;
        for (int64_t li = 0; li < c.B * c.heads; li++) {
            ci->lists_round2 += c.added[li] > 0;
            if (ci->pages_round2) ci->pages_round2[li] = (int32_t)c.added[li];
        }
        ci->certified = 1;
    }
    return EKV_OK;
}

ekv_status ekv_decode_certified(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                                float *out, ekv_decode_info *info, ekv_certified_info *ci) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!sel) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "select must not be NULL");
    ekv_select_params cs = *sel;
    cs.method = EKV_SELECT_CERTIFIED;
    ekv_status s = ekv_decode_supported(ctx, EKV_BACKEND_CPU, prm, &cs);
    if (!s) s = ekv_validate_decode(ctx, prm, kv, t, q, out);
    if (!s) s = ekv_check_stats(ctx, ekv_method_info_of(cs.method), 1, kv, st);
    EKV_GUARDED(ctx, s, ekv_cpu_certified_run(ctx, prm, &cs, kv, st, t, q, out, info, ci));
    if (!s) ekv_clear_error(ctx);
    return s;
}
