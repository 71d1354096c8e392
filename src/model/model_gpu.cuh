/*
 * The model engine on the GPU (docs/architecture.md, "The model on the GPU"): the device state
 * shared by its stages, one per file:
 *   model_gpu.cu            creation (weights, caches, plan, buffers), the forward pass, the
 *                           decode step's CUDA graph, the host mirrors for traces
 *   model_gpu_kernels.cu    embedding, RMSNorm, SwiGLU, the linear layers (cuBLAS), the page
 *                           table of a block's prefix views and the append items
 *   model_gpu_prefill.cu    dense prefill attention on tensor cores (docs/math.md §12): the
 *                           entry and the GEMM path (model_gpu_prefill.cuh: what both share)
 *   model_gpu_prefill_fused.cu  the fused dense prefill kernel (S and P stay on the chip)
 *   model_gpu_attention.cu  a block's attention through the decode stages (ekv_cuda_decode)
 */
#pragma once
extern "C" {
#include "model_gpu.h"
}
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "../cuda/common/plan.cuh" /* the plan (EKV_SLOW_*, ekv_cuda_count_slow_paths) */

/* The device copy of one layer: weights (fp32, into model_gpu.weights) and its KV cache. The
 * cache holds max_seqs sequences; logical page p of sequence s is physical page s*pages + p,
 * in the NHD layout, so the keys of KV head g of a sequence are one matrix [tokens][D] with
 * row stride Hk*D (what the prefill's GEMMs read) and still a paged cache to the decode
 * stages (ekv_paged_kv strides). */
struct gpu_layer {
    const float *attn_norm, *ffn_norm;
    const float *wq, *wk, *wv, *wo, *w1, *w2, *w3;
    void *k, *v;
    float *stats; /* kmin | kmax | kmean | km2 (pages*Hk*D each) | radius (pages*Hk) */
    int32_t *count;
    uint16_t *range16; /* kmin16 | kmax16, K's dtype (compact ranges), or NULL for f32 K */
    uint8_t *codes;    /* key codes (code_bits > 0), else NULL */
    ekv_paged_kv kv;
    ekv_page_stats st;
    float *last_q; /* [H*D] the last token's queries */
    /* the host mirror of ekv_model_layer_cache (built on demand) */
    ekv_cache *host;
    void *host_k, *host_v;
};

/* The fused prefill's counters per layer (pf_rows [n_layers][PF_COUNTERS]): rows retried, rows
 * solved by Newton passes, rows whose list was compacted inside round 0's sweep. */
enum { PF_RETRIED, PF_NEWTONED, PF_COMPACTED, PF_COUNTERS };

struct model_gpu {
    ekv_context *ctx;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    ekv_cuda_plan *plan;
    int32_t views; /* prefix views per decode-stage block: the plan's max_batch */
    int64_t block; /* rows of the activations: the most tokens of one block */
    int64_t pages; /* pages of one sequence (max_tokens) */
    int32_t max_seqs;
    int64_t *hpos;  /* [max_seqs] the host's copy of the positions */
    int32_t *bseqs; /* [views] the sequences of a batched step (device) */
    int32_t *vbase; /* [views] the first physical page of each view's sequence (device) */
    int64_t chunk;  /* query tokens of one dense prefill block */
    int32_t nparts; /* 16-bit parts of the prefill's fp32 GEMM inputs (docs/math.md §12) */
    float *weights, *vectors, *slopes;
    const float *tok_emb, *out_w, *norm_w;
    gpu_layer *layers;
    int32_t nlayers;
    int32_t *tokens; /* [block] */
    int64_t *pos;    /* [max_seqs] the positions on the device: graph replays read them */
    float *x, *xn, *q, *k, *v, *att, *h1, *h3, *logits;
    int64_t *indptr; /* the prefix views of a block: [views + 1] */
    int32_t *indices, *last_len;
    ekv_cuda_append_item *items; /* [block / page_size + 2] */
    /* dense prefill scratch (model_gpu_prefill.cu) */
    float *scores; /* [H * chunk][ld] z, then reused */
    void *pparts;  /* [nparts][H * chunk][ld] P in V's dtype */
    void *qparts;  /* [nparts][H * chunk][D] q' in K's dtype */
    float *qshift; /* [2][H * chunk]: 2^-s of each row's q' split, then 1 / sum p */
    float *obuf;   /* [H * chunk][D] */
    int32_t *bad;  /* set by the prefill when a row's scores are not finite */
    int64_t ld_cap;
    /* the fused dense prefill (model_gpu_prefill_fused.cu) instead of the GEMMs: its per-row
     * state over the H * chunk rows of a block */
    int fused;
    int32_t cand_cap;   /* candidates kept per row (prefill_candidates, docs/architecture.md) */
    int32_t compact_at; /* the fill that compacts a list in the sweep (prefill_compact) */
    float *pf_cand;    /* [H * chunk][cand_cap] */
    int64_t *pf_cidx;  /* [H * chunk][cand_cap] the candidates' key positions */
    int32_t *pf_count; /* [H * chunk] candidates found (may exceed cand_cap) */
    int32_t *pf_state; /* [H * chunk] where the row's tau stands (model_gpu_prefill_fused.cu) */
    float *pf_thr;     /* [H * chunk] the row's candidate threshold (a lower bound of tau) */
    float *pf_m;       /* [H * chunk] the row's max M */
    double *pf_tau;    /* [H * chunk] tau - M */
    unsigned long long *pf_rows; /* [n_layers][PF_COUNTERS] */
    int32_t *pf_wlist;  /* [2][H * chunk] the rows of a retry or Newton pass, per KV head     */
    int32_t *pf_wcount; /* [2][n_kv_heads] their counts                                      */
    /* the decode stages' slow paths over the blocks' views, per layer (EKV_SLOW_*,
     * docs/architecture.md, "The model on the GPU"): cumulative on the device, read after each
     * block into the layers' stats */
    unsigned long long *slow_paths; /* [n_layers][EKV_SLOW_PATHS] device */
    unsigned long long *slow_host;  /* [n_layers][EKV_SLOW_PATHS] this block's copy */
    unsigned long long *slow_seen;  /* [n_layers][EKV_SLOW_PATHS] those already in the stats */
    cudaGraphExec_t graph;
    int graph_ready;
    int32_t graph_seq; /* the sequence the captured step advances */
    int graph_warm;    /* a step ran eagerly since the last method change (model_gpu.cu) */
};

/* What one forward block runs: T tokens of sequence seq from its position pos0 (batch 0), or
 * one token of each of T sequences, g->bseqs on the device (batch 1). */
struct gpu_block {
    int32_t seq;
    int64_t pos0, T;
    int batch;
};

/* The number of items ekv_cuda_append gets for T tokens at pos0 (pages touched). */
static inline int32_t gpu_items(int64_t pos0, int64_t T, int64_t ps) {
    return (int32_t)((pos0 + T - 1) / ps - pos0 / ps + 1);
}

/* model_gpu_kernels.cu: launches on g->stream; the status of the launch. */
ekv_status gpu_embed(model_gpu *g, int64_t T, int64_t d);
ekv_status gpu_rmsnorm(model_gpu *g, const float *x, const float *w, float *out, int64_t T,
                       int64_t d, double eps);
ekv_status gpu_swiglu(model_gpu *g, float *h1, const float *h3, int64_t n);
/* y[T][rows] = x[T][cols] . W^T + beta * y (beta 0 or 1: a residual add), fp32 */
ekv_status gpu_linear(model_gpu *g, const float *W, int64_t rows, int64_t cols, const float *x,
                      int64_t T, float *y, float beta);
/* From the device positions: the append items of the block's tokens (n_items of them), and
 * with views the CSR of its T views (docs/architecture.md, "The model on the GPU"): the prefix
 * of each token of one sequence, or each batched sequence whole. */
ekv_status gpu_block_tables(model_gpu *g, const gpu_block *b, int64_t ps, int32_t n_items,
                            int views);
ekv_status gpu_advance(model_gpu *g, const gpu_block *b);
/* model_gpu_prefill.cu (one sequence) */
ekv_status gpu_prefill_attention(ekv_model *m, gpu_layer *L, const gpu_block *b);
/* model_gpu_prefill_fused.cu: whether the fused kernel serves this cache (f16/bf16 K and V,
 * head dims 64 and 128) */
bool gpu_prefill_fused_applies(ekv_dtype kv, int64_t head_dim);
/* model_gpu_attention.cu */
ekv_status gpu_views_attention(ekv_model *m, gpu_layer *L, const gpu_block *b);

#define GPU_TRY(g, call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((g)->ctx, EKV_ERR_DEVICE, "model (cuda): %s: %s", #call,               \
                            cudaGetErrorString(e_));                                               \
    } while (0)
#define GPU_LAUNCHED(g) GPU_TRY(g, cudaGetLastError())
#define BLAS_TRY(g, call)                                                                          \
    do {                                                                                           \
        cublasStatus_t b_ = (call);                                                                \
        if (b_ != CUBLAS_STATUS_SUCCESS)                                                           \
            return ekv_fail((g)->ctx, EKV_ERR_DEVICE, "model (cuda): %s: cuBLAS status %d", #call, \
                            (int)b_);                                                              \
    } while (0)
