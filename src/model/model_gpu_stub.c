/* The model's GPU engine in a build without -DEKV_CUDA=ON: loading with backend cuda says so;
 * nothing else is reachable (m->gpu stays NULL). */
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "model_gpu.h"

ekv_status ekv_model_gpu_create(ekv_model *m) {
    return ekv_fail(m->ctx, EKV_ERR_UNSUPPORTED,
                    "model: backend cuda needs a build with CUDA (configure with -DEKV_CUDA=ON)");
}
void ekv_model_gpu_free(model_gpu *g) { (void)g; }
ekv_status ekv_model_gpu_step(ekv_model *m, int32_t seq, const int32_t *tokens, int64_t n,
                              float *logits) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_model_gpu_batch_step(ekv_model *m, const int32_t *seqs, int32_t n_seqs,
                                    const int32_t *tokens, float *logits) {
    return EKV_ERR_UNSUPPORTED;
}
int64_t ekv_model_gpu_position(const model_gpu *g, int32_t seq) { return -1; }
ekv_status ekv_model_gpu_reset(ekv_model *m) { return EKV_ERR_UNSUPPORTED; }
ekv_status ekv_model_gpu_seq_reset(ekv_model *m, int32_t seq) { return EKV_ERR_UNSUPPORTED; }
ekv_status ekv_model_gpu_seq_truncate(ekv_model *m, int32_t seq, int64_t n_tokens) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_model_gpu_last_query(const ekv_model *m, int32_t layer, float *q) {
    return EKV_ERR_UNSUPPORTED;
}
ekv_status ekv_model_gpu_layer_cache(const ekv_model *m, int32_t layer, const ekv_cache **cache,
                                     int32_t *seq) {
    return EKV_ERR_UNSUPPORTED;
}
