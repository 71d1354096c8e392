/*
 * The model engine on the GPU (docs/architecture.md, "The model on the GPU"): the device state
 * shared by its stages, one per file:
 *   model_gpu.cu            creation (weights, caches, plan, buffers), the forward pass, the
 *                           decode step's CUDA graph, the host mirrors for traces
 *   model_gpu_kernels.cu    embedding, RMSNorm, SwiGLU, the linear layers (cuBLAS), the page
 *                           table of a block's prefix views and the append items
 *   model_gpu_attention.cu  a block's attention: a dense prefill block by the CUDA backend's
 *                           prefill (src/cuda/prefill/, docs/math.md §12), the rest through
 *                           the decode stages (ekv_cuda_decode)
 */
#pragma once
extern "C" {
#include "model_gpu.h"
}
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "../cuda/common/plan.cuh" /* the plan (EKV_SLOW_*, ekv_cuda_count_slow_paths) */
#include "../cuda/prefill/prefill.cuh" /* dense prefill; GPU_TRY, GPU_LAUNCHED, BLAS_TRY */

/* The device copy of one layer: weights (fp32, into model_gpu.weights) and its KV cache. The
 * cache holds max_seqs sequences; logical page p of sequence s is physical page s*pages + p,
 * in the NHD layout, so the keys of KV head g of a sequence are one matrix [tokens][D] with
 * row stride Hk*D (what the prefill's GEMMs read) and still a paged cache to the decode
 * stages (ekv_paged_kv strides). */
struct gpu_layer {
    const float *attn_norm, *ffn_norm;
    const float *wq, *wk, *wv, *wo, *w1, *w2, *w3;
    ekv_cuda_cache *cache; /* K/V pools, statistics, key codes (src/cuda/cache/) */
    ekv_paged_kv kv;       /* its views, taken once */
    ekv_page_stats st;
    float *last_q; /* [H*D] the last token's queries */
    /* the host mirror of ekv_model_layer_cache (built on demand) */
    ekv_cache *host;
    void *host_k, *host_v;
};

/* A decode step captured as a CUDA graph, keyed by everything its launches take from the host:
 * the step's sequences B (grids, rows, the decode stages' splits: ekv_cuda_step_splits) and the
 * method and budget (which stages, their select params). The sequences themselves, their tokens
 * and positions are device inputs (bseqs, tokens, pos), so one graph serves any B sequences at
 * any lengths. At most GPU_GRAPHS, the least recently used dropped. */
enum { GPU_GRAPHS = 8 };
struct gpu_graph {
    int32_t batch; /* the key; 0: a free entry */
    ekv_select_method method;
    double budget;
    int warm;             /* the key's step ran eagerly once: its kernels are loaded */
    cudaGraphExec_t exec; /* captured at the key's second step; NULL before */
    uint64_t used;        /* model_gpu.graph_clock at its last step */
};

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
    float *weights, *vectors, *slopes;
    const float *tok_emb, *out_w, *norm_w;
    gpu_layer *layers;
    int32_t nlayers;
    int32_t *tokens; /* [block] */
    int64_t *pos;    /* [max_seqs] the positions on the device: graph replays read them */
    float *x, *xn, *q, *k, *v, *att, *logits;
    float *h13, *h; /* [block][2F] gate | up per token; [block][F] swiglu of them */
    int64_t *indptr; /* the prefix views of a block: [views + 1] */
    int32_t *indices, *last_len;
    ekv_cuda_append_item *items; /* [block / page_size + 2] */
    /* dense prefill: its stream and handle (the model's), sizes and scratch (size_prefill), its
     * buffers in the one block pf_scratch (ekv_cuda_prefill_layout_of) */
    ekv_cuda_prefill pf;
    void *pf_scratch;
    unsigned long long *pf_rows; /* [n_layers][PF_COUNTERS] the fused prefill's counters */
    /* the decode stages' slow paths over the blocks' views, per layer (EKV_SLOW_*,
     * docs/architecture.md, "The model on the GPU"): cumulative on the device, read after each
     * block into the layers' stats */
    unsigned long long *slow_paths; /* [n_layers][EKV_SLOW_PATHS] device */
    unsigned long long *slow_host;  /* [n_layers][EKV_SLOW_PATHS] this block's copy */
    unsigned long long *slow_seen;  /* [n_layers][EKV_SLOW_PATHS] those already in the stats */
    gpu_graph graphs[GPU_GRAPHS];   /* the captured decode steps (model_gpu.cu, graph_step) */
    uint64_t graph_clock;           /* decode steps through the cache: its recency */
};

/* Where the model's own kernels go: its stream, overlapped as the plan's launches are
 * (ekv_model_params.overlap_launches, common/overlap.cuh). */
static inline ekv_launch_stream gpu_on(const model_gpu *g) {
    return ekv_launch_stream{g->stream, g->plan ? g->plan->p.overlap_launches : 0};
}

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
/* A linear layer's input: x itself, RMSNorm(x) with weight norm_w, or the SwiGLU of x's rows
 * [gate | up] (2 cols per token): model.c's steps before its matmuls. */
typedef enum { GPU_LIN_X, GPU_LIN_RMSNORM, GPU_LIN_SWIGLU } gpu_lin_kind;
typedef struct {
    const float *x;
    gpu_lin_kind kind;
    const float *norm_w; /* GPU_LIN_RMSNORM: [cols] */
    double eps;
} gpu_lin_in;
/* y[T][rows] = in[T][cols] . W^T + beta * y (beta 0 or 1: a residual add), fp32 */
ekv_status gpu_linear(model_gpu *g, const float *W, int64_t rows, int64_t cols,
                      const gpu_lin_in *in, int64_t T, float *y, float beta);
/* The same over W's rows in up to GPU_LIN_PARTS consecutive parts, part p (rows end[p - 1] to
 * end[p], from 0; end[last] = W's rows, an unused part empty) into its own y[p] [T][its rows]:
 * q, k and v from [wq; wk; wv] in one launch for a decode step's tokens. */
enum { GPU_LIN_PARTS = 3 };
typedef struct {
    float *y[GPU_LIN_PARTS];
    int64_t end[GPU_LIN_PARTS];
} gpu_lin_out;
ekv_status gpu_linear_parts(model_gpu *g, const float *W, int64_t cols, const gpu_lin_in *in,
                            int64_t T, const gpu_lin_out *out, float beta);
/* From the device positions: the append items of the block's tokens (n_items of them), and
 * with views the CSR of its T views (docs/architecture.md, "The model on the GPU"): the prefix
 * of each token of one sequence, or each batched sequence whole. */
ekv_status gpu_block_tables(model_gpu *g, const gpu_block *b, int64_t ps, int32_t n_items,
                            int views);
ekv_status gpu_advance(model_gpu *g, const gpu_block *b);
/* model_gpu_attention.cu: a dense prefill block (one sequence), or the block's prefix views */
ekv_status gpu_prefill_attention(ekv_model *m, gpu_layer *L, const gpu_block *b);
ekv_status gpu_views_attention(ekv_model *m, gpu_layer *L, const gpu_block *b, const float *q);
