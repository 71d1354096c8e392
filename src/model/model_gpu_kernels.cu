/*
 * The model's small GPU stages (docs/architecture.md, "The model on the GPU"): embedding,
 * RMSNorm, SwiGLU, the linear layers (a kernel of its own for a decode step's few tokens, cuBLAS
 * for a prefill block), and the tables of a block (append items, prefix views) computed on the
 * device from the device position, so that a decode step reads nothing from the host and can be
 * replayed as a CUDA graph. Each computes what model.c's CPU pass computes, in the same precision
 * (fp32; RMSNorm's sum of squares in double).
 */
#include "model_gpu.cuh"

namespace {

__global__ void embed_kernel(const float *emb, const int32_t *tok, int64_t d, float *x) {
    ekv_grid_begin();
    const int64_t t = blockIdx.x;
    const float *row = emb + (int64_t)tok[t] * d;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) x[t * d + i] = row[i];
}

/* RMSNorm's factor 1 / sqrt(mean(x^2) + eps) from the row's sum of squares ss (in double), and
 * SwiGLU's silu(gate) * up: model.c's expressions, written once for the norm and SwiGLU kernels
 * and for the linear kernel that folds them in. */
__device__ __forceinline__ float rms_factor(double ss, int64_t d, double eps) {
    return (float)(1.0 / sqrt(ss / (double)d + eps));
}
__device__ __forceinline__ float swiglu(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}

/* one block per row: out = x * (1/sqrt(mean(x^2) + eps)) * w, as model.c's rmsnorm */
__global__ void rmsnorm_kernel(const float *x, const float *w, float *out, int64_t d, double eps) {
    ekv_grid_begin();
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
    const float f = rms_factor(part[0], d, eps);
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x)
        out[(int64_t)blockIdx.x * d + i] = r[i] * f * w[i];
}

/* out[t][f] = silu(gate) * up with gate = h13[t][f], up = h13[t][F + f] (one GEMM's rows). */
__global__ void swiglu_kernel(const float *h13, int64_t T, int64_t F, float *out) {
    ekv_grid_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * F;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / F, f = i - t * F;
        out[i] = swiglu(h13[t * 2 * F + f], h13[t * 2 * F + F + f]);
    }
}

struct tables_args {
    const int64_t *pos;   /* [max_seqs] */
    const int32_t *bseqs; /* batch: the sequence of each row */
    int32_t seq;          /* one sequence: which */
    int64_t T, ps, pages; /* pages: of one sequence, so sequence s starts at page s * pages */
    int32_t n_items;
    int views, batch;
    ekv_cuda_append_item *items;
    int64_t *indptr;
    int32_t *last_len, *vbase;
};

/* One thread. One sequence: the append items of its T tokens from pos[seq], and view t ending
 * at position pos[seq] + t (pages 0 .. (pos + t) / ps of the sequence). Batch: row b's token
 * goes to sequence bseqs[b] at its position, whose view is the whole sequence after it. */
__global__ void block_tables_kernel(tables_args A) {
    ekv_grid_begin();
    if (A.batch) {
        A.indptr[0] = 0;
        for (int64_t b = 0; b < A.T; b++) {
            const int32_t s = A.bseqs[b];
            const int64_t p = A.pos[s], np = p / A.ps + 1, base = (int64_t)s * A.pages;
            A.items[b] =
                    ekv_cuda_append_item{(int32_t)(base + p / A.ps), (int32_t)(p % A.ps), 1, 0, b};
            A.indptr[b + 1] = A.indptr[b] + np;
            A.last_len[b] = (int32_t)(p - (np - 1) * A.ps + 1);
            A.vbase[b] = (int32_t)base;
        }
        return;
    }
    const int64_t p0 = A.pos[A.seq], base = (int64_t)A.seq * A.pages;
    for (int32_t i = 0; i < A.n_items; i++) {
        const int64_t page = p0 / A.ps + i, first = page * A.ps > p0 ? page * A.ps : p0;
        const int64_t end = (page + 1) * A.ps < p0 + A.T ? (page + 1) * A.ps : p0 + A.T;
        A.items[i] = ekv_cuda_append_item{(int32_t)(base + page), (int32_t)(first - page * A.ps),
                                          (int32_t)(end - first), 0, first - p0};
    }
    if (!A.views) return;
    A.indptr[0] = 0;
    for (int64_t t = 0; t < A.T; t++) {
        const int64_t np = (p0 + t) / A.ps + 1;
        A.indptr[t + 1] = A.indptr[t] + np;
        A.last_len[t] = (int32_t)(p0 + t - (np - 1) * A.ps + 1);
        A.vbase[t] = (int32_t)base;
    }
}

/* view blockIdx.y lists its sequence's physical pages vbase .. vbase + np - 1 */
__global__ void view_pages_kernel(const int64_t *indptr, const int32_t *vbase, int32_t *indices) {
    ekv_grid_begin();
    const int64_t t = blockIdx.y, first = indptr[t], np = indptr[t + 1] - first;
    for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < np;
         p += (int64_t)gridDim.x * blockDim.x)
        indices[first + p] = vbase[t] + (int32_t)p;
}

/* one sequence: pos[seq] += T; batch (bseqs distinct): pos[bseqs[b]] += 1 for each row */
__global__ void advance_kernel(int64_t *pos, const int32_t *bseqs, int32_t seq, int64_t T,
                               int batch) {
    ekv_grid_begin();
    if (!batch) {
        if (threadIdx.x == 0) pos[seq] += T;
        return;
    }
    for (int64_t b = threadIdx.x; b < T; b += blockDim.x) pos[bseqs[b]] += 1;
}

/* y[t][r] = beta y[t][r] + <W[r], in(x)[t]> for the few tokens of a decode step (gpu_linear).
 * The block stages LIN_TOKENS tokens' input in shared memory (so the inner loop's loads are not
 * a chain of global-memory latencies), with the layer's RMSNorm or SwiGLU applied on the way
 * (stage_input: their own launches saved); a warp per output row reads
 * W's row in float4 loads (cols % 4 == 0) and keeps a sum per token. Each token's products are
 * summed lane-strided, then over the warp by the same tree whatever T and the token's place in
 * the block, so a sequence's outputs do not depend on the other sequences of a batched step.
 * Why not cuBLAS: for these shapes (T up to 64, rows and cols of a few hundred) its heuristic
 * picked kernels of ~50 us for a 128 x 384 product (ncu, bench/RESULTS.md "Batched decode
 * steps"). beta is 0 (y not read) or 1 (the residual add). */
enum {
    LIN_WARPS = 8,
    LIN_TOKENS = 8,   /* tokens staged at a time (<= LIN_WARPS: a warp per token's norm) */
    LIN_SMALL_T = 64, /* tokens up to which gpu_linear runs it */
    /* the stage (dynamic) and the kernel's static array within the 48 KB a launch gets without
     * the opt-in: 40 KB of stage, at most 1280 columns; wider layers take cuBLAS */
    LIN_MAX_COLS = 40 * 1024 / 4 / LIN_TOKENS,
    /* float4s of a W row each lane of the linear kernels holds (cols <= LIN_MAX_COLS) */
    LIN_ROW_HELD = LIN_MAX_COLS / 4 / 32
};
static_assert(LIN_MAX_COLS % 128 == 0, "a row of LIN_MAX_COLS is whole float4s over 32 lanes");
struct linear_args {
    const float *W;
    int64_t rows, cols, T;
    gpu_lin_in in;
    gpu_lin_out out;
    float beta;
};

/* Where token t's output row r goes: part p of out (the rows from end[p - 1] to end[p]) holds
 * [T][its rows]. Once per output. */
__device__ __forceinline__ float *lin_out_at(const linear_args &A, int64_t t, int64_t r) {
    const int p = (r >= A.out.end[0]) + (r >= A.out.end[1]);
    const int64_t start = p ? A.out.end[p - 1] : 0;
    return A.out.y[p] + t * (A.out.end[p] - start) + (r - start);
}

/* A token's RMSNorm factor from its row r (cols floats), by one warp: lane-strided squares in
 * double, summed by an xor tree (every lane ends with the same value). Written once for the
 * staged kernel and the one-token kernel, so that both give a token the same factor. */
__device__ __forceinline__ float warp_rms_factor(const float *r, const linear_args &A, int lane) {
    double ss = 0;
    for (int64_t i = lane; i < A.cols; i += 32) ss += (double)r[i] * r[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    return rms_factor(ss, A.cols, A.in.eps);
}

/* acc + <a, b> in the order every linear kernel sums a float4 of products (x, y, z, w). */
__device__ __forceinline__ float dot4_add(float4 a, float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

/* Four inputs of a token: SwiGLU of gate and up, and RMSNorm's x * f * w (f: the token's
 * factor), as swiglu_kernel and rmsnorm_kernel compute them; for both linear kernels. */
__device__ __forceinline__ float4 swiglu4(float4 gt, float4 up) {
    return make_float4(swiglu(gt.x, up.x), swiglu(gt.y, up.y), swiglu(gt.z, up.z),
                       swiglu(gt.w, up.w));
}
__device__ __forceinline__ float4 rmsnorm4(float4 v, float f, float4 w) {
    return make_float4(v.x * f * w.x, v.y * f * w.y, v.z * f * w.z, v.w * f * w.w);
}

/* A lane's products summed over the warp by the xor tree (every lane gets the same sum). */
__device__ __forceinline__ float warp_sum_f(float s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* The warp sums of N per-lane values at once (N a power of two, at most 32), each by warp_sum_f's
 * xor tree, but scattered: at offset o a lane keeps the half of the values its bit o selects and
 * adds the partner's copy of them (one shuffle a kept value), so N sums take N - 1 + log2(32 / N)
 * shuffles instead of 5 N. The same pairs are added at every level (a + b = b + a in floating
 * point), so each sum is bitwise warp_sum_f's. Returns the sum of value t(lane) = lane / (32 /
 * N): lane t (32 / N) holds value t's sum. */
template <int N> __device__ __forceinline__ float warp_sums_scattered(float (&v)[N]) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two up to 32");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16, n = N; o > 0; o >>= 1) {
        if (n > 1) { /* keep [0, n/2) or [n/2, n), re-indexed from 0 */
            n >>= 1;
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                if (i >= n) break;
                const float send = upper ? v[i] : v[i + n], keep = upper ? v[i + n] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
    return v[0];
}

/* xs[t][c] = in(x)[t0 + t][c] for t < nt, as rmsnorm_kernel and swiglu_kernel compute them (the
 * same float expressions; RMSNorm's sum of squares in double, a warp per token). */
__device__ void stage_input(const linear_args &A, int64_t t0, int nt, float4 *xs, float *f) {
    const int64_t n4 = A.cols / 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (A.in.kind == GPU_LIN_SWIGLU) { /* x is [T][2 cols]: gate | up */
        const float4 *h = reinterpret_cast<const float4 *>(A.in.x + t0 * 2 * A.cols);
        for (int64_t i = threadIdx.x; i < nt * n4; i += blockDim.x) {
            const int64_t t = i / n4, c = i - t * n4;
            xs[i] = swiglu4(__ldg(h + t * 2 * n4 + c), __ldg(h + t * 2 * n4 + n4 + c));
        }
        return;
    }
    const float4 *xt = reinterpret_cast<const float4 *>(A.in.x + t0 * A.cols);
    for (int64_t i = threadIdx.x; i < nt * n4; i += blockDim.x) xs[i] = __ldg(xt + i);
    if (A.in.kind != GPU_LIN_RMSNORM) return;
    __syncthreads();
    if (warp < nt) {
        const float f_t = warp_rms_factor(reinterpret_cast<const float *>(xs + warp * n4), A, lane);
        if (lane == 0) f[warp] = f_t; /* once per token */
    }
    __syncthreads();
    const float4 *nw = reinterpret_cast<const float4 *>(A.in.norm_w);
    for (int64_t i = threadIdx.x; i < nt * n4; i += blockDim.x) {
        const int64_t t = i / n4;
        xs[i] = rmsnorm4(xs[i], f[t], __ldg(nw + (i - t * n4)));
    }
}

/* The float4s of W's row r = the warp's (row 0's for a warp past the last row) that lane holds
 * in both linear kernels: c = lane + 32 k, zero past the row's end. Loaded before the kernel's
 * wait: no kernel writes the weights (uploaded at load), so with overlapped launches these loads
 * run during the previous kernel (common/overlap.cuh). */
struct lin_row_weights {
    float4 v[LIN_ROW_HELD];
};
__device__ __forceinline__ lin_row_weights load_lin_row_weights(const linear_args &A) {
    const int lane = threadIdx.x & 31;
    const int64_t r = blockIdx.x * (int64_t)LIN_WARPS + (threadIdx.x >> 5), n4 = A.cols / 4;
    const float4 *w = reinterpret_cast<const float4 *>(A.W + (r < A.rows ? r : 0) * A.cols);
    lin_row_weights h;
#pragma unroll
    for (int k = 0; k < LIN_ROW_HELD; k++)
        h.v[k] = lane + 32 * k < n4 ? __ldg(w + lane + 32 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
    return h;
}

__global__ void __launch_bounds__(32 * LIN_WARPS) linear_rows_kernel(linear_args A) {
    const lin_row_weights wv = ekv_grid_begin_with([&] { return load_lin_row_weights(A); });
    extern __shared__ float4 xs[]; /* [LIN_TOKENS][cols / 4] */
    __shared__ float f[LIN_TOKENS]; /* the staged tokens' RMSNorm factors */
    const int lane = threadIdx.x & 31;
    const int64_t r = blockIdx.x * (int64_t)LIN_WARPS + (threadIdx.x >> 5), n4 = A.cols / 4;
    /* block y takes token tiles y, y + gridDim.y, ...: a batched step's tiles side by side, not
     * one after another in each block (at 16 tokens that doubled the kernel's time: ncu, bench/
     * RESULTS.md 2026-12-05); a token's sums are the same in whichever block */
    for (int64_t t0 = blockIdx.y * (int64_t)LIN_TOKENS; t0 < A.T;
         t0 += (int64_t)gridDim.y * LIN_TOKENS) {
        const int nt = A.T - t0 < LIN_TOKENS ? (int)(A.T - t0) : LIN_TOKENS;
        __syncthreads(); /* the previous tile's reads are done */
        stage_input(A, t0, nt, xs, f);
        __syncthreads();
        float acc[LIN_TOKENS] = {};
#pragma unroll
        for (int k = 0; k < LIN_ROW_HELD; k++) { /* c = lane + 32 k ascending, as before */
            const int64_t c = lane + 32 * k;
            if (c >= n4) break;
#pragma unroll
            for (int t = 0; t < LIN_TOKENS; t++)
                acc[t] = dot4_add(wv.v[k], xs[(t < nt ? t : 0) * n4 + c], acc[t]);
        }
        constexpr int LANES = 32 / LIN_TOKENS; /* lanes a token's sum ends in */
        const float s = warp_sums_scattered(acc);
        const int t = lane / LANES;
        if (lane % LANES == 0 && t < nt && r < A.rows) {
            float *out = lin_out_at(A, t0 + t, r);
            *out = A.beta != 0.f ? *out + s : s;
        }
    }
}

/* in(x)[c] (float4 c) of a single token for linear_row1_kernel, as stage_input forms it (f: the
 * token's RMSNorm factor). */
__device__ __forceinline__ float4 token_input4(const linear_args &A, int64_t c, float f) {
    const float4 *x = reinterpret_cast<const float4 *>(A.in.x);
    if (A.in.kind == GPU_LIN_SWIGLU) /* x is [2 cols]: gate | up */
        return swiglu4(__ldg(x + c), __ldg(x + A.cols / 4 + c));
    const float4 v = __ldg(x + c);
    if (A.in.kind != GPU_LIN_RMSNORM) return v;
    return rmsnorm4(v, f, __ldg(reinterpret_cast<const float4 *>(A.in.norm_w) + c));
}

/* linear_rows_kernel for one token (a single sequence's decode step, T = 1): the same sums in
 * the same order (a token's output does not depend on the kernel that computed it), without
 * the shared stage and its barriers: each warp reads the token's input itself and, for RMSNorm,
 * computes the token's factor itself (the same expression). At T = 1 the staged kernel took ~6
 * us a launch under ncu, 33 launches a step (bench/RESULTS.md, "The model's fixed cost"). */
__global__ void __launch_bounds__(32 * LIN_WARPS) linear_row1_kernel(linear_args A) {
    const lin_row_weights wv = ekv_grid_begin_with([&] { return load_lin_row_weights(A); });
    const int lane = threadIdx.x & 31;
    const int64_t r = blockIdx.x * (int64_t)LIN_WARPS + (threadIdx.x >> 5), n4 = A.cols / 4;
    if (r >= A.rows) return; /* a whole warp: no barrier in this kernel */
    const float f = A.in.kind == GPU_LIN_RMSNORM ? warp_rms_factor(A.in.x, A, lane) : 1.f;
    float acc = 0.f; /* the staged kernel's order: c = lane, lane + 32, ... */
#pragma unroll
    for (int k = 0; k < LIN_ROW_HELD; k++)
        if (lane + 32 * k < n4) acc = dot4_add(wv.v[k], token_input4(A, lane + 32 * k, f), acc);
    const float s = warp_sum_f(acc);
    if (lane == 0) {
        float *out = lin_out_at(A, 0, r);
        *out = A.beta != 0.f ? *out + s : s;
    }
}

} // namespace

ekv_status gpu_embed(model_gpu *g, int64_t T, int64_t d) {
    ekv_launch(gpu_on(g), embed_kernel, (unsigned)T, 256, 0, g->tok_emb, g->tokens, d, g->x);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

static ekv_status gpu_rmsnorm(model_gpu *g, const float *x, const float *w, float *out,
                              int64_t T, int64_t d, double eps) {
    ekv_launch(gpu_on(g), rmsnorm_kernel, (unsigned)T, 256, 0, x, w, out, d, eps);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

static ekv_status gpu_swiglu(model_gpu *g, const float *h13, int64_t T, int64_t F,
                             float *out) {
    const int64_t blocks = (T * F + 255) / 256;
    const unsigned grid = (unsigned)(blocks < 4096 ? blocks : 4096);
    ekv_launch(gpu_on(g), swiglu_kernel, grid, 256, 0, h13, T, F, out);
    GPU_LAUNCHED(g);
    return EKV_OK;
}

/* A decode step's few tokens (up to LIN_SMALL_T) through linear_rows_kernel, the input's norm
 * or SwiGLU folded in, every part in one launch; a prefill block's input made whole first (into
 * g->xn or g->h), then cuBLAS per part, which is column-major: y^T (rows x T, ld rows) = W
 * (row-major [rows][cols], i.e. cols x rows column-major, transposed) times x^T (cols x T, ld
 * cols). fp32 inputs, fp32 compute (the CPU pass's precision; the linear layers are a small
 * share of a long prefill, docs/math.md §12). */
ekv_status gpu_linear_parts(model_gpu *g, const float *W, int64_t cols, const gpu_lin_in *in,
                            int64_t T, const gpu_lin_out *out, float beta) {
    const int64_t rows = out->end[GPU_LIN_PARTS - 1];
    const uintptr_t align = (uintptr_t)W | (uintptr_t)in->x | (uintptr_t)in->norm_w;
    if (T <= LIN_SMALL_T && cols % 4 == 0 && cols <= LIN_MAX_COLS && align % 16 == 0) {
        const linear_args A = {W, rows, cols, T, *in, *out, beta};
        const size_t smem = (size_t)LIN_TOKENS * (size_t)cols * 4;
        const unsigned blocks = (unsigned)((rows + LIN_WARPS - 1) / LIN_WARPS);
        const dim3 grid(blocks, (unsigned)((T + LIN_TOKENS - 1) / LIN_TOKENS));
        if (T == 1)
            ekv_launch(gpu_on(g), linear_row1_kernel, blocks, 32 * LIN_WARPS, 0, A);
        else
            ekv_launch(gpu_on(g), linear_rows_kernel, grid, 32 * LIN_WARPS, smem, A);
        GPU_LAUNCHED(g);
        return EKV_OK;
    }
    const float *x = in->x;
    if (in->kind == GPU_LIN_RMSNORM) {
        const ekv_status s = gpu_rmsnorm(g, x, in->norm_w, g->xn, T, cols, in->eps);
        if (s) return s;
        x = g->xn;
    } else if (in->kind == GPU_LIN_SWIGLU) {
        const ekv_status s = gpu_swiglu(g, x, T, cols, g->h);
        if (s) return s;
        x = g->h;
    }
    const float one = 1.f;
    for (int p = 0, start = 0; p < GPU_LIN_PARTS; start = (int)out->end[p], p++) {
        const int n = (int)out->end[p] - start;
        if (n == 0) continue;
        BLAS_TRY(g, cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, (int)T, (int)cols, &one,
                                 W + (int64_t)start * cols, CUDA_R_32F, (int)cols, x, CUDA_R_32F,
                                 (int)cols, &beta, out->y[p], CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    }
    return EKV_OK;
}

ekv_status gpu_linear(model_gpu *g, const float *W, int64_t rows, int64_t cols,
                      const gpu_lin_in *in, int64_t T, float *y, float beta) {
    const gpu_lin_out out = {{y, y, y}, {rows, rows, rows}};
    return gpu_linear_parts(g, W, cols, in, T, &out, beta);
}

ekv_status gpu_block_tables(model_gpu *g, const gpu_block *b, int64_t ps, int32_t n_items,
                            int views) {
    const tables_args A = {g->pos, g->bseqs, b->seq,   b->T,      ps,          g->pages, n_items,
                           views,  b->batch, g->items, g->indptr, g->last_len, g->vbase};
    ekv_launch(gpu_on(g), block_tables_kernel, 1, 1, 0, A);
    GPU_LAUNCHED(g);
    if (views) {
        const int64_t bx = (g->pages + 255) / 256;
        const dim3 grid((unsigned)(bx < 1024 ? bx : 1024), (unsigned)b->T);
        ekv_launch(gpu_on(g), view_pages_kernel, grid, 256, 0, g->indptr, g->vbase, g->indices);
        GPU_LAUNCHED(g);
    }
    return EKV_OK;
}

ekv_status gpu_advance(model_gpu *g, const gpu_block *b) {
    ekv_launch(gpu_on(g), advance_kernel, 1, 256, 0, g->pos, g->bseqs, b->seq, b->T, b->batch);
    GPU_LAUNCHED(g);
    return EKV_OK;
}
