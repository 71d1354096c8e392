/* The CUDA entry points of a build without -DEKV_CUDA=ON: each says so and changes nothing.
 * They take the real API's parameters and use few of them. */
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "../core/internal.h"
#include "plan/plan_defaults.h"

#define NO_CUDA(ctx)                                                                               \
    ekv_fail((ctx), EKV_ERR_UNSUPPORTED,                                                           \
             "this build has no CUDA backend (configure with -DEKV_CUDA=ON)")

ekv_cuda_plan_params ekv_cuda_plan_default_params(void) { return ekv_cuda_plan_defaults(); }
ekv_status ekv_cuda_device_count(ekv_context *ctx, int32_t *count) {
    if (!count) return EKV_ERR_NULL_POINTER;
    *count = 0;
    return EKV_OK;
}
ekv_status ekv_cuda_plan_create(ekv_context *ctx, const ekv_cuda_plan_params *params,
                                ekv_cuda_plan **out) {
    if (out) *out = NULL;
    if (!ctx) return EKV_ERR_NULL_POINTER;
    return NO_CUDA(ctx);
}
void ekv_cuda_plan_free(ekv_cuda_plan *plan) { (void)plan; }
int64_t ekv_cuda_plan_bytes(const ekv_cuda_plan *plan) { return 0; }
ekv_status ekv_cuda_decode(ekv_cuda_plan *plan, const ekv_decode_params *params,
                           const ekv_select_params *select, const ekv_paged_kv *kv,
                           const ekv_page_stats *stats, const ekv_page_table *table, const float *q,
                           float *out) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_decode_certified(ekv_cuda_plan *plan, const ekv_decode_params *params,
                                     const ekv_select_params *select, const ekv_paged_kv *kv,
                                     const ekv_page_stats *stats, const ekv_page_table *table,
                                     const float *q, float *out) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_read_report(ekv_cuda_plan *plan, int32_t batch, ekv_cuda_report *report) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_append(ekv_cuda_plan *plan, const ekv_paged_kv *kv, const ekv_page_stats *stats,
                           const ekv_cuda_append_item *items, int32_t n_items, const float *k_new,
                           const float *v_new) {
    return EKV_ERR_UNSUPPORTED;
}
/* The device cache: its layout (ekv_cuda_cache_default_params, ekv_cuda_cache_sizes) is host
 * arithmetic, in every build (cache/layout.c); the rest needs device memory. */
ekv_status ekv_cuda_cache_create(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                 ekv_cuda_cache **out) {
    if (out) *out = NULL;
    if (!ctx) return EKV_ERR_NULL_POINTER;
    return NO_CUDA(ctx);
}
ekv_status ekv_cuda_cache_adopt(ekv_context *ctx, const ekv_cuda_cache_params *params, void *k_pool,
                                void *v_pool, void *stats, ekv_cuda_cache **out) {
    return ekv_cuda_cache_create(ctx, params, out);
}
void ekv_cuda_cache_free(ekv_cuda_cache *cache) { (void)cache; }
ekv_status ekv_cuda_cache_view(const ekv_cuda_cache *cache, ekv_paged_kv *kv,
                               ekv_page_stats *stats) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_cache_append(ekv_cuda_plan *plan, ekv_cuda_cache *cache,
                                 const ekv_cuda_append_item *items, int32_t n_items,
                                 const float *k_new, const float *v_new) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_cache_truncate(ekv_cuda_plan *plan, ekv_cuda_cache *cache, const int32_t *pages,
                                   int64_t n_pages, int64_t length, int64_t n_tokens) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_cuda_sharded_params ekv_cuda_sharded_default_params(void) {
    return ekv_cuda_sharded_defaults();
}
ekv_status ekv_cuda_sharded_create(ekv_context *ctx, const ekv_cuda_sharded_params *params,
                                   ekv_cuda_sharded_plan **out) {
    if (out) *out = NULL;
    if (!ctx) return EKV_ERR_NULL_POINTER;
    return NO_CUDA(ctx);
}
void ekv_cuda_sharded_free(ekv_cuda_sharded_plan *plan) { (void)plan; }
ekv_cuda_plan *ekv_cuda_sharded_shard(ekv_cuda_sharded_plan *plan, int32_t shard) { return NULL; }
int32_t ekv_cuda_sharded_device(const ekv_cuda_sharded_plan *plan, int32_t shard) { return -1; }
ekv_status ekv_cuda_sharded_decode(ekv_cuda_sharded_plan *plan, const ekv_decode_params *params,
                                   const ekv_select_params *select, const ekv_paged_kv *kv,
                                   const ekv_page_stats *stats, const ekv_page_table *tables,
                                   const float *const *q, float *const *out) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_sharded_append(ekv_cuda_sharded_plan *plan, const ekv_paged_kv *kv,
                                   const ekv_page_stats *stats, const ekv_cuda_append_item *items,
                                   int32_t n_items, const float *k_new, const float *v_new) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_sharded_read_report(ekv_cuda_sharded_plan *plan, int32_t batch,
                                        ekv_cuda_report *report, ekv_cuda_sharded_report *sharded) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_cuda_flash_entmax_workspace(ekv_context *ctx, const ekv_flash_entmax_args *args,
                                           int64_t *forward_bytes, int64_t *backward_bytes) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    return NO_CUDA(ctx);
}
ekv_status ekv_cuda_flash_entmax_forward(ekv_context *ctx, const ekv_flash_entmax_args *args,
                                         void *workspace, int64_t workspace_bytes, void *stream) {
    return ekv_cuda_flash_entmax_workspace(ctx, args, NULL, NULL);
}
ekv_status ekv_cuda_flash_entmax_backward(ekv_context *ctx, const ekv_flash_entmax_args *args,
                                          const void *dout, void *dq, void *dk, void *dv,
                                          void *workspace, int64_t workspace_bytes, void *stream) {
    return ekv_cuda_flash_entmax_workspace(ctx, args, NULL, NULL);
}
