/*
 * The device cache's layout (docs/architecture.md, "The device cache"), host arithmetic
 * compiled in every build (layout.c): its params checked, the bytes of a pool and of the
 * statistics block, each array's offset in the block, and the views over a cache's memory.
 * cache.cu allocates or adopts the memory and takes its views from here; the CUDA plan checks
 * head_dim and the device with the same rules.
 */
#ifndef EKV_CUDA_CACHE_LAYOUT_H
#define EKV_CUDA_CACHE_LAYOUT_H
#include "entmaxkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arrays of the statistics block, in the order they are laid out. */
enum {
    EKV_CC_KMIN,
    EKV_CC_KMAX,
    EKV_CC_KMEAN,
    EKV_CC_KM2,
    EKV_CC_RADIUS,
    EKV_CC_COUNT,
    EKV_CC_KMIN16, /* compact ranges (range_dtype f16/bf16) */
    EKV_CC_KMAX16,
    EKV_CC_KMEAN16, /* the compact ball (compact_ball) */
    EKV_CC_RADIUS16,
    EKV_CC_SMIN, /* superpage boxes (superpage_pages > 0) */
    EKV_CC_SMAX,
    EKV_CC_CODES, /* key codes (code_bits 4 or 8) */
    EKV_CC_PARTS
};
/* Every array starts at a multiple of this many bytes from the block's start (a cudaMalloc'd
 * or torch block starts at one too). */
#define EKV_CC_ALIGN 256

typedef struct ekv_cuda_cache_layout {
    int64_t pool_bytes;        /* one pool, K or V */
    int64_t stats_bytes;       /* the statistics block */
    int64_t off[EKV_CC_PARTS]; /* each array's byte offset in the block, -1 when absent */
    int64_t num_superpages;
} ekv_cuda_cache_layout;

/* The CUDA backend's head dims: a multiple of 8 in [8, EKV_CUDA_MAX_DIM] (the plan's rule
 * too). */
ekv_status ekv_cuda_check_head_dim(ekv_context *ctx, int64_t head_dim);
/* cache.cu (CUDA builds): a device is there and `device` names one (the plan's rule too). */
ekv_status ekv_cuda_check_device(ekv_context *ctx, int32_t device);
/* params checked (a message on ctx, which may be NULL) and their layout. */
ekv_status ekv_cuda_cache_layout_of(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                    ekv_cuda_cache_layout *out);
/* The views of a cache whose pools are k, v and whose statistics block is stats. */
void ekv_cuda_cache_views(const ekv_cuda_cache_params *params, const ekv_cuda_cache_layout *lay,
                          void *k, void *v, void *stats, ekv_paged_kv *kv, ekv_page_stats *st);

#ifdef __cplusplus
}
#endif
#endif
