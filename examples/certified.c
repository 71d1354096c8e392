/* Certified decode (ekv_decode_certified): a first round over the pages with the largest
 * certified bounds within a budget, then every page whose bound still exceeds the computed
 * tau. Its output is dense entmax; this program checks that against ekv_decode_dense and
 * exits nonzero if they differ. */
#include "example_util.h"

int main(void) {
    ekv_context *ctx = NULL;
    ekv_status st = ekv_context_create(NULL, &ctx);
    if (st) {
        fprintf(stderr, "certified: %s\n", ekv_status_string(st));
        return 1;
    }
    ex_setup s;
    st = ex_setup_create(ctx, &s);
    ekv_decode_params dp = ekv_decode_default_params(); /* 32 query heads, alpha 1.5 */
    ekv_select_params sp = ekv_select_default_params();
    sp.budget_tokens = EX_N / 16; /* sizes round 1 only: the result is exact at any budget */
    float dense[EX_H * EX_D], out[EX_H * EX_D];
    int64_t sup_dense[EX_H], sup_cert[EX_H];
    int32_t round1[EX_HK], round2[EX_HK]; /* one per page list: per KV head by default */
    ekv_decode_info di = {.support = sup_dense}, ci = {.support = sup_cert};
    ekv_certified_info cinfo = {.pages_round1 = round1, .pages_round2 = round2};
    if (!st) st = ekv_decode_dense(ctx, &dp, &s.kv, &s.table, s.q, dense, &di);
    if (!st)
        st = ekv_decode_certified(ctx, &dp, &sp, &s.kv, &s.stats, &s.table, s.q, out, &ci, &cinfo);
    int bad = 0;
    if (!st) {
        const double err = ex_rel_error(out, dense);
        for (int h = 0; h < EX_H; h++) bad |= sup_cert[h] != sup_dense[h];
        bad |= !(err <= 1e-5) || !cinfo.certified;
        printf("certified decode over %d tokens (%lld pages): list 0 read %d + %d pages, %lld lists needed round 2;\n"
               "K bytes %lld of dense %lld; certified %d; error vs dense %.3g, supports %s\n",
               EX_N, (long long)s.indptr[1], round1[0], round2[0], (long long)cinfo.lists_round2,
               (long long)ci.bytes_k, (long long)di.bytes_k, cinfo.certified, err,
               bad ? "DIFFER" : "equal");
    } else {
        fprintf(stderr, "certified: %s: %s\n", ekv_status_string(st), ekv_last_error(ctx));
    }
    if (bad) fprintf(stderr, "certified: the certified output differs from dense\n");
    ex_setup_free(&s);
    ekv_context_free(ctx);
    return st || bad ? 1 : 0;
}
