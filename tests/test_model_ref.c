/*
 * The shipped model (models/entmaxkv-lm.safetensors) against PyTorch: the logits after every
 * byte of tests/data/model_ref_prompt.txt, computed in fp32 from the same fp16 weights by
 * train/make_ref_logits.py (tests/data/model_ref_logits.bin, T x 256 float32), must agree to
 * 1e-3 relative (max |C - torch| / max |torch|) with an f32 KV cache; certified decode and
 * top-k with a budget of every token must give the dense logits; the f16 cache stays close.
 * Skipped (77) when the model or the reference is absent.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

#ifndef EKV_SOURCE_DIR
#define EKV_SOURCE_DIR "."
#endif

static double rel_diff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= num)) num = d != d ? INFINITY : d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return num / (den > 0 ? den : 1);
}

static unsigned char *read_all(const char *path, int64_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)(n > 0 ? n : 1));
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *len = n;
    return b;
}

int main(void) {
    const char *model = EKV_SOURCE_DIR "/models/entmaxkv-lm.safetensors";
    int64_t plen, llen;
    unsigned char *prompt = read_all(EKV_TEST_DATA_DIR "/model_ref_prompt.txt", &plen);
    float *want = (float *)read_all(EKV_TEST_DATA_DIR "/model_ref_logits.bin", &llen);
    FILE *mf = fopen(model, "rb");
    if (!prompt || !want || !mf) {
        printf("test_model_ref: skipped (%s missing)\n", !mf       ? model
                                                         : !prompt ? "model_ref_prompt.txt"
                                                                   : "model_ref_logits.bin");
        if (mf) fclose(mf);
        free(prompt);
        free(want);
        return 77;
    }
    fclose(mf);
    const int64_t V = 256, n = plen;
    CHECK(llen == n * V * 4, "reference holds %lld bytes, expected %lld x 256 floats",
          (long long)llen, (long long)n);
    if (llen != n * V * 4) return test_finish("test_model_ref");
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    float *got = malloc(sizeof(float) * (size_t)(n * V)),
          *dense = malloc(sizeof(float) * (size_t)(n * V));
    ekv_model_tokenize((const char *)prompt, n, tok);
    const ekv_dtype dts[2] = {EKV_DTYPE_F32, EKV_DTYPE_F16};
    for (int di = 0; di < 2; di++) {
        ekv_model_params p = ekv_model_default_params();
        p.max_tokens = n;
        p.kv_dtype = dts[di];
        ekv_model *m = NULL;
        ekv_status s = ekv_model_load(ctx, model, &p, &m);
        CHECK(s == EKV_OK, "load: %s", ekv_last_error(ctx));
        if (s) break;
        CHECK(ekv_model_step(m, tok, n, dense) == EKV_OK, "dense: %s", ekv_last_error(ctx));
        double e = rel_diff(dense, want, n * V);
        printf("%s cache, dense: max |C - torch| / max |torch| = %.3g over %lld positions\n",
               ekv_dtype_name(dts[di]), e, (long long)n);
        CHECK(e <= (di == 0 ? 1e-3 : 1e-2), "%s cache: logits differ from PyTorch by %.3g",
              ekv_dtype_name(dts[di]), e);
        /* the prediction at every position agrees where torch is not near a tie */
        int64_t agree = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t a = 0, b = 0;
            for (int64_t v = 1; v < V; v++) {
                if (dense[i * V + v] > dense[i * V + a]) a = v;
                if (want[i * V + v] > want[i * V + b]) b = v;
            }
            agree += a == b;
        }
        printf("  argmax agrees at %lld of %lld positions\n", (long long)agree, (long long)n);
        if (di == 0) {
            CHECK(agree >= n - 2, "argmax differs at %lld positions", (long long)(n - agree));
            const ekv_select_method ms[2] = {EKV_SELECT_CERTIFIED, EKV_SELECT_TOPK};
            const double bud[2] = {1.0 / 16, 1.0};
            for (int k = 0; k < 2; k++) {
                ekv_model_set_method(m, ms[k], bud[k]);
                ekv_model_reset(m);
                CHECK(ekv_model_step(m, tok, n, got) == EKV_OK, "%s: %s", ekv_method_name(ms[k]),
                      ekv_last_error(ctx));
                double d = rel_diff(got, dense, n * V);
                printf("  %s (budget %g) vs dense: %.3g\n", ekv_method_name(ms[k]), bud[k], d);
                CHECK(d <= 1e-5, "%s differs from dense by %.3g", ekv_method_name(ms[k]), d);
            }
        }
        ekv_model_free(m);
    }
    free(tok);
    free(got);
    free(dense);
    free(prompt);
    free(want);
    ekv_context_free(ctx);
    return test_finish("test_model_ref");
}
