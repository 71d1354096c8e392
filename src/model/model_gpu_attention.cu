/*
 * A block's attention on the GPU. A dense prefill block (one sequence, method dense) runs the
 * CUDA backend's prefill over the sequence's pages (src/cuda/prefill/, docs/math.md §12). Every
 * other block goes through the decode stages, as model_attention.c does it on the CPU: token t
 * of the block attends as the newest token of its prefix view (the pages up to its own
 * position, cut there; gpu_block_tables wrote the views from the device position), the T views
 * form one batch of ekv_cuda_decode with the model's method. A decode step is a batched step:
 * one view per sequence (ragged: each its own length; a single sequence's step is a batch of
 * one), which is what the CUDA graphs of model_gpu.cu replay.
 */
#include "model_gpu.cuh"
extern "C" {
#include "../core/method.h"
}

/* The select params of the block: the CPU's (ekv_model_select_params), except that a
 * certified decode step (T = 1, or a batch of sequences) sizes its round 1 by
 * budget_fraction, read against each sequence's length on the device: the same budget
 * (ekv_seq_budget_tokens of one view), and nothing the host must rewrite when a graph replays
 * the step. */
static ekv_select_params gpu_select(const ekv_model *m, const gpu_block *b) {
    ekv_select_params sp = ekv_model_select_params(m->prm.method, m->prm.budget, b->pos0 + 1);
    if (m->prm.method == EKV_SELECT_CERTIFIED && (b->T == 1 || b->batch))
        sp.budget_fraction = m->prm.budget;
    return sp;
}

ekv_status gpu_views_attention(ekv_model *m, gpu_layer *L, const gpu_block *b, const float *q) {
    model_gpu *g = m->gpu;
    if (b->T > g->views)
        return ekv_fail(m->ctx, EKV_ERR_INTERNAL, "model (cuda): %lld views > the plan's %d",
                        (long long)b->T, g->views);
    const ekv_decode_params dp = ekv_model_decode_params(&m->cfg, g->slopes);
    const ekv_select_params sp = gpu_select(m, b);
    const ekv_page_table tab = {(int32_t)b->T, g->indptr, g->indices, g->last_len};
    ekv_cuda_count_slow_paths(g->plan, g->slow_paths + EKV_SLOW_PATHS * (L - g->layers));
    const ekv_status s = ekv_cuda_decode(g->plan, &dp, &sp, &L->kv, &L->st, &tab, q, g->att);
    ekv_cuda_count_slow_paths(g->plan, NULL);
    return s;
}

ekv_status gpu_prefill_attention(ekv_model *m, gpu_layer *L, const gpu_block *b) {
    model_gpu *g = m->gpu;
    const ekv_model_config *c = &m->cfg;
    /* the sequence's keys: its first page's rows onward (model_gpu.cuh) */
    const int64_t kv_offset =
            (int64_t)b->seq * g->pages * L->kv.stride_page * ekv_dtype_size(L->kv.dtype);
    ekv_cuda_prefill_block pb = {}; /* causal, scale 1/sqrt(D) */
    pb.pos0 = b->pos0;
    pb.T = b->T;
    pb.H = c->n_heads;
    pb.Hk = c->n_kv_heads;
    pb.D = c->head_dim;
    pb.alpha = c->alpha;
    pb.dtype = L->kv.dtype;
    pb.k = (const char *)L->kv.k + kv_offset;
    pb.v = (const char *)L->kv.v + kv_offset;
    pb.q = g->q;
    pb.slopes = g->slopes;
    pb.att = g->att;
    /* the fused kernel's counters of this layer (allocated with the fused kernel's buffers) */
    pb.counters = g->pf.fused ? g->pf_rows + PF_COUNTERS * (int64_t)(L - g->layers) : NULL;
    return ekv_cuda_prefill_attention(&g->pf, &pb);
}
