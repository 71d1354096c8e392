/* The model engine on the GPU (backend cuda, docs/architecture.md "The model on the GPU"):
 * what model.c calls. Built from model_gpu*.cu with -DEKV_CUDA=ON; model_gpu_stub.c
 * otherwise, where creation says the build has no CUDA and the rest is never reached. */
#ifndef EKV_MODEL_GPU_H
#define EKV_MODEL_GPU_H
#include "model_internal.h"

#ifdef __cplusplus
extern "C" {
#endif
typedef struct model_gpu model_gpu;

/* Uploads the weights of m (loaded and checked on the host) and allocates the device caches,
 * the decode plan and the activations; sets m->gpu. */
ekv_status ekv_model_gpu_create(ekv_model *m);
void ekv_model_gpu_free(model_gpu *g);
/* ekv_model_seq_step on the device: tokens and logits are host arrays (checked by the caller). */
ekv_status ekv_model_gpu_step(ekv_model *m, int32_t seq, const int32_t *tokens, int64_t n,
                              float *logits);
/* ekv_model_batch_step on the device (seqs distinct and in range, checked by the caller). */
ekv_status ekv_model_gpu_batch_step(ekv_model *m, const int32_t *seqs, int32_t n_seqs,
                                    const int32_t *tokens, float *logits);
int64_t ekv_model_gpu_position(const model_gpu *g, int32_t seq);
/* Empties every sequence (position 0), or one. */
ekv_status ekv_model_gpu_reset(ekv_model *m);
ekv_status ekv_model_gpu_seq_reset(ekv_model *m, int32_t seq);
/* n_tokens already checked against the position */
ekv_status ekv_model_gpu_seq_truncate(ekv_model *m, int32_t seq, int64_t n_tokens);
ekv_status ekv_model_gpu_last_query(const ekv_model *m, int32_t layer, float *q);
ekv_status ekv_model_gpu_layer_cache(const ekv_model *m, int32_t layer, const ekv_cache **cache,
                                     int32_t *seq);
#ifdef __cplusplus
}
#endif
#endif
