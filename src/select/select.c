/*
 * bound + select (SPEC 2): the Quest box bound of every page, then a page list per KV head
 * (or per query head) for the chosen policy. A policy only writes page numbers; it never
 * touches K or V. The last page of a sequence is always listed, last.
 *
 * The bound is in z-space, consistent with the attention scores (SPEC 6.1 item 7 fixed):
 *   U_p = a*scale*sum_d max(q_d kmin_pd, q_d kmax_pd) + a*m_h*(last token of p - (N-1)),
 * an upper bound on z_j = a*(scale*<q,k_j> + m_h (j - (N-1))) for every token j of page p
 * (m_h >= 0; a = alpha - 1, or 1 for softmax). With GQA the per-KV-head ranking uses the
 * max of U over the group's query heads.
 */
#include "../core/internal.h"
#include <stdlib.h>

ekv_select_params ekv_select_default_params(void) {
    ekv_select_params p;
    p.method = EKV_SELECT_TOPK;
    p.budget_tokens = 2048;
    p.per_query_head = 0;
    return p;
}

int64_t ekv_page_list_capacity(const ekv_page_table *t, int32_t heads) {
    if (!t || !t->indptr || t->batch <= 0 || heads <= 0) return -1;
    int64_t total = t->indptr[t->batch], out;
    if (ekv_mul_i64(total, heads, &out)) return -1;
    return out;
}

typedef struct { float u; int32_t p; } scored_page;

/* a before b: larger bound first, then the lower page number (deterministic ties). */
static int before(scored_page a, scored_page b) { return a.u > b.u || (a.u == b.u && a.p < b.p); }

static int cmp_scored(const void *x, const void *y) {
    scored_page a = *(const scored_page *)x, b = *(const scored_page *)y;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* Moves the k best (by `before`) to the front of v[0..n) in O(n) expected (quickselect). */
static void select_best(scored_page *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    while (lo < hi) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        scored_page pivot = v[lo + (int64_t)((seed >> 33) % (uint64_t)(hi - lo + 1))];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(v[i], pivot)) i++;
            while (before(pivot, v[j])) j--;
            if (i <= j) {
                scored_page t = v[i]; v[i] = v[j]; v[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* Box bounds of pages [0, P-1) of sequence b for query head h, z-space, into u[]. */
static void box_bounds(const ekv_paged_kv *kv, const ekv_page_stats *st, const ekv_page_table *t, int64_t b,
                       int64_t h, int64_t G, const float *qz, double am, int64_t N, float *u) {
    const int64_t D = kv->head_dim, kvh = h / G, P = t->indptr[b + 1] - t->indptr[b], ps = kv->page_size;
    for (int64_t p = 0; p + 1 < P; p++) {
        int64_t off = ((int64_t)t->indices[t->indptr[b] + p] * kv->num_kv_heads + kvh) * D;
        const float *mn = st->kmin + off, *mx = st->kmax + off;
        float s = 0.f;
        for (int64_t d = 0; d < D; d++) s += qz[d] > 0 ? qz[d] * mx[d] : qz[d] * mn[d];
        int64_t last = (p + 1) * ps - 1 < N - 1 ? (p + 1) * ps - 1 : N - 1;
        u[p] = s + (float)(am * (double)(last - (N - 1)));
    }
}

ekv_status ekv_select_pages(ekv_context *ctx, const ekv_decode_params *prm, const ekv_select_params *sel,
                            const ekv_paged_kv *kv, const ekv_page_stats *st, const ekv_page_table *t,
                            const float *q, ekv_page_list *list) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!sel || !st || !list) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !sel ? "select" : !st ? "stats" : "list");
    ekv_status s = ekv_validate_decode(ctx, prm, kv, t, q, q);
    if (s) return s;
    if (!st->kmin || !st->kmax) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "stats->kmin/kmax is NULL");
    if (!list->indptr || !list->pages) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "list->indptr/pages is NULL");
    if (sel->method != EKV_SELECT_DENSE && sel->method != EKV_SELECT_TOPK && sel->method != EKV_SELECT_ORACLE)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "select method %d is not dense (0), topk (1) or oracle (2)",
                        (int)sel->method);
    const int64_t B = t->batch, H = prm->num_heads, Hk = kv->num_kv_heads, G = H / Hk, ps = kv->page_size;
    const int64_t heads = sel->per_query_head ? H : Hk;
    int64_t maxP = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t P = t->indptr[b + 1] - t->indptr[b], N = (P - 1) * ps + t->last_page_len[b];
        if (P > maxP) maxP = P;
        if (sel->method == EKV_SELECT_TOPK && (sel->budget_tokens <= 0 || sel->budget_tokens > N))
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "budget_tokens=%lld must be in [1, length=%lld] (sequence %lld)",
                            (long long)sel->budget_tokens, (long long)N, (long long)b);
    }
    int64_t cap = ekv_page_list_capacity(t, (int32_t)heads);
    if (list->capacity < cap && sel->method == EKV_SELECT_DENSE)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "list capacity %lld < %lld page numbers", (long long)list->capacity,
                        (long long)cap);
    if (list->capacity < cap)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "list capacity %lld < %lld (ekv_page_list_capacity)",
                        (long long)list->capacity, (long long)cap);
    /* workspace: bounds of one list, its page pairs, scaled queries, oracle probabilities */
    int64_t nmax = maxP * ps;
    size_t need = (size_t)(maxP * (int64_t)(sizeof(float) + sizeof(scored_page)) + G * kv->head_dim * 4 +
                           (sel->method == EKV_SELECT_ORACLE ? B * H * nmax * 4 + B * H * 8 : 0) + 256);
    char *ws = ekv_context_workspace(ctx, need);
    if (!ws) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for page selection");
    float *u = (float *)ws, *ug = u; /* per-list bounds (max over the group) */
    scored_page *pairs = (scored_page *)(ws + maxP * sizeof(float));
    float *qz = (float *)(ws + maxP * (sizeof(float) + sizeof(scored_page)));
    float *ptmp = NULL;
    const double a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    const double scale = prm->scale > 0 ? prm->scale : 1.0 / sqrt((double)kv->head_dim);
    if (sel->method == EKV_SELECT_ORACLE) {
        /* ekv_dense_probs uses the workspace itself: run it first into a private buffer */
        ptmp = malloc(sizeof(float) * (size_t)(B * H * nmax));
        double *taus = malloc(sizeof(double) * (size_t)(B * H));
        if (!ptmp || !taus) { free(ptmp); free(taus); return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "oracle: no memory"); }
        s = ekv_dense_probs(ctx, prm, kv, t, q, nmax, ptmp, taus);
        free(taus);
        if (s) { free(ptmp); return s; }
        ws = ekv_context_workspace(ctx, need); /* may have moved */
        u = ug = (float *)ws;
        pairs = (scored_page *)(ws + maxP * sizeof(float));
        qz = (float *)(ws + maxP * (sizeof(float) + sizeof(scored_page)));
    }
    int64_t w = 0, bytes_summary = 0;
    float *ubuf = malloc(sizeof(float) * (size_t)(maxP > 0 ? maxP : 1));
    if (!ubuf) { free(ptmp); return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "no memory for page bounds"); }
    list->indptr[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t P = t->indptr[b + 1] - t->indptr[b], N = (P - 1) * ps + t->last_page_len[b];
        for (int64_t l = 0; l < heads; l++) {
            const int64_t h0 = sel->per_query_head ? l : l * G, hn = sel->per_query_head ? 1 : G;
            if (sel->method == EKV_SELECT_DENSE) {
                for (int64_t p = 0; p < P; p++) list->pages[w++] = (int32_t)p;
            } else if (sel->method == EKV_SELECT_ORACLE) {
                /* every page with a token of positive dense probability for some listed head */
                for (int64_t p = 0; p + 1 < P; p++) {
                    int hit = 0;
                    for (int64_t h = h0; h < h0 + hn && !hit; h++)
                        for (int64_t j = p * ps; j < (p + 1) * ps && !hit; j++)
                            hit = ptmp[(b * H + h) * nmax + j] > 0;
                    if (hit) list->pages[w++] = (int32_t)p;
                }
                list->pages[w++] = (int32_t)(P - 1);
            } else { /* top-k */
                for (int64_t p = 0; p + 1 < P; p++) ug[p] = -INFINITY;
                for (int64_t h = h0; h < h0 + hn; h++) {
                    const float *qh = q + (b * H + h) * kv->head_dim;
                    for (int64_t d = 0; d < kv->head_dim; d++) qz[d] = (float)(a * scale * qh[d]);
                    double am = prm->alibi_slopes ? a * prm->alibi_slopes[h] : 0.0;
                    box_bounds(kv, st, t, b, h, G, qz, am, N, ubuf);
                    for (int64_t p = 0; p + 1 < P; p++) ug[p] = ubuf[p] > ug[p] ? ubuf[p] : ug[p];
                }
                bytes_summary += (P - 1) * kv->head_dim * 2 * (int64_t)sizeof(float); /* kmin + kmax */
                int64_t nsel = sel->budget_tokens / ps;
                if (nsel < 1) nsel = 1;
                if (nsel > P - 1) nsel = P - 1;
                for (int64_t p = 0; p + 1 < P; p++) pairs[p] = (scored_page){ug[p], (int32_t)p};
                if (nsel > 0 && nsel < P - 1) select_best(pairs, P - 1, nsel);
                qsort(pairs, (size_t)nsel, sizeof *pairs, cmp_scored);
                for (int64_t i = 0; i < nsel; i++) list->pages[w++] = pairs[i].p;
                list->pages[w++] = (int32_t)(P - 1);
            }
            list->indptr[b * heads + l + 1] = w;
        }
    }
    free(ubuf);
    free(ptmp);
    list->heads = (int32_t)heads;
    list->bytes_summary = bytes_summary;
    ekv_clear_error(ctx);
    return EKV_OK;
}
