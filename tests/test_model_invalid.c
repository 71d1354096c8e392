/*
 * Bad model files and bad calls: each gives an error status and a message, never a crash
 * (ASan/UBSan in CI). Variants of the tiny test model: every truncation (at a stride), a table
 * of header edits (wrong arch tag, metadata, dtypes, shapes, missing and unknown tensors),
 * NaN weights, random byte mutations; then misuse of the model API.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <stddef.h>
#include <string.h>

static unsigned char *file;
static int64_t file_len, hdr_end;

static ekv_status try_load(ekv_context *ctx, const unsigned char *b, int64_t n, int step) {
    ekv_safetensors *st;
    ekv_status s = ekv_safetensors_parse(ctx, b, n, &st);
    if (s) return s;
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 64;
    ekv_model *m = NULL;
    s = ekv_model_from_safetensors(ctx, st, &p, &m);
    ekv_safetensors_free(st);
    if (!s && step) { /* a file that loads must also run (weights may be odd but finite) */
        int32_t tok[3] = {72, 105, 33};
        float logits[3 * 256];
        ekv_status r = ekv_model_step(m, tok, 3, logits);
        CHECK(r == EKV_OK || r == EKV_ERR_NAN_INPUT, "step on a mutated model: %d %s", r,
              ekv_last_error(ctx));
    }
    ekv_model_free(m);
    return s;
}

/* The file with the first occurrence of `from` in the header replaced by `to` (same length). */
static ekv_status load_edited(ekv_context *ctx, const char *from, const char *to) {
    unsigned char *b = malloc((size_t)file_len);
    memcpy(b, file, (size_t)file_len);
    const size_t fl = strlen(from);
    int64_t at = -1;
    for (int64_t i = 8; i + (int64_t)fl <= hdr_end && at < 0; i++)
        if (!memcmp(b + i, from, fl)) at = i;
    CHECK(at >= 0 && strlen(to) == fl, "edit '%s': not found in the header", from);
    if (at >= 0 && strlen(to) == fl) memcpy(b + at, to, fl);
    ekv_status s = try_load(ctx, b, file_len, 1);
    free(b);
    return s;
}

/* Huge finite weights: the final norm.weight as F32 3e38 (the file's last tensor, so its data
 * grows at the end) passes the load, which checks finiteness, but the logits overflow fp32.
 * A step that returns logits fails with EKV_ERR_NAN_INPUT and a message; sampling and a loss
 * never see them (issue 32: ppl printed -nan, run emitted NUL bytes). */
static void huge_weights(ekv_context *ctx) {
    static const char key[] =
            "\"norm.weight\":{\"dtype\":\"F16\",\"shape\":[32],\"data_offsets\":[";
    unsigned char *b = calloc(1, (size_t)file_len + 64);
    memcpy(b, file, (size_t)file_len);
    int64_t at = -1;
    for (int64_t i = 8; i + (int64_t)sizeof key - 1 <= hdr_end && at < 0; i++)
        if (!memcmp(b + i, key, sizeof key - 1)) at = i;
    long long lo = 0, hi = 0;
    CHECK(at >= 0 && sscanf((const char *)b + at + sizeof key - 1, "%lld,%lld", &lo, &hi) == 2 &&
                  hi == file_len - hdr_end && hi - lo == 64,
          "norm.weight: not the file's last F16 [32] tensor");
    char edit[128];
    const int n = snprintf(
            edit, sizeof edit,
            "\"norm.weight\":{\"dtype\":\"F32\",\"shape\":[32],\"data_offsets\":[%lld,%lld", lo,
            lo + 128);
    char old[128];
    snprintf(old, sizeof old, "%s%lld,%lld", key, lo, hi);
    CHECK(at >= 0 && (size_t)n == strlen(old), "the edit keeps the header's length");
    if (at >= 0 && (size_t)n == strlen(old)) {
        memcpy(b + at, edit, (size_t)n);
        for (int e = 0; e < 32; e++) {
            const float big = 3e38f;
            memcpy(b + hdr_end + lo + 4 * e, &big, 4);
        }
        ekv_safetensors *st = NULL;
        ekv_model *m = NULL;
        ekv_model_params p = ekv_model_default_params();
        p.max_tokens = 16;
        ekv_status s = ekv_safetensors_parse(ctx, b, file_len + 64, &st);
        if (!s) s = ekv_model_from_safetensors(ctx, st, &p, &m);
        CHECK(s == EKV_OK, "huge finite weights load: %s", ekv_last_error(ctx));
        int32_t tok[2] = {72, 105};
        float logits[2 * 256];
        if (m) {
            CHECK(ekv_model_step(m, tok, 1, NULL) == EKV_OK, "a step without logits: %s",
                  ekv_last_error(ctx));
            s = ekv_model_step(m, tok, 2, logits);
            CHECK(s == EKV_ERR_NAN_INPUT &&
                          strstr(ekv_last_error(ctx), "logits after the token at position 1") &&
                          strstr(ekv_last_error(ctx), "not finite"),
                  "overflowing logits: %d %s", s, ekv_last_error(ctx));
        }
        ekv_model_free(m);
        ekv_safetensors_free(st);
    }
    free(b);
}

/* The cuda list sizes of the params (include/entmaxkv/model.h): 0 = the default, else 1 ..
 * their most; out of range is refused on every backend with a message naming the field (they
 * were environment variables once; the library reads none). */
static void list_sizes(ekv_context *ctx) {
    static const char *const tiny = EKV_TEST_DATA_DIR "/tiny_model.safetensors";
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 10;
    ekv_model *m = NULL;
    static const struct {
        size_t at;
        const char *name;
        int32_t most;
    } lists[] = {
            {offsetof(ekv_model_params, prefill_candidates), "prefill_candidates",
             EKV_MODEL_MAX_PREFILL_CANDIDATES},
            {offsetof(ekv_model_params, prefill_compact), "prefill_compact",
             EKV_MODEL_MAX_PREFILL_CANDIDATES},
            {offsetof(ekv_model_params, decode_candidates), "decode_candidates",
             EKV_MODEL_MAX_DECODE_CANDIDATES},
    };
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        const int32_t bad[2] = {-1, lists[i].most + 1}, good[2] = {1, lists[i].most};
        ekv_model_params q = p;
        int32_t *field = (int32_t *)((char *)&q + lists[i].at);
        CHECK(*field == 0, "%s defaults to %d, not 0", lists[i].name, *field);
        for (int b = 0; b < 2; b++) {
            *field = bad[b];
            CHECK(ekv_model_load(ctx, tiny, &q, &m) == EKV_ERR_INVALID_SIZE && !m &&
                          strstr(ekv_last_error(ctx), lists[i].name),
                  "%s %d: %s", lists[i].name, bad[b], ekv_last_error(ctx));
            *field = good[b]; /* the cpu engine has no such lists: accepted, unused */
            CHECK(ekv_model_load(ctx, tiny, &q, &m) == EKV_OK && m, "%s %d: %s", lists[i].name,
                  good[b], ekv_last_error(ctx));
            ekv_model_free(m);
            m = NULL;
        }
    }
}

/* A flag of ekv_model_params (name, at its offset) whose values are lo .. 1: def by default, a
 * value outside refused on every backend with a message naming it; each value accepted on the
 * cpu engine (and unused). */
/* An int32 field of ekv_model_params at offset `at`: `def` by default, each of the nbad values of
 * bad fails the load with EKV_ERR_INVALID_ARGUMENT naming it, each of the ngood values of good
 * loads (the cpu backend ignores them). */
static void field_values(ekv_context *ctx, const char *name, size_t at, int32_t def,
                         const int32_t *bad, int nbad, const int32_t *good, int ngood) {
    static const char *const tiny = EKV_TEST_DATA_DIR "/tiny_model.safetensors";
    ekv_model_params p = ekv_model_default_params();
    int32_t *flag = (int32_t *)((char *)&p + at);
    p.max_tokens = 10;
    CHECK(*flag == def, "%s defaults to %d, not %d", name, *flag, def);
    ekv_model *m = NULL;
    for (int b = 0; b < nbad; b++) {
        *flag = bad[b];
        CHECK(ekv_model_load(ctx, tiny, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m &&
                      strstr(ekv_last_error(ctx), name),
              "%s %d: %s", name, bad[b], ekv_last_error(ctx));
    }
    for (int g = 0; g < ngood; g++) {
        *flag = good[g];
        CHECK(ekv_model_load(ctx, tiny, &p, &m) == EKV_OK && m, "%s %d: %s", name, good[g],
              ekv_last_error(ctx));
        ekv_model_free(m);
        m = NULL;
    }
}

/* A flag of values lo..1 (lo 0 or -1): lo - 1 and 2 fail, lo..1 load. */
static void flag_values(ekv_context *ctx, const char *name, size_t at, int32_t def, int32_t lo) {
    const int32_t bad[2] = {lo - 1, 2}, good[3] = {lo, lo + 1, lo + 2};
    field_values(ctx, name, at, def, bad, 2, good, 2 - lo);
}

/* tau_cluster: -1 by default; -1, 0, 2, 4 and 8 load, others fail */
static void tau_cluster_values(ekv_context *ctx) {
    const int32_t bad[4] = {-2, 1, 3, 16}, good[5] = {-1, 0, 2, 4, 8};
    field_values(ctx, "tau_cluster", offsetof(ekv_model_params, tau_cluster), -1, bad, 4, good, 5);
}

int main(void) {
    ekv_context *ctx;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    if (ekv_context_create(&cp, &ctx)) return 1;
    FILE *f = fopen(EKV_TEST_DATA_DIR "/tiny_model.safetensors", "rb");
    if (!f) {
        fprintf(stderr, "no tiny model\n");
        return 1;
    }
    fseek(f, 0, SEEK_END);
    file_len = ftell(f);
    fseek(f, 0, SEEK_SET);
    file = malloc((size_t)file_len);
    if (fread(file, 1, (size_t)file_len, f) != (size_t)file_len) return 1;
    fclose(f);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | file[i];
    hdr_end = 8 + (int64_t)hl;
    CHECK(try_load(ctx, file, file_len, 1) == EKV_OK, "the unedited file: %s", ekv_last_error(ctx));

    /* truncations: every byte of the header, then a stride through the data */
    int64_t rejected = 0, tried = 0;
    for (int64_t n = 0; n < file_len; n += n < hdr_end + 8 ? 1 : 613) {
        tried++;
        rejected += try_load(ctx, file, n, 0) != EKV_OK;
    }
    CHECK(rejected == tried, "%lld of %lld truncated files were accepted",
          (long long)(tried - rejected), (long long)tried);

    static const struct {
        const char *from, *to;
        ekv_status want;
    } edits[] = {
            {"entmaxkv-lm-v1", "entmaxkv-lm-v2", EKV_ERR_UNSUPPORTED}, /* another arch */
            {"\"arch\"", "\"arcx\"", EKV_ERR_INVALID_ARGUMENT},        /* no arch tag */
            {"\"nape\"", "\"rope\"", EKV_ERR_UNSUPPORTED},             /* positions */
            {"\"vocab\"", "\"vocax\"", EKV_ERR_INVALID_ARGUMENT},      /* missing key */
            {"\"vocab\":\"256\"", "\"vocab\":\"255\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"n_heads\":\"4\"", "\"n_heads\":\"x\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"n_heads\":\"4\"", "\"n_heads\":\"0\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"n_kv_heads\":\"2\"", "\"n_kv_heads\":\"3\"", EKV_ERR_HEAD_MISMATCH},
            {"\"head_dim\":\"8\"", "\"head_dim\":\"9\"",
             EKV_ERR_INVALID_ARGUMENT}, /* shapes no longer match */
            {"\"d_model\":\"32\"", "\"d_model\":\"33\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"ffn_dim\":\"48\"", "\"ffn_dim\":\"49\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"n_layers\":\"2\"", "\"n_layers\":\"3\"",
             EKV_ERR_INVALID_ARGUMENT}, /* missing layer 2 */
            {"\"n_layers\":\"2\"", "\"n_layers\":\"1\"",
             EKV_ERR_INVALID_ARGUMENT}, /* unknown layer 1 */
            {"\"alpha\":\"1.5\"", "\"alpha\":\"1.x\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"alpha\":\"1.5\"", "\"alpha\":\"0.5\"", EKV_ERR_INVALID_ALPHA},
            {"\"alpha\":\"1.5\"", "\"alpha\":\"nan\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"norm_eps\":\"1e-05\"", "\"norm_eps\":\"-1e-5\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"tied_embeddings\":\"1\"", "\"tied_embeddings\":\"0\"",
             EKV_ERR_INVALID_ARGUMENT}, /* output.weight missing */
            {"\"tied_embeddings\":\"1\"", "\"tied_embeddings\":\"2\"", EKV_ERR_INVALID_ARGUMENT},
            {"\"norm.weight\"", "\"norm.weighx\"", EKV_ERR_INVALID_ARGUMENT}, /* missing tensor */
            {"\"layers.0.attn.wq.weight\"", "\"layers.0.attn.wk.weighq\"",
             EKV_ERR_INVALID_ARGUMENT},
            {"\"layers.1.attn.wq.weight\"", "\"layers.1.attn.wx.weight\"",
             EKV_ERR_INVALID_ARGUMENT},
            {"\"dtype\":\"F16\"", "\"dtype\":\"I16\"",
             EKV_ERR_INVALID_ARGUMENT}, /* not a float type */
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        ekv_status s = load_edited(ctx, edits[i].from, edits[i].to);
        CHECK(s == edits[i].want, "edit %zu (%s -> %s): status %d (%s), want %d", i, edits[i].from,
              edits[i].to, s, ekv_last_error(ctx), edits[i].want);
        CHECK(s == EKV_OK || strlen(ekv_last_error(ctx)) > 0, "edit %zu: no message", i);
        if (getenv("EKV_TEST_VERBOSE")) printf("  %-40s %s\n", edits[i].to, ekv_last_error(ctx));
    }
    /* wrong shapes with a consistent file: swap the shapes of two same-sized tensors
     * (w1 [48,32] and w2 [32,48]) */
    {
        ekv_status s =
                load_edited(ctx, "\"layers.0.ffn.w1.weight\":{\"dtype\":\"F16\",\"shape\":[48,32]",
                            "\"layers.0.ffn.w1.weight\":{\"dtype\":\"F16\",\"shape\":[32,48]");
        CHECK(s == EKV_ERR_INVALID_ARGUMENT && strstr(ekv_last_error(ctx), "w1"),
              "transposed w1: %d %s", s, ekv_last_error(ctx));
    }
    /* NaN in the weights */
    {
        unsigned char *b = malloc((size_t)file_len);
        memcpy(b, file, (size_t)file_len);
        b[file_len - 2] = 0x00;
        b[file_len - 1] = 0x7e; /* the last F16 element: NaN */
        ekv_status s = try_load(ctx, b, file_len, 0);
        CHECK(s == EKV_ERR_NAN_INPUT, "NaN weight: %d %s", s, ekv_last_error(ctx));
        free(b);
    }
    /* a vector of the wrong shape: the message prints each dimension once ([16], not [160]) */
    {
        ekv_status s = load_edited(ctx, "\"norm.weight\":{\"dtype\":\"F16\",\"shape\":[32]",
                                   "\"norm.weight\":{\"dtype\":\"F32\",\"shape\":[16]");
        CHECK(s == EKV_ERR_INVALID_ARGUMENT &&
                      strstr(ekv_last_error(ctx),
                             "tensor 'norm.weight' has shape [16] (ndim 1), expected [32]"),
              "norm.weight [16]: %d %s", s, ekv_last_error(ctx));
    }
    huge_weights(ctx);
    /* random mutations: any status, never a crash; a model that loads must run */
    test_rng r = {777};
    int ok = 0;
    unsigned char *b = malloc((size_t)file_len);
    for (int it = 0; it < 300; it++) {
        memcpy(b, file, (size_t)file_len);
        for (int k = 0; k < 1 + (int)(test_next(&r) % 3); k++) {
            int64_t pos = test_next(&r) % 2 ? (int64_t)(test_next(&r) % (uint64_t)hdr_end)
                                            : (int64_t)(test_next(&r) % (uint64_t)file_len);
            b[pos] = (unsigned char)test_next(&r);
        }
        ok += try_load(ctx, b, file_len, 1) == EKV_OK;
    }
    printf("mutations: %d of 300 still loaded\n", ok);
    free(b);

    /* misuse of the API */
    ekv_model *m = NULL;
    ekv_model_params p = ekv_model_default_params();
    p.max_tokens = 10;
    CHECK(ekv_model_load(ctx, "/nonexistent/model.safetensors", &p, &m) ==
                          EKV_ERR_INVALID_ARGUMENT &&
                  !m,
          "missing file");
    CHECK(ekv_model_load(NULL, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) ==
                  EKV_ERR_NULL_POINTER,
          "NULL ctx");
    CHECK(ekv_model_load(ctx, NULL, &p, &m) == EKV_ERR_NULL_POINTER, "NULL path");
    p.page_size = 0;
    CHECK(ekv_model_load(ctx, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) ==
                  EKV_ERR_INVALID_PAGE_SIZE,
          "page 0");
    p = ekv_model_default_params();
    p.max_tokens = 0;
    CHECK(ekv_model_load(ctx, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) ==
                  EKV_ERR_INVALID_SIZE,
          "max_tokens 0");
    p.max_tokens = 10;
    p.budget = 0;
    CHECK(ekv_model_load(ctx, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "budget 0");
    p.budget = 0.5;
    p.method = (ekv_select_method)9;
    CHECK(ekv_model_load(ctx, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) ==
                  EKV_ERR_INVALID_ARGUMENT,
          "method 9");
    p.method = EKV_SELECT_DENSE;
    /* the backend fields (the GPU engine's; several sequences are a CUDA feature) */
#define TINY EKV_TEST_DATA_DIR "/tiny_model.safetensors"
    p.backend = EKV_BACKEND_REF;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m, "backend ref");
    p.backend = EKV_BACKEND_CPU;
    p.max_seqs = 2;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m, "max_seqs 2 on cpu");
    p.max_seqs = 0;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m, "max_seqs 0");
    p.max_seqs = 1;
    p.cuda_graphs = 2;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m, "cuda_graphs 2");
    p.cuda_graphs = 1;
    p.prefill_chunk = -1;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_SIZE && !m, "prefill_chunk -1");
    p.prefill_chunk = 0;
    p.prefill_kernel = (ekv_prefill_kernel)7;
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_INVALID_ARGUMENT && !m, "prefill_kernel 7");
    p.prefill_kernel = EKV_PREFILL_AUTO;
    list_sizes(ctx);
    flag_values(ctx, "fused_attend", offsetof(ekv_model_params, fused_attend), 0, 0);
    tau_cluster_values(ctx);
    /* -1: overlapped where the GPU supports it (the default) */
    flag_values(ctx, "overlap_launches", offsetof(ekv_model_params, overlap_launches), -1, -1);
    p.backend = EKV_BACKEND_CUDA;
    p.method = EKV_SELECT_ORACLE; /* evaluation only: no CUDA path */
    CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_UNSUPPORTED && !m &&
                  strstr(ekv_last_error(ctx), "oracle"),
          "oracle on cuda: %s", ekv_last_error(ctx));
    p.method = EKV_SELECT_DENSE;
    int32_t ndev = 0;
    ekv_cuda_device_count(ctx, &ndev);
    if (!ndev) { /* no CUDA build or no device: the load says so and gives no model */
        CHECK(ekv_model_load(ctx, TINY, &p, &m) == EKV_ERR_UNSUPPORTED && !m &&
                      strstr(ekv_last_error(ctx), "cuda"),
              "backend cuda without a device: %s", ekv_last_error(ctx));
    }
    p.backend = EKV_BACKEND_CPU;
    CHECK(ekv_model_load(ctx, EKV_TEST_DATA_DIR "/tiny_model.safetensors", &p, &m) == EKV_OK,
          "load: %s", ekv_last_error(ctx));
    CHECK(ekv_model_backend(m) == EKV_BACKEND_CPU, "backend cpu");
    if (m) {
        int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, bad = 256, neg = -1;
        float lg[12 * 256];
        CHECK(ekv_model_step(m, &bad, 1, lg) == EKV_ERR_INVALID_ARGUMENT, "token 256");
        CHECK(ekv_model_step(m, &neg, 1, lg) == EKV_ERR_INVALID_ARGUMENT, "token -1");
        CHECK(ekv_model_step(m, tok, 0, lg) == EKV_ERR_INVALID_SIZE, "n = 0");
        CHECK(ekv_model_step(m, NULL, 1, lg) == EKV_ERR_NULL_POINTER, "NULL tokens");
        CHECK(ekv_model_position(m) == 0, "failed steps moved the position");
        CHECK(ekv_model_step(m, tok, 11, lg) == EKV_ERR_CACHE_FULL, "past max_tokens");
        CHECK(ekv_model_step(m, tok, 10, lg) == EKV_OK, "up to max_tokens: %s",
              ekv_last_error(ctx));
        CHECK(ekv_model_step(m, tok, 1, NULL) == EKV_ERR_CACHE_FULL, "full");
        CHECK(ekv_model_set_method(m, EKV_SELECT_TOPK, 1.5) == EKV_ERR_INVALID_ARGUMENT,
              "budget 1.5");
        CHECK(ekv_model_set_method(m, EKV_SELECT_TOPK, NAN) == EKV_ERR_INVALID_ARGUMENT,
              "budget NaN");
        ekv_model_stats s;
        CHECK(ekv_model_get_stats(m, 2, &s) == EKV_ERR_INVALID_ARGUMENT &&
                      ekv_model_get_stats(m, -2, &s) == EKV_ERR_INVALID_ARGUMENT,
              "stats of a layer that does not exist");
        float q[32];
        const ekv_cache *c;
        int32_t seq;
        CHECK(ekv_model_last_query(m, 2, q) == EKV_ERR_INVALID_ARGUMENT, "last query of layer 2");
        CHECK(ekv_model_layer_cache(m, -1, &c, &seq) == EKV_ERR_INVALID_ARGUMENT,
              "cache of layer -1");
        /* one sequence: seq 0 is the model's; batch_step of [0] is a step */
        const int32_t s0[2] = {0, 0}, s1 = 1;
        CHECK(ekv_model_seq_step(m, 1, tok, 1, lg) == EKV_ERR_INVALID_ARGUMENT, "seq 1 of 1");
        CHECK(ekv_model_seq_position(m, 0) == 10 && ekv_model_seq_position(m, 1) == -1,
              "seq positions");
        CHECK(ekv_model_batch_step(m, s0, 2, tok, lg) == EKV_ERR_INVALID_SIZE, "2 of max_seqs 1");
        CHECK(ekv_model_batch_step(m, &s1, 1, tok, lg) == EKV_ERR_INVALID_ARGUMENT, "batch seq 1");
        CHECK(ekv_model_batch_step(m, s0, 1, tok, lg) == EKV_ERR_CACHE_FULL,
              "batch past max_tokens");
        CHECK(ekv_model_seq_reset(m, 3) == EKV_ERR_INVALID_ARGUMENT, "reset seq 3");
        CHECK(ekv_model_seq_reset(m, 0) == EKV_OK && ekv_model_position(m) == 0, "seq_reset 0");
        CHECK(ekv_model_batch_step(m, s0, 1, tok, lg) == EKV_OK && ekv_model_position(m) == 1,
              "batch step of seq 0: %s", ekv_last_error(ctx));
        CHECK(ekv_model_reset(m) == EKV_OK && ekv_model_position(m) == 0, "reset");
        CHECK(ekv_model_step(m, tok, 10, lg) == EKV_OK, "after reset");
        ekv_model_free(m);
    }
    ekv_select_method am;
    CHECK(ekv_method_from_name("certified", &am) == EKV_OK && am == EKV_SELECT_CERTIFIED,
          "method name");
    CHECK(ekv_method_from_name("fast", &am) == EKV_ERR_INVALID_ARGUMENT, "unknown method name");
    CHECK(ekv_method_name((ekv_select_method)7) == NULL, "name of method 7");
    ekv_model_free(NULL);
    free(file);
    ekv_context_free(ctx);
    return test_finish("test_model_invalid");
}
