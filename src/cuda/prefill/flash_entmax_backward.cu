/*
 * ekv_cuda_flash_entmax_backward (include/entmaxkv/cuda.h; docs/math.md §13.2-13.3): the
 * gradients of exact entmax attention from the forward's tau, on CUDA cores in fp32 (a first
 * version; the tensor-core backward is the next step of issue 30). With p~_j = [z_j - tau]_+^beta
 * (softmax: exp(z_j - tau)) recomputed from the saved tau, S = sum p~, p = p~ / S as the forward
 * normalises it, and w~_j = p~_j^(2 - alpha) = (z_j - tau)^(beta - 1) on the support:
 *   w_j = S^(alpha - 2) w~_j,  delta = sum w~ g / sum w~ (the scale of w cancels),
 *   ds_j = scale w_j (g_j - delta),  g_j = dout . v_j,
 *   dq = sum_j ds_j k_j,  dk_j = sum over rows ds_j q,  dv_j = sum over rows p_j dout.
 * Two passes, each owning what it writes (no atomics):
 *   1. rows_kernel, a warp per query row: one sweep of its keys for S, sum w~ and sum w~ g (its
 *      row's 1 / S, S^(alpha - 2) and delta to the workspace), a second for ds and dq (a key's
 *      row of K read only where ds != 0: the support);
 *   2. keys_kernel, a warp per (key, KV head): over the rows of the group's heads that see the
 *      key, ds and p of each, then dk_j and dv_j.
 * Both read q and dout as fp32 (16-bit ones converted into the workspace first). Cost: every
 * (row, key) pair takes two D-long dot products in each pass (the scores and dout . v), so
 * about 4 x 2 D flops per pair on CUDA cores against the forward's tensor cores; the axpys
 * into dq, dk and dv only for the support's pairs.
 */
#include "flash_entmax.cuh"
#include "../common/reduce.cuh"
#include "../common/weights.cuh"

namespace {

enum { BWD_THREADS = 256, BWD_WARPS = BWD_THREADS / 32 };

struct bwd_args {
    int64_t B, T, N, H, Hk, G, D, pos0; /* pos0 = N - T: row t sits at pos0 + t */
    int causal;
    float qf;                     /* a * scale as the forward's scores take it */
    float scale;                  /* the effective scale: ds is d/d(q.k) */
    double alpha, beta, a;        /* a: z = a s (softmax: 1) */
    const float *slopes;          /* [H] device, or NULL */
    const float *q, *dout;        /* [B][T][H][D] fp32 */
    const void *k, *v;            /* [B][N][Hk][D] */
    const double *tau;            /* [B][T][H] */
    float *rinv, *wscale, *delta; /* [B][T][H]: 1 / S, S^(alpha - 2), delta */
    void *dq, *dk, *dv;
};

/* p~ and w~ of a score z given tau (the file's comment): 0 outside the support. */
__device__ __forceinline__ void bwd_weights(float z, double tau, const bwd_args &A, float *p,
                                            float *w) {
    if (A.alpha == 1.0) {
        *p = *w = (float)exp((double)z - tau);
        return;
    }
    const double x = (double)z - tau;
    *p = entmax_p(z, tau, A.beta);
    *w = !(x > 0)        ? 0.f
         : A.beta == 2.0 ? (float)x
         : A.beta == 1.0 ? 1.f
                         : (float)pow(x, A.beta - 1.0);
}

/* x . y over D: x fp32 in shared memory, y a row of T in global memory (16-byte aligned) */
template <typename T, int D> __device__ __forceinline__ float dot_row(const float *x, const T *y) {
    float s = 0.f;
#pragma unroll
    for (int d = 0; d < D; d += 8) {
        float v[8];
        ekv_elem<T>::load8(y + d, v);
#pragma unroll
        for (int e = 0; e < 8; e++) s = fmaf(x[d + e], v[e], s);
    }
    return s;
}

/* z of query row (t, h) against key j, q . k given: a (scale q.k - m_h |j - i|) rounded as the
 * forward's fused kernel forms it (docs/math.md §12) */
__device__ __forceinline__ float bwd_z(const bwd_args &A, float qk, int64_t h, int64_t t,
                                       int64_t j) {
    const float am = A.slopes ? (float)(A.a * (double)A.slopes[h]) : 0.f;
    return fmaf(qk, A.qf, -am * fabsf((float)(j - (A.pos0 + t))));
}

/* Keys row t sees: [0, n). */
__device__ __forceinline__ int64_t row_keys(const bwd_args &A, int64_t t) {
    return A.causal ? A.pos0 + t + 1 : A.N;
}

/* Pass 1, a warp per row (b, t, h): the sums, then ds and dq. A block's warps take consecutive
 * tokens of one head, which read the same keys (their K and V rows shared in L1). Warp-uniform
 * exits. */
template <typename TK, typename TQ, int D>
__global__ void __launch_bounds__(BWD_THREADS) rows_kernel(bwd_args A) {
    constexpr int PER = D / 32;
    __shared__ float sq[BWD_WARPS][D], sg[BWD_WARPS][D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t item = (int64_t)blockIdx.x * BWD_WARPS + warp; /* [B][H][T] */
    if (item >= A.B * A.T * A.H) return;
    const int64_t t = item % A.T, h = item / A.T % A.H, b = item / (A.T * A.H), n = row_keys(A, t);
    const int64_t r = (b * A.T + t) * A.H + h; /* the row of q, dout, dq: [B][T][H] */
    for (int d = lane; d < D; d += 32) {
        sq[warp][d] = A.q[r * D + d];
        sg[warp][d] = A.dout[r * D + d];
    }
    __syncwarp();
    const TK *K = static_cast<const TK *>(A.k) + (b * A.N * A.Hk + h / A.G) * D;
    const TK *V = static_cast<const TK *>(A.v) + (b * A.N * A.Hk + h / A.G) * D;
    const int64_t ks = A.Hk * D;
    const double tau = A.tau[r];
    double S = 0, SW = 0, SWG = 0;
    for (int64_t j = lane; j < n; j += 32) {
        float p, w;
        bwd_weights(bwd_z(A, dot_row<TK, D>(sq[warp], K + j * ks), h, t, j), tau, A, &p, &w);
        S += p;
        if (w != 0.f) {
            SW += w;
            SWG += (double)w * dot_row<TK, D>(sg[warp], V + j * ks);
        }
    }
    S = ekv_warp_sum(S), SW = ekv_warp_sum(SW), SWG = ekv_warp_sum(SWG);
    const float delta = (float)(SWG / SW), wsc = (float)pow(S, A.alpha - 2.0);
    if (lane == 0) A.rinv[r] = (float)(1.0 / S), A.wscale[r] = wsc, A.delta[r] = delta;
    float dq[PER];
#pragma unroll
    for (int c = 0; c < PER; c++) dq[c] = 0.f;
    for (int64_t base = 0; base < n; base += 32) {
        const int64_t j = base + lane;
        float ds = 0.f;
        if (j < n) {
            float p, w;
            bwd_weights(bwd_z(A, dot_row<TK, D>(sq[warp], K + j * ks), h, t, j), tau, A, &p, &w);
            if (w != 0.f) ds = A.scale * wsc * w * (dot_row<TK, D>(sg[warp], V + j * ks) - delta);
        }
        for (unsigned m = __ballot_sync(0xffffffffu, ds != 0.f); m; m &= m - 1) {
            const int src = __ffs(m) - 1;
            const float dsj = __shfl_sync(0xffffffffu, ds, src);
            const TK *kr = K + (base + src) * ks;
#pragma unroll
            for (int c = 0; c < PER; c++)
                dq[c] = fmaf(dsj, ekv_elem<TK>::to(kr[lane + 32 * c]), dq[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < PER; c++)
        static_cast<TQ *>(A.dq)[r * D + lane + 32 * c] = ekv_elem<TQ>::from(dq[c]);
}

/* Pass 2, a warp per (b, key j, KV head g): the rows (t, h of g's group) that see key j, 32 at
 * a time (a lane each: ds and p), then dk_j and dv_j. A block's warps take consecutive keys of
 * one KV head, which the same rows see (their q and dout rows shared in L1). Warp-uniform
 * exits. */
template <typename TK, int D>
__global__ void __launch_bounds__(BWD_THREADS) keys_kernel(bwd_args A) {
    constexpr int PER = D / 32;
    __shared__ float sk[BWD_WARPS][D], sv[BWD_WARPS][D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t item = (int64_t)blockIdx.x * BWD_WARPS + warp; /* [B][Hk][N] */
    if (item >= A.B * A.N * A.Hk) return;
    const int64_t j = item % A.N, g = item / A.N % A.Hk, b = item / (A.N * A.Hk);
    const int64_t ko = ((b * A.N + j) * A.Hk + g) * D; /* k, v, dk, dv: [B][N][Hk][D] */
    for (int d = lane; d < D; d += 32) {
        sk[warp][d] = ekv_elem<TK>::to(static_cast<const TK *>(A.k)[ko + d]);
        sv[warp][d] = ekv_elem<TK>::to(static_cast<const TK *>(A.v)[ko + d]);
    }
    __syncwarp();
    /* causal: the rows at positions >= j, t >= j - pos0 */
    const int64_t t0 = A.causal && j > A.pos0 ? j - A.pos0 : 0, nr = (A.T - t0) * A.G;
    float dk[PER], dv[PER];
#pragma unroll
    for (int c = 0; c < PER; c++) dk[c] = dv[c] = 0.f;
    for (int64_t base = 0; base < nr; base += 32) {
        const int64_t i = base + lane;
        const int64_t t = t0 + i / A.G, h = g * A.G + i % A.G;
        const int64_t r = (b * A.T + t) * A.H + h;
        float ds = 0.f, p = 0.f;
        if (i < nr) {
            float pt, w;
            float qk = 0.f, gv = 0.f;
            const float *qr = A.q + r * D, *gr = A.dout + r * D;
#pragma unroll
            for (int d = 0; d < D; d += 4) {
                const float4 x = *reinterpret_cast<const float4 *>(qr + d);
                const float4 y = *reinterpret_cast<const float4 *>(gr + d);
                qk = fmaf(x.x, sk[warp][d],
                          fmaf(x.y, sk[warp][d + 1],
                               fmaf(x.z, sk[warp][d + 2], fmaf(x.w, sk[warp][d + 3], qk))));
                gv = fmaf(y.x, sv[warp][d],
                          fmaf(y.y, sv[warp][d + 1],
                               fmaf(y.z, sv[warp][d + 2], fmaf(y.w, sv[warp][d + 3], gv))));
            }
            bwd_weights(bwd_z(A, qk, h, t, j), A.tau[r], A, &pt, &w);
            p = pt * A.rinv[r];
            if (w != 0.f) ds = A.scale * A.wscale[r] * w * (gv - A.delta[r]);
        }
        for (unsigned m = __ballot_sync(0xffffffffu, p != 0.f || ds != 0.f); m; m &= m - 1) {
            const int src = __ffs(m) - 1;
            const float dsi = __shfl_sync(0xffffffffu, ds, src),
                        pi = __shfl_sync(0xffffffffu, p, src);
            const int64_t ri = __shfl_sync(0xffffffffu, r, src);
#pragma unroll
            for (int c = 0; c < PER; c++) {
                dk[c] = fmaf(dsi, A.q[ri * D + lane + 32 * c], dk[c]);
                dv[c] = fmaf(pi, A.dout[ri * D + lane + 32 * c], dv[c]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < PER; c++) {
        static_cast<TK *>(A.dk)[ko + lane + 32 * c] = ekv_elem<TK>::from(dk[c]);
        static_cast<TK *>(A.dv)[ko + lane + 32 * c] = ekv_elem<TK>::from(dv[c]);
    }
}

template <typename TK, int D>
cudaError_t launch_passes(const bwd_args &A, ekv_dtype qt, cudaStream_t s) {
    const int64_t rows = A.B * A.T * A.H, keys = A.B * A.N * A.Hk;
    ekv_cuda_with_dtype(qt, [&](auto ty) {
        rows_kernel<TK, typename decltype(ty)::type, D>
                <<<(unsigned)((rows + BWD_WARPS - 1) / BWD_WARPS), BWD_THREADS, 0, s>>>(A);
    });
    keys_kernel<TK, D><<<(unsigned)((keys + BWD_WARPS - 1) / BWD_WARPS), BWD_THREADS, 0, s>>>(A);
    return cudaGetLastError();
}

cudaError_t launch(const bwd_args &A, ekv_dtype kt, ekv_dtype qt, cudaStream_t s) {
    if (kt == EKV_DTYPE_F16)
        return A.D == 64 ? launch_passes<__half, 64>(A, qt, s)
                         : launch_passes<__half, 128>(A, qt, s);
    return A.D == 64 ? launch_passes<__nv_bfloat16, 64>(A, qt, s)
                     : launch_passes<__nv_bfloat16, 128>(A, qt, s);
}

} // namespace

/* The backward's pieces of the workspace: q and dout as fp32 (when 16-bit), the per-row sums. */
struct bwd_layout {
    int64_t q32, g32, rinv, wscale, delta, total;
};

static bwd_layout backward_layout(const flash_job &J) {
    const int64_t rows = J.B * J.T * J.H;
    ws_carver c;
    bwd_layout L;
    L.q32 = J.a->q_dtype != EKV_DTYPE_F32 ? c.take(rows * J.D * 4) : -1;
    L.g32 = J.a->out_dtype != EKV_DTYPE_F32 ? c.take(rows * J.D * 4) : -1;
    L.rinv = c.take(rows * 4);
    L.wscale = c.take(rows * 4);
    L.delta = c.take(rows * 4);
    L.total = c.at;
    return L;
}

int64_t flash_backward_bytes(const flash_job &J) { return backward_layout(J).total; }

extern "C" ekv_status ekv_cuda_flash_entmax_backward(ekv_context *ctx,
                                                     const ekv_flash_entmax_args *args,
                                                     const void *dout, void *dq, void *dk, void *dv,
                                                     void *workspace, int64_t workspace_bytes,
                                                     void *stream) {
    const void *grads[4] = {dout, dq, dk, dv};
    flash_job J;
    ekv_status st = flash_check(ctx, args, stream, 1, grads, &J);
    if (st) return st;
    const bwd_layout L = backward_layout(J);
    if ((st = flash_check_workspace(J, workspace, workspace_bytes, L.total))) return st;
    char *base = static_cast<char *>(workspace);
    const int64_t n = J.B * J.T * J.H * J.D;
    bwd_args A;
    A.B = J.B, A.T = J.T, A.N = J.N, A.H = J.H, A.Hk = J.Hk, A.G = J.G, A.D = J.D;
    A.pos0 = J.N - J.T;
    A.causal = J.causal;
    A.qf = J.qf;
    A.scale = (float)J.scale;
    A.alpha = J.alpha;
    A.beta = J.alpha == 1.0 ? 1.0 : 1.0 / (J.alpha - 1.0);
    A.a = J.alpha == 1.0 ? 1.0 : J.alpha - 1.0;
    A.slopes = args->shape.alibi_slopes;
    A.q = L.q32 < 0 ? (const float *)args->q : (const float *)(base + L.q32);
    A.dout = L.g32 < 0 ? (const float *)dout : (const float *)(base + L.g32);
    if (L.q32 >= 0) FLASH_TRY(J, flash_to_f32(J, args->q_dtype, args->q, (float *)A.q, n));
    if (L.g32 >= 0) FLASH_TRY(J, flash_to_f32(J, args->out_dtype, dout, (float *)A.dout, n));
    A.k = args->k, A.v = args->v;
    A.tau = args->tau;
    A.rinv = (float *)(base + L.rinv);
    A.wscale = (float *)(base + L.wscale);
    A.delta = (float *)(base + L.delta);
    A.dq = dq, A.dk = dk, A.dv = dv;
    FLASH_TRY(J, launch(A, args->kv_dtype, args->q_dtype, J.stream));
    ekv_clear_error(ctx);
    return EKV_OK;
}
