/*
 * ekv_cuda_flash_entmax_backward (include/entmaxkv/cuda.h; docs/math.md §13.2-13.3, "On tensor
 * cores"): the gradients of exact entmax attention from the forward's tau, on tensor cores. With
 * p~_j = [z_j - tau]_+^beta (softmax: exp(z_j - tau)) recomputed from the saved tau, S = sum p~,
 * p = p~ / S as the forward normalises it, and w~_j = p~_j^(2 - alpha) on the support:
 *   w_j = S^(alpha - 2) w~_j,  delta = sum w~ g / sum w~ = dout . o-hat (the forward's),
 *   ds_j = scale w_j (g_j - delta),  g_j = dout . v_j,
 *   dq = sum_j ds_j k_j,  dk_j = sum over rows ds_j q,  dv_j = sum over rows p_j dout.
 * Steps (flash_entmax_backward.cuh):
 *   1. q and dout as 16-bit parts of K's dtype where either is not K's dtype (split_kernel;
 *      BWD_SPLIT_PARTS parts: every bit of an fp32 value), else both read where they are;
 *   2. the rows pass (delta, 1 / S and S^(alpha - 2) per row, and dq);
 *   3. the keys pass (dk, dv; with splits of a tile's rows, their fp32 partial sums added in
 *      split order by one more kernel).
 */
#include "flash_entmax_backward.cuh"

namespace {

/* x = src[i] as BWD_SPLIT_PARTS parts of T at dst[p n + i] (x_1 = rn(x), x_{k+1} = rn of what
 * the earlier parts left), a grid-stride loop. */
template <typename TS, typename T> __global__ void split_kernel(const TS *src, T *dst, int64_t n) {
    ekv_grid_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = ekv_elem<TS>::to(src[i]);
#pragma unroll
        for (int p = 0; p < BWD_SPLIT_PARTS; p++) {
            const T h = ekv_elem<T>::from(x);
            dst[p * n + i] = h;
            x -= ekv_elem<T>::to(h);
        }
    }
}

unsigned grid_of(int64_t n) {
    const int64_t blocks = (n + 255) / 256;
    return (unsigned)(blocks < 65536 ? blocks : 65536);
}

/* n elements of dtype dt at src as parts of K's dtype kv at dst. */
cudaError_t split_parts(const flash_job &J, ekv_dtype dt, ekv_dtype kv, const void *src, void *dst,
                        int64_t n) {
    ekv_cuda_with_dtype(kv, [&](auto tk) {
        typedef typename decltype(tk)::type T;
        ekv_cuda_with_dtype(dt, [&](auto ts) {
            typedef typename decltype(ts)::type TS;
            split_kernel<TS, T><<<grid_of(n), 256, 0, J.stream>>>(static_cast<const TS *>(src),
                                                                  static_cast<T *>(dst), n);
        });
    });
    return cudaGetLastError();
}

} // namespace

/* The backward's pieces of the workspace: the parts of q and dout (when split), the per-row
 * sums, the keys pass's partial dk and dv (when it splits the rows). */
struct bwd_layout {
    int np, splits;
    int64_t qparts, gparts, rinv, wscale, delta, dkv_part, total;
};

/* The keys pass's splits of a tile's rows: enough blocks to fill the device a few times over
 * (BWD_KEY_BLOCKS), each split at least 8 row blocks; a function of the shape only, so the
 * same shape sums in the same order on every call. */
static int key_splits(const flash_job &J) {
    const int64_t blocks = bwd_keys_grid(J.B, J.N, J.Hk, 1);
    const int64_t row_blocks = (J.T * J.G + BWD_ROWS - 1) / BWD_ROWS;
    int64_t s = blocks >= BWD_KEY_BLOCKS ? 1 : (BWD_KEY_BLOCKS + blocks - 1) / blocks;
    s = s < BWD_MAX_SPLITS ? s : (int64_t)BWD_MAX_SPLITS;
    s = s < row_blocks / 8 ? s : row_blocks / 8;
    return s > 1 ? (int)s : 1;
}

static bwd_layout backward_layout(const flash_job &J) {
    const int64_t rows = J.B * J.T * J.H, kv = J.a->kv_dtype;
    ws_carver c;
    bwd_layout L;
    L.np = J.a->q_dtype == kv && J.a->out_dtype == kv ? 1 : BWD_SPLIT_PARTS;
    L.qparts = L.np > 1 ? c.take(L.np * rows * J.D * 2) : -1;
    L.gparts = L.np > 1 ? c.take(L.np * rows * J.D * 2) : -1;
    L.rinv = c.take(rows * 4);
    L.wscale = c.take(rows * 4);
    L.delta = c.take(rows * 4);
    L.splits = key_splits(J);
    L.dkv_part = L.splits > 1 ? c.take(2 * L.splits * J.B * J.N * J.Hk * J.D * 4) : -1;
    L.total = c.at;
    return L;
}

int64_t flash_backward_bytes(const flash_job &J) { return backward_layout(J).total; }

/* The kernels' arguments of a checked call over the workspace at base. */
static bwd_args backward_args(const flash_job &J, const bwd_layout &L, char *base, const void *dout,
                              void *dq, void *dk, void *dv) {
    const ekv_flash_entmax_args *a = J.a;
    bwd_args A;
    A.B = J.B, A.T = J.T, A.N = J.N, A.H = J.H, A.Hk = J.Hk, A.G = J.G, A.D = J.D;
    A.R = J.T * J.G;
    A.pos0 = J.N - J.T;
    A.causal = J.causal;
    A.qf = J.qf;
    A.scale = (float)J.scale;
    A.alpha = J.alpha;
    A.beta = J.alpha == 1.0 ? 1.0 : 1.0 / (J.alpha - 1.0);
    A.a = J.alpha == 1.0 ? 1.0 : J.alpha - 1.0;
    A.wkind = J.alpha == 1.0  ? BWD_W_SOFTMAX
              : A.beta == 2.0 ? BWD_W_SQUARE
              : A.beta == 1.0 ? BWD_W_LINEAR
                              : BWD_W_POWER;
    A.bm1 = (float)(A.beta - 1.0);
    A.slopes = a->shape.alibi_slopes;
    A.q = L.np > 1 ? (const void *)(base + L.qparts) : a->q;
    A.g = L.np > 1 ? (const void *)(base + L.gparts) : dout;
    A.part_stride = J.B * J.T * J.H * J.D;
    A.k = a->k, A.v = a->v;
    A.tau = a->tau;
    A.ohat = a->ohat;
    A.rinv = (float *)(base + L.rinv);
    A.wscale = (float *)(base + L.wscale);
    A.delta = (float *)(base + L.delta);
    A.dq = dq;
    A.dq_dtype = a->q_dtype;
    A.dk = dk, A.dv = dv;
    A.key_splits = L.splits;
    A.dk_part = L.splits > 1 ? (float *)(base + L.dkv_part) : NULL;
    A.dv_part = L.splits > 1 ? A.dk_part + L.splits * J.B * J.N * J.Hk * J.D : NULL;
    return A;
}

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
    /* the grids, in x alone: B x row blocks x KV heads, B x key tiles x KV heads x splits */
    if (bwd_rows_grid(J.B, J.T * J.G, J.Hk) > INT32_MAX ||
        bwd_keys_grid(J.B, J.N, J.Hk, L.splits) > INT32_MAX)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_SIZE,
                "flash entmax backward: batch=%d x the rows' or keys' blocks x num_kv_heads=%d "
                "passes 2^31",
                args->batch, args->shape.num_kv_heads);
    char *base = static_cast<char *>(workspace);
    const bwd_args A = backward_args(J, L, base, dout, dq, dk, dv);
    const int64_t n = J.B * J.T * J.H * J.D;
    const ekv_dtype kv = args->kv_dtype;
    if (L.np > 1) {
        FLASH_TRY(J, split_parts(J, args->q_dtype, kv, args->q, base + L.qparts, n));
        FLASH_TRY(J, split_parts(J, args->out_dtype, kv, dout, base + L.gparts, n));
    }
    FLASH_TRY(J, flash_bwd_rows(A, kv, L.np, J.stream));
    FLASH_TRY(J, flash_bwd_keys(A, kv, L.np, J.stream));
    ekv_clear_error(ctx);
    return EKV_OK;
}
