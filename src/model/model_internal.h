/* The model engine's internal layout, shared by model.c (weights, forward pass) and
 * model_attention.c (attention through the caches with the decode methods). */
#ifndef EKV_MODEL_INTERNAL_H
#define EKV_MODEL_INTERNAL_H
#include "../core/internal.h"

/* Tokens run through the layers together: a prefill block. */
enum { EKV_MODEL_BLOCK = 64 };

/* A weight matrix [rows][cols] (torch nn.Linear layout) or vector, in its file dtype. */
typedef struct {
    const void *data;
    ekv_dtype dtype;
    int64_t rows, cols;
} model_matrix;

typedef struct {
    float *attn_norm, *ffn_norm; /* [d_model], fp32 */
    model_matrix wq, wk, wv, wo, w1, w2, w3;
    ekv_cache *cache;
    int32_t seq;
    float *last_q; /* [n_heads * head_dim] of the last token run */
    ekv_model_stats stats;
} model_layer;

/* Scratch of one attention call over a block: the CSR of T prefix views of the sequence.
 * Grown on demand (the page lists live in the context, inside ekv_decode). */
typedef struct {
    int64_t *indptr;   /* [T + 1] */
    int32_t *indices;  /* prefix views: T * pages */
    int32_t *last_len; /* [T] */
    int64_t indices_cap;
    int32_t *full; /* the sequence's own page list */
    int64_t full_cap;
} attn_scratch;

struct ekv_model {
    ekv_context *ctx;
    ekv_model_config cfg;
    ekv_model_params prm;
    void *weights;  /* one aligned copy of every matrix */
    float *vectors; /* norm weights, fp32 */
    model_layer *layers;
    model_matrix tok_emb, out_w;
    float *norm_w;
    float *slopes; /* [n_heads] NAPE */
    int64_t pos;
    /* activations of one block [EKV_MODEL_BLOCK][...] */
    float *x, *xn, *q, *k, *v, *att, *h1, *h3, *proj;
    float *zmax; /* [threads][EKV_MODEL_BLOCK] scratch of the matmul kernel */
    attn_scratch as;
    struct model_gpu *gpu; /* the device engine (backend cuda, model_gpu.h), else NULL */
};

/* Attention of a block of T tokens at positions pos0.. at layer l: appends k, v [T][Hk][D]
 * to the layer's cache, then out[T][H][D] = attention of q[T][H][D] with the model's method,
 * each token over the prefix that ends at itself. */
/* The decode parameters of the model's attention (slopes may be NULL for checks). */
ekv_decode_params ekv_model_decode_params(const ekv_model_config *cfg, const float *slopes);
/* The select params of a method for a block whose shortest prefix view has view_len tokens:
 * topk reads a fraction of each view; certified sizes its round 1 by the shortest view. */
ekv_select_params ekv_model_select_params(ekv_select_method method, double budget,
                                          int64_t view_len);
/* Counts T attention steps at positions pos0.. in L's statistics: the steps and the K + V
 * bytes of the attended tokens (what reading everything costs), on every backend. */
void ekv_model_count_steps(const ekv_model *m, model_layer *L, int64_t pos0, int64_t T);
ekv_status ekv_model_attention(ekv_model *m, model_layer *L, int64_t pos0, int64_t T,
                               const float *q, const float *k, const float *v, float *out);
#endif
