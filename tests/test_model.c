/*
 * The model engine on a tiny random model (tests/golden/make_tiny_model.py: d_model 32, 2
 * layers, 4 query heads on 2 KV heads, head_dim 8, NAPE, 1.5-entmax):
 *   - logits after every token of a 78-token prompt match the independent numpy forward
 *     (float64, bisection entmax) to 1e-4 relative, for several page sizes;
 *   - a prefill in blocks gives the same logits as one token at a time, bit for bit;
 *   - certified decode gives the dense logits at every step, and so does top-k with a budget
 *     of every token; top-k at a small budget and the gaussian selector run and read less;
 *   - screened decode (key codes of 4 and 8 bits) gives the dense logits and reads less than
 *     the K+V bytes; without codes it is refused at load and at set_method;
 *   - truncation (ekv_model_seq_truncate) back to any position, then the rest of the prompt
 *     again: the same logits bit for bit, for every method;
 *   - reset, stats and the f16 cache.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static const char *model_path = EKV_TEST_DATA_DIR "/tiny_model.safetensors";
static const char *ref_path = EKV_TEST_DATA_DIR "/tiny_model_ref.safetensors";

/* max |a - b| / max |b| over n values */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > num || d != d) num = d != d ? INFINITY : d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return num / (den > 0 ? den : 1);
}

static ekv_model *load_codes(ekv_context *ctx, int32_t page, ekv_dtype dt,
                             ekv_select_method method, double budget, int32_t code_bits) {
    ekv_model_params p = ekv_model_default_params();
    p.code_bits = code_bits;
    p.max_tokens = 200;
    p.page_size = page;
    p.kv_dtype = dt;
    p.method = method;
    p.budget = budget;
    p.superpage_pages = 2; /* so certified's superpage skipping runs on a short prompt */
    ekv_model *m = NULL;
    ekv_status s = ekv_model_load(ctx, model_path, &p, &m);
    CHECK(s == EKV_OK, "load (page %d): %s", page, ekv_last_error(ctx));
    return m;
}

static ekv_model *load(ekv_context *ctx, int32_t page, ekv_dtype dt, ekv_select_method method,
                       double budget) {
    return load_codes(ctx, page, dt, method, budget, 0);
}

/* All logits of the prompt, in one call (blocks of the engine) or one token at a time. */
static int run(ekv_model *m, const int32_t *tok, int64_t n, int one_by_one, float *logits) {
    if (!m) return -1;
    ekv_model_reset(m);
    if (!one_by_one) return ekv_model_step(m, tok, n, logits) == EKV_OK ? 0 : -1;
    for (int64_t i = 0; i < n; i++)
        if (ekv_model_step(m, tok + i, 1, logits + i * 256) != EKV_OK) return -1;
    return 0;
}

/* Screened decode needs key codes: refused without them (at load and at set_method, naming
 * code_bits); with 4- or 8-bit codes it gives the dense logits of the same model and cache,
 * token by token and in blocks, and reads less than the K+V bytes. */
static void test_screened(ekv_context *ctx, const int32_t *tok, int64_t n, float *got,
                          float *dense) {
    const int64_t V = 256;
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 200;
    p.method = EKV_SELECT_SCREENED;
    ekv_model *m = NULL;
    ekv_status s = ekv_model_load(ctx, model_path, &p, &m);
    CHECK(s == EKV_ERR_INVALID_ARGUMENT && !m && strstr(ekv_last_error(ctx), "code_bits"),
          "screened without codes: status %d, '%s'", (int)s, ekv_last_error(ctx));
    m = load(ctx, 16, EKV_DTYPE_F32, EKV_SELECT_DENSE, 1.0);
    if (m) {
        s = ekv_model_set_method(m, EKV_SELECT_SCREENED, 1.0);
        CHECK(s == EKV_ERR_INVALID_ARGUMENT && strstr(ekv_last_error(ctx), "code_bits"),
              "set_method screened without codes: status %d, '%s'", (int)s, ekv_last_error(ctx));
        ekv_model_free(m);
    }
    const struct {
        int32_t bits, page;
        ekv_dtype dt;
    } cases[] = {{4, 16, EKV_DTYPE_F32}, {8, 16, EKV_DTYPE_F32}, {4, 5, EKV_DTYPE_F32},
                 {4, 8, EKV_DTYPE_F16}, {8, 16, EKV_DTYPE_BF16}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        m = load_codes(ctx, cases[c].page, cases[c].dt, EKV_SELECT_DENSE, 1.0, cases[c].bits);
        if (!m) continue;
        CHECK(run(m, tok, n, 0, dense) == 0, "dense with codes: %s", ekv_last_error(ctx));
        for (int one = 0; one < 2; one++) {
            CHECK(ekv_model_set_method(m, EKV_SELECT_SCREENED, 1.0) == EKV_OK, "set screened: %s",
                  ekv_last_error(ctx));
            CHECK(run(m, tok, n, one, got) == 0, "screened run: %s", ekv_last_error(ctx));
            ekv_model_stats st;
            ekv_model_get_stats(m, -1, &st);
            const double e = rel_diff(got, dense, n * V);
            /* every (token, query head) pair a run could keep: 2 layers x 4 heads x prefixes */
            const int64_t pairs = 2 * 4 * n * (n + 1) / 2;
            printf("screened %d-bit, %s cache, page %2d%s vs dense: %.3g; KV read %.3f of K+V, "
                   "survivors %.3f of tokens\n",
                   cases[c].bits, ekv_dtype_name(cases[c].dt), cases[c].page,
                   one ? " (one by one)" : "", e, (double)st.bytes_read / (double)st.bytes_kv,
                   (double)st.survivors / (double)pairs);
            CHECK(e <= 1e-6, "screened %d-bit page %d differs from dense by %.3g", cases[c].bits,
                  cases[c].page, e);
            CHECK(st.bytes_read > 0 && st.bytes_read < st.bytes_kv,
                  "screened: read %lld of %lld bytes", (long long)st.bytes_read,
                  (long long)st.bytes_kv);
            CHECK(st.survivors > 0 && st.survivors < pairs, "screened survivors %lld of %lld",
                  (long long)st.survivors, (long long)pairs);
            ekv_model_set_method(m, EKV_SELECT_DENSE, 1.0);
        }
        ekv_model_free(m);
    }
}

/* After the whole prompt, truncate to `cut` and run the rest again: the logits equal the first
 * run's from there, bit for bit, whatever the method (the caches then are what the first run
 * had at cut: docs/architecture.md, "Cache layout"); page 5 and superpages of 2 pages put cuts
 * mid-page, at page ends and inside superpages. The refusals leave the position alone. */
static void test_truncate(ekv_context *ctx, const int32_t *tok, int64_t n, float *got) {
    const int64_t V = 256;
    const ekv_select_method methods[] = {EKV_SELECT_DENSE, EKV_SELECT_CERTIFIED,
                                         EKV_SELECT_SCREENED, EKV_SELECT_TOPK, EKV_SELECT_GAUSSIAN};
    const int64_t cuts[] = {n - 1, 37, 35, 10, 0};
    float *first = malloc(sizeof(float) * (size_t)(n * V));
    for (int mi = 0; mi < 5; mi++) {
        const double budget = methods[mi] == EKV_SELECT_CERTIFIED ? 1.0 / 16 : 1.0 / 8;
        ekv_model *m = load_codes(ctx, 5, EKV_DTYPE_F32, methods[mi], budget, 4);
        if (!m || run(m, tok, n, 0, first)) {
            CHECK(0, "%s: first run: %s", ekv_method_name(methods[mi]), ekv_last_error(ctx));
            ekv_model_free(m);
            continue;
        }
        for (int ci = 0; ci < 5; ci++) {
            const int64_t cut = cuts[ci];
            ekv_status st = ekv_model_seq_truncate(m, 0, cut);
            CHECK(st == EKV_OK && ekv_model_position(m) == cut, "%s: truncate to %lld: %s",
                  ekv_method_name(methods[mi]), (long long)cut, ekv_last_error(ctx));
            st = st ? st : ekv_model_step(m, tok + cut, n - cut, got);
            CHECK(st == EKV_OK &&
                          !memcmp(got, first + cut * V, sizeof(float) * (size_t)((n - cut) * V)),
                  "%s: truncated to %lld, the rest again differs by %.3g",
                  ekv_method_name(methods[mi]), (long long)cut,
                  rel_diff(got, first + cut * V, (n - cut) * V));
        }
        CHECK(ekv_model_seq_truncate(m, 0, n + 1) == EKV_ERR_INVALID_SIZE &&
                      ekv_model_seq_truncate(m, 0, -1) == EKV_ERR_INVALID_SIZE &&
                      ekv_model_seq_truncate(m, 1, 0) == EKV_ERR_INVALID_ARGUMENT &&
                      ekv_model_position(m) == n,
              "%s: a refused truncation moved the position to %lld", ekv_method_name(methods[mi]),
              (long long)ekv_model_position(m));
        ekv_model_free(m);
    }
    printf("truncation: %d methods x 5 cuts, the rest of the prompt again bit for bit\n", 5);
    free(first);
}

int main(void) {
    ekv_context *ctx;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    if (ekv_context_create(&cp, &ctx)) return 1;
    ekv_safetensors *ref;
    if (ekv_safetensors_open(ctx, ref_path, &ref)) {
        fprintf(stderr, "%s\n", ekv_last_error(ctx));
        return 1;
    }
    ekv_tensor_info tt, tl;
    CHECK(ekv_safetensors_find(ref, "tokens", &tt) == EKV_OK &&
                  ekv_safetensors_find(ref, "logits", &tl) == EKV_OK,
          "reference tensors");
    const int64_t n = tt.numel, V = 256;
    CHECK(n > 64 && tl.numel == n * V && tl.dtype == EKV_DTYPE_F32, "reference shapes");
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    float *want = malloc(sizeof(float) * (size_t)(n * V)),
          *got = malloc(sizeof(float) * (size_t)(n * V));
    float *dense = malloc(sizeof(float) * (size_t)(n * V));
    memcpy(tok, tt.data, sizeof(int32_t) * (size_t)n);
    memcpy(want, tl.data, sizeof(float) * (size_t)(n * V));

    /* the config as the file says */
    ekv_model *m = load(ctx, 16, EKV_DTYPE_F32, EKV_SELECT_DENSE, 1.0 / 16);
    if (!m) return test_finish("test_model");
    const ekv_model_config *c = ekv_model_get_config(m);
    CHECK(c->vocab == 256 && c->d_model == 32 && c->n_layers == 2 && c->n_heads == 4 &&
                  c->n_kv_heads == 2 && c->head_dim == 8 && c->ffn_dim == 48 && c->alpha == 1.5 &&
                  c->tied_embeddings == 1 && c->train_ctx == 64,
          "config");
    float slopes[4];
    ekv_model_alibi_slopes(m, slopes);
    CHECK(slopes[0] == 0.0625f && slopes[1] == 0.00390625f && slopes[2] == 0 && slopes[3] == 0,
          "NAPE slopes %g %g %g %g", slopes[0], slopes[1], slopes[2], slopes[3]);

    /* against numpy, dense, page sizes that put page ends and block ends everywhere */
    const int32_t pages[] = {1, 5, 16, 64};
    for (int i = 0; i < 4; i++) {
        ekv_model *mp = i == 2 ? m : load(ctx, pages[i], EKV_DTYPE_F32, EKV_SELECT_DENSE, 1.0);
        CHECK(run(mp, tok, n, 0, got) == 0, "run page %d: %s", pages[i], ekv_last_error(ctx));
        double e = rel_diff(got, want, n * V);
        printf("dense, page %2d: max |logit - numpy| / max |numpy| = %.3g\n", pages[i], e);
        CHECK(e <= 1e-4, "page %d: logits differ from numpy by %.3g", pages[i], e);
        CHECK(ekv_model_position(mp) == n, "position %lld", (long long)ekv_model_position(mp));
        if (mp != m) ekv_model_free(mp);
    }
    /* blocks = one token at a time, exactly */
    CHECK(run(m, tok, n, 0, dense) == 0, "dense run");
    CHECK(run(m, tok, n, 1, got) == 0, "dense one by one");
    CHECK(memcmp(got, dense, sizeof(float) * (size_t)(n * V)) == 0,
          "one token at a time differs from blocks by %.3g", rel_diff(got, dense, n * V));
    ekv_model_stats sd;
    ekv_model_get_stats(m, -1, &sd);
    CHECK(sd.steps == n * 2 && sd.bytes_read > 0 && sd.bytes_read <= sd.bytes_kv,
          "dense stats: steps %lld, read %lld of %lld", (long long)sd.steps,
          (long long)sd.bytes_read, (long long)sd.bytes_kv);
    /* the last query is the one the numpy model would use at the last token: check it is set */
    float q[32], q2[32];
    CHECK(ekv_model_last_query(m, 1, q) == EKV_OK, "last query");
    double qn = 0;
    for (int i = 0; i < 32; i++) qn += q[i] * q[i];
    CHECK(qn > 0, "last query is zero");

    /* certified = dense at every step; top-k with every token = dense */
    for (int pass = 0; pass < 2; pass++) {
        for (int one = 0; one < 2; one++) {
            ekv_model_set_method(m, pass == 0 ? EKV_SELECT_CERTIFIED : EKV_SELECT_TOPK,
                                 pass == 0 ? 1.0 / 16 : 1.0);
            CHECK(run(m, tok, n, one, got) == 0, "%s run: %s", pass ? "topk" : "certified",
                  ekv_last_error(ctx));
            double e = rel_diff(got, dense, n * V);
            printf("%s%s vs dense: %.3g\n", pass ? "topk budget 1" : "certified 1/16",
                   one ? " (one by one)" : "", e);
            CHECK(e <= 1e-5, "%s differs from dense by %.3g", pass ? "topk 1.0" : "certified", e);
        }
    }
    ekv_model_stats sc;
    ekv_model_set_method(m, EKV_SELECT_CERTIFIED, 1.0 / 16);
    run(m, tok, n, 0, got);
    ekv_model_get_stats(m, -1, &sc);
    CHECK(sc.lists == n * 2 * 2 && sc.lists_round2 >= 0 && sc.lists_round2 <= sc.lists,
          "certified lists %lld, round 2 %lld", (long long)sc.lists, (long long)sc.lists_round2);
    printf("certified: round 2 in %lld of %lld lists, bytes %lld vs dense %lld\n",
           (long long)sc.lists_round2, (long long)sc.lists, (long long)sc.bytes_read,
           (long long)sd.bytes_read);

    /* top-k at a small budget and gaussian: different from dense, still sane, fewer K bytes */
    const ekv_select_method sparse[2] = {EKV_SELECT_TOPK, EKV_SELECT_GAUSSIAN};
    for (int i = 0; i < 2; i++) {
        ekv_model_set_method(m, sparse[i], 1.0 / 8);
        CHECK(run(m, tok, n, 0, got) == 0, "%s run: %s", ekv_method_name(sparse[i]),
              ekv_last_error(ctx));
        ekv_model_stats ss;
        ekv_model_get_stats(m, -1, &ss);
        double e = rel_diff(got, dense, n * V);
        int finite = 1;
        for (int64_t k = 0; k < n * V; k++) finite &= isfinite(got[k]) != 0;
        printf("%s: vs dense %.3g, kv fraction %.3f (dense %.3f)\n", ekv_method_name(sparse[i]), e,
               (double)ss.bytes_read / (double)ss.bytes_kv,
               (double)sd.bytes_read / (double)sd.bytes_kv);
        CHECK(finite, "%s: logits not finite", ekv_method_name(sparse[i]));
        CHECK(ss.bytes_read > 0 && ss.bytes_read < ss.bytes_kv, "%s: read %lld of %lld bytes",
              ekv_method_name(sparse[i]), (long long)ss.bytes_read, (long long)ss.bytes_kv);
        if (sparse[i] == EKV_SELECT_TOPK) {
            CHECK(e > 0, "top-k 1/8 equals dense exactly: the test cannot see the method");
            /* blocks and one by one agree for the sparse path too (per-view budgets) */
            float *one = malloc(sizeof(float) * (size_t)(n * V));
            CHECK(run(m, tok, n, 1, one) == 0, "topk one by one");
            CHECK(memcmp(one, got, sizeof(float) * (size_t)(n * V)) == 0,
                  "topk: one by one differs from blocks by %.3g", rel_diff(one, got, n * V));
            free(one);
        }
    }

    /* reset gives a fresh sequence: the same logits again */
    ekv_model_set_method(m, EKV_SELECT_DENSE, 1.0);
    CHECK(run(m, tok, n, 0, got) == 0 && memcmp(got, dense, sizeof(float) * (size_t)(n * V)) == 0,
          "rerun after reset");
    CHECK(ekv_model_last_query(m, 1, q2) == EKV_OK && memcmp(q, q2, sizeof q) == 0,
          "last query after rerun");
    /* the layer's cache holds the sequence */
    const ekv_cache *lc;
    int32_t seq;
    int64_t len = 0;
    CHECK(ekv_model_layer_cache(m, 0, &lc, &seq) == EKV_OK &&
                  ekv_cache_seq_length(lc, seq, &len) == EKV_OK && len == n,
          "layer cache length %lld", (long long)len);
    ekv_model_free(m);

    test_screened(ctx, tok, n, got, dense);
    test_truncate(ctx, tok, n, got);

    /* f16 KV cache: close to the reference */
    m = load(ctx, 16, EKV_DTYPE_F16, EKV_SELECT_DENSE, 1.0);
    if (m) {
        CHECK(run(m, tok, n, 0, got) == 0, "f16 run");
        double e = rel_diff(got, want, n * V);
        printf("dense, f16 cache: %.3g\n", e);
        CHECK(e <= 2e-2, "f16 cache: %.3g from numpy", e);
        ekv_model_free(m);
    }
    free(tok);
    free(want);
    free(got);
    free(dense);
    ekv_safetensors_free(ref);
    ekv_context_free(ctx);
    return test_finish("test_model");
}
