/*
 * Dense prefill attention on the GPU (docs/math.md §12; docs/architecture.md, "The model on the
 * GPU"): the entry the model engine calls for a dense block, what it runs on and the scratch it
 * needs. prefill.cu holds the entry and the GEMM path (S and P in global memory, cuBLAS),
 * prefill_fused.cu the fused kernel (S and P never leave the chip; prefill_hist.cu its
 * histogram tau scheme, prefill_fused.cuh what its passes share), prefill_common.cuh what
 * both paths share. The public entry over device tensors (ekv_cuda_flash_entmax_*, include/entmaxkv/
 * cuda.h) runs the fused kernel through ekv_cuda_prefill_attention too (flash_entmax.cu).
 */
#pragma once
#include "entmaxkv.h"
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include "../common/launch.cuh"

/* The 16-bit parts of q' (and of P on the GEMM path) for K's dtype: 2 for f16 (after the shift),
 * 3 for bf16, none (1) for f32 (docs/math.md §12). */
static inline int32_t ekv_cuda_prefill_parts(ekv_dtype kv) {
    return kv == EKV_DTYPE_F16 ? 2 : kv == EKV_DTYPE_BF16 ? 3 : 1;
}
/* The fused kernel's defaults: candidates kept per row (the GEMM path's row kernel keeps as
 * many) and the fill that compacts a row's list inside the sweep (docs/math.md §12). */
enum { EKV_PREFILL_CANDIDATES = 4096, EKV_PREFILL_COMPACT_AT = 1024 };
/* How the fused kernel finds each row's tau (docs/math.md §12, §12.1): candidate lists of
 * z > running max - 1 with compaction and retries, or a histogram pass (row max and counts on
 * the grid floor(32 z)) whose count bound sizes an exact list per row (prefill_hist.cu); rows
 * whose list would exceed EKV_PREFILL_ROW_CAP (or row_cap) take the pool's room the others left,
 * else Newton passes. */
enum { EKV_PREFILL_TAU_CANDIDATES = 0, EKV_PREFILL_TAU_HIST = 1 };
enum { EKV_PREFILL_ROW_CAP = 1024 };
/* The list entries a row of the histogram scheme may take: row_cap, 0 = EKV_PREFILL_ROW_CAP. */
static inline int32_t ekv_prefill_row_cap(int32_t row_cap) {
    return row_cap ? row_cap : EKV_PREFILL_ROW_CAP;
}

/* The fused kernel's geometry, which sizes the histogram scheme's tile marks (docs/math.md
 * §12.1, "Tile marks"): blocks of EKV_PREFILL_MARK_ROWS query rows (of one KV head) sweep tiles
 * of EKV_PREFILL_MARK_KEYS keys; a block's marks are a bit a tile, in 32-bit words. */
enum { EKV_PREFILL_MARK_ROWS = 64, EKV_PREFILL_MARK_KEYS = 64 };
/* The key tiles of `keys` keys, the words of one block's marks for them, and the row blocks of
 * `rows` rows (the fused kernel's grid). */
__host__ __device__ static inline int64_t ekv_prefill_tiles(int64_t keys) {
    return (keys + EKV_PREFILL_MARK_KEYS - 1) / EKV_PREFILL_MARK_KEYS;
}
static inline int64_t ekv_prefill_mark_words(int64_t keys) {
    return (ekv_prefill_tiles(keys) + 31) / 32;
}
__host__ __device__ static inline int64_t ekv_prefill_row_blocks(int64_t rows) {
    return (rows + EKV_PREFILL_MARK_ROWS - 1) / EKV_PREFILL_MARK_ROWS;
}

/* The prefill's per-row elementwise kernels (split_queries_kernel, the flash entry's
 * finish_kernel): a warp a row, EKV_PREFILL_WARP_ROWS rows a block of 32 x that many threads (a
 * 64-thread block a row was bound by its launches: 0.12 ms for the 131K rows of a 32K pass,
 * bench/RESULTS.md). The blocks for `rows` rows, and in the kernel the warp's row (>= rows past
 * the last: the warp returns). */
enum { EKV_PREFILL_WARP_ROWS = 8 };
static inline unsigned ekv_prefill_warp_row_blocks(int64_t rows) {
    return (unsigned)((rows + EKV_PREFILL_WARP_ROWS - 1) / EKV_PREFILL_WARP_ROWS);
}
__device__ __forceinline__ int64_t ekv_prefill_warp_row() {
    return (int64_t)blockIdx.x * EKV_PREFILL_WARP_ROWS + (threadIdx.x >> 5);
}

/* The fused kernel's counters of one block (ekv_cuda_prefill_block.counters): rows retried,
 * rows solved by Newton passes, rows whose list was compacted inside round 0's sweep, (row
 * block, key tile) pairs the histogram scheme's P2 skipped (unmarked: docs/math.md §12.1) and
 * that its P1 never swept (past ALiBi's reach, §12.1). */
enum { PF_RETRIED, PF_NEWTONED, PF_COMPACTED, PF_SKIPPED_TILES, PF_UNREACHED_TILES, PF_COUNTERS };

/* What dense prefill runs on: the stream and cuBLAS handle, the sizes its scratch was laid out
 * for and the device scratch: one block laid out by ekv_cuda_prefill_layout_of, which its caller
 * sizes and allocates (the model engine, src/model/model_gpu.cu) or carves from its workspace
 * (flash_entmax.cu). */
struct ekv_cuda_prefill {
    ekv_context *ctx;
    cudaStream_t stream;
    cublasHandle_t blas;
    int64_t chunk;  /* query tokens of one block at most */
    int32_t nparts; /* 16-bit parts of the fp32 GEMM inputs (docs/math.md §12) */
    void *qparts;   /* [nparts][H * chunk][D] q' in K's dtype */
    float *qshift;  /* [2][H * chunk]: 2^-s of each row's q' split, then 1 / sum p */
    int32_t *bad;   /* set when a row's scores are not finite */
    /* the GEMM path */
    int64_t ld_cap; /* keys per score row at most, a multiple of 16 */
    float *scores;  /* [H * chunk][ld] z, then reused */
    void *pparts;   /* [nparts][H * chunk][ld] P in V's dtype */
    float *obuf;    /* [H * chunk][D] */
    /* the fused kernel instead of the GEMMs (prefill_fused.cu): its per-row state over the
     * H * chunk rows of a block */
    int fused;
    int32_t cand_cap;   /* candidates kept per row (prefill_candidates, docs/architecture.md) */
    int32_t compact_at; /* the fill that compacts a list in the sweep (prefill_compact) */
    float *cand;        /* [H * chunk][cand_cap] */
    int64_t *cidx;      /* [H * chunk][cand_cap] the candidates' key positions */
    int32_t *count;     /* [H * chunk] candidates found (may exceed cand_cap) */
    int32_t *state;     /* [H * chunk] where the row's tau stands (prefill_fused.cu) */
    float *thr;         /* [H * chunk] the row's candidate threshold (a lower bound of tau) */
    float *m;           /* [H * chunk] the row's max M */
    double *tau;        /* [H * chunk] tau - M */
    int32_t *wlist;     /* [2][H * chunk] the rows of a retry or Newton pass, per KV head */
    int32_t *wcount;    /* [2][n_kv_heads] their counts */
    /* the histogram scheme (EKV_PREFILL_TAU_HIST): the pool is cand / cidx (H * chunk *
     * cand_cap entries), a row's slice starts at off[row] */
    int tau_scheme;  /* EKV_PREFILL_TAU_* */
    int32_t row_cap; /* a list's entries sure of room (0: EKV_PREFILL_ROW_CAP; capped by
                        cand_cap); longer lists take the room left (prefill_hist.cu, route) */
    int64_t *off;    /* [H * chunk] */
    unsigned long long *pool_used; /* [1] the pool's entries handed out (the route's cursor) */
    /* the keys a block sees at most (the model's max_tokens, the flash op's keys): sizes the
     * tile marks, [Hk][row blocks of G * chunk rows][ekv_prefill_mark_words(key_cap)]; 0, or a
     * block with more keys: no marks, P2 sweeps every tile */
    int64_t key_cap;
    uint32_t *marks;
    /* the histogram scheme's ALiBi reach (docs/math.md §12.1): a bound on |k| of each KV head
     * over the block's keys, and on the unbiased part of each row's z */
    float *kbound; /* [n_kv_heads] */
    float *qbound; /* [H * chunk] */
};

/* Consecutive 256-byte-aligned pieces of one device block (offsets from its start): the prefill
 * scratch's layout and the flash entry's workspace (flash_entmax.cuh) carve alike. */
struct ws_carver {
    int64_t at = 0;
    int64_t take(int64_t bytes) {
        const int64_t o = at;
        at += (bytes + 255) / 256 * 256;
        return o;
    }
};

/* Where each buffer of an ekv_cuda_prefill lies in its one block of scratch (byte offsets; -1:
 * a buffer the path does not use) and the block's bytes. */
struct ekv_cuda_prefill_layout {
    int64_t qparts, qshift, bad;  /* both paths */
    int64_t scores, pparts, obuf; /* the GEMM path */
    /* the fused kernel */
    int64_t cand, cidx, count, state, thr, m, tau, off, wlist, wcount, pool_used, marks, kbound,
            qbound;
    int64_t total;
};
/* The layout of the scratch that pf's sizes (chunk, nparts, fused; cand_cap when fused, ld_cap
 * when not) call for, with H query heads, Hk KV heads of head dim D and K's dtype kv
 * (prefill_layout.cu). */
ekv_cuda_prefill_layout ekv_cuda_prefill_layout_of(const ekv_cuda_prefill *pf, int64_t H,
                                                   int64_t Hk, int64_t D, ekv_dtype kv);
/* pf's buffers pointed into the block at base (256-byte aligned, L->total bytes). */
void ekv_cuda_prefill_place(ekv_cuda_prefill *pf, const ekv_cuda_prefill_layout *L, void *base);

/* One dense block: T query tokens of one sequence at positions pos0.., each attending its
 * causal prefix (docs/math.md §12), or every key (noncausal_keys, docs/math.md §13.1). Zero
 * in scale and noncausal_keys is the model engine's block. */
struct ekv_cuda_prefill_block {
    int64_t pos0, T;
    int64_t H, Hk, D; /* query heads, KV heads, head dim */
    double alpha;     /* 1 = softmax (the fused kernel only), else entmax */
    float scale;      /* of the scores; 0 = 1/sqrt(D) */
    /* 0: causal; else every row sees the keys [0, noncausal_keys) (the fused kernel only), and
     * its ALiBi bias is -m_h |j - i| on both sides */
    int64_t noncausal_keys;
    ekv_dtype dtype;     /* K's and V's */
    const void *k, *v;   /* key and value 0 of KV head 0 of the sequence, tokens Hk * D apart */
    const void *q;       /* [T][H][D] of q_dtype; pos0 may be negative when noncausal_keys < T */
    ekv_dtype q_dtype;   /* f32 (zero: the model engine's), f16 or bf16 (the flash op's) */
    /* 1: q_dtype is K's: every q value is exact there, so the scores take q as one part and
     * a * scale after the product (docs/math.md §12) */
    int q_in_kv_dtype;
    const float *slopes; /* [H] ALiBi slopes (device), or NULL */
    float *att;          /* [T][H][D] the output */
    /* [T][H][D] o-hat = sum w v / sum w, w = p^(2 - alpha) on the support (docs/math.md §13.3:
     * the flash backward's delta), or NULL (the model engine); the fused kernel only */
    float *ohat;
    unsigned long long *counters; /* [PF_COUNTERS] the fused kernel adds to (device) */
};

/* The attention of one dense block on pf->stream: q' split into parts, then the fused kernel
 * (pf->fused) or the GEMM path. A block larger than the scratch is EKV_ERR_INTERNAL. */
ekv_status ekv_cuda_prefill_attention(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b);
/* Whether the fused kernel serves this cache (f16/bf16 K and V, head dims 64 and 128). */
bool ekv_cuda_prefill_fused_applies(ekv_dtype kv, int64_t head_dim);

/* The checks of a CUDA or cuBLAS call by the model engine and its prefill, on (g)->ctx (messages
 * "model (cuda): ..."). */
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
