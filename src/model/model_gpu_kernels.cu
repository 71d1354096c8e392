/*
 * The model's small GPU stages (docs/architecture.md, "The model on the GPU"): embedding,
 * RMSNorm, SwiGLU, the linear layers through cuBLAS, and the tables of a block (append items,
 * prefix views) computed on the device from the device position, so that a decode step reads
 * nothing from the host and can be replayed as a CUDA graph. Each computes what model.c's
 * CPU pass computes, in the same precision (fp32; RMSNorm's sum of squares in double).
 */
#include "model_gpu.cuh"

namespace {

__global__ void embed_kernel(const float *emb, const int32_t *tok, int64_t d, float *x) {
    const int64_t t = blockIdx.x;
    const float *row = emb + (int64_t)tok[t] * d;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) x[t * d + i] = row[i];
}

/* one block per row: out = x * (1/sqrt(mean(x^2) + eps)) * w, as model.c's rmsnorm */
__global__ void rmsnorm_kernel(const float *x, const float *w, float *out, int64_t d, double eps) {
    __shared__ double part[32];
    const float *r = x + (int64_t)blockIdx.x * d;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += (double)r[i] * r[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) s += part[i];
        part[0] = s;
    }
    __syncthreads();
    const float f = (float)(1.0 / sqrt(part[0] / (double)d + eps));
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x)
        out[(int64_t)blockIdx.x * d + i] = r[i] * f * w[i];
}

__global__ void swiglu_kernel(float *h1, const float *h3, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float gate = h1[i];
        h1[i] = gate / (1.0f + expf(-gate)) * h3[i]; /* silu(gate) * up */
    }
}

/* One thread: the append items of the T tokens from *pos, and the views' indptr/last_len
 * (view t ends at position *pos + t: its pages are 0 .. (*pos + t) / ps). */
__global__ void block_tables_kernel(const int64_t *pos, int64_t T, int64_t ps, int32_t n_items,
                                    int views, ekv_cuda_append_item *items, int64_t *indptr,
                                    int32_t *last_len) {
    const int64_t p0 = *pos;
    for (int32_t i = 0; i < n_items; i++) {
        const int64_t page = p0 / ps + i, first = page * ps > p0 ? page * ps : p0;
        const int64_t end = (page + 1) * ps < p0 + T ? (page + 1) * ps : p0 + T;
        items[i] = ekv_cuda_append_item{(int32_t)page, (int32_t)(first - page * ps),
                                        (int32_t)(end - first), 0, first - p0};
    }
    if (!views) return;
    indptr[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t np = (p0 + t) / ps + 1;
        indptr[t + 1] = indptr[t] + np;
        last_len[t] = (int32_t)(p0 + t - (np - 1) * ps + 1);
    }
}

/* view blockIdx.y lists the physical pages 0 .. np - 1 (logical = physical here) */
__global__ void view_pages_kernel(const int64_t *indptr, int32_t *indices) {
    const int64_t t = blockIdx.y, first = indptr[t], np = indptr[t + 1] - first;
    for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < np;
         p += (int64_t)gridDim.x * blockDim.x)
        indices[first + p] = (int32_t)p;
}

__global__ void advance_kernel(int64_t *pos, int64_t T) { *pos += T; }

} // namespace

ekv_status gpu_embed(model_gpu *g, int64_t T, int64_t d) {
    embed_kernel<<<(unsigned)T, 256, 0, g->stream>>>(g->tok_emb, g->tokens, d, g->x);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

ekv_status gpu_rmsnorm(model_gpu *g, const float *x, const float *w, float *out, int64_t T,
                       int64_t d, double eps) {
    rmsnorm_kernel<<<(unsigned)T, 256, 0, g->stream>>>(x, w, out, d, eps);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

ekv_status gpu_swiglu(model_gpu *g, float *h1, const float *h3, int64_t n) {
    const int64_t blocks = (n + 255) / 256;
    swiglu_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, g->stream>>>(h1, h3, n);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

/* cuBLAS is column-major: y^T (rows x T, ld rows) = W (row-major [rows][cols], i.e. cols x rows
 * column-major, transposed) times x^T (cols x T, ld cols). fp32 inputs, fp32 compute (the CPU
 * pass's precision; the linear layers are a small share of a long prefill, docs/math.md §12). */
ekv_status gpu_linear(model_gpu *g, const float *W, int64_t rows, int64_t cols, const float *x,
                      int64_t T, float *y, float beta) {
    const float one = 1.f;
    BLAS_TRY(g, cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T, (int)cols, &one,
                             W, CUDA_R_32F, (int)cols, x, CUDA_R_32F, (int)cols, &beta, y,
                             CUDA_R_32F, (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return EKV_OK;
}

ekv_status gpu_block_tables(model_gpu *g, int64_t T, int64_t ps, int32_t n_items, int views) {
    block_tables_kernel<<<1, 1, 0, g->stream>>>(g->pos, T, ps, n_items, views, g->items,
                                                g->indptr, g->last_len);
    GPU_LAUNCHED(g);
    if (views) {
        const int64_t bx = (g->pages + 255) / 256;
        view_pages_kernel<<<dim3((unsigned)(bx < 1024 ? bx : 1024), (unsigned)T), 256, 0,
                            g->stream>>>(g->indptr, g->indices);
        GPU_LAUNCHED(g);
    }
    return EKV_OK;
}

ekv_status gpu_advance(model_gpu *g, int64_t T) {
    advance_kernel<<<1, 1, 0, g->stream>>>(g->pos, T);
    GPU_LAUNCHED(g);
    return EKV_OK;
}
