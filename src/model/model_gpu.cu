/*
 * The model engine on the GPU (docs/architecture.md, "The model on the GPU"): the weights
 * (checked and loaded on the host by model.c) uploaded once as fp32, one device KV cache per
 * layer, one decode plan shared by the layers, and the forward pass of model.c with every
 * stage on the device:
 *   h   = x + Wo . Attn(RMSNorm(x))          attention: model_gpu_attention.cu, a dense block
 *   out = h + W2 . SwiGLU(W1, W3; RMSNorm(h))           by src/cuda/prefill/, the rest by the
 *                                                       decode stages
 * A decode step (one token of each of B sequences; a single sequence's step is a batch of one)
 * is captured as a CUDA graph per key (B, method, budget: model_gpu.cuh, gpu_graph) and
 * replayed: everything it reads (sequences, tokens, positions, page tables) lives in device
 * memory, nothing is allocated and the host waits only for the logits after the step.
 */
#include "model_gpu.cuh"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ekv_status dev_alloc(model_gpu *g, void *pp, int64_t bytes, const char *what) {
    void **p = (void **)pp;
    cudaError_t e = cudaMalloc(p, (size_t)(bytes > 0 ? bytes : 16));
    if (e != cudaSuccess) {
        *p = NULL;
        cudaGetLastError();
        return ekv_fail(g->ctx, EKV_ERR_OUT_OF_MEMORY,
                        "model (cuda): cannot allocate %.3f GiB of device memory for %s: %s",
                        (double)bytes / (double)(1 << 30), what, cudaGetErrorString(e));
    }
    return EKV_OK;
}

/* Every matrix in fp32 (the file's F16/BF16/F32 values converted exactly), in one buffer, a
 * layer's in the order wq, wk, wv, wo, w1, w3, w2: the rows of wq, wk, wv (and of w1, w3) are
 * then one matrix, so one GEMM gives a token's q | k | v (and gate | up; layer_forward). */
static ekv_status upload_weights(ekv_model *m, model_gpu *g) {
    const ekv_model_config *c = &m->cfg;
    const int64_t per = 7, nmat = per * c->n_layers + 2;
    const model_matrix **mats = (const model_matrix **)calloc((size_t)nmat, sizeof *mats);
    if (!mats) return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    mats[0] = &m->tok_emb;
    mats[1] = &m->out_w;
    for (int32_t l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        /* q, k, v consecutive and w1, w3 consecutive: one GEMM each (layer_forward) */
        const model_matrix *lm[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w1, &L->w3, &L->w2};
        for (int k = 0; k < per; k++) mats[2 + per * l + k] = lm[k];
    }
    int64_t total = 0;
    for (int64_t i = 0; i < nmat; i++) total += mats[i]->rows * mats[i]->cols;
    float *host = (float *)malloc(sizeof(float) * (size_t)total);
    ekv_status s = host ? dev_alloc(g, &g->weights, total * 4, "the weights")
                        : ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    const float **dev = (const float **)calloc((size_t)nmat, sizeof *dev);
    if (!s && !dev) s = ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    int64_t off = 0;
    for (int64_t i = 0; i < nmat && !s; i++) {
        const int64_t n = mats[i]->rows * mats[i]->cols;
        for (int64_t e = 0; e < n; e++)
            host[off + e] = ekv_load_f32(mats[i]->data, mats[i]->dtype, e);
        dev[i] = g->weights + off;
        off += n;
    }
    if (!s && cudaMemcpy(g->weights, host, sizeof(float) * (size_t)total, cudaMemcpyHostToDevice) !=
                      cudaSuccess)
        s = ekv_fail(m->ctx, EKV_ERR_DEVICE, "model (cuda): uploading the weights failed");
    if (!s) {
        g->tok_emb = dev[0];
        g->out_w = c->tied_embeddings ? dev[0] : dev[1];
        for (int32_t l = 0; l < c->n_layers; l++) {
            gpu_layer *G = &g->layers[l];
            const float **w[7] = {&G->wq, &G->wk, &G->wv, &G->wo, &G->w1, &G->w3, &G->w2};
            for (int k = 0; k < per; k++) *w[k] = dev[2 + per * l + k];
            const int64_t d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim,
                          kvd = (int64_t)c->n_kv_heads * c->head_dim;
            if (G->wk != G->wq + qd * d || G->wv != G->wk + kvd * d ||
                G->w3 != G->w1 + c->ffn_dim * d)
                s = ekv_fail(m->ctx, EKV_ERR_INTERNAL,
                             "model (cuda): layer %d's q, k, v (or w1, w3) rows are not one matrix",
                             (int)l);
        }
    }
    free(dev);
    free(host);
    free(mats);
    return s;
}

/* The norms and the NAPE slopes, as model.c holds them (fp32). */
static ekv_status upload_vectors(ekv_model *m, model_gpu *g) {
    const ekv_model_config *c = &m->cfg;
    const int64_t nv = (2 * (int64_t)c->n_layers + 1) * c->d_model;
    ekv_status s = dev_alloc(g, &g->vectors, nv * 4, "the norms");
    if (!s) s = dev_alloc(g, &g->slopes, (int64_t)c->n_heads * 4, "the slopes");
    if (s) return s;
    GPU_TRY(g, cudaMemcpy(g->vectors, m->vectors, (size_t)nv * 4, cudaMemcpyHostToDevice));
    GPU_TRY(g, cudaMemcpy(g->slopes, m->slopes, (size_t)c->n_heads * 4, cudaMemcpyHostToDevice));
    for (int32_t l = 0; l < c->n_layers; l++) {
        g->layers[l].attn_norm = g->vectors + (m->layers[l].attn_norm - m->vectors);
        g->layers[l].ffn_norm = g->vectors + (m->layers[l].ffn_norm - m->vectors);
    }
    g->norm_w = g->vectors + (m->norm_w - m->vectors);
    return EKV_OK;
}

/* One layer's device cache (ekv_cuda_cache): K/V pools in NHD (model_gpu.cuh), statistics
 * with the CPU cache's compact ranges but the fp32 ball, key codes when the model has
 * code_bits, superpage boxes when it has superpage_pages (certified's round 0, which then also
 * picks its round 1: docs/math.md §9.3; every append rebuilds the boxes it touches). */
static ekv_status alloc_layer_cache(ekv_model *m, model_gpu *g, gpu_layer *L) {
    const ekv_model_config *c = &m->cfg;
    ekv_cuda_cache_params cp = ekv_cuda_cache_default_params();
    cp.device = m->prm.device;
    cp.num_pages = g->pages * g->max_seqs;
    cp.page_size = m->prm.page_size;
    cp.num_kv_heads = c->n_kv_heads;
    cp.head_dim = c->head_dim;
    cp.dtype = m->prm.kv_dtype;
    cp.layout = EKV_LAYOUT_NHD;
    cp.range_dtype = ekv_cache_compact_ranges(cp.dtype);
    cp.compact_ball = 0;
    cp.code_bits = m->prm.code_bits;
    cp.superpage_pages = m->prm.superpage_pages;
    ekv_status s = ekv_cuda_cache_create(m->ctx, &cp, &L->cache);
    if (!s) s = ekv_cuda_cache_view(L->cache, &L->kv, &L->st);
    if (!s) s = dev_alloc(g, &L->last_q, (int64_t)c->n_heads * c->head_dim * 4, "the queries");
    return s;
}

/* The candidates a row of the model's histogram scheme may list by default: its pool holds as
 * many a row, so the flat heads' long lists take the room the short rows leave; a row that finds
 * none is solved by Newton passes (a sweep of its prefix for each of its solver's steps). The 1M
 * prefill (H200, bench/RESULTS.md "2026-12-07 (twelfth session)"): 8192 a row 82.68 s (425065
 * rows by Newton passes), 16384 65.30 s (73610), 32768 53.01 s (none), the same text; at 512K
 * 17.64 / 13.66 / 13.69 s; at 128K no row needs the room (1.10 / 1.13 s at 8192 / 32768). The
 * pool is 12 bytes an entry: 9.7 GB at 6 heads x 4096 tokens a block. */
enum { MODEL_HIST_CANDIDATES = 32768 };
static_assert(MODEL_HIST_CANDIDATES <= EKV_MODEL_MAX_PREFILL_CANDIDATES,
              "the default is a value prefill_candidates may take");
/* The share of the device's free memory the default's prefill scratch may take: the decode plan
 * and the activations are allocated after it. */
static const double MODEL_HIST_FREE_SHARE = 0.25;

/* The histogram scheme's default candidates a row: MODEL_HIST_CANDIDATES, at most the keys a row
 * has (ld_cap: a short context's model holds no pool for keys it never sees), halved while the
 * prefill's scratch (its layout's total, so the sizes stay written once) would take more than
 * MODEL_HIST_FREE_SHARE of the device's free memory (a model of many heads has as many more
 * rows), but not below the candidate scheme's EKV_PREFILL_CANDIDATES. pf's other sizes are set. */
static ekv_status hist_default_candidates(ekv_model *m, model_gpu *g, int64_t *cap) {
    const ekv_model_config *c = &m->cfg;
    size_t fr = 0, tot = 0;
    GPU_TRY(g, cudaMemGetInfo(&fr, &tot));
    ekv_cuda_prefill probe = g->pf;
    int64_t k =
            g->pf.ld_cap < MODEL_HIST_CANDIDATES ? g->pf.ld_cap : (int64_t)MODEL_HIST_CANDIDATES;
    while (k > EKV_PREFILL_CANDIDATES) {
        probe.cand_cap = (int32_t)k; /* the layout's sizes read cand_cap, not row_cap */
        const ekv_cuda_prefill_layout L = ekv_cuda_prefill_layout_of(
                &probe, c->n_heads, c->n_kv_heads, c->head_dim, m->prm.kv_dtype);
        if ((double)L.total <= MODEL_HIST_FREE_SHARE * (double)fr) break;
        k = k / 2 > EKV_PREFILL_CANDIDATES ? k / 2 : (int64_t)EKV_PREFILL_CANDIDATES;
    }
    *cap = k;
    return EKV_OK;
}

/* The fused kernel's knobs and its counters per layer (PF_COUNTERS). The candidates kept per
 * row: the params' prefill_candidates (a test's way to make rows overflow, or a benchmark's), else
 * for the histogram scheme hist_default_candidates, and 4096 for the candidate scheme (the GEMM
 * path's row kernel keeps as many). The fill at which a row's list is compacted
 * inside the sweep (capped by the candidates kept at launch): the params' prefill_compact (a
 * benchmark's knob), else 1024. Each compaction solves tau over that many values in one warp while
 * its other rows wait, so a small fill is cheap; a head whose support outgrows it settles and fills
 * the whole list. Both checked at load. */
static ekv_status set_up_fused(ekv_model *m, model_gpu *g) {
    ekv_cuda_prefill *pf = &g->pf;
    pf->key_cap = m->prm.max_tokens; /* the tile marks' room: every block's keys */
    pf->compact_at = m->prm.prefill_compact ? m->prm.prefill_compact : EKV_PREFILL_COMPACT_AT;
    int64_t cap = m->prm.prefill_candidates;
    ekv_status s = EKV_OK;
    if (!cap && pf->tau_scheme == EKV_PREFILL_TAU_HIST)
        s = hist_default_candidates(m, g, &cap);
    else if (!cap)
        cap = EKV_PREFILL_CANDIDATES;
    pf->cand_cap = (int32_t)cap;
    pf->row_cap = pf->cand_cap; /* the histogram scheme's lists may fill the pool's share of a
                                   row: the flat heads' lists of thousands take them, not sweeps */
    const int64_t nc = PF_COUNTERS * (int64_t)m->cfg.n_layers;
    if (!s) s = dev_alloc(g, &g->pf_rows, nc * 8, "the prefill counters");
    if (!s) GPU_TRY(g, cudaMemset(g->pf_rows, 0, (size_t)nc * 8));
    return s;
}

/* The prefill's scratch for blocks of pf->chunk tokens: one device block laid out by the
 * prefill (ekv_cuda_prefill_layout_of, which the flash entry's workspace shares), its flag of
 * non-finite scores zeroed. */
static ekv_status alloc_prefill(ekv_model *m, model_gpu *g) {
    const ekv_model_config *c = &m->cfg;
    ekv_cuda_prefill *pf = &g->pf;
    const ekv_cuda_prefill_layout L =
            ekv_cuda_prefill_layout_of(pf, c->n_heads, c->n_kv_heads, c->head_dim, m->prm.kv_dtype);
    char what[160];
    snprintf(what, sizeof what,
             "the prefill scratch (%s, blocks of %lld tokens x %d heads: a smaller prefill_chunk "
             "takes less)",
             pf->fused ? "fused kernel" : "GEMM path", (long long)pf->chunk, c->n_heads);
    ekv_status s = dev_alloc(g, &g->pf_scratch, L.total, what);
    if (s) return s;
    ekv_cuda_prefill_place(pf, &L, g->pf_scratch);
    GPU_TRY(g, cudaMemset(pf->bad, 0, 4));
    return EKV_OK;
}

/* Query tokens per dense prefill block: the caller's; or for the fused kernel up to 4096
 * (nothing of size keys per row: its buffers are cand_cap per row); or for the GEMMs as many
 * as leave the score and P buffers ([H * chunk][keys], 4 + nparts * es bytes an entry) within
 * 60% of the free memory (at most 64 GiB), up to 4096; multiples of 16. */
static ekv_status size_prefill(ekv_model *m, model_gpu *g) {
    const ekv_model_config *c = &m->cfg;
    ekv_cuda_prefill *pf = &g->pf;
    pf->ctx = g->ctx;
    pf->stream = g->stream;
    pf->blas = g->blas;
    const int64_t es = ekv_dtype_size(m->prm.kv_dtype), bpe = 4 + pf->nparts * es;
    pf->ld_cap = (m->prm.max_tokens + 15) / 16 * 16;
    int64_t chunk = m->prm.prefill_chunk;
    if (!chunk && pf->fused) chunk = 4096;
    if (!chunk) {
        size_t fr = 0, tot = 0;
        GPU_TRY(g, cudaMemGetInfo(&fr, &tot));
        double budget = 0.6 * (double)fr;
        if (budget > 64.0 * (1 << 30)) budget = 64.0 * (1 << 30);
        chunk = (int64_t)(budget / ((double)c->n_heads * (double)pf->ld_cap * (double)bpe));
        if (chunk > 4096) chunk = 4096;
        if (chunk >= 16) chunk -= chunk % 16;
        if (chunk < 1)
            return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY,
                            "model (cuda): %.1f GiB free cannot hold one prefill row over %lld "
                            "tokens (give a smaller max_tokens)",
                            (double)fr / (1 << 30), (long long)m->prm.max_tokens);
    }
    if (chunk > pf->ld_cap) chunk = pf->ld_cap;
    pf->chunk = chunk;
    ekv_status s = pf->fused ? set_up_fused(m, g) : EKV_OK;
    return s ? s : alloc_prefill(m, g);
}

/* The device memory the decode stages' score rows of every view take at most (the views are as
 * many as fit, up to EKV_MODEL_BLOCK). */
static const int64_t VIEW_SCORE_BYTES = (int64_t)4 << 30;

/* The decode plan (views per block: up to 64, fewer when its score rows would pass
 * VIEW_SCORE_BYTES, but every sequence in one batched step) and the activations of a block. */
static ekv_status alloc_state(ekv_model *m, model_gpu *g) {
    const ekv_model_config *c = &m->cfg;
    ekv_cuda_plan_params pp = ekv_cuda_plan_default_params();
    const int64_t per_view = (int64_t)c->n_heads * g->pages * m->prm.page_size * 4;
    int64_t views = VIEW_SCORE_BYTES / per_view;
    views = views < 1 ? 1 : views > (int64_t)EKV_MODEL_BLOCK ? (int64_t)EKV_MODEL_BLOCK : views;
    pp.max_batch = (int32_t)(views > g->max_seqs ? views : g->max_seqs);
    pp.device = m->prm.device;
    pp.stream = g->stream;
    pp.num_heads = c->n_heads;
    pp.num_kv_heads = c->n_kv_heads;
    pp.head_dim = c->head_dim;
    pp.page_size = m->prm.page_size;
    pp.max_pages_per_seq = g->pages;
    /* the params' decode_candidates (a test's way to make the decode stages' tau lists
     * overflow), else 0: the plan's default */
    pp.max_candidates = m->prm.decode_candidates;
    pp.fused_attend = m->prm.fused_attend;
    pp.tau_cluster = m->prm.tau_cluster;
    pp.overlap_launches = m->prm.overlap_launches; /* also the model's own kernels' */
    /* the screen's lists as much room as the views' scores: whole lists (no retry pass) up to
     * about 870K tokens of context with 64 views of 6 heads */
    pp.screen_list_bytes = VIEW_SCORE_BYTES;
    ekv_status s = ekv_cuda_plan_create(m->ctx, &pp, &g->plan);
    if (s) return s;
    g->views = pp.max_batch;
    g->block = g->pf.chunk > g->views ? g->pf.chunk : g->views;
    const int64_t B = g->block, d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim, F = c->ffn_dim;
    const int64_t items = B / m->prm.page_size + 2 > g->views ? B / m->prm.page_size + 2 : g->views;
    struct {
        void *p;
        int64_t bytes;
    } t[] = {{&g->x, B * d * 4},
             {&g->xn, B * d * 4},
             {&g->q, B * qd * 4},
             {&g->k, B * kvd * 4},
             {&g->v, B * kvd * 4},
             {&g->att, B * qd * 4},
             {&g->h13, B * 2 * F * 4},
             {&g->h, B * F * 4},
             {&g->logits, B * c->vocab * 4},
             {&g->tokens, B * 4},
             {&g->pos, 8 * g->max_seqs},
             {&g->slow_paths, 8 * EKV_SLOW_PATHS * (int64_t)c->n_layers},
             {&g->bseqs, g->views * 4},
             {&g->vbase, g->views * 4},
             {&g->indptr, (g->views + 1) * 8},
             {&g->last_len, g->views * 4},
             {&g->indices, g->views * g->pages * 4},
             {&g->items, items * (int64_t)sizeof(ekv_cuda_append_item)}};
    for (size_t i = 0; i < sizeof t / sizeof t[0] && !s; i++)
        s = dev_alloc(g, t[i].p, t[i].bytes, "the activations");
    if (s) return s;
    GPU_TRY(g, cudaMemset(g->pos, 0, 8 * (size_t)g->max_seqs));
    GPU_TRY(g, cudaMemset(g->slow_paths, 0, 8 * EKV_SLOW_PATHS * (size_t)c->n_layers));
    g->slow_host = (unsigned long long *)calloc(EKV_SLOW_PATHS * (size_t)c->n_layers, 8);
    g->slow_seen = (unsigned long long *)calloc(EKV_SLOW_PATHS * (size_t)c->n_layers, 8);
    if (!g->slow_host || !g->slow_seen)
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model (cuda): out of memory");
    return EKV_OK;
}

static void free_host_mirror(gpu_layer *L) {
    ekv_cache_free(L->host);
    free(L->host_k);
    free(L->host_v);
    L->host = NULL;
    L->host_k = L->host_v = NULL;
}

extern "C" void ekv_model_gpu_free(model_gpu *g) {
    if (!g) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    for (int i = 0; i < GPU_GRAPHS; i++)
        if (g->graphs[i].exec) cudaGraphExecDestroy(g->graphs[i].exec);
    if (g->layers)
        for (int32_t l = 0; l < g->nlayers; l++) {
            gpu_layer *L = &g->layers[l];
            ekv_cuda_cache_free(L->cache);
            cudaFree(L->last_q);
            free_host_mirror(L);
        }
    free(g->layers);
    /* g->pf's buffers all lie in pf_scratch (alloc_prefill) */
    void *bufs[] = {g->weights, g->vectors, g->slopes, g->tokens,     g->pos,      g->x,
                    g->xn,      g->q,       g->k,      g->v,          g->att,      g->h13,
                    g->h,       g->logits,  g->indptr, g->indices,    g->last_len, g->items,
                    g->blas_ws, g->bseqs,   g->vbase,  g->pf_scratch, g->pf_rows,  g->slow_paths};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    ekv_cuda_plan_free(g->plan);
    free(g->slow_host);
    free(g->slow_seen);
    free(g->hpos);
    if (g->blas) cublasDestroy(g->blas);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

/* The stream, cuBLAS on it with a fixed workspace (so that a captured step allocates nothing). */
static ekv_status open_device(ekv_model *m, model_gpu *g) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return ekv_fail(m->ctx, EKV_ERR_UNSUPPORTED, "model: backend cuda: no CUDA device");
    }
    if (m->prm.device < 0 || m->prm.device >= n)
        return ekv_fail(m->ctx, EKV_ERR_INVALID_ARGUMENT,
                        "model: device=%d: only %d CUDA device(s)", m->prm.device, n);
    GPU_TRY(g, cudaSetDevice(m->prm.device));
    /* blocking: ordered after the legacy-stream uploads and memsets of the weights and caches
     * (docs/architecture.md, "Streams") */
    GPU_TRY(g, cudaStreamCreate(&g->stream));
    BLAS_TRY(g, cublasCreate(&g->blas));
    BLAS_TRY(g, cublasSetStream(g->blas, g->stream));
    const int64_t ws = (int64_t)32 << 20;
    ekv_status s = dev_alloc(g, &g->blas_ws, ws, "the cuBLAS workspace");
    if (s) return s;
    BLAS_TRY(g, cublasSetWorkspace(g->blas, g->blas_ws, (size_t)ws));
    return EKV_OK;
}

extern "C" ekv_status ekv_model_gpu_create(ekv_model *m) {
    const ekv_model_config *c = &m->cfg;
    model_gpu *g = (model_gpu *)calloc(1, sizeof *g);
    if (!g) return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    g->ctx = m->ctx;
    g->nlayers = c->n_layers;
    g->max_seqs = m->prm.max_seqs;
    g->layers = (gpu_layer *)calloc((size_t)c->n_layers, sizeof *g->layers);
    g->hpos = (int64_t *)calloc((size_t)g->max_seqs, sizeof *g->hpos);
    g->pages = (m->prm.max_tokens + m->prm.page_size - 1) / m->prm.page_size;
    g->pf.nparts = ekv_cuda_prefill_parts(m->prm.kv_dtype);
    const bool fits = ekv_cuda_prefill_fused_applies(m->prm.kv_dtype, c->head_dim);
    g->pf.fused = m->prm.prefill_kernel != EKV_PREFILL_GEMM && fits;
    /* auto: the histogram scheme (faster at 128K and 256K: bench/RESULTS.md, 2026-12-05) */
    g->pf.tau_scheme = m->prm.prefill_kernel == EKV_PREFILL_FUSED ? EKV_PREFILL_TAU_CANDIDATES
                                                                  : EKV_PREFILL_TAU_HIST;
    ekv_status s = g->layers && g->hpos
                           ? open_device(m, g)
                           : ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    if (!s && (m->prm.prefill_kernel == EKV_PREFILL_FUSED ||
               m->prm.prefill_kernel == EKV_PREFILL_FUSED_HIST) && !fits)
        s = ekv_fail(m->ctx, EKV_ERR_UNSUPPORTED,
                     "model (cuda): prefill_kernel fused or hist needs an f16 or bf16 cache and head_dim "
                     "64 or 128 (kv_dtype %s, head_dim %d): use auto or gemm",
                     ekv_dtype_name(m->prm.kv_dtype), c->head_dim);
    if (!s) s = upload_weights(m, g);
    if (!s) s = upload_vectors(m, g);
    for (int32_t l = 0; l < c->n_layers && !s; l++) s = alloc_layer_cache(m, g, &g->layers[l]);
    if (!s) s = size_prefill(m, g);
    if (!s) s = alloc_state(m, g);
    /* cudaMemset runs on the legacy stream, which the model's non-blocking stream does not
     * wait for: the zeroed counts and positions must be there before the first step */
    if (!s && cudaDeviceSynchronize() != cudaSuccess)
        s = ekv_fail(m->ctx, EKV_ERR_DEVICE, "model (cuda): %s",
                     cudaGetErrorString(cudaGetLastError()));
    if (s) {
        ekv_model_gpu_free(g);
        return s;
    }
    m->gpu = g;
    return EKV_OK;
}

/* ---------------------------------------------------------------------------------- */
/* Forward pass                                                                         */
/* ---------------------------------------------------------------------------------- */
#define TRY(x)                                                                                     \
    do {                                                                                           \
        ekv_status s_ = (x);                                                                       \
        if (s_) return s_;                                                                         \
    } while (0)

/* Layer l over the block's T tokens (x in place): model.c's forward_block on the device. */
static ekv_status layer_forward(ekv_model *m, int32_t l, const gpu_block *b, int views,
                                int32_t n_items) {
    const ekv_model_config *c = &m->cfg;
    model_gpu *g = m->gpu;
    gpu_layer *L = &g->layers[l];
    const int64_t d = c->d_model, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim, F = c->ffn_dim, T = b->T;
    const gpu_lin_in attn_in = {g->x, GPU_LIN_RMSNORM, L->attn_norm, c->norm_eps};
    float *q = g->q, *k = g->k, *v = g->v;
    /* [wq; wk; wv] is one matrix (upload_weights): one launch for a decode step's tokens, q, k
     * and v each contiguous over the tokens, as the stages read them */
    const gpu_lin_out qkv = {{q, k, v}, {qd, qd + kvd, qd + 2 * kvd}};
    TRY(gpu_linear_parts(g, L->wq, d, &attn_in, T, &qkv, 0.f));
    TRY(ekv_cuda_cache_append(g->plan, L->cache, g->items, n_items, k, v));
    TRY(views ? gpu_views_attention(m, L, b, q) : gpu_prefill_attention(m, L, b));
    GPU_TRY(g, cudaMemcpyAsync(L->last_q, q + (T - 1) * qd, (size_t)qd * 4,
                               cudaMemcpyDeviceToDevice, g->stream));
    const gpu_lin_in att = {g->att, GPU_LIN_X, NULL, 0};
    const gpu_lin_in ffn_in = {g->x, GPU_LIN_RMSNORM, L->ffn_norm, c->norm_eps};
    const gpu_lin_in gate_up = {g->h13, GPU_LIN_SWIGLU, NULL, 0};
    TRY(gpu_linear(g, L->wo, d, qd, &att, T, g->x, 1.f));          /* x += Wo . att */
    TRY(gpu_linear(g, L->w1, 2 * F, d, &ffn_in, T, g->h13, 0.f)); /* [w1; w3]: gate | up */
    return gpu_linear(g, L->w2, d, F, &gate_up, T, g->x, 1.f);    /* x += W2 . swiglu */
}

/* Whether a block is a dense prefill block (src/cuda/prefill/) rather than prefix views
 * through the decode stages (model_gpu_attention.cu). */
static int dense_prefill(const ekv_model *m, const gpu_block *b) {
    return !b->batch && b->T > 1 && m->prm.method == EKV_SELECT_DENSE;
}

/* One block (g->tokens) at the device positions, which it advances; the logits of every
 * token into g->logits. Host values used: b->pos0 (the host's copy of the position) only in a
 * block of one sequence (a batched step's is 0), so a captured batched step stays valid as the
 * positions move and for any sequences in g->bseqs (model_gpu_attention.cu). */
static ekv_status forward_block(ekv_model *m, const gpu_block *b) {
    const ekv_model_config *c = &m->cfg;
    model_gpu *g = m->gpu;
    const int64_t T = b->T;
    const int views = !dense_prefill(m, b);
    const int32_t n_items = b->batch ? (int32_t)T : gpu_items(b->pos0, T, m->prm.page_size);
    TRY(gpu_block_tables(g, b, m->prm.page_size, n_items, views));
    TRY(gpu_embed(g, T, c->d_model));
    for (int32_t l = 0; l < c->n_layers; l++) TRY(layer_forward(m, l, b, views, n_items));
    TRY(gpu_advance(g, b));
    const gpu_lin_in out_in = {g->x, GPU_LIN_RMSNORM, g->norm_w, c->norm_eps};
    return gpu_linear(g, g->out_w, c->vocab, c->d_model, &out_in, T, g->logits, 0.f);
}

/* The cache entry of a decode step of B sequences with the model's method: its own, else a free
 * one or the least recently used, whose graph is destroyed (after the stream's work: a replay
 * of it may still run) and which is keyed anew. */
static gpu_graph *graph_entry(ekv_model *m, int32_t B) {
    model_gpu *g = m->gpu;
    gpu_graph *e = &g->graphs[0];
    for (int i = 0; i < GPU_GRAPHS; i++) {
        gpu_graph *c = &g->graphs[i];
        if (c->batch == B && c->method == m->prm.method && c->budget == m->prm.budget) {
            c->used = ++g->graph_clock;
            return c;
        }
        if (c->used < e->used) e = c; /* a free entry's is 0 */
    }
    if (e->exec) {
        cudaStreamSynchronize(g->stream);
        cudaGraphExecDestroy(e->exec);
    }
    *e = gpu_graph{B, m->prm.method, m->prm.budget, 0, NULL, ++g->graph_clock};
    return e;
}

/* A batched decode step (b->batch) as the replay of its key's graph (*replayed = 1), captured
 * at the key's second step. The first runs eagerly, so that every kernel and cuBLAS's choices
 * for these shapes are loaded before a capture, which must not load modules. */
static ekv_status graph_step(ekv_model *m, const gpu_block *b, int *replayed) {
    model_gpu *g = m->gpu;
    gpu_graph *e = graph_entry(m, (int32_t)b->T);
    if (!e->warm) {
        e->warm = 1;
        return forward_block(m, b);
    }
    if (!e->exec) {
        cudaGraph_t graph;
        GPU_TRY(g, cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
        ekv_status s = forward_block(m, b);
        cudaError_t err = cudaStreamEndCapture(g->stream, &graph);
        if (s) {
            if (err == cudaSuccess) cudaGraphDestroy(graph);
            return s;
        }
        GPU_TRY(g, err);
        err = cudaGraphInstantiate(&e->exec, graph, 0);
        cudaGraphDestroy(graph);
        if (err != cudaSuccess) e->exec = NULL;
        GPU_TRY(g, err);
    }
    GPU_TRY(g, cudaGraphLaunch(e->exec, g->stream));
    *replayed = 1;
    return EKV_OK;
}

/* The kernel of a dense prefill block into each layer's stats, and the fused kernel's counters
 * (PF_COUNTERS: rows retried, solved by Newton passes, compacted, tiles skipped and unreached;
 * then zeroed). */
static ekv_status count_prefill(ekv_model *m, const gpu_block *b) {
    model_gpu *g = m->gpu;
    const int32_t nl = m->cfg.n_layers;
    unsigned long long rows[PF_COUNTERS * 64];
    for (int32_t l0 = 0; l0 < nl && g->pf.fused; l0 += 64) {
        const int32_t n = nl - l0 < 64 ? nl - l0 : 64;
        const size_t bytes = (size_t)n * PF_COUNTERS * sizeof rows[0];
        unsigned long long *dev = g->pf_rows + PF_COUNTERS * (int64_t)l0;
        GPU_TRY(g, cudaMemcpy(rows, dev, bytes, cudaMemcpyDeviceToHost));
        GPU_TRY(g, cudaMemset(dev, 0, bytes));
        for (int32_t l = 0; l < n; l++) {
            const unsigned long long *c = rows + PF_COUNTERS * l;
            ekv_model_stats *st = &m->layers[l0 + l].stats;
            st->prefill_retry_rows += (int64_t)c[PF_RETRIED];
            st->prefill_newton_rows += (int64_t)c[PF_NEWTONED];
            st->prefill_compacted_rows += (int64_t)c[PF_COMPACTED];
            st->prefill_tiles_skipped += (int64_t)c[PF_SKIPPED_TILES];
            st->prefill_tiles_unreached += (int64_t)c[PF_UNREACHED_TILES];
        }
    }
    for (int32_t l = 0; l < nl; l++)
        *(g->pf.fused ? &m->layers[l].stats.prefill_fused : &m->layers[l].stats.prefill_gemm) +=
                b->T;
    return EKV_OK;
}

/* The decode stages' slow paths of the block (run_block copied the counters) into each layer's
 * stats: what each counter gained since the last block. */
static void count_slow_paths(ekv_model *m) {
    model_gpu *g = m->gpu;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        unsigned long long *now = g->slow_host + EKV_SLOW_PATHS * l,
                           *seen = g->slow_seen + EKV_SLOW_PATHS * l;
        int64_t d[EKV_SLOW_PATHS];
        for (int k = 0; k < EKV_SLOW_PATHS; k++) {
            d[k] = (int64_t)(now[k] - seen[k]);
            seen[k] = now[k];
        }
        ekv_model_stats *st = &m->layers[l].stats;
        st->tau_compacted_rows += d[EKV_SLOW_TAU_COMPACTED];
        st->tau_whole_rows += d[EKV_SLOW_TAU_WHOLE_ROW];
        st->screen_retry_rows += d[EKV_SLOW_SCREEN_RETRIED];
        st->screen_all_rows += d[EKV_SLOW_SCREEN_ALL];
    }
}

/* One block: its tokens to the device, the forward pass (a replayed graph for a decode step),
 * the logits back; the host waits here only. */
static ekv_status run_block(ekv_model *m, const gpu_block *b, const int32_t *tokens,
                            float *logits) {
    model_gpu *g = m->gpu;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) free_host_mirror(&g->layers[l]);
    GPU_TRY(g, cudaMemcpyAsync(g->tokens, tokens, (size_t)b->T * 4, cudaMemcpyHostToDevice,
                               g->stream));
    int replayed = 0;
    TRY(b->batch && m->prm.cuda_graphs ? graph_step(m, b, &replayed) : forward_block(m, b));
    int32_t bad = 0;
    if (logits)
        GPU_TRY(g, cudaMemcpyAsync(logits, g->logits, (size_t)(b->T * m->cfg.vocab) * 4,
                                   cudaMemcpyDeviceToHost, g->stream));
    GPU_TRY(g, cudaMemcpyAsync(&bad, g->pf.bad, 4, cudaMemcpyDeviceToHost, g->stream));
    if (!dense_prefill(m, b))
        GPU_TRY(g, cudaMemcpyAsync(g->slow_host, g->slow_paths,
                                   8 * EKV_SLOW_PATHS * (size_t)m->cfg.n_layers,
                                   cudaMemcpyDeviceToHost, g->stream));
    GPU_TRY(g, cudaStreamSynchronize(g->stream));
    if (dense_prefill(m, b))
        TRY(count_prefill(m, b));
    else
        count_slow_paths(m);
    for (int32_t l = 0; l < m->cfg.n_layers && replayed; l++)
        m->layers[l].stats.graph_steps += b->T;
    if (bad)
        return ekv_fail(m->ctx, EKV_ERR_NAN_INPUT,
                        "model (cuda): attention scores overflowed (not finite) in the prefill "
                        "at positions %lld..%lld",
                        (long long)b->pos0, (long long)(b->pos0 + b->T - 1));
    return EKV_OK;
}

extern "C" ekv_status ekv_model_gpu_step(ekv_model *m, int32_t seq, const int32_t *tokens,
                                         int64_t n, float *logits) {
    if (n == 1) return ekv_model_gpu_batch_step(m, &seq, 1, tokens, logits); /* its graph's */
    model_gpu *g = m->gpu;
    const int64_t V = m->cfg.vocab;
    const int64_t most = m->prm.method == EKV_SELECT_DENSE ? g->pf.chunk : g->views;
    for (int64_t i = 0; i < n; i += most) {
        const gpu_block b = {seq, g->hpos[seq], n - i < most ? n - i : most, 0};
        TRY(run_block(m, &b, tokens + i, logits ? logits + i * V : NULL));
        for (int32_t l = 0; l < m->cfg.n_layers; l++)
            ekv_model_count_steps(m, &m->layers[l], b.pos0, b.T);
        g->hpos[seq] += b.T;
        m->pos = g->hpos[0];
    }
    ekv_clear_error(m->ctx);
    return EKV_OK;
}

extern "C" ekv_status ekv_model_gpu_batch_step(ekv_model *m, const int32_t *seqs, int32_t n_seqs,
                                               const int32_t *tokens, float *logits) {
    model_gpu *g = m->gpu;
    if (n_seqs > g->views)
        return ekv_fail(m->ctx, EKV_ERR_INVALID_SIZE,
                        "n_seqs=%d: a batched step takes at most %d sequences", n_seqs, g->views);
    GPU_TRY(g,
            cudaMemcpyAsync(g->bseqs, seqs, (size_t)n_seqs * 4, cudaMemcpyHostToDevice, g->stream));
    const gpu_block b = {0, 0, n_seqs, 1};
    TRY(run_block(m, &b, tokens, logits));
    for (int32_t k = 0; k < n_seqs; k++) {
        for (int32_t l = 0; l < m->cfg.n_layers; l++)
            ekv_model_count_steps(m, &m->layers[l], g->hpos[seqs[k]], 1);
        g->hpos[seqs[k]] += 1;
    }
    m->pos = g->hpos[0];
    ekv_clear_error(m->ctx);
    return EKV_OK;
}

extern "C" int64_t ekv_model_gpu_position(const model_gpu *g, int32_t seq) { return g->hpos[seq]; }

/* ---------------------------------------------------------------------------------- */
/* Reset, method changes, host copies                                                  */
/* ---------------------------------------------------------------------------------- */
extern "C" ekv_status ekv_model_gpu_reset(ekv_model *m) {
    model_gpu *g = m->gpu;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) free_host_mirror(&g->layers[l]);
    /* the first append of a new sequence rebuilds each page's statistics from slot 0 */
    GPU_TRY(g, cudaMemsetAsync(g->pos, 0, 8 * (size_t)g->max_seqs, g->stream));
    GPU_TRY(g, cudaMemsetAsync(g->pf.bad, 0, 4, g->stream));
    GPU_TRY(g, cudaStreamSynchronize(g->stream));
    memset(g->hpos, 0, sizeof(int64_t) * (size_t)g->max_seqs);
    return EKV_OK;
}

extern "C" ekv_status ekv_model_gpu_seq_reset(ekv_model *m, int32_t seq) {
    model_gpu *g = m->gpu;
    if (seq == 0)
        for (int32_t l = 0; l < m->cfg.n_layers; l++) free_host_mirror(&g->layers[l]);
    GPU_TRY(g, cudaMemsetAsync(g->pos + seq, 0, 8, g->stream));
    GPU_TRY(g, cudaStreamSynchronize(g->stream));
    g->hpos[seq] = 0;
    m->pos = g->hpos[0];
    return EKV_OK;
}

/* The next step appends at n_tokens: the append rebuilds that page's statistics and codes from
 * its first slots (ekv_cuda_cache_append), and the page tables come from pos, so nothing past
 * n_tokens is read again. A superpage box keeps the keys past n_tokens (their pages' counts stay
 * positive, so a rebuild takes them too): a box over more keys still bounds the live ones, so
 * certified stays exact, only looser. */
extern "C" ekv_status ekv_model_gpu_seq_truncate(ekv_model *m, int32_t seq, int64_t n_tokens) {
    model_gpu *g = m->gpu;
    if (seq == 0)
        for (int32_t l = 0; l < m->cfg.n_layers; l++) free_host_mirror(&g->layers[l]);
    GPU_TRY(g, cudaMemcpyAsync(g->pos + seq, &n_tokens, 8, cudaMemcpyHostToDevice, g->stream));
    GPU_TRY(g, cudaStreamSynchronize(g->stream)); /* n_tokens is on this stack */
    g->hpos[seq] = n_tokens;
    m->pos = g->hpos[0];
    ekv_clear_error(m->ctx);
    return EKV_OK;
}

extern "C" ekv_status ekv_model_gpu_last_query(const ekv_model *m, int32_t layer, float *q) {
    model_gpu *g = m->gpu;
    GPU_TRY(g, cudaStreamSynchronize(g->stream));
    GPU_TRY(g, cudaMemcpy(q, g->layers[layer].last_q,
                          sizeof(float) * (size_t)m->cfg.n_heads * (size_t)m->cfg.head_dim,
                          cudaMemcpyDeviceToHost));
    return EKV_OK;
}

/* A host cache over copies of the layer's used pages (NHD in the caller's memory, adopted:
 * its summaries and codes rebuilt from the keys as appends build them). */
extern "C" ekv_status ekv_model_gpu_layer_cache(const ekv_model *m, int32_t layer,
                                                const ekv_cache **cache, int32_t *seq) {
    model_gpu *g = m->gpu;
    gpu_layer *L = &g->layers[layer];
    free_host_mirror(L);
    const int64_t ps = m->prm.page_size, P = m->pos ? (m->pos + ps - 1) / ps : 1;
    const int64_t bytes =
            P * ps * m->cfg.n_kv_heads * m->cfg.head_dim * ekv_dtype_size(m->prm.kv_dtype);
    if (posix_memalign(&L->host_k, 64, (size_t)bytes) ||
        posix_memalign(&L->host_v, 64, (size_t)bytes)) {
        free_host_mirror(L);
        return ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory (host K/V copy)");
    }
    GPU_TRY(g, cudaStreamSynchronize(g->stream));
    GPU_TRY(g, cudaMemcpy(L->host_k, L->kv.k, (size_t)bytes, cudaMemcpyDeviceToHost));
    GPU_TRY(g, cudaMemcpy(L->host_v, L->kv.v, (size_t)bytes, cudaMemcpyDeviceToHost));
    ekv_cache_params cp = ekv_cache_default_params();
    cp.num_pages = P;
    cp.page_size = (int32_t)ps;
    cp.num_kv_heads = m->cfg.n_kv_heads;
    cp.head_dim = m->cfg.head_dim;
    cp.dtype = m->prm.kv_dtype;
    cp.max_seqs = 1;
    cp.superpage_pages = m->prm.superpage_pages;
    cp.code_bits = m->prm.code_bits;
    cp.range_dtype = ekv_cache_compact_ranges(cp.dtype);
    cp.layout = EKV_LAYOUT_NHD;
    cp.k_pool = L->host_k;
    cp.v_pool = L->host_v;
    int32_t *pages = (int32_t *)malloc(sizeof(int32_t) * (size_t)P);
    ekv_status s = pages ? ekv_cache_create(m->ctx, &cp, &L->host)
                         : ekv_fail(m->ctx, EKV_ERR_OUT_OF_MEMORY, "model: out of memory");
    int32_t sq = 0;
    if (!s) s = ekv_cache_seq_new(L->host, &sq);
    for (int64_t p = 0; p < P && pages; p++) pages[p] = (int32_t)p;
    if (!s && m->pos)
        s = ekv_cache_seq_adopt(L->host, sq, pages, P, (int32_t)(m->pos - (P - 1) * ps));
    free(pages);
    if (s) {
        free_host_mirror(L);
        return s;
    }
    *cache = L->host;
    *seq = sq;
    return EKV_OK;
}
