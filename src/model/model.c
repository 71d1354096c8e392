/*
 * The entmaxkv language model (train/MODEL.md): loading and validation, the byte tokenizer
 * and the fp32 forward pass. One block of tokens goes through every layer together, so each
 * weight matrix is read once per block (the matrix products use the CPU's score kernel, which
 * computes every dot product in the same order whatever the block size: a block gives the
 * same numbers as one token at a time). Attention is in model_attention.c.
 *
 *   h   = x + Wo . Attn(RMSNorm(x; attn_norm))
 *   out = h + W2 . (silu(W1 . RMSNorm(h; ffn_norm)) * (W3 . RMSNorm(h; ffn_norm)))
 *   logits = Wout . RMSNorm(x_last; norm)
 */
#include "model_internal.h"
#include "model_gpu.h"
#include "../core/method.h"
#include "../cpu/kernels/kernels.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static const char *const ARCH_TAG = "entmaxkv-lm-v1";

/* ---------------------------------------------------------------------------------- */
/* Parameters and names                                                                 */
/* ---------------------------------------------------------------------------------- */
ekv_model_params ekv_model_default_params(void) {
    ekv_model_params p;
    p.max_tokens = 4096;
    p.page_size = 16;
    p.kv_dtype = EKV_DTYPE_F16;
    p.superpage_pages = 16;
    p.method = EKV_SELECT_DENSE;
    p.budget = 1.0 / 16;
    p.code_bits = 0;
    p.backend = EKV_BACKEND_CPU;
    p.device = 0;
    p.cuda_graphs = 1;
    p.prefill_chunk = 0;
    p.max_seqs = 1;
    p.prefill_kernel = EKV_PREFILL_AUTO;
    p.prefill_candidates = 0;
    p.prefill_compact = 0;
    p.decode_candidates = 0;
    p.fused_attend = 0;
    p.tau_cluster = -1;      /* where the GPU supports it: measured faster (bench/RESULTS.md) */
    p.overlap_launches = -1; /* where the GPU supports it */
    return p;
}

/* The method and budget of the model's attention, checked by the decode stack's own support
 * check on the select params the attention will use (model_attention.c). A method that reads
 * key codes (the method table says which) is refused up front when the caches have none:
 * the decode step would only say so at the first token. */
static ekv_status check_method(ekv_context *ctx, const ekv_model_config *cfg, ekv_backend backend,
                               ekv_select_method method, double budget, int32_t code_bits) {
    if (!(budget > 0.0 && budget <= 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "budget=%g must be a fraction in (0, 1]",
                        budget);
    /* the slopes' presence matters to the CUDA check (gaussian with ALiBi), not their values */
    static const float any_slopes[1] = {0.f};
    const ekv_decode_params dp = ekv_model_decode_params(cfg, any_slopes);
    const ekv_select_params sp = ekv_model_select_params(method, budget, 1);
    ekv_status s = ekv_decode_supported(ctx, backend, &dp, &sp);
    if (s) return s;
    if ((ekv_method_info_of(method)->needs & EKV_NEEDS_CODES) && code_bits == 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "method %s needs key codes in the KV caches: load the model with "
                        "ekv_model_params.code_bits 4 or 8 (it has code_bits 0)",
                        ekv_method_name(method));
    return EKV_OK;
}

/* ---------------------------------------------------------------------------------- */
/* Loading: metadata, then every tensor checked against it                              */
/* ---------------------------------------------------------------------------------- */
/* An integer metadata value in [lo, hi]; digits only. */
static ekv_status meta_int(ekv_context *ctx, const ekv_safetensors *st, const char *key,
                           int required, int64_t lo, int64_t hi, int32_t *out) {
    const char *v = ekv_safetensors_metadata(st, key);
    if (!v) {
        if (!required) {
            *out = 0;
            return EKV_OK;
        }
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "model: metadata key '%s' is missing", key);
    }
    int64_t x = 0;
    const char *s = v;
    if (!*s) return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "model: metadata '%s' is empty", key);
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || x > (INT64_MAX - 9) / 10)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "model: metadata '%s'='%.32s' is not an integer", key, v);
        x = x * 10 + (*s - '0');
    }
    if (x < lo || x > hi)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "model: metadata '%s'=%lld is outside [%lld, %lld]", key, (long long)x,
                        (long long)lo, (long long)hi);
    *out = (int32_t)x;
    return EKV_OK;
}

static ekv_status meta_double(ekv_context *ctx, const ekv_safetensors *st, const char *key,
                              double *out) {
    const char *v = ekv_safetensors_metadata(st, key);
    if (!v)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "model: metadata key '%s' is missing", key);
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "model: metadata '%s'='%.32s' is not a finite number", key, v);
    *out = x;
    return EKV_OK;
}

static ekv_status read_config(ekv_context *ctx, const ekv_safetensors *st, ekv_model_config *c) {
    const char *arch = ekv_safetensors_metadata(st, "arch");
    if (!arch)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "model: no 'arch' in the metadata (not an entmaxkv model file)");
    if (strcmp(arch, ARCH_TAG))
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "model: arch '%.64s' is not supported (this engine runs '%s')", arch,
                        ARCH_TAG);
    memset(c, 0, sizeof *c);
    ekv_status s;
    if ((s = meta_int(ctx, st, "vocab", 1, 256, 256, &c->vocab)) ||
        (s = meta_int(ctx, st, "d_model", 1, 1, 65536, &c->d_model)) ||
        (s = meta_int(ctx, st, "n_layers", 1, 1, EKV_MODEL_MAX_LAYERS, &c->n_layers)) ||
        (s = meta_int(ctx, st, "n_heads", 1, 2, 256, &c->n_heads)) ||
        (s = meta_int(ctx, st, "n_kv_heads", 1, 1, 256, &c->n_kv_heads)) ||
        (s = meta_int(ctx, st, "head_dim", 1, 1, 1024, &c->head_dim)) ||
        (s = meta_int(ctx, st, "ffn_dim", 1, 1, 1 << 20, &c->ffn_dim)) ||
        (s = meta_int(ctx, st, "train_ctx", 0, 0, INT32_MAX, &c->train_ctx)) ||
        (s = meta_int(ctx, st, "tied_embeddings", 1, 0, 1, &c->tied_embeddings)) ||
        (s = meta_double(ctx, st, "alpha", &c->alpha)) ||
        (s = meta_double(ctx, st, "norm_eps", &c->norm_eps)))
        return s;
    const char *pos = ekv_safetensors_metadata(st, "positions");
    if (!pos)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "model: metadata key 'positions' is missing");
    if (strcmp(pos, "nape"))
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "model: positions '%.32s' are not supported (only 'nape')", pos);
    if (c->n_heads % c->n_kv_heads)
        return ekv_fail(ctx, EKV_ERR_HEAD_MISMATCH,
                        "model: n_heads=%d is not a multiple of n_kv_heads=%d", c->n_heads,
                        c->n_kv_heads);
    if (!(c->alpha > 1.0 && c->alpha <= 4.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA,
                        "model: alpha=%g must be in (1, 4] (an entmax model)", c->alpha);
    if (!(c->norm_eps > 0.0 && c->norm_eps < 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "model: norm_eps=%g must be in (0, 1)",
                        c->norm_eps);
    return EKV_OK;
}

/* One expected tensor: its name and shape; where its data goes. */
typedef struct {
    char name[64];
    int64_t rows, cols; /* cols = 0: a vector [rows] */
    model_matrix *mat;  /* matrices keep their dtype */
    float *vec;         /* vectors are converted to fp32 */
} tensor_spec;

static int all_finite(const void *data, ekv_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float f;
        switch (dt) { /* the file's data may be unaligned: copy each element out */
        case EKV_DTYPE_F32: memcpy(&f, (const char *)data + 4 * i, 4); break;
        default: {
            uint16_t h;
            memcpy(&h, (const char *)data + 2 * i, 2);
            f = dt == EKV_DTYPE_F16 ? ekv_f16_to_f32(h) : ekv_bf16_to_f32(h);
        }
        }
        if (!isfinite(f)) return 0;
    }
    return 1;
}

/* "[384]", "[16, 32]", "[]": a shape as the messages print it (every dimension, each once). */
static void shape_string(char *buf, size_t n, const int64_t *shape, int32_t ndim) {
    size_t at = (size_t)snprintf(buf, n, "[");
    for (int32_t d = 0; d < ndim && at < n; d++)
        at += (size_t)snprintf(buf + at, n - at, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (at < n) snprintf(buf + at, n - at, "]");
}

void ekv_model_free(ekv_model *m) {
    if (!m) return;
    ekv_model_gpu_free(m->gpu);
    if (m->layers)
        for (int32_t l = 0; l < m->cfg.n_layers; l++) {
            ekv_cache_free(m->layers[l].cache);
            free(m->layers[l].last_q);
        }
    free(m->layers);
    free(m->weights);
    free(m->vectors);
    free(m->slopes);
    free(m->x);
    free(m->xn);
    free(m->q);
    free(m->k);
    free(m->v);
    free(m->att);
    free(m->h1);
    free(m->h3);
    free(m->proj);
    free(m->zmax);
    attn_scratch *a = &m->as;
    free(a->indptr);
    free(a->indices);
    free(a->last_len);
    free(a->full);
    free(m);
}

/* The expected tensors of this config, in file-independent order. Returns the count. */
static int64_t expected_tensors(ekv_model *m, tensor_spec *t, float *vec) {
    const ekv_model_config *c = &m->cfg;
    const int64_t d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t n = 0;
#define SPEC(R, C, MAT, VEC, ...)                                                                  \
    do {                                                                                           \
        snprintf(t[n].name, sizeof t[n].name, __VA_ARGS__);                                        \
        t[n].rows = (R);                                                                           \
        t[n].cols = (C);                                                                           \
        t[n].mat = (MAT);                                                                          \
        t[n].vec = (VEC);                                                                          \
        n++;                                                                                       \
    } while (0)
    SPEC(c->vocab, d, &m->tok_emb, NULL, "tok_embeddings.weight");
    for (int32_t l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        L->attn_norm = vec + (int64_t)(2 * l) * d;
        L->ffn_norm = vec + (int64_t)(2 * l + 1) * d;
        SPEC(d, 0, NULL, L->attn_norm, "layers.%d.attn_norm.weight", l);
        SPEC(qd, d, &L->wq, NULL, "layers.%d.attn.wq.weight", l);
        SPEC(kvd, d, &L->wk, NULL, "layers.%d.attn.wk.weight", l);
        SPEC(kvd, d, &L->wv, NULL, "layers.%d.attn.wv.weight", l);
        SPEC(d, qd, &L->wo, NULL, "layers.%d.attn.wo.weight", l);
        SPEC(d, 0, NULL, L->ffn_norm, "layers.%d.ffn_norm.weight", l);
        SPEC(c->ffn_dim, d, &L->w1, NULL, "layers.%d.ffn.w1.weight", l);
        SPEC(c->ffn_dim, d, &L->w3, NULL, "layers.%d.ffn.w3.weight", l);
        SPEC(d, c->ffn_dim, &L->w2, NULL, "layers.%d.ffn.w2.weight", l);
    }
    m->norm_w = vec + (int64_t)2 * c->n_layers * d;
    SPEC(d, 0, NULL, m->norm_w, "norm.weight");
    if (!c->tied_embeddings) SPEC(c->vocab, d, &m->out_w, NULL, "output.weight");
#undef SPEC
    return n;
}

/* Checks every tensor against its spec and copies the weights into the model. */
static ekv_status load_tensors(ekv_model *m, const ekv_safetensors *st) {
    ekv_context *ctx = m->ctx;
    const ekv_model_config *c = &m->cfg;
    const int64_t nspec = 2 + 9 * (int64_t)c->n_layers + 1;
    tensor_spec *t = calloc((size_t)nspec, sizeof *t);
    m->vectors = malloc(sizeof(float) * (size_t)((2 * (int64_t)c->n_layers + 1) * c->d_model));
    if (!t || !m->vectors) {
        free(t);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    }
    const int64_t n = expected_tensors(m, t, m->vectors);
    ekv_status s = EKV_OK;
    ekv_tensor_info *info = calloc((size_t)n, sizeof *info);
    int64_t total = 0;
    if (!info) {
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
        goto done;
    }
    for (int64_t i = 0; i < n && !s; i++) {
        ekv_tensor_info *ti = &info[i];
        const int want_nd = t[i].cols ? 2 : 1;
        if (ekv_safetensors_find(st, t[i].name, ti))
            s = ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "model: tensor '%s' is missing", t[i].name);
        else if (ti->dtype < 0)
            s = ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                         "model: tensor '%s' is %s (expected F16, BF16 or F32)", t[i].name,
                         ti->dtype_name);
        else if (ti->ndim != want_nd || ti->shape[0] != t[i].rows ||
                 (want_nd == 2 && ti->shape[1] != t[i].cols)) {
            char have[200], want[64];
            const int64_t want_shape[2] = {t[i].rows, t[i].cols};
            shape_string(have, sizeof have, ti->shape, ti->ndim);
            shape_string(want, sizeof want, want_shape, want_nd);
            s = ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                         "model: tensor '%s' has shape %s (ndim %d), expected %s", t[i].name, have,
                         ti->ndim, want);
        } else if (!all_finite(ti->data, (ekv_dtype)ti->dtype, ti->numel))
            s = ekv_fail(ctx, EKV_ERR_NAN_INPUT, "model: tensor '%s' holds NaN or infinite values",
                         t[i].name);
        else if (t[i].mat)
            total += (ti->nbytes + 63) & ~(int64_t)63;
    }
    if (!s && ekv_safetensors_count(st) !=
                      n) { /* every expected name was found: anything else is unknown */
        for (int64_t i = 0; i < ekv_safetensors_count(st); i++) {
            ekv_tensor_info x;
            ekv_safetensors_at(st, i, &x);
            int64_t k = 0;
            while (k < n && strcmp(x.name, t[k].name)) k++;
            if (k == n) {
                s = ekv_fail(
                        ctx, EKV_ERR_INVALID_ARGUMENT, "model: unexpected tensor '%.64s'%s", x.name,
                        !strcmp(x.name, "output.weight") ? " (tied_embeddings=1 says there is none)"
                                                         : "");
                break;
            }
        }
    }
    if (s) goto done;
    /* one 64-byte aligned copy of the matrices (the file's data may be unaligned) */
    if (posix_memalign(&m->weights, 64, (size_t)(total > 0 ? total : 64))) {
        m->weights = NULL;
        s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "model: cannot hold %.1f MiB of weights",
                     (double)total / (1 << 20));
        goto done;
    }
    int64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        const ekv_tensor_info *ti = &info[i];
        if (t[i].mat) {
            memcpy((char *)m->weights + off, ti->data, (size_t)ti->nbytes);
            *t[i].mat = (model_matrix){(char *)m->weights + off, (ekv_dtype)ti->dtype, t[i].rows,
                                       t[i].cols};
            off += (ti->nbytes + 63) & ~(int64_t)63;
        } else {
            const int64_t es = ekv_dtype_size((ekv_dtype)ti->dtype);
            for (int64_t e = 0; e < t[i].rows; e++) {
                unsigned char b[4] = {0};
                memcpy(b, (const char *)ti->data + e * es, (size_t)es);
                t[i].vec[e] = ekv_load_f32(b, (ekv_dtype)ti->dtype, 0);
            }
        }
    }
    if (c->tied_embeddings) m->out_w = m->tok_emb;
done:
    free(info);
    free(t);
    return s;
}

static ekv_status alloc_state(ekv_model *m) {
    const ekv_model_config *c = &m->cfg;
    const int64_t T = EKV_MODEL_BLOCK, d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim;
    const int64_t kvd = (int64_t)c->n_kv_heads * c->head_dim,
                  wide = c->ffn_dim > c->vocab ? c->ffn_dim : c->vocab;
    m->x = malloc(sizeof(float) * (size_t)(T * d));
    m->xn = malloc(sizeof(float) * (size_t)(T * d));
    m->q = malloc(sizeof(float) * (size_t)(T * qd));
    m->k = malloc(sizeof(float) * (size_t)(T * kvd));
    m->v = malloc(sizeof(float) * (size_t)(T * kvd));
    m->att = malloc(sizeof(float) * (size_t)(T * qd));
    m->h1 = malloc(sizeof(float) * (size_t)(T * wide));
    m->h3 = malloc(sizeof(float) * (size_t)(T * c->ffn_dim));
    m->proj = malloc(sizeof(float) * (size_t)(T * d));
    m->zmax = malloc(sizeof(float) * (size_t)(T * ekv_context_threads(m->ctx)));
    m->slopes = malloc(sizeof(float) * (size_t)c->n_heads);
    if (!m->x || !m->xn || !m->q || !m->k || !m->v || !m->att || !m->h1 || !m->h3 || !m->proj ||
        !m->zmax || !m->slopes)
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    /* NAPE (docs/math.md §1.6): h0 = H/2 ALiBi heads with m_h = 2^(-8(h+1)/h0), the rest without
     * position */
    const int32_t h0 = c->n_heads / 2;
    for (int32_t h = 0; h < c->n_heads; h++)
        m->slopes[h] = h < h0 ? (float)pow(2.0, -8.0 * (h + 1) / h0) : 0.f;
    for (int32_t l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        L->last_q = calloc((size_t)qd, sizeof(float));
        if (!L->last_q) return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
        if (m->prm.backend == EKV_BACKEND_CUDA) continue; /* its caches live on the device */
        ekv_cache_params cp = ekv_cache_default_params();
        cp.page_size = m->prm.page_size;
        cp.num_kv_heads = c->n_kv_heads;
        cp.head_dim = c->head_dim;
        cp.dtype = m->prm.kv_dtype;
        cp.max_seqs = 1;
        cp.superpage_pages = m->prm.superpage_pages;
        cp.code_bits = m->prm.code_bits;
        cp.range_dtype = ekv_cache_compact_ranges(cp.dtype); /* exact: K's own dtype */
        cp.num_pages = ekv_cache_pages_for(m->prm.max_tokens, 1, cp.page_size);
        ekv_status s = ekv_cache_create(m->ctx, &cp, &L->cache);
        if (s) return s;
        if ((s = ekv_cache_seq_new(L->cache, &L->seq))) return s;
    }
    return EKV_OK;
}

/* A cuda list size of the params (docs/architecture.md, "The model on the GPU"): 0 = the
 * default, else 1 .. most. Checked on every backend, as the other cuda fields are. */
static ekv_status check_list_size(ekv_context *ctx, const char *name, int32_t v, int32_t most) {
    if (v >= 0 && v <= most) return EKV_OK;
    return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "%s=%d must be in [0, %d] (0 = the default)", name,
                    v, most);
}

ekv_status ekv_model_from_safetensors(ekv_context *ctx, const ekv_safetensors *st,
                                      const ekv_model_params *params, ekv_model **out) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!st || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !st ? "st" : "out");
    ekv_model_params p = params ? *params : ekv_model_default_params();
    if (p.max_tokens < 1 || p.max_tokens > ((int64_t)1 << 40))
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "max_tokens=%lld must be in [1, 2^40]",
                        (long long)p.max_tokens);
    if (p.page_size < 1 || p.page_size > 256)
        return ekv_fail(ctx, EKV_ERR_INVALID_PAGE_SIZE, "page_size=%d must be in [1, 256]",
                        p.page_size);
    if (!ekv_dtype_valid(p.kv_dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE, "kv_dtype=%d is unknown", (int)p.kv_dtype);
    if (p.backend != EKV_BACKEND_CPU && p.backend != EKV_BACKEND_CUDA)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "backend=%d: the model runs on cpu (0) or cuda (2)", (int)p.backend);
    if (p.cuda_graphs != 0 && p.cuda_graphs != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "cuda_graphs=%d must be 0 or 1",
                        p.cuda_graphs);
    if (p.max_seqs < 1 || p.max_seqs > 4096 || (p.max_seqs > 1 && p.backend != EKV_BACKEND_CUDA))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "max_seqs=%d must be in [1, 4096], and 1 on the cpu backend (several "
                        "sequences are a cuda feature)",
                        p.max_seqs);
    if (p.prefill_kernel != EKV_PREFILL_AUTO && p.prefill_kernel != EKV_PREFILL_FUSED &&
        p.prefill_kernel != EKV_PREFILL_GEMM && p.prefill_kernel != EKV_PREFILL_FUSED_HIST)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "prefill_kernel=%d: expected auto (0), fused (1), gemm (2) or hist (3)",
                        (int)p.prefill_kernel);
    const ekv_status opts =
            ekv_check_cuda_options(ctx, p.fused_attend, p.overlap_launches, p.tau_cluster);
    if (opts) return opts;
    if (p.prefill_chunk < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "prefill_chunk=%lld must be >= 0 (0 = auto)",
                        (long long)p.prefill_chunk);
    ekv_status s = check_list_size(ctx, "prefill_candidates", p.prefill_candidates,
                                   EKV_MODEL_MAX_PREFILL_CANDIDATES);
    if (!s)
        s = check_list_size(ctx, "prefill_compact", p.prefill_compact,
                            EKV_MODEL_MAX_PREFILL_CANDIDATES);
    if (!s)
        s = check_list_size(ctx, "decode_candidates", p.decode_candidates,
                            EKV_MODEL_MAX_DECODE_CANDIDATES);
    ekv_model_config cfg;
    if (!s) s = read_config(ctx, st, &cfg);
    if (s) return s;
    if ((s = check_method(ctx, &cfg, p.backend, p.method, p.budget, p.code_bits))) return s;
    ekv_model *m = calloc(1, sizeof *m);
    if (!m) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    m->ctx = ctx;
    m->cfg = cfg;
    m->prm = p;
    m->layers = calloc((size_t)cfg.n_layers, sizeof *m->layers);
    if (!m->layers) s = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    if (!s) s = load_tensors(m, st);
    if (!s) s = alloc_state(m);
    if (!s && p.backend == EKV_BACKEND_CUDA) s = ekv_model_gpu_create(m);
    if (s) {
        ekv_model_free(m);
        return s;
    }
    *out = m;
    ekv_clear_error(ctx);
    return EKV_OK;
}

ekv_status ekv_model_load(ekv_context *ctx, const char *path, const ekv_model_params *params,
                          ekv_model **out) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!path || !out)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL", !path ? "path" : "out");
    ekv_safetensors *st;
    ekv_status s = ekv_safetensors_open(ctx, path, &st);
    if (s) return s;
    s = ekv_model_from_safetensors(ctx, st, params, out);
    ekv_safetensors_free(st);
    return s;
}

/* ---------------------------------------------------------------------------------- */
/* Small API                                                                            */
/* ---------------------------------------------------------------------------------- */
const ekv_model_config *ekv_model_get_config(const ekv_model *m) { return m ? &m->cfg : NULL; }
int64_t ekv_model_position(const ekv_model *m) { return m ? m->pos : 0; }
ekv_backend ekv_model_backend(const ekv_model *m) { return m ? m->prm.backend : EKV_BACKEND_CPU; }

ekv_status ekv_model_set_method(ekv_model *m, ekv_select_method method, double budget) {
    if (!m) return EKV_ERR_NULL_POINTER;
    ekv_status s = check_method(m->ctx, &m->cfg, m->prm.backend, method, budget, m->prm.code_bits);
    if (s) return s;
    m->prm.method = method;
    m->prm.budget = budget;
    return EKV_OK;
}

void ekv_model_reset_stats(ekv_model *m) {
    if (!m) return;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        memset(&m->layers[l].stats, 0, sizeof m->layers[l].stats);
}

ekv_status ekv_model_reset(ekv_model *m) {
    if (!m) return EKV_ERR_NULL_POINTER;
    if (m->gpu) {
        ekv_status s = ekv_model_gpu_reset(m);
        if (s) return s;
    }
    for (int32_t l = 0; l < m->cfg.n_layers && !m->gpu; l++) {
        model_layer *L = &m->layers[l];
        ekv_status s = ekv_cache_seq_free(L->cache, L->seq);
        if (!s) s = ekv_cache_seq_new(L->cache, &L->seq);
        if (s) return s;
    }
    m->pos = 0;
    ekv_model_reset_stats(m);
    return EKV_OK;
}

ekv_status ekv_model_get_stats(const ekv_model *m, int32_t layer, ekv_model_stats *out) {
    if (!m || !out) return EKV_ERR_NULL_POINTER;
    if (layer < -1 || layer >= m->cfg.n_layers) return EKV_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        if (layer >= 0 && l != layer) continue;
        const ekv_model_stats *s = &m->layers[l].stats;
        out->steps += s->steps;
        out->bytes_read += s->bytes_read;
        out->bytes_kv += s->bytes_kv;
        out->lists_round2 += s->lists_round2;
        out->lists += s->lists;
        out->survivors += s->survivors;
        out->prefill_fused += s->prefill_fused;
        out->prefill_gemm += s->prefill_gemm;
        out->prefill_retry_rows += s->prefill_retry_rows;
        out->prefill_newton_rows += s->prefill_newton_rows;
        out->prefill_compacted_rows += s->prefill_compacted_rows;
        out->tau_compacted_rows += s->tau_compacted_rows;
        out->tau_whole_rows += s->tau_whole_rows;
        out->screen_retry_rows += s->screen_retry_rows;
        out->screen_all_rows += s->screen_all_rows;
        out->graph_steps += s->graph_steps;
        out->prefill_tiles_skipped += s->prefill_tiles_skipped;
        out->prefill_tiles_unreached += s->prefill_tiles_unreached;
    }
    return EKV_OK;
}

int64_t ekv_model_tokenize(const char *text, int64_t len, int32_t *tokens) {
    if (!text || !tokens || len < 0) return 0;
    for (int64_t i = 0; i < len; i++) tokens[i] = (unsigned char)text[i];
    return len;
}

ekv_status ekv_model_layer_cache(const ekv_model *m, int32_t layer, const ekv_cache **cache,
                                 int32_t *seq) {
    if (!m || !cache || !seq) return EKV_ERR_NULL_POINTER;
    if (layer < 0 || layer >= m->cfg.n_layers) return EKV_ERR_INVALID_ARGUMENT;
    if (m->gpu) return ekv_model_gpu_layer_cache(m, layer, cache, seq);
    *cache = m->layers[layer].cache;
    *seq = m->layers[layer].seq;
    return EKV_OK;
}

ekv_status ekv_model_last_query(const ekv_model *m, int32_t layer, float *q) {
    if (!m || !q) return EKV_ERR_NULL_POINTER;
    if (layer < 0 || layer >= m->cfg.n_layers) return EKV_ERR_INVALID_ARGUMENT;
    if (m->gpu) return ekv_model_gpu_last_query(m, layer, q);
    memcpy(q, m->layers[layer].last_q,
           sizeof(float) * (size_t)m->cfg.n_heads * (size_t)m->cfg.head_dim);
    return EKV_OK;
}

ekv_status ekv_model_alibi_slopes(const ekv_model *m, float *slopes) {
    if (!m || !slopes) return EKV_ERR_NULL_POINTER;
    memcpy(slopes, m->slopes, sizeof(float) * (size_t)m->cfg.n_heads);
    return EKV_OK;
}

/* ---------------------------------------------------------------------------------- */
/* Forward pass                                                                         */
/* ---------------------------------------------------------------------------------- */
enum { MATMUL_ROWS = 32 }; /* output rows per task */

typedef struct {
    ekv_model *m;
    const model_matrix *w;
    const float *x;
    float *y;
    int64_t T;
} matmul_job;

static void matmul_task(void *vp, int64_t task, int worker) {
    const matmul_job *j = vp;
    const model_matrix *w = j->w;
    const int64_t r0 = task * MATMUL_ROWS,
                  nr = w->rows - r0 < MATMUL_ROWS ? w->rows - r0 : MATMUL_ROWS;
    float *zmax = j->m->zmax + (int64_t)worker * EKV_MODEL_BLOCK;
    for (int64_t t = 0; t < j->T; t++)
        zmax[t] = -INFINITY; /* the kernel's running maxima: unused here */
    const ekv_cpu_kernels *kern = ekv_cpu_kernels_for(j->m->ctx->isa);
    /* y[t][r0 + i] = <x[t], w[r0 + i]>: the score kernel with weight rows as keys, tokens as
     * queries */
    kern->score((const char *)w->data + r0 * w->cols * ekv_dtype_size(w->dtype), w->cols, nr,
                w->dtype, w->cols, j->x, w->cols, (int)j->T, NULL, NULL, 0, j->y + r0, w->rows,
                zmax, NULL);
}

/* y[T][rows] = x[T][cols] . w^T. A decode step's products (T = 1) are too small to pay for
 * waking the pool's threads (measured: 3x slower decode with 2 threads than inline), so
 * small products run on the calling thread; the result is the same either way. */
static void matmul(ekv_model *m, const model_matrix *w, const float *x, int64_t T, float *y) {
    matmul_job j = {m, w, x, y, T};
    const int64_t tasks = (w->rows + MATMUL_ROWS - 1) / MATMUL_ROWS;
    if (T * w->rows * w->cols < ((int64_t)1 << 22))
        for (int64_t t = 0; t < tasks; t++) matmul_task(&j, t, 0);
    else
        ekv_pool_run(m->ctx->pool, tasks, matmul_task, &j);
}

static void rmsnorm(const float *x, const float *g, int64_t d, double eps, float *out) {
    double ss = 0;
    for (int64_t i = 0; i < d; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)d + eps));
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * g[i];
}

static void embed(const ekv_model *m, int32_t tok, float *x) {
    const model_matrix *e = &m->tok_emb;
    const int64_t d = e->cols;
    const char *row = (const char *)e->data + (int64_t)tok * d * ekv_dtype_size(e->dtype);
    for (int64_t i = 0; i < d; i++) x[i] = ekv_load_f32(row, e->dtype, i);
}

/* One block of T <= EKV_MODEL_BLOCK tokens through every layer. */
static ekv_status forward_block(ekv_model *m, const int32_t *tokens, int64_t T, float *logits) {
    const ekv_model_config *c = &m->cfg;
    const int64_t d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim, F = c->ffn_dim;
    for (int64_t t = 0; t < T; t++) embed(m, tokens[t], m->x + t * d);
    for (int32_t l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        for (int64_t t = 0; t < T; t++)
            rmsnorm(m->x + t * d, L->attn_norm, d, c->norm_eps, m->xn + t * d);
        matmul(m, &L->wq, m->xn, T, m->q);
        matmul(m, &L->wk, m->xn, T, m->k);
        matmul(m, &L->wv, m->xn, T, m->v);
        ekv_status s = ekv_model_attention(m, L, m->pos, T, m->q, m->k, m->v, m->att);
        if (s) return s;
        memcpy(L->last_q, m->q + (T - 1) * qd, sizeof(float) * (size_t)qd);
        matmul(m, &L->wo, m->att, T, m->proj);
        for (int64_t i = 0; i < T * d; i++) m->x[i] += m->proj[i];
        for (int64_t t = 0; t < T; t++)
            rmsnorm(m->x + t * d, L->ffn_norm, d, c->norm_eps, m->xn + t * d);
        matmul(m, &L->w1, m->xn, T, m->h1);
        matmul(m, &L->w3, m->xn, T, m->h3);
        for (int64_t i = 0; i < T * F; i++) {
            const float g = m->h1[i];
            m->h1[i] = g / (1.0f + expf(-g)) * m->h3[i]; /* silu(gate) * up */
        }
        matmul(m, &L->w2, m->h1, T, m->proj);
        for (int64_t i = 0; i < T * d; i++) m->x[i] += m->proj[i];
    }
    m->pos += T;
    if (logits) {
        for (int64_t t = 0; t < T; t++)
            rmsnorm(m->x + t * d, m->norm_w, d, c->norm_eps, m->xn + t * d);
        matmul(m, &m->out_w, m->xn, T, logits);
    }
    return EKV_OK;
}

/* n tokens after pos in a sequence: the count before the data it counts (tokens[] may be
 * shorter than n), then every token in [0, vocab). */
static ekv_status check_tokens(const ekv_model *m, const int32_t *tokens, int64_t n, int64_t pos) {
    if (!tokens) return ekv_fail(m->ctx, EKV_ERR_NULL_POINTER, "tokens is NULL");
    if (n < 1) return ekv_fail(m->ctx, EKV_ERR_INVALID_SIZE, "n=%lld must be >= 1", (long long)n);
    if (n > m->prm.max_tokens - pos)
        return ekv_fail(m->ctx, EKV_ERR_CACHE_FULL,
                        "%lld more tokens after %lld pass max_tokens=%lld", (long long)n,
                        (long long)pos, (long long)m->prm.max_tokens);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab)
            return ekv_fail(m->ctx, EKV_ERR_INVALID_ARGUMENT,
                            "tokens[%lld]=%d is outside [0, vocab=%d)", (long long)i, tokens[i],
                            m->cfg.vocab);
    return EKV_OK;
}

/* The logits a step returns (rows of vocab values; row r: sequence seqs[r], or seq for every
 * row, after the token at position pos[r], or pos0 + r): all finite, else EKV_ERR_NAN_INPUT
 * naming the first that is not. Weights pass the load's check when finite, yet huge ones can
 * overflow fp32 in the forward pass; sampling and a log-loss must never read an infinity or a
 * NaN. Both engines end here (the GPU's logits are copied back to the host). The tokens were
 * run: the model should be reset (ekv_model_step). */
static ekv_status check_logits(const ekv_model *m, const float *logits, int64_t rows,
                               const int32_t *seqs, int32_t seq, const int64_t *pos, int64_t pos0) {
    const int64_t V = m->cfg.vocab;
    for (int64_t i = 0; logits && i < rows * V; i++) {
        if (isfinite(logits[i])) continue;
        const int64_t r = i / V;
        return ekv_fail(m->ctx, EKV_ERR_NAN_INPUT,
                        "model: the logits after the token at position %lld of sequence %d are "
                        "not finite (logit %lld = %g): the weights overflow fp32 in the forward "
                        "pass (the tokens were run: reset the model)",
                        (long long)(pos ? pos[r] : pos0 + r), seqs ? seqs[r] : seq,
                        (long long)(i % V), (double)logits[i]);
    }
    return EKV_OK;
}

static ekv_status check_seq(const ekv_model *m, int32_t seq) {
    if (seq < 0 || seq >= m->prm.max_seqs)
        return ekv_fail(m->ctx, EKV_ERR_INVALID_ARGUMENT, "seq=%d is outside [0, max_seqs=%d)", seq,
                        m->prm.max_seqs);
    return EKV_OK;
}

int64_t ekv_model_seq_position(const ekv_model *m, int32_t seq) {
    if (!m || seq < 0 || seq >= m->prm.max_seqs) return -1;
    return m->gpu ? ekv_model_gpu_position(m->gpu, seq) : m->pos;
}

ekv_status ekv_model_seq_reset(ekv_model *m, int32_t seq) {
    if (!m) return EKV_ERR_NULL_POINTER;
    ekv_status s = check_seq(m, seq);
    if (s) return s;
    if (!m->gpu) return ekv_model_reset(m); /* one sequence */
    return ekv_model_gpu_seq_reset(m, seq);
}

ekv_status ekv_model_seq_truncate(ekv_model *m, int32_t seq, int64_t n_tokens) {
    if (!m) return EKV_ERR_NULL_POINTER;
    ekv_status s = check_seq(m, seq);
    if (s) return s;
    const int64_t pos = ekv_model_seq_position(m, seq);
    if (n_tokens < 0 || n_tokens > pos)
        return ekv_fail(m->ctx, EKV_ERR_INVALID_SIZE,
                        "n_tokens=%lld must be in [0, %lld] (the sequence's position)",
                        (long long)n_tokens, (long long)pos);
    if (m->gpu) return ekv_model_gpu_seq_truncate(m, seq, n_tokens);
    for (int32_t l = 0; l < m->cfg.n_layers; l++) /* fails only for want of a key row */
        if ((s = ekv_cache_truncate(m->layers[l].cache, m->layers[l].seq, n_tokens))) return s;
    m->pos = n_tokens;
    ekv_clear_error(m->ctx);
    return EKV_OK;
}

ekv_status ekv_model_seq_step(ekv_model *m, int32_t seq, const int32_t *tokens, int64_t n,
                              float *logits) {
    if (!m) return EKV_ERR_NULL_POINTER;
    ekv_status s = check_seq(m, seq);
    if (s) return s;
    if (seq == 0) return ekv_model_step(m, tokens, n, logits);
    const int64_t pos0 = ekv_model_seq_position(m, seq);
    if ((s = check_tokens(m, tokens, n, pos0))) return s;
    s = ekv_model_gpu_step(m, seq, tokens, n, logits); /* max_seqs > 1: the GPU's */
    return s ? s : check_logits(m, logits, n, NULL, seq, NULL, pos0);
}

ekv_status ekv_model_batch_step(ekv_model *m, const int32_t *seqs, int32_t n_seqs,
                                const int32_t *tokens, float *logits) {
    if (!m) return EKV_ERR_NULL_POINTER;
    if (!seqs || !tokens) return ekv_fail(m->ctx, EKV_ERR_NULL_POINTER, "seqs or tokens is NULL");
    if (n_seqs < 1 || n_seqs > m->prm.max_seqs)
        return ekv_fail(m->ctx, EKV_ERR_INVALID_SIZE, "n_seqs=%d must be in [1, max_seqs=%d]",
                        n_seqs, m->prm.max_seqs);
    int64_t pos[4096]; /* max_seqs <= 4096: each sequence's position before the step */
    for (int32_t b = 0; b < n_seqs; b++) {
        ekv_status s = check_seq(m, seqs[b]);
        for (int32_t c = 0; !s && c < b; c++)
            if (seqs[c] == seqs[b])
                s = ekv_fail(m->ctx, EKV_ERR_INVALID_ARGUMENT,
                             "seqs[%d] = seqs[%d] = %d: a sequence takes one token per step", c, b,
                             seqs[b]);
        if (!s) s = check_tokens(m, tokens + b, 1, pos[b] = ekv_model_seq_position(m, seqs[b]));
        if (s) return s;
    }
    if (!m->gpu) return ekv_model_step(m, tokens, 1, logits); /* the one sequence, seqs[0] = 0 */
    ekv_status s = ekv_model_gpu_batch_step(m, seqs, n_seqs, tokens, logits);
    return s ? s : check_logits(m, logits, n_seqs, seqs, 0, pos, 0);
}

ekv_status ekv_model_step(ekv_model *m, const int32_t *tokens, int64_t n, float *logits) {
    if (!m) return EKV_ERR_NULL_POINTER;
    const int64_t pos0 = m->pos;
    ekv_status s = check_tokens(m, tokens, n, pos0);
    if (s) return s;
    if (m->gpu) {
        s = ekv_model_gpu_step(m, 0, tokens, n, logits);
        return s ? s : check_logits(m, logits, n, NULL, 0, NULL, pos0);
    }
    s = ekv_ctx_enter(m->ctx); /* the layers run on the context's pool */
    if (s) return s;
    for (int64_t i = 0; i < n && !s; i += EKV_MODEL_BLOCK) {
        const int64_t T = n - i < EKV_MODEL_BLOCK ? n - i : EKV_MODEL_BLOCK;
        s = forward_block(m, tokens + i, T, logits ? logits + i * m->cfg.vocab : NULL);
    }
    ekv_ctx_leave(m->ctx);
    if (!s) s = check_logits(m, logits, n, NULL, 0, NULL, pos0);
    if (s) return s;
    ekv_clear_error(m->ctx);
    return EKV_OK;
}
