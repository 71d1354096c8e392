/* Top-k page selection ranked by certified page bounds (use_ball), attention over the
 * selected pages, and the certified bound delta_bar on the attention mass each step dropped
 * (ekv_delta_bound), compared with dense decode at three token budgets. delta_bar = 0 proves
 * the top-k step exact; the program fails if such a step differs from dense. */
#include "example_util.h"

/* One top-k step at a budget of `budget` tokens: out, and the largest delta_bar over heads. */
static ekv_status topk_step(ekv_context *ctx, const ex_setup *s, int64_t budget,
                            ekv_page_list *list, float *out, double *worst_bar) {
    ekv_decode_params dp = ekv_decode_default_params(); /* 32 query heads, alpha 1.5 */
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_TOPK;
    sp.budget_tokens = budget;
    sp.use_ball = 1; /* rank by min(box, ball) + slack: bounds on the computed scores */
    double tau[EX_H], bar[EX_H];
    ekv_decode_info info = {.tau = tau}; /* the exact tau of the step, which the bound needs */
    ekv_status st = ekv_select_pages(ctx, &dp, &sp, &s->kv, &s->stats, &s->table, s->q, list);
    if (!st) st = ekv_decode_pages(ctx, &dp, &s->kv, &s->table, list, s->q, out, &info);
    if (!st) st = ekv_delta_bound(ctx, &dp, &s->kv, &s->table, list, tau, bar);
    *worst_bar = 0;
    for (int h = 0; h < EX_H && !st; h++) *worst_bar = fmax(*worst_bar, bar[h]);
    return st;
}

int main(void) {
    ekv_context *ctx = NULL;
    ekv_status st = ekv_context_create(NULL, &ctx);
    if (st) {
        fprintf(stderr, "topk_delta: %s\n", ekv_status_string(st));
        return 1;
    }
    ex_setup s;
    st = ex_setup_create(ctx, &s);
    const int64_t P = s.indptr[1]; /* pages of the sequence */
    const int32_t heads = EX_HK;   /* one page list per KV head (the default) */
    float dense[EX_H * EX_D], out[EX_H * EX_D];
    int64_t list_indptr[EX_HK + 1];
    const int64_t cap = ekv_page_list_capacity(&s.table, heads);
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)(cap > 0 ? cap : 1));
    float *bounds = malloc(sizeof(float) * (size_t)(EX_H * P)); /* [head][page] */
    if (!st && (!pages || !bounds)) st = EKV_ERR_OUT_OF_MEMORY;
    ekv_decode_params dp = ekv_decode_default_params();
    if (!st) st = ekv_decode_dense(ctx, &dp, &s.kv, &s.table, s.q, dense, NULL);
    int bad = 0;
    static const int64_t budgets[] = {16, 32, 48, EX_N / 16};
    for (int i = 0; i < 4 && !st; i++) {
        ekv_page_list list = {.indptr = list_indptr,
                              .pages = pages,
                              .capacity = cap,
                              .bounds = bounds,
                              .bounds_stride = P};
        double bar = 0;
        st = topk_step(ctx, &s, budgets[i], &list, out, &bar);
        if (st) break;
        const double err = ex_rel_error(out, dense);
        printf("budget %4lld tokens: %5.1f of %lld pages per list, delta_bar %.3g (%s), error vs dense %.3g\n",
               (long long)budgets[i], (double)list_indptr[heads] / heads, (long long)P, bar,
               bar == 0 ? "proven exact" : "bounded", err);
        if (bar == 0 && err > 1e-5) bad = 1;
    }
    if (st) fprintf(stderr, "topk_delta: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
    if (bad) fprintf(stderr, "topk_delta: a step with delta_bar = 0 differs from dense\n");
    free(pages);
    free(bounds);
    ex_setup_free(&s);
    ekv_context_free(ctx);
    return st || bad ? 1 : 0;
}
